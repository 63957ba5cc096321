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
from privfl.privacy.dp_sgd import DPSGDConfig, DPSGDTrainer
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


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
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


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
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
        ({"noise_multiplier": 1.0, "grad_sample_mode": "ew"}, "ghost, hooks, functorch"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "delta"),
        ({"noise_multiplier": 1.0, "max_grad_norm": -1}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "accountant": "gdp"}, "pld, prv"),
    ],
)
def test_config_validation_names_the_bad_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DPSGDConfig(**kwargs)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_hardened_noise_reaches_opacus_as_secure_mode_with_the_calibrated_std(mode, monkeypatch):
    # As in the test above, every per-sample gradient is 0, so the update is -lr * noise / batch_size; 1,000,000
    # coordinates measure the noise's std to 0.07% (SE sigma / sqrt(2 N)), so 2% catches a factor error.
    import opacus.optimizers.optimizer as opacus_optimizer
    import opacus.optimizers.optimizer_fast_gradient_clipping as opacus_ghost

    calls = []
    for module in (opacus_optimizer, opacus_ghost):
        def spy(*args, _original=module._generate_noise, **kwargs):
            calls.append(kwargs.get("secure_mode"))
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, "_generate_noise", spy)
    model = nn.Linear(1000, 1000, bias=False)
    nn.init.zeros_(model.weight)
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=3.0, max_grad_norm=0.5, noise="hardened",
                                       grad_sample_mode=mode))
    trainer.train(model, torch.zeros(64, 1000), torch.zeros(64, dtype=torch.long), lr=1.0, steps=1, batch_size=64,
                  rng=np.random.default_rng(0))
    assert calls == [True]                                    # one parameter, one noisy step, in secure_mode
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
    # q = 1/200: a step's batch is empty with probability 0.995^200 ~ 0.37; 60 steps all non-empty: ~1e-12
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0, noise="hardened"))
    _, event = trainer.train(small_model(), x, y, lr=0.1, steps=60, batch_size=1, rng=np.random.default_rng(0))
    assert flags and set(flags) == {True}
    assert event == SelfComposedEvent(SubsampledGaussianEvent(1.0, 1 / 200), 60)   # the same accounting


def test_hardened_noise_is_not_determined_by_the_run_seed():
    first, second = _weights_after_two_runs("hardened")
    assert any(not torch.equal(a, b) for a, b in zip(first, second))
