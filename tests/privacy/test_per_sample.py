"""The clipped per-sample gradient sum: every path against Opacus' per-sample gradients and a brute-force loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from privfl.errors import ConfigError
from privfl.models import build_model
from privfl.privacy.per_sample import ClippedGradientSum, cross_entropy_losses, flat_views

PATHS = ("fast", "vmap", "loop")


def brute_force_clipped_sum(model, loss, x, y, max_grad_norm, params=None):
    """sum_i min(1, C / ||g_i||) g_i with g_i from one autograd call per record (the definition)."""
    params = dict(model.named_parameters()) if params is None else params
    total = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64)
    norms = []
    for i in range(len(x)):
        value = loss(model, x[i:i + 1], y[i:i + 1])[0]
        grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).flatten().double()
                          for p, g in zip(params.values(), grads, strict=True)])
        norms.append(flat.norm().item())
        total += flat * min(1.0, max_grad_norm / flat.norm().item())
    return total, norms


def engine_sum(model, loss, x, y, max_grad_norm, path, params=None):
    params = dict(model.named_parameters()) if params is None else params
    flat = torch.zeros(sum(p.numel() for p in params.values()))
    engine = ClippedGradientSum(model, params, loss, path=path)
    losses = engine(x, y, max_grad_norm, flat_views(params, flat))
    return flat.double(), engine, losses


def assert_close_relative(actual, expected, rtol=1e-5):
    error = ((actual - expected).norm() / expected.norm()).item()
    assert error < rtol, f"relative error {error:.2e}"


def opacus_clipped_sum(model, x, y, max_grad_norm):
    """The clipped sum from Opacus' per-sample gradients (GradSampleModule, hooks), clipped here."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum")
    try:
        with warnings.catch_warnings():   # Opacus' hooks fire on the first layer, whose input needs no gradient
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
        per_sample = torch.cat([p.grad_sample.reshape(len(x), -1) for p in model.parameters()], dim=1).double()
    finally:
        gsm._close()
        model.zero_grad(set_to_none=True)
    norms = per_sample.norm(dim=1)
    return (per_sample * (max_grad_norm / norms).clamp(max=1.0).unsqueeze(1)).sum(0), norms


@pytest.mark.parametrize(("name", "shape"), [("mlp2nn", (1, 28, 28)), ("lenet", (3, 32, 32)),
                                             ("fedtta_cnn", (1, 28, 28))])
