"""The privacy layer's settings and client-level mechanisms: calibration, adaptive clipping's budget split, central
DP-FedAvg reducing to FedAvg without noise or clipping, and what each mode records."""

from __future__ import annotations

import math

import pytest
import torch

import accounting
from accounting import SelfComposedEvent, SubsampledGaussianEvent
from privfl.config import RunConfig
from privfl.data import build_federation
from privfl.errors import ConfigError
from privfl.experiment import build_runtime
from privfl.privacy.training import (
    NovelPrivacy,
    TrainingPrivacy,
    central_noise_multiplier,
    client_level_noise,
    joint_noise_multiplier,
    update_noise_multiplier,
)


def test_settings_that_do_not_fit_a_mode_are_refused_by_name():
    with pytest.raises(ConfigError, match="privacy mode must be None .* got 'global'"):
        TrainingPrivacy(mode="global")
    with pytest.raises(ConfigError, match="needs exactly one of epsilon .* and noise_multiplier"):
        TrainingPrivacy(mode="record")
    with pytest.raises(ConfigError, match="need a privacy mode"):
        TrainingPrivacy(epsilon=1.0)
    with pytest.raises(ConfigError, match="'adaptive' .* central mode only"):
        TrainingPrivacy(mode="local", epsilon=1.0, clip="adaptive")
    with pytest.raises(ConfigError, match="participations is for modes 'local' and 'distributed'"):
        TrainingPrivacy(mode="central", epsilon=1.0, participations=3)
    with pytest.raises(ConfigError, match="shares is for mode 'distributed'"):
        TrainingPrivacy(mode="local", epsilon=1.0, shares=3)
    with pytest.raises(ConfigError, match="novel epsilon must be a finite number > 0"):
        NovelPrivacy(epsilon=0.0)
    with pytest.raises(ConfigError, match="unknown privacy setting"):
        TrainingPrivacy.from_dict({"mode": "record", "eps": 1.0})


def test_central_calibration_meets_the_target_over_the_run():
    privacy = TrainingPrivacy(mode="central", epsilon=2.0, delta=1e-5)
    z = central_noise_multiplier(privacy, sampling_probability=0.05, rounds=150)
    spent = accounting.epsilon(SelfComposedEvent(SubsampledGaussianEvent(z, 0.05), 150), 1e-5)
    assert spent <= 2.0 and spent == pytest.approx(2.0, rel=5e-3)
    more = accounting.epsilon(SelfComposedEvent(SubsampledGaussianEvent(z * 0.99, 0.05), 150), 1e-5)
    assert more > 2.0                        # the least noise that meets it, to the bisection's tolerance


def test_adaptive_clipping_splits_one_round_budget_between_the_count_and_the_update():
    # Andrew et al. 2021, Theorem 1: a count of noise sigma_b (sensitivity 1/2) beside an update of noise multiplier
    # z_u is one Gaussian release of noise multiplier (z_u^-2 + (2 sigma_b)^-2)^-1/2
    z, sigma_b = 1.3, 4.5
    z_update = update_noise_multiplier(z, sigma_b)
    assert joint_noise_multiplier(z_update, sigma_b) == pytest.approx(z, rel=1e-12)
    assert z_update == pytest.approx((1.3 ** -2 - 9.0 ** -2) ** -0.5)
    with pytest.raises(ConfigError, match="needs clip_count_noise > noise_multiplier / 2"):
        update_noise_multiplier(10.0, 4.0)


def test_local_noise_is_calibrated_for_the_lifetime_and_split_over_the_stages():
    privacy = TrainingPrivacy(mode="local", epsilon=3.0, delta=1e-5, clip=2.0)
    noise = client_level_noise(privacy, stages=3, participations=5)
    assert sum(c ** 2 for c in noise.clips) == pytest.approx(4.0)          # sum_s C_s^2 = C^2
    # three stages of sensitivity 2 C_s and one sigma compose to one Gaussian of sensitivity 2 C: the lifetime of 5
    # rounds is calibrated to exactly (3, 1e-5)
    assert noise.lifetime_epsilon == pytest.approx(3.0, rel=1e-4)
    distributed = client_level_noise(TrainingPrivacy(mode="distributed", epsilon=3.0, clip=2.0), stages=1,
                                     participations=5, shares=4)
    assert distributed.share_sigma == pytest.approx(distributed.sigma / 2)


def _fedavg(spec, privacy, **overrides):
    values = dict(federation=spec, method="fedavg", method_config={"lr": 0.1, "local_steps": 2, "batch_size": 16},
                  rounds=3, select="last", seed=2, client_fraction=1.0, privacy=privacy)
    values.update(overrides)
    return RunConfig(**values)


def test_central_dp_without_noise_or_clipping_is_fedavg(make_spec, noise_floor_lifted):
    # q = 1 samples every client and the expected count is the count; a clip no update reaches and a negligible
    # noise multiplier leave FedAvg's uniform mean
    spec = make_spec(num_clients=6, novel_fraction=0.5, partition="iid")
    federation = build_federation(spec, seed=2)
    central = build_runtime(_fedavg(spec, TrainingPrivacy(mode="central", noise_multiplier=1e-7, clip=10.0,
                                                          noise="seeded")), federation)
    plain = build_runtime(_fedavg(spec, TrainingPrivacy()), federation)
    central.run_round(0)
    plain.run_round(0)
    # (plain FedAvg weights by sample count, central DP uniformly: the iid clients' counts differ by one at most)
    for name, value in plain.strategy.weights.items():
        torch.testing.assert_close(central.strategy.inner.weights[name], value, rtol=0, atol=1e-5)
    # and every training client's ledger holds the round's aggregate, its contribution seen by the aggregator alone
    ledgers = central.ledgers()
    for cid in central.training_ids:
        purposes = [(r.purpose, r.audience) for r in ledgers[cid].records]
        assert purposes == [("model_update", "trusted_aggregator"), ("central_aggregate", "everyone")]
        assert ledgers[cid].records[1].event == SubsampledGaussianEvent(1e-7, 1.0)


def test_central_dp_clips_each_contribution_and_adapts_the_clip(make_spec, noise_floor_lifted):
    spec = make_spec(num_clients=6, novel_fraction=0.5, partition="iid")
    federation = build_federation(spec, seed=2)
    privacy = TrainingPrivacy(mode="central", noise_multiplier=1e-7, clip="adaptive", clip_initial=1e-3,
                              clip_count_noise=1e-6, noise="seeded")
    runtime = build_runtime(_fedavg(spec, privacy), federation)
    before = {k: v.clone() for k, v in runtime.strategy.inner.weights.items()}
    metrics = runtime.run_round(0)
    step = torch.sqrt(sum(((runtime.strategy.inner.weights[k] - v) ** 2).sum() for k, v in before.items()))
    # every update is far above the clip of 1e-3: each contributes exactly 1e-3, their mean has norm at most that
    assert float(step) <= 1e-3 * (1 + 1e-6)
    # none was within the clip, so the estimated quantile is 0 and the clip grows by exp(0.2 * 0.5)
    assert metrics["clip_quantile_estimate"] == pytest.approx(0.0, abs=1e-3)
    assert runtime.strategy.clip == pytest.approx(1e-3 * math.exp(0.2 * 0.5), rel=1e-3)
    # the count's noise default leaves the update most of the budget even when the round's noise is large
    loud = build_runtime(_fedavg(spec, TrainingPrivacy(mode="central", noise_multiplier=12.0, clip="adaptive")),
                         federation)
    assert loud.strategy.count_noise == 12.0
    assert loud.strategy.update_multiplier == pytest.approx(12.0 / math.sqrt(0.75))
