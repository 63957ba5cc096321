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


# -- DSS, Set Transformer, the clip option and the registry -----------------------------------------------------------

from privfl.models.encoders import ENCODERS, build_encoder, encoder_options  # noqa: E402
from privfl.models.set_encoders import ClipToBall, DSSEncoder, SetTransformerEncoder  # noqa: E402
from privfl.privacy import privatize  # noqa: E402


@pytest.mark.parametrize("make,x", [
    (lambda: DSSEncoder(input_shape=(1, 8, 8), channels=(4, 8), hidden=16, output_dim=5), (13, 1, 8, 8)),
    (lambda: DSSEncoder(input_dim=6, channels=(8,), hidden=10, output_dim=5, pool="mean"), (13, 6)),
    (lambda: SetTransformerEncoder(input_shape=(1, 8, 8), dim=16, heads=4, inducing=3, output_dim=5), (13, 1, 8, 8)),
    (lambda: SetTransformerEncoder(input_dim=6, dim=8, heads=2, inducing=4, blocks=1, output_dim=5, ln=True),
     (13, 6)),
])
def test_dss_and_set_transformer_shapes_and_permutation_invariance(make, x):
    torch.manual_seed(0)
    enc = make()
    x = torch.randn(*x)
    out = enc(x)
    assert out.shape == (5,)
    torch.testing.assert_close(enc(x[torch.randperm(len(x))]), out, rtol=1e-4, atol=1e-5)
    # the set matters: a different set (here, half of it) gives a different descriptor
    assert (enc(x[: len(x) // 2]) - out).abs().max() > 1e-4


def test_dss_layers_see_the_set_aggregate():
    torch.manual_seed(0)
    enc = DSSEncoder(input_dim=4, channels=(6,), hidden=8, output_dim=2, pool="mean")
    x = torch.randn(5, 4)
    layer = enc.equivariant[0]
    torch.testing.assert_close(layer(x), layer.siamese(x) + layer.aggregate(x.mean(0, keepdim=True)))
    # changing one element changes every other element's features (the aggregate term)
    y = x.clone()
    y[0] += 3.0
    assert (layer(y)[1:] - layer(x)[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("make,message", [
    (lambda: DSSEncoder(input_shape=(1, 8, 8), channels=(4,), hidden=8, output_dim=2),
     r"encoder\.pool\.max is MaxPool: its sensitivity does not shrink with n"),
    (lambda: DSSEncoder(input_shape=(1, 8, 8), channels=(4,), hidden=8, output_dim=2, pool="mean"),
     r"encoder \(DSSEncoder\) has no module encoder\.phi"),
    (lambda: SetTransformerEncoder(input_dim=4, dim=8, heads=2, inducing=2, output_dim=2),
     r"encoder\.blocks\.0\.mab0\.attention is MultiheadAttention: attention lets one sample dominate"),
    (lambda: SetTransformerEncoder(input_dim=4, dim=8, heads=2, inducing=2, blocks=0, output_dim=2),
     r"encoder\.pma\.mab\.attention is MultiheadAttention"),
])
def test_privatize_refuses_dss_and_set_transformer_by_name(make, message):
    with pytest.raises(ConfigError, match=message):
        privatize(make(), 1.0, 1e-5)


def test_clip_to_ball_projects_rows():
    h = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    torch.testing.assert_close(ClipToBall(1.0)(h), torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    torch.testing.assert_close(ClipToBall(2.0, sphere=True)(h), torch.tensor([[1.2, 1.6], [1.2, 1.6], [0.0, 0.0]]))
    with pytest.raises(ConfigError, match="-1"):
        ClipToBall(-1)


def test_clipped_dp_deepset_trains_with_the_structure_privatize_releases():
    torch.manual_seed(0)
    enc = DPDeepSetEncoder(input_dim=6, hidden=5, output_dim=3, clip=1.0, phi_hidden=7, sphere=True)
    x = 50 * torch.randn(40, 6)
    torch.testing.assert_close(enc.phi(x).detach().norm(dim=1), torch.ones(40))
    assert float(enc.phi(x).detach().norm(dim=1).max()) <= 1.0 + 1e-6
    private = privatize(enc, 1.0, 1e-5, bound=1.0)
    # the pre-noise value privatize computes is exactly what the encoder pooled in training
    torch.testing.assert_close(private.clipped_mean(x).float(), enc.pool(enc.phi(x)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(enc.psi(private.clipped_mean(x).float()), enc(x), rtol=1e-5, atol=1e-6)


def test_registry_builds_every_encoder_and_names_bad_values():
    assert sorted(ENCODERS) == ["deepset", "dp_deepset", "dss", "set_transformer"]
    for name in ENCODERS:
        enc = build_encoder(name, (1, 8, 8), 4)
        assert enc(torch.randn(3, 1, 8, 8)).shape == (4,)
    assert "clip" in encoder_options("dp_deepset") and "inducing" in encoder_options("set_transformer")
    with pytest.raises(ConfigError, match="unknown encoder 'gru'; valid choices: deepset, dp_deepset, dss"):
        build_encoder("gru", (4,), 2)
    with pytest.raises(ConfigError, match="encoder 'dss' has no option clip; valid options: channels, hidden, pool"):
        build_encoder("dss", (4,), 2, clip=1.0)
    with pytest.raises(ConfigError, match="heads must divide dim"):
        build_encoder("set_transformer", (4,), 2, dim=10, heads=4)


# -- the prototype-histogram form (softmax phi, identity or linear psi) -----------------------------------------------

from privfl.models.set_encoders import PrototypeSoftmax  # noqa: E402


def test_softmax_phi_gives_soft_histograms_that_privatize_releases_unchanged():
    torch.manual_seed(0)
    enc = DPDeepSetEncoder(input_dim=6, hidden=5, output_dim=5, clip=1.0, phi_hidden=7, phi_head="softmax",
                           psi="identity", temperature=0.5)
    x = 30 * torch.randn(40, 6)
    v = enc.phi(x).detach()
    torch.testing.assert_close(v.sum(1), torch.ones(40))                 # every sample: a point of the simplex
    assert float(v.min()) >= 0 and float(v.norm(dim=1).max()) <= 1.0 + 1e-6
    scores = enc.phi[:-2](x).detach()                                    # before PrototypeSoftmax and ClipToBall
    torch.testing.assert_close(v, torch.softmax(scores / 0.5, dim=1))
    descriptor = enc(x).detach()
    torch.testing.assert_close(descriptor, v.mean(0))                     # identity psi: the histogram itself
    private = privatize(enc, 1.0, 1e-5, bound=1.0)
    torch.testing.assert_close(private.clipped_mean(x).float(), descriptor, rtol=1e-5, atol=1e-6)
    assert isinstance(enc.psi, torch.nn.Identity)


def test_histograms_of_clients_with_different_data_differ_by_their_mixture():
    """Two 'classes' of inputs far apart, prototypes = the two directions: the pooled mean is the class mix."""
    enc = DPDeepSetEncoder(input_dim=2, hidden=2, output_dim=2, phi_head="softmax", psi="identity",
                           temperature=0.01)
    with torch.no_grad():
        enc.phi[1].weight.copy_(torch.eye(2))
        enc.phi[1].bias.zero_()
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    mixed = torch.cat([a.repeat(30, 1), b.repeat(10, 1)])
    torch.testing.assert_close(enc(mixed).detach(), torch.tensor([0.75, 0.25]))
    torch.testing.assert_close(enc(b.repeat(5, 1)).detach(), torch.tensor([0.0, 1.0]))


def test_linear_psi_and_the_new_options_are_checked():
    enc = DPDeepSetEncoder(input_dim=4, hidden=6, output_dim=3, psi="linear")
    assert isinstance(enc.psi, torch.nn.Linear) and enc(torch.randn(5, 4)).shape == (3,)
    with pytest.raises(ConfigError, match="output_dim must equal hidden"):
        DPDeepSetEncoder(input_dim=4, hidden=6, output_dim=3, psi="identity")
    with pytest.raises(ConfigError, match="phi_head must be one of relu, softmax"):
        DPDeepSetEncoder(input_dim=4, phi_head="sigmoid")
    with pytest.raises(ConfigError, match="psi must be one of mlp, linear, identity"):
        DPDeepSetEncoder(input_dim=4, psi="attention")
    with pytest.raises(ConfigError, match="sphere=True would rescale them off it"):
        DPDeepSetEncoder(input_dim=4, clip=1.0, sphere=True, phi_head="softmax")
    with pytest.raises(ConfigError, match="temperature=0.5 applies only to phi_head='softmax'"):
        DPDeepSetEncoder(input_dim=4, temperature=0.5)
    with pytest.raises(ConfigError, match="temperature must be a finite number > 0"):
        PrototypeSoftmax(0.0)
    assert {"phi_head", "psi", "temperature"} <= set(encoder_options("dp_deepset"))
