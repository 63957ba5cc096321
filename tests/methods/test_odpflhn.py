"""ODPFL-HN: Algorithm 1's gradients (Amosy et al.; docs/papers.md, ODPFL-HN), the dialogue's releases, novel-client
ledgers, resume, config errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import assert_resumed_as_uninterrupted
from torch import nn

from privfl.config import RunConfig
from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError, TrainingDivergedError
from privfl.experiment import RunInterrupted, train
from privfl.federation import InProcessRuntime
from privfl.federation.context import client_context
from privfl.methods import ModelFactory, get_method
from privfl.methods.odpflhn import ODPFLHNClient, ODPFLHNConfig, ODPFLHNStrategy, client_descriptor
from privfl.models import backprop_weight_change, functional_forward
from privfl.modes.wrappers import PrivateClient
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

FACTORY = ModelFactory("mlp2nn", (6,), 3)


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def _client(cid: int, n: int = 24, seed: int = 0) -> TrainingClient:
    g = torch.Generator().manual_seed(seed + cid)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return TrainingClient(cid, x, y, x[:4].clone(), y[:4].clone())


def _runtime(config: ODPFLHNConfig, clients: list[TrainingClient], *, novel_privacy: NovelPrivacy | None = None,
             privacy: TrainingPrivacy | None = None) -> InProcessRuntime:
    strategy = ODPFLHNStrategy(model_factory=FACTORY, config=config, seed=1, num_training_clients=len(clients))
    client = ODPFLHNClient(model_factory=FACTORY, config=config, novel_privacy=novel_privacy, privacy=privacy,
                           participations=4)
    return InProcessRuntime(strategy=strategy, client=client, training_clients=clients, seed=1)


@pytest.mark.parametrize("encoder,descriptor", [("dp_deepset", "full"), ("dp_deepset", "batch_mean"),
                                                ("dss", "full")])
def test_one_plain_sgd_step_gives_lr_times_the_true_gradients(encoder, descriptor):
    """Algorithm 1 (docs/papers.md, "Training: Algorithm 1"): with one local plain-SGD step on one batch, no momentum
    and no weight decay, the hypernetwork and encoder updates equal lr_local x the gradients of L(theta, gamma)
    back-propagated straight through w and e."""
    lr_local, hn_lr, encoder_lr = 0.1, 0.5, 0.3
    config = ODPFLHNConfig(lr=lr_local, local_steps=1, batch_size=64, local_momentum=0.0, local_weight_decay=0.0,
                           hn_lr=hn_lr, hn_weight_decay=0.0, encoder_lr=encoder_lr, encoder_weight_decay=0.0,
                           server_momentum=0.0, grad_clip=None, encoder=encoder, encoder_hidden=8,
                           encoder_clip=1.0, embed_dim=4, hn_hidden=16, hn_layers=1, descriptor=descriptor,
                           descriptor_batch_size=10)
    data = _client(0)
    runtime = _runtime(config, [data])
    hnet, enc = copy.deepcopy(runtime.strategy.hnet), copy.deepcopy(runtime.strategy.encoder)

    # the true gradient of L = mean cross-entropy of h(x; f_theta(g_gamma(X))) on the one batch
    seed = ODPFLHNClient._descriptor_seed(client_context(runtime.seed, 0, 0))
    e = client_descriptor(enc, data.x_train, config, seed=seed)
    loss = nn.functional.cross_entropy(functional_forward(FACTORY(), hnet(e), data.x_train), data.y_train)
    hn_params, enc_params = list(hnet.parameters()), list(enc.parameters())
    grads = torch.autograd.grad(loss, hn_params + enc_params)
    runtime.run_round(0)

    for before, after, g in zip(hn_params, runtime.strategy.hnet.parameters(), grads[:len(hn_params)]):
        torch.testing.assert_close(before.detach() - after.detach(), hn_lr * lr_local * g, rtol=1e-4, atol=1e-7)
    for before, after, g in zip(enc_params, runtime.strategy.encoder.parameters(), grads[len(hn_params):]):
        torch.testing.assert_close(before.detach() - after.detach(), encoder_lr * lr_local * g, rtol=1e-4,
                                   atol=1e-7)
    assert sum(float(g.abs().sum()) for g in grads[len(hn_params):]) > 1e-4   # the encoder does get a gradient


def test_a_round_is_three_recorded_releases_per_client_and_lowers_the_loss():
    config = ODPFLHNConfig(lr=0.1, local_steps=5, batch_size=8, encoder_hidden=8, embed_dim=4, hn_hidden=16,
                           hn_lr=0.05, encoder_lr=0.05)
    clients = [_client(i, seed=3) for i in range(3)]
    runtime = _runtime(config, clients)
    losses = [runtime.run_round(r)["train_loss"] for r in range(8)]
    assert losses[-1] < losses[0]
    for cid in range(3):
        records = runtime.wire.ledgers[cid].records
        assert [r.purpose for r in records[:3]] == ["descriptor", "weight_change", "encoder_gradient"]
        assert len(records) == 24 and math.isinf(runtime.wire.ledgers[cid].spent(1e-5).epsilon)
    assert sorted(runtime.strategy.descriptors) == ["0", "1", "2"]


def test_a_diverging_round_is_refused_naming_the_rates_and_leaves_the_models_finite():
    # local lr 1e6 on unit-scale inputs: the weight change overflows, so the averaged gradients are not finite
    config = ODPFLHNConfig(lr=1e6, local_steps=5, batch_size=8, encoder_hidden=8, embed_dim=4, hn_hidden=16,
                           hn_lr=0.05, encoder_lr=0.05, grad_clip=None)
    runtime = _runtime(config, [_client(i, seed=3) for i in range(3)])
    with pytest.raises(TrainingDivergedError,
                       match=r"round 0: ODPFL-HN training diverged.*hn_lr \(now 0.05\).*local lr \(now 1000000.0\)"):
        runtime.run_round(0)
    for module in (runtime.strategy.hnet, runtime.strategy.encoder):
        assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_the_hypernetwork_step_averages_only_the_clients_that_answer_the_last_stage():
    """A client that drops after its weight change is out of the round's mean (its gradient was already summed in
    stage 2): the step is hn_lr x the mean of the others' chain-rule gradients, not of all three."""
    config = ODPFLHNConfig(lr=0.1, local_steps=3, batch_size=8, encoder_hidden=8, embed_dim=4, hn_hidden=16,
                           hn_lr=0.5, hn_weight_decay=0.0, server_momentum=0.0, grad_clip=None)
    seen = {}

    class Recording(ODPFLHNStrategy):
        def _backprop_changes(self, replies):
            seen.update({cid: (self._round["descriptors"][cid].clone(), dict(r.arrays)) for cid, r in replies.items()})
            return super()._backprop_changes(replies)

    class Dropping(ODPFLHNClient):
        def train_stage(self, stage, data, message, state, ctx):
            return None if stage == 2 and data.client_id == 1 else super().train_stage(stage, data, message, state,
                                                                                         ctx)

    clients = [_client(i, seed=3) for i in range(3)]
    strategy = Recording(model_factory=FACTORY, config=config, seed=1, num_training_clients=3)
    runtime = InProcessRuntime(strategy=strategy, client=Dropping(model_factory=FACTORY, config=config),
                               training_clients=clients, seed=1)
    hnet = copy.deepcopy(strategy.hnet)
    runtime.run_round(0)
    grads = {cid: backprop_weight_change(hnet, *seen[cid])[0] for cid in seen}
    for name, after in strategy.hnet.named_parameters():
        step = hnet.get_parameter(name).detach() - after.detach()
        torch.testing.assert_close(step, config.hn_lr * (grads[0][name] + grads[2][name]) / 2, rtol=1e-4, atol=1e-6)
    every = {n: config.hn_lr * sum(g[n] for g in grads.values()) / 3 for n in grads[0]}
    assert not all(torch.allclose(hnet.get_parameter(n).detach() - p.detach(), every[n], rtol=1e-4, atol=1e-6)
                   for n, p in strategy.hnet.named_parameters())


