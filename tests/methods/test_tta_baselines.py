"""TENT, AFL, FedGMA, FedADG and FedSR (the FedTTA paper's test-time and domain-generalisation baselines): values
computed by hand, and short runs on a tiny synthetic federation."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from accounting import ComposedEvent, GaussianEvent, NeighboringRelation
from privfl.config import RunConfig
from privfl.data import NovelClient, build_federation
from privfl.errors import ConfigError
from privfl.experiment import build_runtime
from privfl.federation import ClientContext, Message
from privfl.federation.context import client_context
from privfl.methods import ModelFactory, get_method
from privfl.methods.afl import LOSS, project_to_simplex
from privfl.methods.fedadg import FedADGModel, adversarial_step, record_adversarial_losses
from privfl.methods.fedgma import gradient_mask, sign_agreement
from privfl.methods.fedsr import (
    FedSRModel,
    conditional_mi_bound,
    forward_with_representation,
    l2_representation,
    record_objective,
    update_release,
)
from privfl.methods.tent import normalisation_parameters, prediction_entropy, tent_adapt
from privfl.models import targets
from privfl.privacy.training import TrainingPrivacy, dp_sgd_round_event

VECTOR = ModelFactory("mlp2nn", (3,), 2)


class NormMLP(nn.Module):
    """A target with normalisation layers: Linear -> BatchNorm -> ReLU -> Linear -> LayerNorm -> Linear."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.fc3 = nn.Linear(16, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.fc1(torch.flatten(x, 1))))
        return self.fc3(torch.relu(self.ln(self.fc2(x))))


@pytest.fixture
def norm_mlp(monkeypatch):
    monkeypatch.setitem(targets.MODELS, "norm_mlp", NormMLP)
    return "norm_mlp"


def make(name, factory=VECTOR, num_clients=3, **settings):
    spec = get_method(name)
    config = spec.make_config(**settings)
    strategy = spec.strategy(model_factory=factory, config=config, seed=0, num_training_clients=num_clients)
    return strategy, spec.client(model_factory=factory, config=config)


# --- TENT -------------------------------------------------------------------------------------------------------

def test_prediction_entropy_in_bits_and_nats():
    assert float(prediction_entropy(torch.zeros(3, 2))) == pytest.approx(1.0)            # uniform over 2: 1 bit
    assert float(prediction_entropy(torch.zeros(1, 4))) == pytest.approx(2.0)
    assert float(prediction_entropy(torch.zeros(1, 4), base=math.e)) == pytest.approx(math.log(4))
    # p = (0.8, 0.2): -(0.8 log2 0.8 + 0.2 log2 0.2) = 0.721928
    logits = torch.tensor([[math.log(0.8), math.log(0.2)]])
    assert float(prediction_entropy(logits)) == pytest.approx(0.7219281, abs=1e-6)


def test_tent_step_moves_only_norm_affine_parameters_by_the_entropy_gradient(norm_mlp):
    torch.manual_seed(0)
    model = NormMLP((5,), 3)
    x = torch.randn(32, 5)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    # the expected step by hand: gradient of the mean entropy (bits) under test-batch statistics
    reference = copy.deepcopy(model).train()
    norm = normalisation_parameters(reference)
    assert sorted(norm) == ["bn.bias", "bn.weight", "ln.bias", "ln.weight"]
    entropy_before = prediction_entropy(reference(x))
    grads = dict(zip(norm, torch.autograd.grad(entropy_before, list(norm.values()))))

    tent_adapt(model, x, adapt="norm", steps=1, lr=0.5)
    for name, value in model.named_parameters():
        if name in norm:
            assert torch.allclose(value, before[name] - 0.5 * grads[name], atol=1e-6), name
            assert not torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, before[name]), name
    assert model.bn.running_mean is None                        # batch norm now normalises with test statistics
    entropy_after = float(prediction_entropy(model(x)).detach())
    assert entropy_after < float(entropy_before.detach()) - 1e-3


