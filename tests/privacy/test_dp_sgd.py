"""DP-SGD trainer: privacy composes over rounds (invariant 5 of docs/invariants.md), checkpoints, calibration, real
per-sample clipping, hardened noise."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import accounting
from accounting import SelfComposedEvent, SubsampledGaussianEvent
from privfl.errors import ConfigError
from privfl.models import build_model
from privfl.privacy.dp_sgd import DPSGDConfig, DPSGDTrainer, GenericPathWarning
from privfl.privacy.mechanisms import standard_normal

DELTA = 1e-5


def separable_data(n: int = 200, dim: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, 0] > 0).long()
    return x, y


def small_model(dim: int = 5, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 8), nn.ReLU(), nn.Linear(8, 2))


def test_epsilon_composes_over_rounds_of_one_trainer():
    x, y = separable_data()
    model = small_model()
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0, delta=DELTA))
    k, batch_size = 10, 20
    initial = copy.deepcopy(model.state_dict())
    epsilons, events = [], []
    for round_ in range(3):
        model.load_state_dict(initial)  # the server's weights are reloaded every round
        _, event = trainer.train(model, x, y, lr=0.1, steps=k, batch_size=batch_size,
                                 rng=np.random.default_rng(round_))
        assert event == SelfComposedEvent(SubsampledGaussianEvent(1.0, batch_size / len(y)), k)
        events.append(event)
        epsilons.append(trainer.epsilon())
    assert epsilons[0] < epsilons[1] < epsilons[2]
    assert trainer.total_steps == 3 * k
    composed = accounting.epsilon(accounting.ComposedEvent(tuple(events)), DELTA)
    three_k = accounting.epsilon(SelfComposedEvent(SubsampledGaussianEvent(1.0, batch_size / len(y)), 3 * k), DELTA)
    one_round = accounting.epsilon(events[0], DELTA)
    assert epsilons[2] == pytest.approx(composed, rel=1e-9)
    assert epsilons[2] == pytest.approx(three_k, rel=1e-6)
    assert epsilons[0] == pytest.approx(one_round, rel=1e-9)
    assert epsilons[2] > 1.4 * one_round  # not the epsilon of one round
    # Opacus' own PRV accountant, holding the same history, agrees with ours to its discretisation error.
    assert trainer.opacus_epsilon() == pytest.approx(trainer.epsilon(accountant="prv"), rel=1e-9)
    assert trainer.opacus_epsilon() == pytest.approx(epsilons[2], rel=0.02)


def test_state_dict_round_trip_continues_with_same_epsilon():
    x, y = separable_data()
    config = DPSGDConfig(noise_multiplier=1.2, delta=DELTA, accountant="prv")
    trainer = DPSGDTrainer(config)
    trainer.train(small_model(), x, y, lr=0.1, steps=5, batch_size=20, rng=np.random.default_rng(0))
    state = trainer.state_dict()
    # Plain values only, so the runtime can save it with the client's state (weights_only loading).
    assert all(isinstance(v, (int, float)) for row in state["history"] for v in row)
    restored = DPSGDTrainer(config)
    restored.load_state_dict(copy.deepcopy(state))
    assert restored.epsilon() == trainer.epsilon()
    assert restored.total_steps == 5
    for t in (trainer, restored):
        t.train(small_model(), x, y, lr=0.1, steps=5, batch_size=20, rng=np.random.default_rng(1))
    assert restored.epsilon() == trainer.epsilon() > DPSGDTrainer(config).epsilon()
    assert restored.history == [(1.2, 0.1, 10)]


def test_target_epsilon_is_met_over_the_planned_schedule():
    x, y = separable_data()
    config = DPSGDConfig(target_epsilon=2.0, delta=DELTA, total_steps=40, accountant="prv")
    trainer = DPSGDTrainer(config)
    for round_ in range(4):
        trainer.train(small_model(), x, y, lr=0.1, steps=10, batch_size=20, rng=np.random.default_rng(round_))
    spent = trainer.epsilon()
    assert spent <= 2.0
    assert spent == pytest.approx(2.0, rel=0.05)
    # The plan is a hard cap: a round beyond it raises before training.
    with pytest.raises(ConfigError, match="total_steps=40"):
        trainer.train(small_model(), x, y, lr=0.1, steps=1, batch_size=20, rng=np.random.default_rng(9))
    assert trainer.total_steps == 40


@pytest.mark.parametrize("mode", ["auto", "vmap", "loop", "ghost", "hooks"])
def test_per_sample_gradients_are_clipped(mode):
    # q = 1 (batch_size = n) so every record enters the one step; negligible noise; lr = 1. The weight change is
    # then -(sum_i clip(g_i, C)) / n, which we compute independently with torch.func.
    x, y = separable_data(n=16)
    x = x * 50.0  # large inputs: most per-sample gradients are far above C
    max_grad_norm = 0.5
    model = small_model()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_of(params, xi, yi):
        out = functional_call(model, params, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(before, x, y)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
    assert (norms > max_grad_norm).sum() >= 8
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    expected = {k: -(g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) / len(y) for k, g in per_sample.items()}

    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1e-9, max_grad_norm=max_grad_norm, grad_sample_mode=mode))
    trainer.train(model, x, y, lr=1.0, steps=1, batch_size=len(y), rng=np.random.default_rng(0))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach() - before[name], expected[name], rtol=1e-4, atol=1e-6)
    change_norm = torch.sqrt(sum((p.detach() - before[k]).pow(2).sum() for k, p in model.named_parameters()))
    assert change_norm <= max_grad_norm + 1e-6
    # The model comes back as a plain module: no Opacus hooks or per-sample attributes left on it.
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_training_reduces_loss_on_a_separable_task():
    x, y = separable_data(n=400)
    model = small_model()
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=0.5))
    with torch.no_grad():
        before = nn.functional.cross_entropy(model(x), y).item()
    for round_ in range(3):
        trainer.train(model, x, y, lr=0.5, steps=30, batch_size=40, rng=np.random.default_rng(round_))
    with torch.no_grad():
        after = nn.functional.cross_entropy(model(x), y).item()
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert after < 0.7 * before
    assert accuracy > 0.9


def test_empty_poisson_batches_are_noise_only_steps():
    x, y = separable_data(n=200)
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    # q = 1/200: most batches are empty; the step still happens (noise only) and is still accounted.
    loss, event = trainer.train(model, x, y, lr=0.1, steps=5, batch_size=1, rng=np.random.default_rng(0))
    assert event.count == 5 and trainer.total_steps == 5
    assert math.isnan(loss) or loss > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _weights_after_two_runs(noise: str) -> list[list[torch.Tensor]]:
    x, y = separable_data()
    results = []
    for _ in range(2):
        model = small_model()
        DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0, noise=noise)).train(
            model, x, y, lr=0.1, steps=5, batch_size=20, rng=np.random.default_rng(7))
        results.append([p.detach().clone() for p in model.parameters()])
    return results


@pytest.mark.parametrize("mode", ["auto", "ghost", "hooks"])
def test_update_with_every_record_sampled_does_not_depend_on_the_private_n(mode):
    # batch_size >= n, so q = 1. Zero inputs and no bias make every per-sample gradient exactly 0, so the update is
    # the noise alone: -lr * N(0, (sigma C)^2) / divisor. With the same seeded noise, n = 100 and its add-one
    # neighbour n = 101 must release the same update. Dividing by the expected batch size q * n = n (private under
    # add-or-remove-one) gives updates in the ratio 101 / 100, whose norms tell the neighbours apart.
    updates = []
    for n in (100, 101):
        model = nn.Linear(5, 2, bias=False)
        nn.init.zeros_(model.weight)   # the same start for both, so the updates compare to the last bit
        trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=5.0, max_grad_norm=1.0, noise="seeded",
                                           grad_sample_mode=mode))
        trainer.train(model, torch.zeros(n, 5), torch.zeros(n, dtype=torch.long), lr=1.0, steps=1, batch_size=128,
                      rng=np.random.default_rng(3))
        updates.append(model.weight.detach().clone())
    assert torch.equal(updates[0], updates[1])
    # The update is the noise, N(0, 5^2) per coordinate, over batch_size = 128: its scale is not 1/n's.
    assert 0.5 * 5.0 / 128 < updates[0].std().item() < 2.0 * 5.0 / 128


def test_seeded_noise_same_seed_same_weights():
    for a, b in zip(*_weights_after_two_runs("seeded")):
        assert torch.equal(a, b)


def test_secure_noise_is_the_default_and_not_determined_by_the_run_seed():
    # The server knows the run seed; with the default noise the same keyed generator must not give the same draws.
    assert DPSGDConfig(noise_multiplier=1.0).noise == "secure"
    first, second = _weights_after_two_runs("secure")
    assert any(not torch.equal(a, b) for a, b in zip(first, second))


def test_unknown_noise_source_is_refused_by_name():
    with pytest.raises(ConfigError, match="noise.*'bogus'"):
        DPSGDConfig(noise_multiplier=1.0, noise="bogus")


def test_batchnorm_model_is_refused_with_the_remedy():
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    x, y = separable_data()
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match=r"ModuleValidator\.fix") as info:
        trainer.train(model, x, y, lr=0.1, steps=1, batch_size=20, rng=np.random.default_rng(0))
    assert "BatchNorm" in str(info.value)
    assert trainer.total_steps == 0  # nothing trained, nothing recorded


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of noise_multiplier and target_epsilon"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "exactly one"),
        ({"target_epsilon": 1.0}, "total_steps is required"),
        ({"noise_multiplier": 0.0}, "noise_multiplier must be a finite number > 0"),
        ({"noise_multiplier": 1.0, "grad_sample_mode": "ew"}, "auto, fast, vmap, loop, ghost, hooks, functorch"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "delta"),
        ({"noise_multiplier": 1.0, "max_grad_norm": -1}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "accountant": "gdp"}, "pld, prv"),
    ],
)
def test_config_validation_names_the_bad_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DPSGDConfig(**kwargs)


@pytest.mark.parametrize("mode", ["auto", "ghost", "hooks"])
def test_hardened_noise_is_one_hardened_draw_per_step_with_the_calibrated_std(mode, monkeypatch):
    # As in the test above, every per-sample gradient is 0, so the update is -lr * noise / batch_size; 1,000,000
    # coordinates measure the noise's std to 0.07% (SE sigma / sqrt(2 N)), so 2% catches a factor error. Every
    # mode, Opacus' included, draws the noise here, once per step for the flat parameter vector.
    import privfl.privacy.dp_sgd as dp_sgd

    calls = []

    def spy(shape, **kwargs):
        calls.append((tuple(shape), kwargs["hardened"]))
        return standard_normal(shape, **kwargs)

    monkeypatch.setattr(dp_sgd, "standard_normal", spy)
    model = nn.Linear(1000, 1000, bias=False)
    nn.init.zeros_(model.weight)
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=3.0, max_grad_norm=0.5, noise="hardened",
                                       grad_sample_mode=mode))
    trainer.train(model, torch.zeros(64, 1000), torch.zeros(64, dtype=torch.long), lr=1.0, steps=1, batch_size=64,
                  rng=np.random.default_rng(0))
    assert calls == [((1_000_000,), True)]                   # one flat draw, hardened
    noise = -model.weight.detach() * 64
    assert noise.std().item() == pytest.approx(3.0 * 0.5, rel=0.02)
    assert trainer.history == [(3.0, 1.0, 1)]                # accounted as any DP-SGD step: sigma 3, q = 1


def test_hardened_noise_only_steps_draw_the_hardened_way(monkeypatch):
    import privfl.privacy.dp_sgd as dp_sgd

    flags = []

    def spy(*args, **kwargs):
        flags.append(kwargs["hardened"])
        return standard_normal(*args, **kwargs)

    monkeypatch.setattr(dp_sgd, "standard_normal", spy)
    x, y = separable_data(n=200)
    # q = 1/200: a step's batch is empty with probability 0.995^200 ~ 0.37; 60 steps all non-empty: ~1e-12. Empty
    # or not, every step draws its noise once, hardened.
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0, noise="hardened"))
    _, event = trainer.train(small_model(), x, y, lr=0.1, steps=60, batch_size=1, rng=np.random.default_rng(0))
    assert flags == [True] * 60
    assert event == SelfComposedEvent(SubsampledGaussianEvent(1.0, 1 / 200), 60)   # the same accounting


def test_hardened_noise_is_not_determined_by_the_run_seed():
    first, second = _weights_after_two_runs("hardened")
    assert any(not torch.equal(a, b) for a, b in zip(first, second))
# --- the generic step: per-sample losses, data-independent terms, optimizer settings, paths ------------------------


def zero_loss(model, xb, yb):
    """Every per-sample gradient is exactly 0: the update is the noise and the data-independent terms alone."""
    return model(xb).sum(1) * 0.0


def test_a_record_with_a_huge_gradient_moves_the_model_by_exactly_c():
    x, y = separable_data(n=1)
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1e-12, max_grad_norm=0.3))
    model = small_model()
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    trainer.train(model, x * 1e4, y, lr=1.0, steps=1, batch_size=1, rng=np.random.default_rng(0))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (after - before).norm().item() == pytest.approx(0.3, rel=1e-6)


@pytest.mark.parametrize("mode", ["auto", "vmap", "hooks"])
def test_extra_loss_gradient_is_added_unclipped_unnoised_and_not_divided(mode):
    # Same seeded noise with and without the extra term <v, w>: the two runs differ by exactly -lr * v, although
    # ||v|| = 100 is far above C and the batch size is 8: the term's gradient is neither clipped, nor noised, nor
    # divided by batch_size.
    x, y = separable_data(n=40)
    v = {name: torch.full_like(p, 100.0 / math.sqrt(sum(q.numel() for q in small_model().parameters())))
         for name, p in small_model().named_parameters()}

    def linear_term(params):
        return sum((v[name] * p).sum() for name, p in params.items())

    changes = []
    for extra in (None, linear_term):
        model = small_model()
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=3.0, max_grad_norm=0.5, noise="seeded",
                                           grad_sample_mode=mode))
        trainer.train(model, x, y, lr=0.1, steps=1, batch_size=8, rng=np.random.default_rng(5),
                      per_sample_loss=zero_loss, extra_loss=extra)
        changes.append({k: p.detach() - before[k] for k, p in model.named_parameters()})
    for name in v:
        torch.testing.assert_close(changes[1][name] - changes[0][name], -0.1 * v[name], rtol=0, atol=2e-6)
    assert sum(c.pow(2).sum() for c in changes[0].values()) > 0   # the first run did move (noise)


@pytest.mark.parametrize("mode", ["auto", "hooks"])
def test_noise_std_is_noise_multiplier_times_c_over_batch_size(mode):
    # Zero per-sample gradients (zero inputs, no bias): one step moves each of the 100,000 weights by
    # -lr * N(0, (sigma C / batch_size)^2). The sample std of 1e5 draws is within 1.5% of the truth with
    # probability far above 1 - 1e-9, so a factor error (sqrt(batch_size), dividing by n, a missing C) fails.
    sigma, clip, batch_size, n = 2.0, 0.5, 8, 16
    model = nn.Linear(500, 200, bias=False)
    nn.init.zeros_(model.weight)
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=sigma, max_grad_norm=clip, grad_sample_mode=mode))
    trainer.train(model, torch.zeros(n, 500), torch.zeros(n, dtype=torch.long), lr=1.0, steps=1,
                  batch_size=batch_size, rng=np.random.default_rng(0))
    noise = -model.weight.detach().flatten()
    expected = sigma * clip / batch_size
    assert noise.std().item() == pytest.approx(expected, rel=0.015)
    assert abs(noise.mean().item()) < 5 * expected / math.sqrt(noise.numel())


def test_noise_std_agrees_with_opacus_dp_optimizer():
    # Opacus' DPOptimizer, the reference: clip, noise and scale a zero per-sample gradient with the same settings.
    from opacus.optimizers import DPOptimizer

    sigma, clip, batch_size = 2.0, 0.5, 8
    weight = nn.Parameter(torch.zeros(200, 500))
    optimizer = DPOptimizer(torch.optim.SGD([weight], lr=1.0), noise_multiplier=sigma, max_grad_norm=clip,
                            expected_batch_size=batch_size)
    weight.grad_sample = torch.zeros(1, 200, 500)
    assert optimizer.pre_step()
    opacus_std = weight.grad.std().item()
    assert opacus_std == pytest.approx(sigma * clip / batch_size, rel=0.015)


def test_momentum_and_weight_decay_act_on_the_noisy_gradient_as_sgd_does():
    # Zero per-sample gradients and negligible noise leave the extra term g = v and the decay: with momentum m,
    # SGD's buffer is b1 = g1, b2 = m b1 + g2, where g_k = v + wd * w_{k-1}.
    model = nn.Linear(3, 2, bias=False)
    w0 = model.weight.detach().clone()
    v = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    lr, m, wd = 0.1, 0.5, 0.2
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1e-12))
    trainer.train(model, torch.randn(10, 3), torch.zeros(10, dtype=torch.long), lr=lr, steps=2, batch_size=4,
                  rng=np.random.default_rng(0), per_sample_loss=zero_loss,
                  extra_loss=lambda params: (v * params["weight"]).sum(), momentum=m, weight_decay=wd)
    g1 = v + wd * w0
    w1 = w0 - lr * g1
    g2 = v + wd * w1
    w2 = w1 - lr * (m * g1 + g2)
    torch.testing.assert_close(model.weight.detach(), w2, rtol=0, atol=1e-6)


def test_params_trains_only_the_named_parameters_and_restores_requires_grad():
    x, y = separable_data()
    model = small_model()
    model[2].bias.requires_grad_(False)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    _, event = trainer.train(model, x, y, lr=0.5, steps=3, batch_size=20, rng=np.random.default_rng(0),
                             params=["0.weight", model[2].bias])
    changed = {k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])}
    assert changed == {"0.weight", "2.bias"}
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, False]
    assert all(p.grad is None for p in model.parameters())
    assert event == SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.1), 3)


def test_events_and_history_do_not_depend_on_the_loss_or_optimizer_settings():
    x, y = separable_data()
    plain, rich = (DPSGDTrainer(DPSGDConfig(noise_multiplier=0.8, delta=DELTA)) for _ in range(2))
    anchor = {k: v.detach().clone() for k, v in small_model().named_parameters()}
    _, plain_event = plain.train(small_model(), x, y, lr=0.1, steps=7, batch_size=20, rng=np.random.default_rng(0))
    _, rich_event = rich.train(
        small_model(), x, y, lr=0.1, steps=7, batch_size=20, rng=np.random.default_rng(0),
        per_sample_loss=lambda m, xb, yb: nn.functional.cross_entropy(m(xb), yb, reduction="none") * 2.0,
        extra_loss=lambda params: 0.05 * sum(((p - anchor[k]) ** 2).sum() for k, p in params.items()),
        weight_decay=1e-3, momentum=0.9)
    assert plain_event == rich_event == SelfComposedEvent(SubsampledGaussianEvent(0.8, 0.1), 7)
    assert plain.history == rich.history == [(0.8, 0.1, 7)]
    assert plain.epsilon() == rich.epsilon()


def test_fast_generic_and_opacus_paths_give_the_same_weights_with_the_same_seeded_noise():
    # The noise is one draw for the flat parameter vector from the client's generator in every mode, so with seeded
    # noise the whole trajectory (sampling, clipping, noise, momentum, proximal term) agrees across paths.
    torch.manual_seed(0)
    x, y = torch.rand(24, 3, 16, 16), torch.randint(0, 10, (24,))
    start = build_model("lenet", (3, 16, 16), 10).state_dict()
    anchor = {k: v.clone() for k, v in start.items()}
    results = {}
    for mode in ("fast", "vmap", "hooks"):
        model = build_model("lenet", (3, 16, 16), 10)
        model.load_state_dict(start)
        trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=0.7, max_grad_norm=0.5, noise="seeded",
                                           grad_sample_mode=mode))
        trainer.train(model, x, y, lr=0.2, steps=3, batch_size=8, rng=np.random.default_rng(11), momentum=0.5,
                      extra_loss=lambda params: 0.5 * sum(((p - anchor[k]) ** 2).sum() for k, p in params.items()))
        assert trainer.gradient_path == mode
        results[mode] = torch.cat([p.detach().flatten() for p in model.parameters()])
    moved = (results["fast"] - torch.cat([v.flatten() for v in start.values()])).norm()
    for mode in ("vmap", "hooks"):
        assert (results[mode] - results["fast"]).norm() < 1e-5 * moved


def test_a_model_the_fast_path_cannot_handle_trains_on_the_generic_path_and_says_so():
    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = small_model()
            self.temperature = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return self.body(x) / self.temperature

    x, y = separable_data()
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    with pytest.warns(GenericPathWarning, match="'vmap'.*'temperature' is used by"):
        _, event = trainer.train(Tempered(), x, y, lr=0.1, steps=2, batch_size=20, rng=np.random.default_rng(0))
    assert trainer.gradient_path == "vmap" and "temperature" in trainer.gradient_path_reason
    assert event == SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.1), 2)
    trainer.train(small_model(), x, y, lr=0.1, steps=1, batch_size=20, rng=np.random.default_rng(1))
    assert trainer.gradient_path == "fast" and trainer.gradient_path_reason is None


def test_empty_batches_take_noise_only_steps_and_skip_the_loss():
    x, y = separable_data(n=200)
    calls = []

    def counting_loss(model, xb, yb):
        if torch.is_grad_enabled():   # not the fast path's once-a-round shape probe, which forms no gradient
            calls.append(len(xb))
        return zero_loss(model, xb, yb)

    model = small_model()
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0, noise="seeded"))
    weights = []
    for step in range(6):
        trainer.train(model, x, y, lr=0.1, steps=1, batch_size=1, rng=np.random.default_rng(step),
                      per_sample_loss=counting_loss)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # q = 1/200: some steps sample nobody (the loss is not called) and every step still moves the model (noise).
    assert 0 < len(calls) < 6 and all(size >= 1 for size in calls)
    assert all(not torch.equal(a, b) for a, b in zip(weights, weights[1:]))
    assert trainer.total_steps == 6


def test_steps_taken_before_a_failure_are_accounted():
    x, y = separable_data(n=20)
    calls = []

    def failing_loss(model, xb, yb):
        calls.append(torch.is_grad_enabled())   # False: the fast path's once-a-round shape probe
        if sum(calls) == 3:
            raise RuntimeError("the loss broke")
        return nn.functional.cross_entropy(model(xb), yb, reduction="none")

    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    with pytest.raises(RuntimeError, match="the loss broke"):
        trainer.train(small_model(), x, y, lr=0.1, steps=5, batch_size=20, rng=np.random.default_rng(0),
                      per_sample_loss=failing_loss)
    assert trainer.history == [(1.0, 1.0, 2)]   # two steps changed the model; they are in its ledger


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -0.1}, "lr must be a finite number >= 0, got -0.1"),
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\), got 1.0"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0"),
        ({"per_sample_loss": "ce"}, "per_sample_loss must be a callable"),
        ({"params": ["fc9.weight"]}, "'fc9.weight', which is not a parameter"),
        ({"params": []}, "no parameter to train"),
    ],
)
def test_train_arguments_are_validated_by_name(kwargs, match):
    x, y = separable_data()
    arguments = {"lr": 0.1, "steps": 1, "batch_size": 20, "rng": np.random.default_rng(0), **kwargs}
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match=match):
        trainer.train(small_model(), x, y, **arguments)
    assert trainer.total_steps == 0
