"""HeteroFedTTA: three model sizes, logit consensus on the public set, the Eq. 14 KD loss, novel clients, a run."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import Bias
from torch import nn

from privfl.config import RunConfig
from privfl.data import build_federation
from privfl.errors import ConfigError
from privfl.experiment import RunInterrupted, build_runtime, train
from privfl.federation import ClientContext, Message
from privfl.methods import ModelFactory, get_method
from privfl.methods.fedtta import AdaptationModel, inner_step
from privfl.methods.heterofedtta import (
    BASE,
    PAPER_CNN_SIZES,
    PER,
    PUBLIC,
    consensus,
    distillation_loss,
    prediction_model,
)
from privfl.privacy.training import TrainingPrivacy

torch.set_num_threads(1)

FACTORY = ModelFactory("mlp2nn", (10,), 4)


def make(**settings):
    spec = get_method("heterofedtta")
    config = spec.make_config(**settings)
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=3)
    return strategy, spec.client(model_factory=FACTORY, config=config), config


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_the_three_sizes_have_different_parameter_counts_and_follow_the_client_id():
    _, client, config = make()
    counts = [count(prediction_model(FACTORY, w)) for w in config.widths]
    assert counts[0] < counts[1] < counts[2]
    g_counts = [count(client.build(size)[1]) for size in range(3)]
    assert g_counts[0] < g_counts[1] < g_counts[2]
    assert [config.size_of(cid) for cid in range(6)] == [0, 1, 2, 0, 1, 2]
    cnn = ModelFactory("fedtta_cnn", (1, 8, 8), 4)
    assert len({count(prediction_model(cnn, w)) for w in config.widths}) == 3
    # the paper's three CNNs (App. Table 3: conv 16/32, 32/64, 64/128, FC 512) on CIFAR-10, to the parameter
    paper = get_method("heterofedtta").make_config(**PAPER_CNN_SIZES)
    cifar = ModelFactory("fedtta_cnn", (3, 32, 32), 10)
    assert [count(prediction_model(cifar, w, c)) for w, c in zip(paper.widths, paper.conv)] == \
        [1_068_266, 2_156_490, 4_409_738]
    with pytest.raises(ConfigError, match="model 'mlp2nn' has none; models with them: fedtta_cnn"):
        prediction_model(FACTORY, 8, (16, 32))
    with pytest.raises(ConfigError, match="conv must be None or one pair of conv channel counts"):
        get_method("heterofedtta").make_config(conv=[[16, 32]])


def test_server_consensus_is_the_mean_of_three_clients_logits():
    strategy, _, _ = make(public_size=100)
    message = strategy.configure_train(0, [0, 1, 2])[0]
    assert set(message.arrays) == {PUBLIC}  # round 0: no consensus yet
    assert message.arrays[PUBLIC].shape == (100, 10)
    torch.manual_seed(0)
    base = [torch.randn(100, 4) for _ in range(3)]
    per = [torch.randn(100, 4) for _ in range(3)]
    replies = {cid: Message(arrays={"base": base[cid], "per": per[cid]}, metrics={"num_examples": 10.0 * (cid + 1),
                                                                              "loss": 1.0})
               for cid in range(3)}
    strategy.aggregate_train(0, replies)
    assert torch.allclose(strategy.base, (base[0] + base[1] + base[2]) / 3)
    assert torch.allclose(strategy.per, (per[0] + per[1] + per[2]) / 3)
    down = strategy.configure_train(1, [0])[0]
    assert torch.equal(down.arrays[BASE], strategy.base) and torch.equal(down.arrays[PER], strategy.per)
    assert torch.allclose(consensus(base, [1.0, 2.0, 3.0]), (base[0] + 2 * base[1] + 3 * base[2]) / 6)
    weighted, _, _ = make(weighted=True)
    weighted.aggregate_train(0, replies)
    assert torch.allclose(weighted.base, (base[0] + 2 * base[1] + 3 * base[2]) / 6)


def _kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def test_distillation_loss_is_the_hand_computed_kl_pair():
    # f(x) = b for every x, so the student's base softmax is softmax(b) for both samples; g(z) = z_1 - z_2 - c.
    f = Bias([0.0, 0.0])
    g = nn.Linear(2, 1).double()
    with torch.no_grad():
        g.weight.copy_(torch.tensor([[1.0, -1.0]]))
        g.bias.fill_(-1.0)
    x = torch.zeros(2, 1, dtype=torch.float64)
    psi, phi = dict(f.named_parameters()), dict(g.named_parameters())
    # l_per = sqrt(2) |b1 - b2 - 1| = sqrt(2) at b = 0; grad_b = sqrt(2) * (-1, +1); inner lr 1/sqrt(2) gives
    # b~ = (1, -1), whose softmax is (e / (e + 1/e), ...).
    inner_lr = 1 / math.sqrt(2)
    assert inner_step(f, g, psi, phi, x, inner_lr=inner_lr)["b"].tolist() == pytest.approx([1.0, -1.0])
    teacher_base = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]], dtype=torch.float64))
    teacher_per = torch.log(torch.tensor([[0.6, 0.4], [0.6, 0.4]], dtype=torch.float64))
    p_tilde = [math.e / (math.e + 1 / math.e), (1 / math.e) / (math.e + 1 / math.e)]
    expected = _kl([0.6, 0.4], p_tilde) + 0.8 * _kl([0.9, 0.1], [0.5, 0.5])
    loss = distillation_loss(f, g, psi, phi, x, teacher_base, teacher_per, inner_lr=inner_lr, kd_lambda=0.8)
    assert loss.item() == pytest.approx(expected)
    vanilla = distillation_loss(f, g, psi, phi, x, teacher_base, teacher_per, inner_lr=inner_lr, kd_lambda=0.0)
    assert vanilla.item() == pytest.approx(_kl([0.6, 0.4], p_tilde))
    flipped = distillation_loss(f, g, psi, phi, x, teacher_base, teacher_per, inner_lr=inner_lr, kd_lambda=0.8,
                                kl_direction="student_teacher")
    assert flipped.item() == pytest.approx(_kl(p_tilde, [0.6, 0.4]) + 0.8 * _kl([0.5, 0.5], [0.9, 0.1]))


def test_the_personalised_term_reaches_the_adaptation_model():
    torch.manual_seed(0)
    f = prediction_model(FACTORY, 8)
    g = AdaptationModel(4, hidden=8, layers=2)
    x = torch.randn(16, 10)
    loss = distillation_loss(f, g, dict(f.named_parameters()), dict(g.named_parameters()), x, torch.randn(16, 4),
                             torch.randn(16, 4), inner_lr=0.5, kd_lambda=0.8)
    grads = torch.autograd.grad(loss, list(g.parameters()))
    assert sum(float(gr.abs().sum()) for gr in grads) > 0


@pytest.mark.parametrize("settings, name", [
    ({"widths": (100, 200)}, "adapt_widths"),
    ({"widths": (100, 0, 400)}, "widths"),
    ({"novel_size": 3}, "novel_size"),
    ({"public_size": 0}, "public_size"),
    ({"public_std": -1.0}, "public_std"),
    ({"kd_lambda": -0.1}, "kd_lambda"),
    ({"distill_batch": 0}, "distill_batch"),
    ({"mu": 0.01}, "mu"),
    ({"adapt_hidden": 16}, "adapt_hidden"),
    ({"dp_epsilon": 1.0}, "no setting dp_epsilon"),     # the privacy layer's TrainingPrivacy protects the logits
])
def test_bad_settings_are_refused_by_name(settings, name):
    with pytest.raises(ConfigError, match=name):
        get_method("heterofedtta").make_config(**settings)


def test_a_model_without_a_hidden_width_is_refused_by_name():
    spec = get_method("heterofedtta")
    with pytest.raises(ConfigError, match="lenet"):
        spec.strategy(model_factory=ModelFactory("lenet", (3, 32, 32), 4), config=spec.make_config(), seed=0,
                      num_training_clients=3)


SMALL = {"local_steps": 2, "batch_size": 16, "widths": [8, 16, 32], "adapt_widths": [4, 8, 16], "public_size": 32,
         "distill_batch": 16}


def _runtime(make_spec, rounds=1, **settings):
    spec = make_spec(num_clients=6, novel_fraction=0.5)
    config = RunConfig(federation=spec, method="heterofedtta", model="mlp2nn", rounds=rounds,
                       method_config={**SMALL, **settings})
    federation = build_federation(spec, seed=0)
    runtime = build_runtime(config, federation)
    for r in range(rounds):
        runtime.run_round(r)
    return federation, runtime


def test_clients_keep_models_of_their_own_size_and_release_only_public_logits(make_spec):
    federation, runtime = _runtime(make_spec, rounds=2)
    public = runtime.strategy.public
    for client in federation.training_clients:
        cid = client.client_id
        width = SMALL["widths"][cid % 3]
        assert runtime.client_states[cid]["psi.fc1.weight"].shape[0] == width
        records = runtime.wire.ledgers[cid].records
        assert len(records) == 2 and {r.purpose for r in records} == {"public_logits"}
        # Each upload is exactly two |D_p| x K float32 matrices.
        assert runtime.wire.bytes_up[cid] == 2 * 2 * public.shape[0] * federation.num_classes * 4
    assert runtime.strategy.base.shape == (public.shape[0], federation.num_classes)


def test_a_client_whose_logits_overflow_sends_nothing_so_the_consensus_stays_finite(make_spec):
    # public inputs of std 1 and an inner rate of 50: finite losses, but some clients' last step overflows
    spec = make_spec(num_clients=6, novel_fraction=0.5)
    config = RunConfig(federation=spec, method="heterofedtta", model="mlp2nn", rounds=2, select="last",
                       method_config={"local_steps": 2, "batch_size": 16, "widths": [8, 16, 32], "public_size": 64,
                                      "public_std": 1.0, "tta_steps": 1, "inner_lr": 50.0})
    runtime = build_runtime(config, build_federation(spec, seed=0))
    sent = []
    for round in range(2):
        runtime.run_round(round)
        sent.append(sum(len(runtime.wire.ledgers[c]) for c in runtime.clients if c in runtime.wire.ledgers))
        assert bool(torch.isfinite(runtime.strategy.base).all()) and bool(torch.isfinite(runtime.strategy.per).all())
    assert 0 < sent[-1] < 2 * len(runtime.clients)    # some clients were silent, the others still spoke


def test_novel_clients_distil_and_adapt_locally_and_send_nothing(make_spec):
    federation, runtime = _runtime(make_spec, novel_size=2)
    for novel in federation.novel_clients:
        model = runtime.novel_client_model(novel)
        assert novel.client_id not in runtime.wire.ledgers
        assert runtime.wire.bytes_up.get(novel.client_id, 0) == 0
        assert runtime.wire.bytes_down[novel.client_id] > 0
        assert model.fc1.weight.shape[0] == SMALL["widths"][2]
        with torch.no_grad():
            assert model(novel.x).shape == (novel.num_samples, federation.num_classes)


def test_two_round_run_end_to_end_and_resumed_identically(make_spec, tmp_path):
    config = RunConfig(federation=make_spec(num_clients=6, novel_fraction=0.5), method="heterofedtta",
                       model="mlp2nn", rounds=2, eval_every=1, method_config=SMALL)
    summary = train(config, str(tmp_path / "run"), progress=False)
    assert summary["rounds_completed"] == 2 and summary["selected_round"] in (1, 2)
    assert 0.0 <= summary["novel"]["accuracy_mean"] <= 100.0
    assert math.isinf(summary["privacy"]["epsilon_max_training"])
    assert summary["privacy"]["epsilon_max_novel"] == 0.0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(metrics[-1]["train_loss"]) and math.isfinite(metrics[-1]["distill_loss"])
    # Interrupted after round 1 and resumed from config.json (widths come back as lists) and the checkpoint (client
    # models and the consensus): the same numbers as the uninterrupted run.
    with pytest.raises(RunInterrupted):
        train(config, str(tmp_path / "resumed"), progress=False, stop_after_round=1)
    resumed = train(config, str(tmp_path / "resumed"), progress=False, resume=True)
    assert resumed["novel"] == summary["novel"] and resumed["training_val"] == summary["training_val"]


# --- privacy ------------------------------------------------------------------------------------------------------


def test_central_and_distributed_dp_form_the_consensus_from_the_mean_of_the_logits():
    strategy, _, _ = make(public_size=20)
    like = strategy.contribution_shapes()
    assert {k: tuple(v.shape) for k, v in like.items()} == {"base": (20, 4), "per": (20, 4)}
    mean = {"base": torch.full((20, 4), 0.5), "per": torch.full((20, 4), -1.0)}
    assert strategy.apply_mean(2, mean, 3.0) == {}
    assert torch.equal(strategy.base, mean["base"]) and torch.equal(strategy.per, mean["per"])
    down = strategy.configure_train(3, [0])[0]
    assert torch.equal(down.arrays[BASE], mean["base"]) and strategy.rounds_done == 3


def _private(make_spec, privacy, rounds=1, **settings):
    spec = make_spec(num_clients=6, novel_fraction=0.5)
    config = RunConfig(federation=spec, method="heterofedtta", model="mlp2nn", rounds=rounds, select="last",
                       method_config={**SMALL, **settings}, privacy=privacy)
    federation = build_federation(spec, seed=0)
    return federation, build_runtime(config, federation)


def test_record_level_rounds_record_the_event_their_round_event_declares_and_send_no_metrics(make_spec):
    federation, runtime = _private(make_spec, TrainingPrivacy(mode="record", noise_multiplier=1.2, noise="seeded"),
                                   rounds=2)
    for round in range(2):
        runtime.run_round(round)
    assert runtime.strategy.base is not None
    for data in federation.training_clients:
        records = runtime.wire.ledgers[data.client_id].records
        assert [r.event for r in records] == [runtime.client.inner.round_event(1.2)] * 2
        assert all(math.isfinite(runtime.wire.ledgers.epsilons(1e-5)[data.client_id]) for _ in records)
    message = runtime.strategy.configure_train(2, [0])[0]
    data = federation.training_clients[0]
    ctx = ClientContext(client_id=data.client_id, round=2, run_seed=0, rng=np.random.default_rng(0))
    release = runtime.client.inner.train(data, message, dict(runtime.client_states[data.client_id]), ctx)
    assert sorted(release.message.arrays) == ["base", "per"] and release.message.metrics == {}


# record level is not here: a record whose gradient overflows is left out of the clipped sum, so it cannot diverge
@pytest.mark.parametrize("mode", ["local"])
def test_under_dp_a_diverged_client_keeps_its_models_and_releases_their_logits_rather_than_staying_silent(
        make_spec, mode):
    federation, runtime = _private(make_spec, TrainingPrivacy(mode=mode, noise_multiplier=1.0, noise="seeded"))
    data = federation.training_clients[0]
    message = runtime.strategy.configure_train(0, [data.client_id])[data.client_id]
    data = dataclasses.replace(data, x_train=data.x_train * 1e25)     # the meta-training diverges
    ctx = ClientContext(client_id=data.client_id, round=0, run_seed=0, rng=np.random.default_rng(0))
    client, state = runtime.client.inner, {}
    release = client.train(data, message, state, ctx)
    assert release is not None and state == {}           # the previous models (here the initial ones) are kept
    kept = client.public_logits(*client.own_models(data.client_id, message, {}), message.arrays[PUBLIC], message)
    assert torch.equal(release.message.arrays["base"], kept[0]) and torch.equal(release.message.arrays["per"], kept[1])
    # without DP it stays silent, as the authors' code has it
    _, plain = _private(make_spec, TrainingPrivacy())
    assert plain.client.train(data, message, {}, ctx) is None