def test_tent_minibatches_pass_over_all_the_data_and_a_single_sample_is_refused_under_batch_statistics(norm_mlp):
    torch.manual_seed(0)
    x = torch.randn(100, 5)
    seen = []
    model = NormMLP((5,), 3)
    model.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].clone()))
    tent_adapt(model, x, adapt="norm", steps=4, lr=0.1, batch_size=64)
    # 0-63, then the short tail 64-99, then a new pass
    assert [tuple(b.shape) for b in seen] == [(64, 5), (36, 5), (64, 5), (36, 5)]
    assert torch.equal(seen[1], x[64:]) and torch.equal(seen[2], x[:64])
    seen.clear()
    hooked = NormMLP((5,), 3)                         # a 1-sample tail is skipped: the next step starts a new pass
    hooked.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[0]))
    tent_adapt(hooked, x[:65], adapt="norm", steps=2, lr=0.1, batch_size=64)
    assert seen == [64, 64]
    with pytest.raises(ConfigError, match="need at least 2 samples, but the client has 1"):
        tent_adapt(NormMLP((5,), 3), x[:1], adapt="norm", steps=1, lr=0.1)


def test_tent_refuses_norm_adaptation_on_a_model_without_normalisation_layers():
    with pytest.raises(ConfigError, match="adapt='all'"):
        make("tent")                                            # mlp2nn has no normalisation layer
    with pytest.raises(ConfigError, match="adapt must be one of norm, all"):
        make("tent", adapt="bn")
    with pytest.raises(ConfigError, match="tta_steps must be an integer >= 0"):
        make("tent", adapt="all", tta_steps=-1)


def test_tent_all_is_one_full_data_step_with_fedavg_lr_and_zero_steps_is_fedavg():
    strategy, client = make("tent", adapt="all", lr=0.3, tta_weight_decay=0.0, tta_grad_clip=None)
    novel = NovelClient(7, torch.randn(20, 3, generator=torch.Generator().manual_seed(1)))
    message = strategy.novel_request(7)
    adapted = client.novel_model(novel, message.copy())
    model = VECTOR()
    model.load_state_dict(message.arrays)
    grads = torch.autograd.grad(prediction_entropy(model(novel.x)), list(model.parameters()))
    for (name, start), g in zip(model.named_parameters(), grads):
        assert torch.allclose(dict(adapted.named_parameters())[name], start - 0.3 * g, atol=1e-6), name
    _, unchanged = make("tent", adapt="all", tta_steps=0)
    plain = unchanged.novel_model(novel, message.copy())
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in message.arrays.items())


# --- FedGMA -----------------------------------------------------------------------------------------------------

# three clients, four coordinates: signs (+,+,+), (-,-,+), (+,-,-), (+,-,0) -> agreement 1, 1/3, 1/3, 0
GMA_UPDATES = [torch.tensor([1.0, -1.0, 2.0, 1.0]), torch.tensor([3.0, -2.0, -1.0, -3.0]),
               torch.tensor([2.0, 1.0, -4.0, 0.0])]


def test_fedgma_mask_is_the_hand_computed_sign_agreement():
    updates = [{"w": u} for u in GMA_UPDATES]
    assert torch.allclose(sign_agreement(updates)["w"], torch.tensor([1.0, 1 / 3, 1 / 3, 0.0]))
    assert torch.allclose(gradient_mask(updates, 0.5)["w"], torch.tensor([1.0, 1 / 3, 1 / 3, 0.0]))
    assert torch.allclose(gradient_mask(updates, 0.3)["w"], torch.tensor([1.0, 1.0, 1.0, 0.0]))