@pytest.mark.parametrize("epsilon", [None, 0.5])
def test_a_novel_client_releases_exactly_one_descriptor(epsilon):
    config = ODPFLHNConfig(encoder_hidden=8, embed_dim=4, hn_hidden=16)
    runtime = _runtime(config, [_client(0)], novel_privacy=NovelPrivacy(epsilon=epsilon, delta=1e-5))
    runtime.run_round(0)
    novel = NovelClient(7, torch.randn(300, 6, generator=torch.Generator().manual_seed(9)))
    model = runtime.novel_client_model(novel)
    assert model(novel.x).shape == (300, 3)
    records = runtime.wire.ledgers[7].records
    assert [r.purpose for r in records] == ["descriptor"]
    spent = runtime.wire.ledgers[7].spent(1e-5).epsilon
    if epsilon is None:
        assert math.isinf(spent)
    else:
        assert spent == pytest.approx(0.5, rel=1e-3)
        assert runtime.wire.bytes_up[7] == 4 * 4      # the descriptor (embed_dim floats) is all that went up


def test_the_private_descriptor_is_the_clean_one_plus_noise_that_shrinks_with_n():
    base = dict(encoder_hidden=8, embed_dim=4, hn_hidden=16, encoder_clip=1.0)
    clean_rt = _runtime(ODPFLHNConfig(**base), [_client(0)])
    state = clean_rt.strategy.state_dict()
    distances = {}
    for n in (100, 10000):
        x = torch.randn(n, 6, generator=torch.Generator().manual_seed(n))
        clean = clean_rt.client.novel_query(NovelClient(1, x), clean_rt.strategy.novel_request(1))
        private_rt = _runtime(ODPFLHNConfig(**base), [_client(0)], novel_privacy=NovelPrivacy(epsilon=1.0))
        private_rt.strategy.load_state_dict(state)
        noisy = private_rt.client.novel_query(NovelClient(1, x), private_rt.strategy.novel_request(1))
        distances[n] = float((noisy.message.arrays["descriptor"] - clean.message.arrays["descriptor"]).norm())
    assert distances[10000] < distances[100] / 10 and distances[100] > 0


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, make_spec):
    cfg = RunConfig(federation=make_spec(), method="odpflhn",
                    method_config={"local_steps": 3, "batch_size": 16, "encoder_hidden": 16, "hn_hidden": 32},
                    novel_privacy=NovelPrivacy(epsilon=1.0, noise="seeded"),
                    rounds=4, client_fraction=0.5, eval_every=2, checkpoint_every=3, seed=2)
    full = train(cfg, str(tmp_path / "full"), progress=False)
    with pytest.raises(RunInterrupted):
        train(cfg, str(tmp_path / "cut"), progress=False, stop_after_round=2)
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    assert_resumed_as_uninterrupted(full, resumed, tmp_path / "full", tmp_path / "cut")
    assert full["privacy"]["epsilon_max_novel"] == pytest.approx(1.0, rel=1e-3)
    # the summary says that these epsilons rest on seeds the server holds (3 novel clients, one release each)
    assert full["privacy"]["noise_sources"] == {"seeded": 3}
    assert full["privacy"]["seeded_noise"].startswith("3 private releases drew their noise from generators seeded")