def test_every_path_matches_opacus_per_sample_gradients_on_the_project_models(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    x, y = torch.rand(6, *shape) * 3, torch.randint(0, 10, (6,))
    reference, norms = opacus_clipped_sum(model, x, y, 1.0)
    max_grad_norm = norms.median().item()   # some records clipped, some not
    reference, _ = opacus_clipped_sum(model, x, y, max_grad_norm)
    assert (norms > max_grad_norm).sum() >= 2 and (norms < max_grad_norm).sum() >= 2
    for path in PATHS:
        actual, engine, _ = engine_sum(model, cross_entropy_losses, x, y, max_grad_norm, path)
        assert engine.path == path
        assert_close_relative(actual, reference)


class ConvZoo(nn.Module):
    """Convolutions and linear layers in every shape the fast path handles differently."""

    def __init__(self) -> None:
        super().__init__()
        self.few_channels = nn.Conv2d(3, 8, 3, stride=2, padding=(1, 2), dilation=2)     # channels-as-batch
        self.many_channels = nn.Conv2d(8, 12, 3, stride=(1, 2), dilation=(2, 1))         # grouped weight gradient
        self.small_output = nn.Conv2d(12, 16, 3, bias=False)                            # Gram matrices
        self.sequence = nn.Linear(16, 40)           # 3-D input, 2 positions: Gram matrices
        self.per_position = nn.Linear(40, 3)        # 3-D input, 2 positions, small output: materialised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.small_output(torch.tanh(self.many_channels(torch.tanh(self.few_channels(x))))))
        h = h.flatten(2).transpose(1, 2)            # (B, positions, 16)
        return self.per_position(torch.tanh(self.sequence(h))).mean(1)


def test_fast_path_matches_brute_force_on_strided_dilated_padded_convs_and_sequences():
    torch.manual_seed(1)
    model = ConvZoo()
    x, y = torch.randn(5, 3, 17, 14), torch.randint(0, 3, (5,))
    assert model.small_output(model.many_channels(model.few_channels(x))).shape[2:] == (2, 1)
    expected, norms = brute_force_clipped_sum(model, cross_entropy_losses, x, y, 0.1)
    assert min(norms) > 0.1
    actual, engine, _ = engine_sum(model, cross_entropy_losses, x, y, 0.1, "fast")
    assert engine.path == "fast"
    assert_close_relative(actual, expected)


def test_a_loss_with_an_extra_per_record_term_matches_brute_force():
    torch.manual_seed(2)
    model = build_model("lenet", (3, 32, 32), 10)

    def loss(m, xb, yb):   # cross-entropy plus an L2 penalty on each record's own logits
        logits = m(xb)
        return nn.functional.cross_entropy(logits, yb, reduction="none") + 0.05 * logits.pow(2).sum(1)

    x, y = torch.rand(5, 3, 32, 32), torch.randint(0, 10, (5,))
    expected, norms = brute_force_clipped_sum(model, loss, x, y, 0.5)
    assert max(norms) > 0.5
    for path in PATHS:
        actual, engine, losses = engine_sum(model, loss, x, y, 0.5, path)
        assert engine.path == path
        assert_close_relative(actual, expected)
        torch.testing.assert_close(losses, loss(model, x, y).detach())


def test_frozen_weight_with_trained_bias_and_a_subset_of_parameters():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    params = {"0.bias": model[0].bias, "3.weight": model[3].weight}
    for name, p in model.named_parameters():
        p.requires_grad_(name in params)
    x, y = torch.randn(6, 2, 6, 6), torch.randint(0, 3, (6,))
    expected, _ = brute_force_clipped_sum(model, cross_entropy_losses, x, y, 0.2, params)
    for path in PATHS:
        actual, _, _ = engine_sum(model, cross_entropy_losses, x, y, 0.2, path, params)
        assert_close_relative(actual, expected)


class ScaledModel(nn.Module):
    """A free parameter used outside any linear layer (as FedSR's reference distribution is)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.temperature


@pytest.mark.parametrize(("model", "reason"), [
    (ScaledModel(), "'temperature' is used by mul"),
    (nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)), "modified in place"),
    (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3)), "'1.weight' is used by layer_norm"),
])
def test_what_the_fast_path_cannot_handle_takes_the_generic_path_and_says_why(model, reason):
    torch.manual_seed(4)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    expected, _ = brute_force_clipped_sum(model, cross_entropy_losses, x, y, 0.3)
    actual, engine, _ = engine_sum(model, cross_entropy_losses, x, y, 0.3, "auto")
    assert engine.path == "vmap"
    assert reason in engine.reason
    assert_close_relative(actual, expected)
    with pytest.raises(ConfigError, match="path 'fast' cannot handle"):
        engine_sum(model, cross_entropy_losses, x, y, 0.3, "fast")


def test_weight_sharing_takes_the_generic_path():
    layer = nn.Linear(4, 4)
    model = nn.Sequential(layer, nn.Tanh(), layer)
    x, y = torch.randn(5, 4), torch.randint(0, 4, (5,))
    expected, _ = brute_force_clipped_sum(model, cross_entropy_losses, x, y, 0.3)
    actual, engine, _ = engine_sum(model, cross_entropy_losses, x, y, 0.3, "auto")
    assert engine.path == "vmap" and "weight sharing" in engine.reason
    assert_close_relative(actual, expected)


def test_a_loss_vmap_cannot_transform_takes_the_per_record_loop():
    model = ScaledModel()

    def loss(m, xb, yb):   # data-dependent control flow: vmap cannot read .item() of a batched tensor
        out = nn.functional.cross_entropy(m(xb), yb, reduction="none")
        return out * 2.0 if out.sum().item() > 0 else out

    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    expected, _ = brute_force_clipped_sum(model, loss, x, y, 0.3)
    actual, engine, _ = engine_sum(model, loss, x, y, 0.3, "auto")
    assert engine.path == "loop"
    assert "temperature" in engine.reason and "vmap" in engine.reason
    assert_close_relative(actual, expected)


def test_a_loss_that_samples_noise_gets_independent_noise_per_record():
    # loss_i = <w, eps_i> with eps_i ~ N(0, I) drawn inside the loss: g_i = eps_i, norm about 10 >> C, so each
    # clipped contribution has norm C. Independent draws sum to norm about sqrt(B) C; one draw shared by the batch
    # (vmap's randomness="same") would give exactly B C.
    model = nn.Linear(100, 1, bias=False)

    def loss(m, xb, yb):
        return (m.weight * torch.randn(len(xb), 100)).sum(1) + 0 * xb.sum(1)

    batch, max_grad_norm = 16, 0.01
    x, y = torch.zeros(batch, 100), torch.zeros(batch, dtype=torch.long)
    actual, engine, _ = engine_sum(model, loss, x, y, max_grad_norm, "auto")
    assert engine.path == "vmap"
    assert actual.norm().item() < 0.5 * batch * max_grad_norm


def test_a_record_with_a_huge_gradient_contributes_exactly_norm_c():
    torch.manual_seed(5)
    model = build_model("mlp2nn", (1, 28, 28), 10)
    x, y = torch.rand(1, 1, 28, 28) * 1e4, torch.tensor([3])
    for path in PATHS:
        actual, _, _ = engine_sum(model, cross_entropy_losses, x, y, 0.7, path)
        assert actual.norm().item() == pytest.approx(0.7, rel=1e-6)


def test_a_loss_that_is_not_per_record_is_refused():
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    for path in PATHS:
        with pytest.raises(ConfigError, match=r"one loss per record.*got \(\); use reduction='none'"):
            engine_sum(model, lambda m, xb, yb: nn.functional.cross_entropy(m(xb), yb), x, y, 1.0, path)


def test_batch_statistics_in_the_forward_are_refused():
    class BatchNormalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.batch_norm(self.linear(x), None, None, training=True)

    with pytest.raises(ConfigError, match="batch statistics"):
        engine_sum(BatchNormalised(), cross_entropy_losses, torch.randn(5, 4), torch.zeros(5, dtype=torch.long),
                   1.0, "auto")


def test_a_time_first_layout_whose_length_equals_the_batch_size_is_not_taken_for_records():
    # (B, T, d) inputs turned time-first for a linear layer, with T == B: every layer input has B rows, but row t
    # holds time step t of all records. Per-row norms would clip time steps, not records; the one-record-shorter
    # probe sees the rows not follow the batch size and the generic path clips whole records.
    class TimeFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = nn.Linear(3, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.step(x.transpose(0, 1)))   # (T, B, 4)
            return self.head(h.mean(0))                      # (B, 2)

    torch.manual_seed(6)
    model = TimeFirst()
    x, y = torch.randn(5, 5, 3) * 3, torch.randint(0, 2, (5,))
    expected, norms = brute_force_clipped_sum(model, cross_entropy_losses, x, y, 0.2)
    assert min(norms) > 0.2
    actual, engine, _ = engine_sum(model, cross_entropy_losses, x, y, 0.2, "auto")
    assert engine.path == "vmap" and "batch size 4" in engine.reason
    assert_close_relative(actual, expected)


@pytest.mark.parametrize("path", ["fast", "vmap", "loop"])
def test_a_record_with_a_non_finite_gradient_contributes_nothing_rather_than_nan(path):
    # one record's overflow must not turn everyone's clipped sum into NaN (an outcome of that record's data that no
    # noise covers): it contributes 0, a contribution within the clip, and the others' sum is unchanged
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    params = dict(model.named_parameters())
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 0])
    poisoned = x.clone()
    poisoned[2] = float("inf")
    engine = ClippedGradientSum(model, params, cross_entropy_losses, path=path)
    total = torch.zeros(sum(p.numel() for p in params.values()))
    engine(poisoned, y, 1.0, flat_views(params, total))
    clean = torch.zeros_like(total)
    keep = torch.tensor([0, 1, 3, 4])
    ClippedGradientSum(model, params, cross_entropy_losses, path=path)(x[keep], y[keep], 1.0,
                                                                        flat_views(params, clean))
    assert bool(torch.isfinite(total).all())
    torch.testing.assert_close(total, clean)