def test_fedgma_server_step_is_masked_weighted_mean():
    strategy, _ = make("fedgma", threshold=0.5, server_lr=2.0)
    before = {k: v.clone() for k, v in strategy.weights.items()}

    def tile(pattern, like):       # coordinate j of every tensor takes pattern[j % 4]
        return pattern[torch.arange(like.numel()) % 4].reshape(like.shape)

    replies = {cid: Message(arrays={k: tile(u, v) for k, v in before.items()},
                            metrics={"num_examples": n, "loss": 0.0})
               for cid, (u, n) in enumerate(zip(GMA_UPDATES, [1.0, 1.0, 2.0]))}
    strategy.aggregate_train(0, replies)
    # weighted mean (1, 1, 2)/4: [2, -0.25, -1.75, -0.5]; mask [1, 1/3, 1/3, 0]; server lr 2
    step = torch.tensor([4.0, -1 / 6, -7 / 6, 0.0])
    for k, v in before.items():
        assert torch.allclose(strategy.weights[k], v + tile(step, v), atol=1e-6), k


def test_fedgma_trains_a_model_with_an_integer_buffer_and_steps_it_as_fedavg(make_spec, norm_mlp):
    # batch norm's num_batches_tracked is an integer counter: no sign to agree on, FedAvg's step
    spec = make_spec(source_options={"num_samples": 320, "dim": 10, "num_classes": 4}, num_clients=8)
    federation = build_federation(spec, seed=1)
    runs = {}
    for method in ("fedgma", "fedavg"):
        config = RunConfig(federation=spec, method=method, model=norm_mlp, rounds=1, seed=1,
                           method_config={"lr": 0.1, "local_steps": 4, "batch_size": 16})
        runtime = build_runtime(config, federation)
        runtime.run_round(0)
        runs[method] = runtime.strategy.weights
    tracked = "bn.num_batches_tracked"
    assert float(runs["fedgma"][tracked]) == float(runs["fedavg"][tracked]) == 4.0
    assert sign_agreement([{tracked: torch.tensor(3)}, {tracked: torch.tensor(-2)}])[tracked] == 1.0


# --- AFL --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("v, expected", [
    ([0.5, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]),
    ([1.2, 0.1, -0.3], [1.0, 0.0, 0.0]),
    ([0.4, 0.3, 0.5], [1 / 3, 7 / 30, 13 / 30]),
])
def test_projection_on_the_simplex(v, expected):
    assert torch.allclose(project_to_simplex(torch.tensor(v, dtype=torch.float64)),
                          torch.tensor(expected, dtype=torch.float64))


def test_afl_lambda_ascends_toward_the_worst_client_and_weights_the_step():
    strategy, _ = make("afl", num_clients=3, lambda_lr=0.1)
    before = {k: v.clone() for k, v in strategy.weights.items()}
    losses = {10: 1.0, 11: 2.0, 12: 5.0}

    def replies(values):
        return {cid: Message(arrays={**{k: torch.full_like(v, values[cid]) for k, v in before.items()},
                                     LOSS: torch.tensor(losses[cid])}, metrics={"num_examples": 1.0})
                for cid in losses}

    strategy.aggregate_train(0, replies({10: 3.0, 11: 6.0, 12: 9.0}))
    # round 0: lambda uniform -> mean change 6; then Proj(1/3 + 0.1 * (1, 2, 5)) = (1/6, 4/15, 17/30)
    assert strategy.mixture_weights() == pytest.approx({10: 1 / 6, 11: 4 / 15, 12: 17 / 30})
    assert float(strategy.lambdas.sum()) == pytest.approx(1.0) and float(strategy.lambdas.min()) >= 0
    for k, v in before.items():
        assert torch.allclose(strategy.weights[k], v + 6.0)
    strategy.aggregate_train(1, replies({10: 30.0, 11: 0.0, 12: 0.0}))
    for k, v in before.items():                               # lambda-weighted: 6 + 30 / 6 = 11
        assert torch.allclose(strategy.weights[k], v + 11.0, atol=1e-5)
    assert max(strategy.mixture_weights(), key=strategy.mixture_weights().get) == 12
    # a diverged client's loss is refused before the weights or lambda move
    state = {k: v.clone() for k, v in strategy.weights.items()}, strategy.lambdas.clone()
    losses[11] = float("nan")
    with pytest.raises(ConfigError, match=r"round 2: AFL needs each client's finite loss .* got \{11: nan\}"):
        strategy.aggregate_train(2, replies({10: 1.0, 11: 1.0, 12: 1.0}))
    assert all(torch.equal(state[0][k], v) for k, v in strategy.weights.items())
    assert torch.equal(state[1], strategy.lambdas)


