import math

import pytest
import torch
from torch.nn import functional as F

from privfl.errors import ConfigError
from privfl.models import build_model, functional_forward
from privfl.models.hypernetwork import HyperNetwork, RoundGradientMean, backprop_weight_change, embedding_dim


@pytest.mark.parametrize("name,shape", [("mlp2nn", (1, 28, 28)), ("lenet", (3, 32, 32)), ("feature_mlp", (64,))])
def test_generated_weights_match_the_target_names_and_shapes_and_run_it(name, shape):
    torch.manual_seed(0)
    target = build_model(name, shape, 10)
    hnet = HyperNetwork(target, embed_dim=7)
    weights = hnet(torch.randn(7))
    assert [(n, tuple(w.shape)) for n, w in weights.items()] == [(n, tuple(p.shape))
                                                                 for n, p in target.named_parameters()]
    logits = functional_forward(target, weights, torch.randn(4, *shape))
    assert logits.shape == (4, 10)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in hnet.parameters())


def test_per_tensor_heads_have_the_papers_parameter_count():
    target = build_model("lenet", (3, 32, 32), 10)            # pFedHN's CNNTarget: 121,182 parameters
    assert sum(p.numel() for p in target.parameters()) == 121_182
    hnet = HyperNetwork(target, embed_dim=25)
    trunk = (25 * 100 + 100) + 3 * (100 * 100 + 100)
    assert sum(p.numel() for p in hnet.parameters()) == trunk + 101 * 121_182   # 12.27 M (docs/papers.md, ODPFL-HN)
    assert not hnet.chunked


def test_large_targets_get_the_chunked_generator_with_a_bounded_head():
    target = build_model("feature_mlp", (1280,), 1203)        # 1,493,703 parameters: per-tensor heads would be 151 M
    hnet = HyperNetwork(target, embed_dim=30, chunk_size=5000, chunk_embed_dim=8)
    assert hnet.chunked and hnet.num_target_params == 1_493_703 and hnet.num_chunks == math.ceil(1_493_703 / 5000)
    assert sum(p.numel() for p in hnet.parameters()) < 1_000_000
    weights = hnet(torch.randn(30))
    assert {n: tuple(w.shape) for n, w in weights.items()} == {n: tuple(p.shape) for n, p in target.named_parameters()}
    functional_forward(target, weights, torch.randn(2, 1280)).sum().backward()
    assert hnet.chunk_embeddings.grad.abs().sum() > 0 and hnet.trunk[0].weight.grad.abs().sum() > 0


def test_spectral_norm_bounds_each_layer():
    torch.manual_seed(0)
    hnet = HyperNetwork(build_model("mlp2nn", (1, 4, 4), 3), embed_dim=5, spectral_norm=True)
    hnet(torch.randn(5))                                      # one power iteration
    for _ in range(20):
        hnet(torch.randn(5))
    sigma = torch.linalg.matrix_norm(hnet.trunk[2].weight.detach(), ord=2)
    assert sigma == pytest.approx(1.0, abs=0.05)