@pytest.mark.parametrize("values,needle", [
    ({"encoder": "lstm"}, "encoder must be one of deepset, dp_deepset, dss, set_transformer, got 'lstm'"),
    ({"descriptor": "sum"}, "descriptor must be one of full, batch_mean"),
    ({"encoder": "dss", "train_mean_noise": 0.1}, "train_mean_noise=0.1 applies only to encoder='dp_deepset'"),
    ({"local_momentum": 1.0}, "local_momentum must be in [0, 1)"),
])
def test_bad_settings_are_named(values, needle):
    with pytest.raises(ConfigError) as info:
        get_method("odpflhn").make_config(**values)
    assert needle in str(info.value)


def test_privacy_settings_the_modes_cannot_hold_under_are_refused_before_the_run(make_spec):
    spec = make_spec()
    with pytest.raises(ConfigError, match="novel_privacy epsilon=1.0 needs a privatizable encoder"):
        RunConfig(federation=spec, method="odpflhn", method_config={"encoder": "deepset"},
                  novel_privacy=NovelPrivacy(epsilon=1.0))
    record = TrainingPrivacy(mode="record", noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="needs descriptor='full'"):
        RunConfig(federation=spec, method="odpflhn", method_config={"descriptor": "batch_mean"}, privacy=record,
                  select="last")
    with pytest.raises(ConfigError, match="standardize_descriptors=True fits the hypernetwork's input statistics"):
        RunConfig(federation=spec, method="odpflhn", method_config={"standardize_descriptors": True},
                  privacy=TrainingPrivacy(mode="central", noise_multiplier=1.0), select="last")
    with pytest.raises(ConfigError, match="cannot run with privacy mode 'distributed': the server generates"):
        RunConfig(federation=spec, method="odpflhn", privacy=TrainingPrivacy(mode="distributed", noise_multiplier=1.0),
                  select="last")
    with pytest.raises(ConfigError, match="novel noise must be one of"):
        NovelPrivacy(noise="urandom")