# --- FedSR ------------------------------------------------------------------------------------------------------

def test_fedsr_regularisers_on_a_fixed_example():
    z = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert float(l2_representation(z)) == pytest.approx(2.5)
    assert float(l2_representation(z, squared=True)) == pytest.approx(12.5)
    mu, sigma, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 1.0]]), torch.tensor([0])
    r_mu = torch.zeros(2, 2)
    r_sigma_raw = torch.full((2, 2), math.log(math.e - 1))     # softplus -> 1
    # KL(N(mu, s^2) || N(0, 1)) per dim = -log s + (s^2 + mu^2) / 2 - 1/2: 0.818147 + 2.0
    assert float(conditional_mi_bound(mu, sigma, y, r_mu, r_sigma_raw, torch.tensor(1.0))) == pytest.approx(
        2.8181472, abs=1e-6)
    # scale C = 2: dims (mu, s) = (2, 1) and (4, 2): 2.0 + 8.806853
    assert float(conditional_mi_bound(mu, sigma, y, r_mu, r_sigma_raw, torch.tensor(2.0))) == pytest.approx(
        10.8068528, abs=1e-6)
    q = torch.distributions.Normal(mu * 2, sigma * 2)
    p = torch.distributions.Normal(torch.zeros(1, 2), torch.ones(1, 2))
    assert float(torch.distributions.kl_divergence(q, p).sum()) == pytest.approx(10.8068528, abs=1e-6)


def test_fedsr_predicts_with_the_target_network_and_trains_with_a_sampled_representation():
    target = VECTOR.init(0)
    model = FedSRModel(copy.deepcopy(target), 2)
    x = torch.randn(4, 3)
    assert torch.equal(model(x), target(x))                    # prediction: z = mu
    parts = model.sample(x)
    assert parts["z"].shape == (4, 200) and not torch.allclose(parts["z"], parts["mu"])
    assert torch.all(parts["sigma"] > 0)
    loss, values = model.objective(x, torch.tensor([0, 1, 0, 1]), l2r_coeff=0.01, cmi_coeff=0.0005)
    assert float(loss.detach()) == pytest.approx(values["ce"] + 0.01 * values["l2r"] + 0.0005 * values["cmi"], rel=1e-5)


# --- FedADG -----------------------------------------------------------------------------------------------------