def test_the_weight_change_chain_rule_is_the_true_gradient_after_one_sgd_step():
    """d = before - after of one plain SGD step at lr eta; the VJP through the hypernetwork is eta * dL/dtheta and
    eta * dL/de (the sign of pFedHN's code, docs/papers.md, ODPFL-HN, E1)."""
    torch.manual_seed(0)
    target = build_model("mlp2nn", (1, 4, 4), 3)
    hnet = HyperNetwork(target, embed_dim=4).double()
    e = torch.randn(4, dtype=torch.float64)
    x, y = torch.randn(8, 1, 4, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    eta = 0.05

    before = {k: v.detach() for k, v in hnet(e).items()}
    w = {k: v.clone().requires_grad_(True) for k, v in before.items()}
    loss = F.cross_entropy(functional_forward(target.double(), w, x), y)
    grads = torch.autograd.grad(loss, list(w.values()))
    after = {k: v - eta * g for (k, v), g in zip(before.items(), grads)}
    change = {k: before[k] - after[k] for k in before}
    param_grads, e_grad = backprop_weight_change(hnet, e, change)

    e_leaf = e.clone().requires_grad_(True)
    true = torch.autograd.grad(F.cross_entropy(functional_forward(target, hnet(e_leaf), x), y),
                               [*hnet.parameters(), e_leaf])
    for (name, got), want in zip(param_grads.items(), true[:-1]):
        torch.testing.assert_close(got, eta * want, msg=name)
    torch.testing.assert_close(e_grad, eta * true[-1])



def _round_inputs(n_clients: int):
    torch.manual_seed(1)
    hnet = HyperNetwork(build_model("mlp2nn", (1, 4, 4), 3), embed_dim=4)
    shapes = {k: v.shape for k, v in hnet(torch.zeros(4)).items()}
    inputs = {cid: (torch.randn(4), {k: torch.randn(s) for k, s in shapes.items()}) for cid in range(n_clients)}
    return hnet, inputs


def _held_mean(hnet, inputs, ids):
    """What the methods computed before: every client's gradient held, then copied, added in id order, divided."""
    held = [backprop_weight_change(hnet, *inputs[cid])[0] for cid in ids]
    total = {k: v.clone() for k, v in held[0].items()}
    for grads in held[1:]:
        for k, v in total.items():
            v.add_(grads[k])
    return {k: v.div_(len(ids)) for k, v in total.items()}


@pytest.mark.parametrize("finished", [[0, 1, 2, 3, 4], [0, 2, 3], [4]])
def test_round_gradient_mean_is_the_mean_of_the_held_gradients_to_the_last_bit(finished):
    """One running sum instead of a gradient per client: the same mean, bit for bit, over all the added clients and
    over the subset that finished the round (recomputed from the kept weight changes); the inputs stay untouched."""
    hnet, inputs = _round_inputs(5)
    kept = {cid: (e.clone(), {k: v.clone() for k, v in change.items()}) for cid, (e, change) in inputs.items()}
    mean = RoundGradientMean(hnet)
    for cid in range(5):
        descriptor_grad = mean.add(cid, *inputs[cid])
        assert torch.equal(descriptor_grad, backprop_weight_change(hnet, *inputs[cid])[1])
    got = mean.mean(finished)
    want = _held_mean(hnet, inputs, finished)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # a different subset gives a different mean: the check above can tell subsets apart
    other = _held_mean(hnet, inputs, [0, 2, 3] if finished == [0, 1, 2, 3, 4] else [0, 1, 2, 3, 4])
    assert not any(torch.equal(got[k], other[k]) for k in want)
    for cid, (e, change) in inputs.items():
        assert torch.equal(e, kept[cid][0]) and all(torch.equal(v, kept[cid][1][k]) for k, v in change.items())


def test_round_gradient_mean_refuses_out_of_order_and_unknown_clients():
    hnet, inputs = _round_inputs(3)
    mean = RoundGradientMean(hnet)
    mean.add(1, *inputs[1])
    with pytest.raises(ValueError, match=r"client 0 added after client 1.*ascending"):
        mean.add(0, *inputs[0])
    with pytest.raises(ValueError, match=r"clients \[1, 2\].*not added: \[2\]"):
        mean.mean([2, 1])
    assert 1 in mean and 0 not in mean


def test_bad_settings_are_refused_by_name():
    target = build_model("mlp2nn", (1, 4, 4), 3)
    with pytest.raises(ConfigError, match="embed_dim"):
        HyperNetwork(target, embed_dim=0)
    with pytest.raises(ConfigError, match=r"shape \(5,\)"):
        HyperNetwork(target, embed_dim=5)(torch.randn(6))
    assert embedding_dim(100) == 25 and embedding_dim(100, rule="pfedhn") == 26
    with pytest.raises(ConfigError, match="rule"):
        embedding_dim(100, rule="half")


# -- the descriptor standardizer ----------------------------------------------------------------------------------

from privfl.models.hypernetwork import DescriptorStandardizer  # noqa: E402


def test_standardizer_fits_the_mean_and_one_isotropic_spread():
    d = torch.tensor([[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [2.0, 0.0, 3.0], [2.0, 0.0, 1.0]])
    standardizer = DescriptorStandardizer(3)
    standardizer.fit(d)
    torch.testing.assert_close(standardizer.shift, torch.tensor([2.0, 0.0, 1.0]))
    # squared distances to the mean 2, 2, 4, 0: mean 2 over clients, / 3 coordinates = 2/3
    assert float(standardizer.scale) == pytest.approx((2 / 3) ** 0.5)
    out = standardizer(d)
    torch.testing.assert_close(out.mean(0), torch.zeros(3))
    assert float(out.pow(2).sum(1).mean() / 3) == pytest.approx(1.0)
    # the coordinate along which nobody differs is not blown up (isotropic: no per-coordinate division)
    assert float(out[:, 1].abs().max()) == 0.0
    noise = torch.tensor([0.0, 1e-2, 0.0])
    torch.testing.assert_close(standardizer(d[0] + noise) - standardizer(d[0]), noise / standardizer.scale)


def test_standardizer_floors_its_scale_and_ignores_a_single_descriptor():
    standardizer = DescriptorStandardizer(2, min_scale=0.1)
    standardizer.fit(torch.tensor([[1.0, 1.0]]))                     # one descriptor: no spread, left as it was
    assert standardizer.shift.tolist() == [0.0, 0.0] and float(standardizer.scale) == 1.0
    standardizer.fit(torch.tensor([[1.0, 1.0], [1.0, 1.001]]))
    assert float(standardizer.scale) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match=r"shape \[m, 2\]"):
        standardizer.fit(torch.zeros(3, 4))
    with pytest.raises(ConfigError, match="NaN"):
        standardizer.fit(torch.tensor([[1.0, float("nan")], [0.0, 0.0]]))


def test_standardizer_batch_gradients_are_those_of_batch_statistics():
    """The projected gradients equal autograd's when mu and s are computed from the batch itself."""
    torch.manual_seed(0)
    m = torch.randn(5, 4, dtype=torch.float64)
    g = torch.randn(5, 4, dtype=torch.float64)           # dL/de of a linear loss L = sum <g_k, e_k>
    leaf = m.clone().requires_grad_(True)
    centred = leaf - leaf.mean(0)
    s = centred.pow(2).sum(1).mean().div(4).sqrt()
    (g * centred / s).sum().backward()
    standardizer = DescriptorStandardizer(4).double()
    standardizer.fit(m)
    fixed = g / standardizer.scale                       # the gradient with the statistics held fixed
    got = standardizer.batch_gradients(m, fixed)
    torch.testing.assert_close(got, leaf.grad)
    # a shift common to every client and a change of overall scale have no gradient left
    assert float(got.sum(0).abs().max()) < 1e-12 and abs(float((got * (m - m.mean(0))).sum())) < 1e-12
    torch.testing.assert_close(standardizer.batch_gradients(m[:1], fixed[:1]), fixed[:1])


def test_a_standardizing_hypernetwork_is_the_plain_one_on_standardized_descriptors():
    torch.manual_seed(0)
    target = build_model("mlp2nn", (1, 4, 4), 3)
    torch.manual_seed(1)
    plain = HyperNetwork(target, embed_dim=3)
    torch.manual_seed(1)
    standardizing = HyperNetwork(target, embed_dim=3, standardize=True)
    d = torch.randn(6, 3) * 0.01 + 0.3
    standardizing.standardizer.fit(d)
    assert set(standardizing.state_dict()) - set(plain.state_dict()) == {"standardizer.shift", "standardizer.scale"}
    got, want = standardizing(d[2]), plain((d[2] - d.mean(0)) / standardizing.standardizer.scale)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    # buffers, not parameters: the optimiser never moves them
    assert all("standardizer" not in name for name, _ in standardizing.named_parameters())