def _record_runtime(clip: float = 1.0, noise_multiplier: float = 1.3) -> InProcessRuntime:
    config = ODPFLHNConfig(encoder_hidden=8, embed_dim=4, hn_hidden=16, encoder_clip=1.0, local_steps=3,
                           batch_size=8)
    privacy = TrainingPrivacy(mode="record", noise_multiplier=noise_multiplier, clip=clip, min_samples=16,
                              noise="seeded", noise_seed=4)
    runtime = _runtime(config, [_client(0, n=40), _client(1, n=40)], privacy=privacy)
    runtime.client = PrivateClient(runtime.client, privacy, method="odpflhn")
    return runtime


def test_a_record_level_round_records_the_three_releases_its_procedure_declares():
    # the descriptor (privatize, add/remove one, n private), the weight change (DP-SGD) and the encoder gradient
    # (clipped per-record contributions): together exactly round_event, what a target epsilon is calibrated on
    runtime = _record_runtime()
    runtime.run_round(0)
    inner = runtime.client.inner
    records = runtime.wire.ledgers[0].records
    assert [r.purpose for r in records] == ["descriptor", "weight_change", "encoder_gradient"]
    declared = inner.round_event(1.3).events
    assert tuple(r.event for r in records) == declared
    # the descriptor and gradient are means with n private, calibrated at min_samples: sensitivity 2 B / 16
    assert [r.event.sensitivity for r in records[::2]] == pytest.approx([2 / 16, 2 / 16])
    assert all(r.event.relation.value == "add_or_remove_one" for r in records)
    assert all(not r.metadata.get("n") for r in records)                 # n stays out of the ledger


def test_the_private_encoder_gradient_is_the_true_one_without_noise_or_clipping(noise_floor_lifted):
    # with (almost) no noise and a clip no contribution reaches, the per-record path gives the gradient of the
    # descriptor's mean, the one the non-private client sends
    runtime = _record_runtime(clip=1e3, noise_multiplier=1e-12)
    inner, data = runtime.client.inner, runtime.clients[0]
    message = runtime.strategy.configure_train(0, [0])[0]
    state = {}
    ctx = client_context(1, 0, 0)
    inner.train(data, message.copy(), state, ctx)
    descriptor_grad = torch.randn(4, generator=torch.Generator().manual_seed(3))
    backprop = runtime.strategy._encoder_message(stage=2)
    backprop.arrays["descriptor_grad"] = descriptor_grad
    private = inner.train_stage(2, data, backprop.copy(), state, ctx).message.arrays
    clean_client = ODPFLHNClient(model_factory=FACTORY, config=inner.config)
    clean = clean_client.train_stage(2, data, backprop.copy(), {}, ctx).message.arrays
    assert private.keys() == clean.keys()
    for name in clean:
        torch.testing.assert_close(private[name], clean[name], rtol=1e-4, atol=1e-6)