def test_fedadg_step_updates_every_network_and_novel_clients_get_the_target_only():
    torch.manual_seed(0)
    model = FedADGModel(VECTOR(), 2, noise_dim=10, hidden=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizers = {"target": torch.optim.SGD(model.target.parameters(), lr=0.1),
                  "discriminator": torch.optim.SGD(model.discriminator.parameters(), lr=0.1),
                  "generator": torch.optim.SGD(model.generator.parameters(), lr=0.1)}
    losses = adversarial_step(model, torch.randn(16, 3), torch.randint(0, 2, (16,)), optimizers, adv_weight=0.5)
    assert set(losses) == {"ce", "adv_f", "adv_d", "adv_g"}
    for prefix in ("target.", "generator.", "discriminator."):
        assert any(not torch.equal(model.state_dict()[k], v) for k, v in before.items() if k.startswith(prefix))
    strategy, _ = make("fedadg")
    assert sorted(strategy.novel_request(0).arrays) == sorted(VECTOR().state_dict())
    assert not any(k.startswith("discriminator.") for k in strategy.weights)       # D stays on the clients


def test_fedadg_clients_keep_their_own_discriminator_and_send_only_f_c_and_g(make_spec):
    spec = make_spec(source_options={"num_samples": 320, "dim": 10, "num_classes": 4}, num_clients=8)
    federation = build_federation(spec, seed=1)
    config = RunConfig(federation=spec, method="fedadg", rounds=2, seed=1,
                       method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16})
    runtime = build_runtime(config, federation)
    runtime.run_round(0)
    held = {cid: {k: v.clone() for k, v in state.items()} for cid, state in runtime.client_states.items()}
    first, second = sorted(held)[:2]
    assert sorted(held[first]) == sorted(k for k in _build_keys(runtime) if k.startswith("discriminator."))
    assert any(not torch.equal(held[first][k], held[second][k]) for k in held[first])   # each its own network
    runtime.run_round(1)
    # the round-1 discriminator starts from the client's round-0 one, not from a fresh initialisation
    assert any(not torch.equal(runtime.client_states[first][k], held[first][k]) for k in held[first])
    data = {c.client_id: c for c in federation.training_clients}[first]
    message = runtime.strategy.configure_train(2, [first])[first]
    release = runtime.client.train(data, message, dict(runtime.client_states[first]), client_context(1, first, 2))
    assert sorted(release.message.arrays) == sorted(runtime.strategy.weights)      # F, C and G; never D
    assert not any(k.startswith("discriminator.") for k in release.message.arrays)


def _build_keys(runtime):
    return list(runtime.client.adg_model().state_dict())


# --- short runs: every method trains, novel clients send nothing ------------------------------------------------

RUN_SETTINGS = {
    "tent": {"adapt": "all"},
    "afl": {"lambda_lr": 0.05},
    "fedgma": {"threshold": 0.4},
    "fedadg": {},
    "fedsr": {},
}


@pytest.mark.parametrize("method", sorted(RUN_SETTINGS))
def test_short_run_trains_and_novel_clients_send_nothing(make_spec, method):
    spec = make_spec(source_options={"num_samples": 320, "dim": 10, "num_classes": 4}, num_clients=8)
    federation = build_federation(spec, seed=1)
    config = RunConfig(federation=spec, method=method, rounds=2, seed=1,
                       method_config={"lr": 0.1, "local_steps": 4, "batch_size": 16, **RUN_SETTINGS[method]})
    runtime = build_runtime(config, federation)
    start = {k: v.clone() for k, v in runtime.strategy.weights.items()}
    for round in range(2):
        metrics = runtime.run_round(round)
        assert math.isfinite(metrics["train_loss"])
    assert any(not torch.equal(runtime.strategy.weights[k], v) for k, v in start.items())
    for client in federation.training_clients:
        assert [r.purpose for r in runtime.wire.ledgers[client.client_id].records] == ["model_update"] * 2
    correct = total = 0
    for novel in federation.novel_clients:
        model = runtime.novel_client_model(novel)
        labels = federation.novel_labels.labels(novel.client_id)
        correct += int((model(novel.x).argmax(1) == labels).sum())
        total += len(labels)
        assert novel.client_id not in runtime.wire.ledgers
        assert runtime.wire.bytes_up.get(novel.client_id, 0) == 0
    assert correct / total > 0.5                                # 4 separable classes; chance is 0.25
    if method == "afl":
        lambdas = runtime.strategy.lambdas
        assert float(lambdas.sum()) == pytest.approx(1.0) and float(lambdas.min()) >= 0
        assert not torch.allclose(lambdas, torch.full_like(lambdas, 1 / len(lambdas)))


