"""Client-level DP of model updates: the joint clip, and the local/distributed noise of the privacy layer calibrated
for a client's whole life (:func:`privfl.privacy.training.client_level_noise`)."""

import math

import pytest
import torch

from accounting import GaussianEvent, NeighboringRelation, SelfComposedEvent, analytic_gaussian_sigma, epsilon
from privfl.errors import ConfigError, TrainingDivergedError
from privfl.privacy.client_dp import clip_update, update_norm
from privfl.privacy.training import TrainingPrivacy, client_level_noise, share_epsilon


def test_clip_is_joint_over_all_tensors():
    update = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}
    clipped, norm = clip_update(update, 2.5)
    assert norm == pytest.approx(5.0)
    assert clipped["a"].tolist() == pytest.approx([1.5, 0.0])
    assert clipped["b"].reshape(-1).tolist() == pytest.approx([2.0])
    assert update_norm(clipped) == pytest.approx(2.5)
    same, _ = clip_update(update, 10.0)  # inside the ball: unchanged
    assert torch.equal(same["a"], update["a"]) and torch.equal(same["b"], update["b"])


def test_sigma_is_calibrated_for_the_whole_life_and_the_ledger_composition_hits_the_target():
    noise = client_level_noise(TrainingPrivacy(mode="local", epsilon=4.0, clip=0.5, participations=9), stages=1,
                               participations=9)
    # k Gaussian releases of sensitivity 2C = one release of sensitivity sqrt(k) * 2C: sigma = 3 * that of one.
    assert noise.sigma == pytest.approx(analytic_gaussian_sigma(4.0, 1e-5, 3.0))
    event = GaussianEvent(sigma=noise.sigma, sensitivity=1.0, relation=NeighboringRelation.REPLACE_ONE)
    assert noise.stage_event(0) == event
    assert epsilon(SelfComposedEvent(event, 9), 1e-5) == pytest.approx(4.0, rel=1e-3)
    assert noise.lifetime_epsilon == pytest.approx(4.0, rel=1e-3)
    # One release more than planned is no longer within the target.
    assert epsilon(SelfComposedEvent(event, 10), 1e-5) > 4.1


def test_a_round_of_several_releases_splits_the_clip_and_composes_to_one_release_of_the_whole_clip():
    noise = client_level_noise(TrainingPrivacy(mode="local", epsilon=2.0, clip=1.0, participations=3), stages=4,
                               participations=3)
    assert noise.clips == pytest.approx((0.5,) * 4)           # sum_s C_s^2 = C^2
    # four Gaussian releases of sensitivity 2 C_s at sigma: one of sensitivity 2 C (the privacy losses add)
    assert noise.lifetime_epsilon == pytest.approx(2.0, rel=1e-3)


def test_distributed_shares_sum_to_the_noise_of_the_sum():
    privacy = TrainingPrivacy(mode="distributed", epsilon=8.0, clip=1.0, participations=4)
    local = client_level_noise(privacy, stages=1, participations=4)
    shared = client_level_noise(privacy, stages=1, participations=4, shares=25)
    assert shared.share_sigma * 5 == pytest.approx(local.sigma) and shared.sigma == local.sigma
    assert shared.lifetime_epsilon == pytest.approx(8.0, rel=1e-3)
    # What one share alone buys (an observer without secure aggregation) is far less than the claim for the sum.
    assert share_epsilon(shared) > 30


@pytest.mark.parametrize("settings, name", [
    ({"mode": "local", "epsilon": 1.0, "clip": 0.0}, "privacy clip"),
    ({"mode": "local", "epsilon": 1.0, "participations": 0}, "privacy participations"),
    ({"mode": "local", "epsilon": 1.0, "shares": 3}, "shares is for mode 'distributed'"),
    ({"mode": "local", "epsilon": math.inf}, "privacy epsilon"),
])
def test_bad_settings_name_the_value(settings, name):
    with pytest.raises(ConfigError, match=name):
        TrainingPrivacy(**settings)


def test_non_finite_update_is_refused_as_a_diverged_training_with_the_settings_to_lower():
    with pytest.raises(TrainingDivergedError, match="NaN or inf: local training diverged .*learning rate"):
        clip_update({"a": torch.tensor([float("nan")])}, 1.0)
