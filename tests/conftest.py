"""Shared fixtures: small federations on the synthetic source, so most tests run in well under a second."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import optimize, stats

from privfl.data import FederationSpec

torch.set_num_threads(2)


def synthetic_spec(**overrides) -> FederationSpec:
    values = dict(source="synthetic", source_options={"num_samples": 1200, "dim": 10, "num_classes": 4},
                  num_clients=12, partition="dirichlet", alpha=1.0, novel_fraction=0.25)
    values.update(overrides)
    return FederationSpec(**values)


@pytest.fixture
def make_spec():
    """A factory of small synthetic federations: ``make_spec(**overrides)``."""
    return synthetic_spec


def _balle_wang_sigma(eps: float, delta: float, sensitivity: float) -> float:
    """Independent of the package: the sigma at which Balle and Wang's (2018, Thm 8) exact delta equals ``delta``."""
    def excess(log_sigma):
        s = math.exp(log_sigma)
        a, b = sensitivity / (2 * s), eps * s / sensitivity
        return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b) - delta
    return math.exp(optimize.brentq(excess, -10, 10, xtol=1e-13))


@pytest.fixture
def balle_wang_sigma():
    """The analytic Gaussian's sigma computed without the package (an oracle for calibration tests)."""
    return _balle_wang_sigma