def test_tent_norm_run_adapts_only_normalisation_parameters(make_spec, norm_mlp):
    spec = make_spec(source_options={"num_samples": 320, "dim": 10, "num_classes": 4}, num_clients=8)
    federation = build_federation(spec, seed=1)
    config = RunConfig(federation=spec, method="tent", model=norm_mlp, rounds=2, seed=1,
                       method_config={"lr": 0.1, "local_steps": 4, "batch_size": 16, "tta_steps": 3})
    runtime = build_runtime(config, federation)
    for round in range(2):
        runtime.run_round(round)
    novel = federation.novel_clients[0]
    model = runtime.novel_client_model(novel)
    served = runtime.strategy.weights
    changed = {k for k, v in model.named_parameters() if not torch.equal(v.detach(), served[k])}
    assert changed == {"bn.weight", "bn.bias", "ln.weight", "ln.bias"}
    assert novel.client_id not in runtime.wire.ledgers
    # training clients adapt on their own validation inputs before they are scored
    data = federation.training_clients[0]
    evaluated = runtime.client.evaluation_model(data, Message(arrays=served), {})
    assert not torch.equal(evaluated.bn.weight.detach(), served["bn.weight"])


def test_method_settings_are_validated():
    with pytest.raises(ConfigError, match="threshold must be in \\[0, 1\\]"):
        make("fedgma", threshold=1.5)
    with pytest.raises(ConfigError, match="lambda_lr must be a finite number >= 0"):
        make("afl", lambda_lr=-1.0)
    with pytest.raises(ConfigError, match="l2r must be one of norm, squared"):
        make("fedsr", l2r="cube")
    with pytest.raises(ConfigError, match="adv_weight must be in \\[0, 1\\)"):
        make("fedadg", adv_weight=1.0)
    # a bool is no count and a string no rate: each is named, never a bare TypeError
    for method, values, name in [("fedavg", {"server_lr": "2"}, "server_lr"),
                                 ("fedavg", {"local_steps": True}, "local_steps"),
                                 ("tent", {"adapt": "all", "tta_steps": True}, "tta_steps"),
                                 ("fedadg", {"noise_dim": True}, "noise_dim")]:
        with pytest.raises(ConfigError, match=f"{name} must be"):
            make(method, **values)


def test_fedsr_and_fedadg_clients_are_deterministic_given_the_seeded_context(make_spec):
    # they draw noise from torch's generator, which the runtime seeds per (round, client)
    data = build_federation(make_spec(), seed=0).training_clients[0]
    factory = ModelFactory("mlp2nn", (10,), 4)
    for method in ("fedsr", "fedadg"):
        strategy, client = make(method, factory=factory, local_steps=3, batch_size=16)
        message = strategy.configure_train(0, [data.client_id])[data.client_id]
        releases = []
        for _ in range(2):
            torch.manual_seed(5)
            ctx = ClientContext(client_id=data.client_id, round=0, run_seed=0, rng=np.random.default_rng(3))
            releases.append(client.train(data, message.copy(), {}, ctx).message.arrays)
        assert releases[0].keys() == message.arrays.keys()
        assert all(torch.equal(releases[0][k], releases[1][k]) for k in message.arrays), method


# --- privacy: AFL, FedSR and FedADG under the privacy layer -----------------------------------------------------

def _private_client(method, privacy, factory, **settings):
    spec = get_method(method)
    config = spec.make_config(**settings)
    strategy = spec.strategy(model_factory=factory, config=config, seed=0, num_training_clients=3)
    return strategy, spec.client(model_factory=factory, config=config, privacy=privacy)


def _round(make_spec, method, privacy, **settings):
    data = build_federation(make_spec(), seed=0).training_clients[0]
    factory = ModelFactory("mlp2nn", (10,), 4)
    strategy, client = _private_client(method, privacy, factory, local_steps=2, batch_size=16, **settings)
    message = strategy.configure_train(0, [data.client_id])[data.client_id]
    torch.manual_seed(0)
    ctx = ClientContext(client_id=data.client_id, round=0, run_seed=0, rng=np.random.default_rng(0))
    state = {}
    return data, client, message, state, client.train(data, message.copy(), state, ctx)


SEEDED = dict(noise="seeded", noise_seed=3)


