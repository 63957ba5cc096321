"""benchmarks/descriptor_settings.py: its settings are the sweep's, and its summary is over seeds."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from descriptor_settings import TRAIN_EPSILONS, VARIANTS, summarise  # noqa: E402

from privfl.errors import ConfigError  # noqa: E402
from privfl.sweep import DEFAULT_METHOD, SweepConfig  # noqa: E402


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_changes_only_what_it_names_and_is_a_valid_sweep(variant):
    config = SweepConfig(method_config={**DEFAULT_METHOD, **VARIANTS[variant]}, train_epsilons=TRAIN_EPSILONS,
                         epsilons=(1.0,), repeats=1)
    assert config.method_config is not None
    changed = {k for k in config.method_config if config.method_config[k] != DEFAULT_METHOD.get(k)}
    assert changed == set(VARIANTS[variant])


def test_a_bad_setting_is_refused_by_the_sweep_before_anything_runs():
    with pytest.raises(ConfigError, match="hn_layers"):
        SweepConfig(method_config={**DEFAULT_METHOD, "hn_layers": -1})


def _row(margin: float, novel: float) -> dict:
    return {"margin": {"50": margin}, "novel": {"50": novel}, "novel_epsilon1": {"50": novel - 1},
            "validation_accuracy": novel, "informative": margin >= 2}


def test_the_summary_is_the_mean_and_sem_over_the_seeds_of_each_variant_and_training():
    stored = {"margins": {
        "temperature_0.1|seed0": {"trainings": {"inf": _row(1.0, 98.0), "8": _row(3.0, 96.0)}},
        "temperature_0.1|seed1": {"trainings": {"inf": _row(2.0, 97.0), "8": _row(2.0, 95.0)}},
        "temperature_0.1_linear_hn|seed0": {"trainings": {"inf": _row(0.5, 99.0), "8": _row(0.0, 90.0)}}}}
    out = summarise(stored)
    inf = out["temperature_0.1"]["inf"]
    assert inf["seeds"] == 2 and inf["margin"]["50"]["mean"] == pytest.approx(1.5)
    assert inf["margin"]["50"]["sem"] == pytest.approx(0.5)          # std 0.7071 over sqrt(2)
    assert inf["novel_epsilon1"]["50"]["mean"] == pytest.approx(96.5)
    assert out["temperature_0.1"]["8"]["informative_seeds"] == 2 and inf["informative_seeds"] == 1   # 2.0 passes
    one = out["temperature_0.1_linear_hn"]["8"]
    assert one["seeds"] == 1 and one["margin"]["50"]["mean"] == 0.0 and math.isnan(one["margin"]["50"]["sem"])
