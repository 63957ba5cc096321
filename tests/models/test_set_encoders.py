"""Set encoders: shapes, permutation invariance, the mean/max pooling halves, and the DP-ready structure."""

from __future__ import annotations

import pytest
import torch

from privfl.errors import ConfigError
from privfl.models.set_encoders import DeepSetEncoder, DPDeepSetEncoder, MaxPool, MeanMaxPool, MeanPool


@pytest.mark.parametrize("cls", [DeepSetEncoder, DPDeepSetEncoder])
def test_shapes_for_features_and_images(cls):
    torch.manual_seed(0)
    assert cls(input_dim=10, hidden=8, output_dim=3)(torch.randn(7, 10)).shape == (3,)
    image = cls(input_shape=(1, 6, 6), hidden=8, output_dim=5)
    assert image(torch.randn(4, 1, 6, 6)).shape == (5,)
    assert cls(input_shape=6, hidden=8, output_dim=2)(torch.randn(1, 6)).shape == (2,)


@pytest.mark.parametrize("cls", [DeepSetEncoder, DPDeepSetEncoder])
def test_permutation_invariant(cls):
    torch.manual_seed(0)
    enc = cls(input_dim=5, hidden=8, output_dim=3)
    x = torch.randn(20, 5)
    torch.testing.assert_close(enc(x), enc(x[torch.randperm(20)]), rtol=1e-5, atol=1e-6)


def test_deepset_pools_half_by_mean_and_half_by_max():
    torch.manual_seed(0)
    enc = DeepSetEncoder(input_dim=4, hidden=6, output_dim=2)
    x = torch.randn(9, 4)
    h = enc.phi(x)
    pooled = enc.pool(h)
    torch.testing.assert_close(pooled[:3], h[:, :3].mean(0))
    torch.testing.assert_close(pooled[3:], h[:, 3:].max(0).values)
    assert isinstance(enc.pool, MeanMaxPool) and isinstance(enc.pool.max, MaxPool)
    torch.testing.assert_close(enc(x), enc.psi(pooled))


def test_dp_deepset_has_the_structure_privatize_accepts():
    enc = DPDeepSetEncoder(input_dim=4, hidden=5, output_dim=2)
    assert type(enc.pool) is MeanPool
    assert {name for name, _ in enc.named_children()} == {"phi", "pool", "psi"}
    x = torch.randn(9, 4)
    torch.testing.assert_close(enc(x), enc.psi(enc.phi(x).mean(0)))


def test_pools_reduce_over_samples():
    h = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    assert torch.equal(MeanPool()(h), torch.tensor([2.0, 1.0]))
    assert torch.equal(MaxPool()(h), torch.tensor([3.0, 4.0]))


@pytest.mark.parametrize("make,named", [
    (lambda: DeepSetEncoder(input_dim=4, hidden=5), "5"),
    (lambda: DPDeepSetEncoder(input_dim=4, input_shape=(4,)), "input_dim"),
    (lambda: DPDeepSetEncoder(), "input_dim"),
    (lambda: DPDeepSetEncoder(input_shape=(1, 0, 3)), "0"),
    (lambda: DPDeepSetEncoder(input_dim=4, output_dim=0), "output_dim"),
])
def test_bad_configuration(make, named):
    with pytest.raises(ConfigError, match=named):
        make()


def test_bad_input_shape_is_named():
    enc = DPDeepSetEncoder(input_shape=(1, 4, 4), hidden=4, output_dim=2)
    with pytest.raises(ConfigError, match=r"\(3, 4, 4\)"):
        enc(torch.randn(3, 4, 4))
    with pytest.raises(ConfigError, match="n >= 1"):
        enc(torch.randn(0, 1, 4, 4))