def test_afl_record_level_releases_its_loss_by_a_gaussian_of_sensitivity_b_over_min_samples(make_spec,
                                                                                          noise_floor_lifted):
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.5, min_samples=8, **SEEDED)
    data, client, message, _, release = _round(make_spec, "afl", privacy, loss_bound=4.0)
    loss_event = GaussianEvent(sigma=1.5 * 0.5, sensitivity=0.5, relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert release.event == ComposedEvent((dp_sgd_round_event(1.5, 1.0, 2), loss_event))
    assert release.event == client.round_event(1.5)              # what the calibration composes
    assert sorted(release.message.arrays) == sorted([*message.arrays, LOSS]) and release.message.metrics == {}
    # the noise the loss carries is the event's: std z B / min_samples = 0.75
    model = ModelFactory("mlp2nn", (10,), 4)()
    model.load_state_dict(message.arrays)
    draws = torch.stack([client.private_loss(model, data, ClientContext(client_id=data.client_id, round=r, run_seed=0,
                                                                         rng=np.random.default_rng(r)))[0]
                         for r in range(400)])
    assert float(draws.std()) == pytest.approx(0.75, rel=0.1)
    # negligible noise: the release is the mean of the per-record losses clipped to [0, B] at the received weights
    quiet = TrainingPrivacy(mode="record", noise_multiplier=1e-9, min_samples=8, **SEEDED)
    data, client, message, _, release = _round(make_spec, "afl", quiet, loss_bound=1.4)
    model = ModelFactory("mlp2nn", (10,), 4)()
    model.load_state_dict(message.arrays)
    losses = nn.functional.cross_entropy(model(data.x_train), data.y_train, reduction="none").detach()
    assert float(losses.max()) > 1.4 > float(losses.min())               # the clip bites
    assert float(release.message.arrays[LOSS]) == pytest.approx(float(losses.clamp(max=1.4).mean()), abs=1e-6)


def test_afl_record_level_needs_a_lower_bound_of_two_records_for_its_mean(make_spec):
    with pytest.raises(ConfigError, match="privacy min_samples, which must be >= 2 .*got min_samples=1"):
        RunConfig(federation=make_spec(), method="afl", select="last",
                  privacy=TrainingPrivacy(mode="record", noise_multiplier=1.0, min_samples=1))


def test_afl_refuses_a_client_below_the_public_lower_bound_without_naming_its_size(make_spec):
    data = build_federation(make_spec(), seed=0).training_clients[0]
    factory = ModelFactory("mlp2nn", (10,), 4)
    _, client = _private_client("afl", TrainingPrivacy(mode="record", noise_multiplier=1.0,
                                                        min_samples=data.num_train + 1), factory)
    ctx = ClientContext(client_id=data.client_id, round=0, run_seed=0, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match=f"public lower bound privacy min_samples={data.num_train + 1} ") as error:
        client.private_loss(factory.init(0), data, ctx)
    assert f"{data.num_train} " not in str(error.value).replace(f"{data.num_train + 1}", "")


def test_fedsr_per_record_objective_is_the_batch_objective_per_record():
    model = FedSRModel(VECTOR.init(0), 2)
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 1, 0])
    torch.manual_seed(4)
    per_record = record_objective(model, x, y, l2r_coeff=0.01, cmi_coeff=0.0005)
    torch.manual_seed(4)
    loss, _ = model.objective(x, y, l2r_coeff=0.01, cmi_coeff=0.0005)
    assert per_record.shape == (6,) and float(per_record.mean().detach()) == pytest.approx(float(loss), rel=1e-6)
    # record 0's loss reads record 0 (and its own noise draw) only
    other = x.clone()
    other[1:] = 10 * torch.randn(5, 3)
    torch.manual_seed(4)
    changed = record_objective(model, other, torch.tensor([0, 0, 1, 1, 0, 1]), l2r_coeff=0.01, cmi_coeff=0.0005)
    assert float(changed[0].detach()) == pytest.approx(float(per_record[0].detach()), rel=1e-6)


