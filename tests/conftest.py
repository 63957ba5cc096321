"""Shared fixtures: small federations on the synthetic source, so most tests run in well under a second."""

from __future__ import annotations

import pytest
import torch

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
