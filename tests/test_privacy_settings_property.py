"""Property: whatever privacy setting a user gives (noise multipliers from 1e-9 to 1e9, epsilons from 1e-6 to 1e9,
deltas from 0 to 1, sampling rates from 1e-12 to 1, in every mode), a run either refuses it before any release,
leaving nothing behind, or runs and reports a finite epsilon for every private client, within a memory bound.

The PLD accountant's point cap is lowered to 2^15 for this test (the ``small_pld_grids`` fixture of ``conftest.py``),
so that the distributions near the noise floor, which take seconds on the real cap, take milliseconds: the cap is
what bounds each distribution's memory, and the grid is chosen by the same code whatever its value.
"""

from __future__ import annotations

import math
import resource
from datetime import timedelta

from conftest import synthetic_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privfl.config import RunConfig
from privfl.errors import ConfigError
from privfl.experiment import train
from privfl.federation import RunDirectory
from privfl.privacy.training import MODES, TrainingPrivacy

#: How far the process's peak memory may grow over the whole test, every drawn run included (a run at the noise
#: floor with the real cap builds distributions of up to 2^22 points, under 1 GiB; here they hold 2^15).
MEMORY_BOUND = 1024 * 2 ** 20


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # kilobytes on Linux


#: The peak before the first drawn run (taken then, not at import: in a whole-suite run the tests in between raise
#: the process's peak, which no drawn run caused).
BASELINE_RSS: list[int] = []


def _log_uniform(low: float, high: float):
    return st.floats(math.log10(low), math.log10(high)).map(lambda e: 10.0 ** e)


# Each setting spans its whole range, and is drawn as often again from the values in use, so that about half the
# draws run (the rest exercise the refusals).
SETTINGS = st.fixed_dictionaries({
    "mode": st.sampled_from(MODES),
    "target": st.one_of(st.tuples(st.just("epsilon"), _log_uniform(1e-6, 1e9)),
                        st.tuples(st.just("noise_multiplier"), _log_uniform(1e-9, 1e9)),
                        st.tuples(st.just("epsilon"), _log_uniform(0.1, 50.0)),
                        st.tuples(st.just("noise_multiplier"), _log_uniform(0.1, 1e3))),
    "delta": st.one_of(st.sampled_from([0.0, 1e-15, 0.5, 1.0]), st.floats(0.0, 1.0), *[_log_uniform(1e-14, 1e-2)] * 4),
    "rate": st.one_of(_log_uniform(1e-12, 1.0), _log_uniform(1e-2, 1.0)),
})


@settings(max_examples=30, deadline=timedelta(seconds=60), derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=SETTINGS)
def test_every_privacy_setting_is_refused_before_any_release_or_runs_with_a_finite_epsilon(
        drawn, tmp_path_factory, small_pld_grids):
    if not BASELINE_RSS:
        BASELINE_RSS.append(_peak_rss())
    out = tmp_path_factory.mktemp("drawn") / "run"
    mode, (kind, value), delta, rate = drawn["mode"], drawn["target"], drawn["delta"], drawn["rate"]
    try:
        privacy = TrainingPrivacy(mode=mode, delta=delta, noise="seeded", min_samples=8,
                                  **{kind: value}, **({"sampling_rate": rate} if mode == "record" else {}))
        config = RunConfig(
            federation=synthetic_spec(source_options={"num_samples": 160, "dim": 4, "num_classes": 3},
                                      num_clients=6, partition="iid", novel_fraction=0.34),
            method_config={"local_steps": 1, "batch_size": 16}, rounds=1, eval_every=1, select="last",
            delta=delta, client_fraction=1.0 if mode == "record" else rate, privacy=privacy)
        summary = train(config, str(out), progress=False)
    except ConfigError as refusal:      # refused: before any release, and nothing left behind
        assert "\n" not in str(refusal)
        assert not out.exists(), f"{drawn}: refused ({refusal}) but left {sorted(out.iterdir())}"
        return
    finally:
        grown = _peak_rss() - BASELINE_RSS[0]
        assert grown < MEMORY_BOUND, f"{drawn}: the process's peak memory grew by {grown / 2**20:.0f} MiB"
    epsilons = summary["privacy"]["epsilon_per_client"]
    training = [row["client_id"] for row in RunDirectory(out).read_clients() if row["role"] == "training"]
    assert len(training) == 4 and all(math.isfinite(epsilons[cid]) for cid in training), (drawn, epsilons)
    assert summary["privacy"]["epsilon_max_training"] <= summary["privacy"]["planned"]["training"] * (1 + 1e-6)
