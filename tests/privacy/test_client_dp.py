"""Client-level DP of model updates: joint clipping, life-long calibration, the recorded event, distributed shares."""

import math

import pytest
import torch

from accounting import GaussianEvent, NeighboringRelation, SelfComposedEvent, analytic_gaussian_sigma, epsilon
from privfl.errors import ConfigError
from privfl.privacy.client_dp import ClientLevelGaussian, clip_update, update_norm


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
    dp = ClientLevelGaussian(epsilon=4.0, delta=1e-5, max_norm=0.5, participations=9)
    # k Gaussian releases of sensitivity 2C = one release of sensitivity sqrt(k) * 2C: sigma = 3 * that of one.
    assert dp.sigma == pytest.approx(analytic_gaussian_sigma(4.0, 1e-5, 3.0))
    assert dp.event == GaussianEvent(sigma=dp.sigma, sensitivity=1.0, relation=NeighboringRelation.REPLACE_ONE)
    assert epsilon(SelfComposedEvent(dp.event, 9), 1e-5) == pytest.approx(4.0, rel=1e-3)
    # One release more than planned is no longer within the target.
    assert epsilon(SelfComposedEvent(dp.event, 10), 1e-5) > 4.1


def test_release_adds_noise_of_scale_sigma_to_the_clipped_update():
    dp = ClientLevelGaussian(epsilon=1.0, delta=1e-5, max_norm=1.0, participations=1,
                             generator=torch.Generator().manual_seed(0))
    update = {"w": torch.full((200, 200), 1.0), "b": torch.zeros(7)}  # norm 200 -> clipped to 1
    noisy, event, norm = dp.release(update)
    assert norm == pytest.approx(200.0) and event == dp.event
    assert noisy["w"].shape == (200, 200) and noisy["b"].shape == (7,)
    residual = torch.cat([(noisy["w"] - 1.0 / 200).reshape(-1), noisy["b"]])
    assert float(residual.std()) == pytest.approx(dp.sigma, rel=0.02)
    assert float(residual.mean()) == pytest.approx(0.0, abs=4 * dp.sigma / 200)


def test_distributed_shares_sum_to_the_central_noise():
    local = ClientLevelGaussian(epsilon=8.0, delta=1e-5, max_norm=1.0, participations=4)
    share = ClientLevelGaussian(epsilon=8.0, delta=1e-5, max_norm=1.0, participations=4, mode="distributed",
                                num_shares=25)
    assert share.sigma * 5 == pytest.approx(local.sigma)
    assert epsilon(share.central_event, 1e-5) == pytest.approx(8.0, rel=1e-3)
    # What the server of this runtime sees (each share) is far less private than the claim for the sum.
    assert epsilon(SelfComposedEvent(share.event, 4), 1e-5, accountant="rdp") > 30


@pytest.mark.parametrize("kwargs, name", [
    ({"max_norm": 0.0}, "max_norm"),
    ({"participations": 0}, "participations"),
    ({"mode": "central"}, "mode"),
    ({"num_shares": 3}, "num_shares"),
    ({"epsilon": math.inf}, "epsilon"),
])
def test_bad_settings_name_the_value(kwargs, name):
    settings = {"epsilon": 1.0, "delta": 1e-5, "max_norm": 1.0, "participations": 2, **kwargs}
    with pytest.raises(ConfigError, match=name):
        ClientLevelGaussian(**settings)


def test_non_finite_update_is_refused():
    with pytest.raises(ConfigError, match="NaN or inf"):
        clip_update({"a": torch.tensor([float("nan")])}, 1.0)
