"""The DP gradient of a mean over records: per-record gradients clipped to C, averaged, noised for 2C/min_samples."""

import pytest
import torch
from torch import nn

from accounting import NeighboringRelation
from privfl.errors import ConfigError
from privfl.privacy.gradient_mean import certify_gradient_mean, release_gradient_mean

torch.set_num_threads(1)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _brute_force(model, x, y, clip):
    """Each record's gradient by its own backward pass, clipped jointly over the parameters, then averaged."""
    params = list(model.parameters())
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for j in range(len(x)):
        grads = torch.autograd.grad(_loss(model, x[j:j + 1], y[j:j + 1])[0], params)
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        scale = min(1.0, clip / float(norm))
        total = [t + scale * g.double() for t, g in zip(total, grads)]
    return [t / len(x) for t in total]


def test_the_release_is_the_mean_of_clipped_per_record_gradients_plus_noise_for_2c_over_min_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    x, y = 3 * torch.randn(11, 5), torch.randint(0, 3, (11,))
    noisy, event, cert = release_gradient_mean(model, _loss, x, y, clip=0.3, min_samples=6, noise_multiplier=0.7,
                                               noise="seeded", generator=torch.Generator().manual_seed(4))
    assert cert.value == pytest.approx(2 * 0.3 / 6) and not cert.n_public
    assert event.relation is NeighboringRelation.ADD_OR_REMOVE_ONE
    assert event.sigma == pytest.approx(0.7 * 0.1) and event.sensitivity == pytest.approx(0.1)
    expected = torch.cat([g.reshape(-1) for g in _brute_force(model, x, y, 0.3)])
    draws = torch.randn(expected.numel(), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    released = torch.cat([noisy[name].reshape(-1).double() for name, _ in model.named_parameters()])
    assert list(noisy) == [name for name, _ in model.named_parameters()]
    assert torch.allclose(released, expected + event.sigma * draws, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_removing_a_record_moves_the_clipped_mean_by_at_most_2c_over_the_larger_size():
    torch.manual_seed(2)
    model = nn.Linear(3, 2)
    x, y = 10 * torch.randn(7, 3), torch.randint(0, 2, (7,))
    full = torch.cat([g.reshape(-1) for g in _brute_force(model, x, y, 0.05)])
    worst = max(float((torch.cat([g.reshape(-1) for g in _brute_force(model, torch.cat([x[:j], x[j + 1:]]),
                                                                      torch.cat([y[:j], y[j + 1:]]), 0.05)])
                       - full).norm()) for j in range(7))
    assert 0.2 * 2 * 0.05 / 7 <= worst <= 2 * 0.05 / 7 + 1e-9
    assert certify_gradient_mean(0.05, 7).value == pytest.approx(2 * 0.05 / 7)


def test_a_client_below_min_samples_and_bad_settings_are_refused_naming_the_value():
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ConfigError, match="fewer records than the public lower bound min_samples=8") as err:
        release_gradient_mean(model, _loss, x, y, clip=1.0, min_samples=8, noise_multiplier=1.0)
    assert "5" not in str(err.value)
    with pytest.raises(ConfigError, match="clip .* must be a finite number > 0, got -1.0"):
        release_gradient_mean(model, _loss, x, y, clip=-1.0, min_samples=2, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="min_samples must be an int >= 2, got 1"):
        release_gradient_mean(model, _loss, x, y, clip=1.0, min_samples=1, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="noise_multiplier must be a finite number > 0, got 0.0"):
        release_gradient_mean(model, _loss, x, y, clip=1.0, min_samples=2, noise_multiplier=0.0)
    with pytest.raises(ConfigError, match="BatchNorm"):
        release_gradient_mean(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), _loss, x, y, clip=1.0,
                              min_samples=2, noise_multiplier=1.0)
