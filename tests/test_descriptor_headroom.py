"""benchmarks/descriptor_headroom.py: the label-prior correction and the private histogram it reads."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from descriptor_headroom import prior_logits, release_histogram  # noqa: E402

from accounting import PrivacyLedger  # noqa: E402
from accounting.calibration import analytic_gaussian_sigma  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402


def test_prior_logits_add_the_log_ratio_to_a_uniform_prior_after_the_floor():
    logits = torch.tensor([[1.0, 0.0, 0.5]])
    adjusted = prior_logits(logits, torch.tensor([0.1, -0.2, 0.9]), floor=1e-4)
    prior = torch.tensor([0.1, 1e-4, 0.9]) / 1.0001        # the negative entry floored, then renormalised
    assert torch.allclose(adjusted, logits + torch.log(3 * prior))
    assert adjusted.argmax(1).item() == 2                   # 1 - 1.204 < 0.5 + 0.993: the prior flips the call
    assert prior_logits(logits, torch.full((3,), 1 / 3)).argmax(1).item() == 0   # a uniform prior changes nothing


@pytest.mark.parametrize("floor", [0.0, 1.0, -0.1])
def test_prior_logits_refuse_a_floor_outside_the_unit_interval(floor):
    with pytest.raises(ConfigError, match=f"floor must be in \\(0, 1\\), got {floor!r}"):
        prior_logits(torch.zeros(1, 3), torch.full((3,), 1 / 3), floor=floor)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def test_without_epsilon_the_histogram_is_the_mean_softmax_and_nothing_is_recorded():
    model, x, ledger = _model(), torch.randn(20, 4), PrivacyLedger(0)
    histogram = release_histogram(model, x, None, 1e-5, ledger)
    assert torch.allclose(histogram, model(x).softmax(1).mean(0).detach())
    assert math.isclose(histogram.sum().item(), 1.0, rel_tol=1e-6)
    assert ledger.records == ()


def test_a_private_histogram_is_one_recorded_release_with_the_replace_one_noise_of_a_mean_in_the_unit_ball():
    model, n, epsilon, delta = _model(), 50, 1.0, 1e-5
    x = torch.randn(n, 4)
    exact = model(x).softmax(1).mean(0).detach()
    ledger = PrivacyLedger(0)
    generator = torch.Generator().manual_seed(7)
    noise = torch.stack([release_histogram(model, x, epsilon, delta, ledger, generator) - exact for _ in range(400)])
    assert len(ledger.records) == 400
    single = PrivacyLedger(1)
    release_histogram(model, x, epsilon, delta, single, generator)
    assert math.isclose(single.spent(delta).epsilon, epsilon, rel_tol=1e-6)
    sigma = analytic_gaussian_sigma(epsilon, delta, 2.0 / n)   # phi's outputs clipped to the unit ball: 2 / n
    assert abs(noise.std().item() / sigma - 1) < 0.06           # 1,200 draws: the ratio's SE is about 0.02