@pytest.mark.parametrize("method", ["fedsr", "fedadg"])
def test_fedsr_and_fedadg_record_level_rounds_record_the_event_their_round_event_declares(make_spec, method):
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.2, **SEEDED)
    data, client, message, state, release = _round(make_spec, method, privacy)
    assert release.event == client.round_event(1.2) == dp_sgd_round_event(1.2, 1.0, 2)
    assert sorted(release.message.arrays) == sorted(message.arrays) and release.message.metrics == {}
    assert all(bool(torch.isfinite(v).all()) and float(v.abs().sum()) > 0 for v in release.message.arrays.values()
               if v.is_floating_point())
    if method == "fedadg":    # D trained (and kept), G moved by its post-processing steps
        assert sorted(state) == sorted(k for k in client.adg_model().state_dict() if k.startswith("discriminator."))
        assert any(float(v.abs().sum()) > 0 for k, v in release.message.arrays.items() if k.startswith("generator."))


def test_a_private_client_releases_a_diverged_update_as_zeros_and_a_plain_one_as_it_is():
    update = {"w": torch.tensor([1.0, float("nan")]), "b": torch.tensor([2.0])}
    _, private = _private_client("fedsr", TrainingPrivacy(mode="record", noise_multiplier=1.0), VECTOR)
    event = dp_sgd_round_event(1.0, 0.16, 2)
    release = update_release(private, update, event, {"loss": 1.0})
    assert release.event == event and release.message.metrics == {}
    assert all(float(v.abs().sum()) == 0 for v in release.message.arrays.values())
    _, plain = _private_client("fedsr", TrainingPrivacy(), VECTOR)
    release = update_release(plain, update, None, {"loss": 1.0})
    assert math.isnan(float(release.message.arrays["w"][1])) and release.message.metrics == {"loss": 1.0}


def test_fedadg_per_record_loss_gives_f_and_c_step_one_s_gradient_and_d_step_two_s_scaled():
    torch.manual_seed(0)
    model = FedADGModel(VECTOR(), 2, noise_dim=10, hidden=8)
    x, y, scale = torch.randn(1, 3), torch.tensor([1]), 0.4
    with torch.no_grad():
        for p in model.discriminator.parameters():
            p.div_(scale)                                   # D' = D / s, as the record-level round holds it
    torch.manual_seed(1)
    loss = record_adversarial_losses(model, x, y, adv_weight=0.3, d_scale=scale)[0]
    target, disc, gen = (list(m.parameters()) for m in (model.target, model.discriminator, model.generator))
    grads = torch.autograd.grad(loss, target + disc + gen, allow_unused=True)
    # the same record with D at its true scale, through the module's own (non-private) step losses
    with torch.no_grad():
        for p in model.discriminator.parameters():
            p.mul_(scale)
    onehot = nn.functional.one_hot(y, 2).float()
    features, logits = forward_with_representation(model.target, x)
    step1 = 0.7 * nn.functional.cross_entropy(logits, y) + 0.3 * (1 - model.discriminate(features, onehot)) ** 2
    torch.manual_seed(1)
    reference = model.reference(onehot)
    step2 = ((1 - model.discriminate(reference.detach(), onehot)) ** 2
             + model.discriminate(features.detach(), onehot) ** 2)
    want_target = torch.autograd.grad(step1.sum(), target)
    want_disc = torch.autograd.grad(step2.sum(), disc)
    for got, want in zip(grads[:len(target)], want_target):
        assert torch.allclose(got, want, atol=1e-6)
    for got, want in zip(grads[len(target):len(target) + len(disc)], want_disc):
        assert torch.allclose(got, scale * want, atol=1e-6)          # d/dD' = s d/dD
    assert all(g is None for g in grads[len(target) + len(disc):])   # G is not trained by the private fit