# -- the generated part (the rest shared, FedAvg's step) --------------------------------------------------------------


def test_generated_names_pick_the_last_layer_or_its_bias():
    from privfl.models import build_model
    from privfl.models.hypernetwork import generated_names

    mlp = build_model("mlp2nn", (1, 28, 28), 10)
    assert generated_names(mlp, "all") == [n for n, _ in mlp.named_parameters()]
    assert generated_names(mlp, "head") == ["fc3.weight", "fc3.bias"]
    assert generated_names(mlp, "head_bias") == ["fc3.bias"]
    assert generated_names(build_model("linear", (12,), 3), "head_bias") == ["fc.bias"]
    with pytest.raises(ConfigError, match="generated must be one of all, head, head_bias, got 'trunk'"):
        generated_names(mlp, "trunk")


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_with_a_generated_bias_the_shared_part_takes_fedavg_s_step_and_the_hypernetwork_reads_the_bias_only(momentum):
    config = ODPFLHNConfig(encoder_hidden=8, embed_dim=4, hn_hidden=16, hn_layers=1, local_steps=2, batch_size=8,
                           generated="head_bias", shared_lr=0.7, shared_momentum=momentum, grad_clip=None)
    clients = [_client(0), _client(1, seed=1)]
    runtime = _runtime(config, clients)
    strategy = runtime.strategy
    names = [n for n, _ in FACTORY().named_parameters()]
    assert list(strategy.hnet.shapes) == ["fc3.bias"] and sorted(strategy.shared) == sorted(names[:-1])
    # every message carries the whole target: the shared part as it stands, the generated bias from the descriptor
    weights = strategy.generated_weights(torch.zeros(strategy.embed_dim))
    assert list(weights) == names
    assert all(torch.equal(weights[k], strategy.shared[k].cpu()) for k in strategy.shared)
    changes = {}
    stage = strategy.configure_stage

    def spy(round, stage_index, replies):
        if stage_index == 2:
            changes.update({cid: dict(m.arrays) for cid, m in replies.items()})
        return stage(round, stage_index, replies)

    strategy.configure_stage = spy
    before = {k: v.clone() for k, v in strategy.shared.items()}
    hnet_before = copy.deepcopy(strategy.hnet)
    runtime.run_round(0)
    assert sorted(changes) == [0, 1]
    mean = {k: (changes[0][k] + changes[1][k]) / 2 for k in before}
    for k in before:   # the first step: b = mean change, shared -= shared_lr * b (momentum has no past yet)
        assert torch.allclose(strategy.shared[k], before[k] - 0.7 * mean[k], atol=1e-6), k
    assert (sorted(strategy.shared_part.momentum) == sorted(before)) == (momentum > 0)
    # the hypernetwork's step is the chain rule of the bias changes alone: zeroing the shared tensors of the changes
    # gives the same hypernetwork gradient
    full = [backprop_weight_change(hnet_before, strategy.descriptors[str(c)].cpu(), changes[c])[0] for c in (0, 1)]
    bias = [backprop_weight_change(hnet_before, strategy.descriptors[str(c)].cpu(),
                                   {k: v if k == "fc3.bias" else torch.zeros_like(v) for k, v in changes[c].items()})[0]
            for c in (0, 1)]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(full, bias, strict=True) for k in a)
    state = strategy.state_dict()
    assert sorted(state["shared"]) == sorted(before) and "shared_momentum" in strategy.training_only
    again = _runtime(config, clients).strategy
    again.load_state_dict(state)
    assert all(torch.equal(again.shared[k], strategy.shared[k]) for k in before)
