"""MR-MTL (``privfl.methods.mrmtl``): lambda = 0 is local training, the release and the server step by hand, a
strong lambda keeps the silos at the mean, scoring with the silo's own model, the record-level round event."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privfl.config import RunConfig
from privfl.data import FederationSpec, TrainingClient, build_federation
from privfl.errors import ConfigError
from privfl.experiment import build_runtime
from privfl.federation.context import ClientContext
from privfl.federation.messages import Message
from privfl.methods import METHODS
from privfl.methods.base import ModelFactory
from privfl.methods.mrmtl import MRMTLClient, MRMTLConfig, MRMTLStrategy, mean_regulariser
from privfl.privacy.training import TrainingPrivacy, dp_sgd_round_event

# label-skewed silos, so that personal models and the mean really differ
SILOS = FederationSpec(source="synthetic", source_options={"num_samples": 600, "dim": 8, "num_classes": 3},
                       num_clients=6, partition="pathological", shards_per_client=1, novel_fraction=1 / 3,
                       val_fraction=0.2)


def runtime_after(method: str, rounds: int, *, privacy: TrainingPrivacy | None = None, **settings):
    config = RunConfig(federation=SILOS, method=method, method_config={"local_steps": 4, "batch_size": 16, **settings},
                       rounds=rounds, select="last", seed=2, privacy=privacy or TrainingPrivacy())
    federation = build_federation(config.federation, seed=config.seed)
    runtime = build_runtime(config, federation)
    for round in range(rounds):
        runtime.run_round(round)
    return runtime, federation


def distances_to_mean(runtime) -> list[float]:
    mean = runtime.strategy.weights
    return [math.sqrt(sum(float(((state[k] - mean[k]) ** 2).sum()) for k in mean))
            for state in runtime.client_states.values()]


def test_lambda_zero_gives_local_training_s_per_silo_models():
    local, _ = runtime_after("local", 2)
    mrmtl, _ = runtime_after("mrmtl", 2, lam=0.0)
    assert set(local.client_states) == set(mrmtl.client_states)
    for cid, own in local.client_states.items():
        assert own.keys() == mrmtl.client_states[cid].keys()
        assert all(torch.equal(own[k], mrmtl.client_states[cid][k]) for k in own), cid
    # and the silos did move apart: the comparison is not between untouched initial weights
    assert min(distances_to_mean(mrmtl)) > 0.1


def test_a_stronger_lambda_keeps_every_silo_nearer_the_mean_and_lr_times_lambda_one_pins_it_there():
    lr = 0.1
    spread = {lam: max(distances_to_mean(runtime_after("mrmtl", 3, lam=lam, lr=lr)[0]))
              for lam in (0.0, 2.0, 1.0 / lr)}
    assert spread[0.0] > spread[2.0] > spread[1.0 / lr]
    # lr * lambda = 1: every step lands on w_bar - lr * (the data gradient), so w_i stays within one step of the mean
    assert spread[1.0 / lr] < 0.25 * spread[0.0]


def _client(lam: float, lr: float, *, steps: int = 1, batch_size: int = 12, privacy: TrainingPrivacy | None = None):
    config = MRMTLConfig(lam=lam, lr=lr, local_steps=steps, batch_size=batch_size)
    return MRMTLClient(model_factory=ModelFactory("linear", (4,), 3), config=config, privacy=privacy), config


def _data(n: int = 12, seed: int = 0) -> TrainingClient:
    generator = torch.Generator().manual_seed(seed)
    return TrainingClient(client_id=0, x_train=torch.randn(n, 4, generator=generator),
                          y_train=torch.randint(0, 3, (n,), generator=generator),
                          x_val=torch.zeros(0, 4), y_val=torch.zeros(0, dtype=torch.int64))


def test_the_regulariser_s_gradient_is_lambda_times_the_distance_to_the_mean():
    generator = torch.Generator().manual_seed(1)
    mean = {"fc.weight": torch.randn(3, 4, generator=generator), "fc.bias": torch.randn(3, generator=generator)}
    params = {k: torch.randn(v.shape, generator=generator, requires_grad=True) for k, v in mean.items()}
    regulariser = mean_regulariser(0.7, mean, "cpu")
    value = regulariser(params)
    value.backward()
    expected = 0.35 * sum(float(((params[k].detach() - mean[k]) ** 2).sum()) for k in mean)
    assert float(value.detach()) == pytest.approx(expected, rel=1e-6)
    for k in mean:
        torch.testing.assert_close(params[k].grad, 0.7 * (params[k].detach() - mean[k]))


def test_a_round_by_hand_releases_w_i_minus_the_mean_keeps_w_i_and_the_server_steps_to_the_weighted_mean():
    lam, lr = 3.0, 0.2
    client, config = _client(lam, lr)
    data = _data()
    strategy = MRMTLStrategy(model_factory=client.model_factory, config=config, seed=0, num_training_clients=2)
    message = strategy.configure_train(0, [0])[0]
    mean = {k: v.clone() for k, v in message.arrays.items()}
    own = {k: v + 0.5 for k, v in mean.items()}           # the silo's model, away from the mean
    state = dict(own)
    release = client.train(data, message, state, ClientContext(client_id=0, round=0, run_seed=0,
                                                               rng=np.random.default_rng(0)))
    # one full-batch step: w_i - lr * (grad of the mean cross-entropy at w_i + lambda (w_i - w_bar))
    weight, bias = (own[k].clone().requires_grad_(True) for k in ("fc.weight", "fc.bias"))
    loss = torch.nn.functional.cross_entropy(data.x_train @ weight.T + bias, data.y_train)
    grad_weight, grad_bias = torch.autograd.grad(loss, (weight, bias))
    expected = {"fc.weight": own["fc.weight"] - lr * (grad_weight + lam * (own["fc.weight"] - mean["fc.weight"])),
                "fc.bias": own["fc.bias"] - lr * (grad_bias + lam * (own["fc.bias"] - mean["fc.bias"]))}
    for k in expected:
        torch.testing.assert_close(state[k], expected[k], atol=1e-6, rtol=0)
        torch.testing.assert_close(release.message.arrays[k], expected[k] - mean[k], atol=1e-6, rtol=0)
    assert release.message.metrics["num_examples"] == 12.0 and release.purpose == "model_update"
    # the server: w_bar + the sample-weighted mean of the releases = the sample-weighted mean of the silos' models
    other = {k: v - 1.0 for k, v in mean.items()}
    replies = {0: release.message,
               1: Message(arrays={k: other[k] - mean[k] for k in mean}, metrics={"num_examples": 36.0})}
    strategy.aggregate_train(0, replies)
    for k in mean:
        torch.testing.assert_close(strategy.weights[k], 0.25 * state[k] + 0.75 * other[k], atol=1e-6, rtol=0)


def test_silos_are_scored_with_their_own_model_and_novel_clients_and_unsampled_silos_get_the_mean():
    runtime, federation = runtime_after("mrmtl", 2, lam=0.01)
    for cid, state in runtime.client_states.items():
        scored = runtime.training_client_model(cid).state_dict()
        assert all(torch.equal(scored[k], state[k]) for k in state)
        assert any(not torch.equal(state[k], runtime.strategy.weights[k]) for k in state)
    served = runtime.novel_client_model(federation.novel_clients[0]).state_dict()
    assert all(torch.equal(served[k], runtime.strategy.weights[k]) for k in served)
    # a silo with no state yet (never sampled) is scored with the mean it is sent
    message = runtime.strategy.configure_evaluate(0)
    unsampled = runtime.client.evaluation_model(federation.training_clients[0], message, {}).state_dict()
    assert all(torch.equal(unsampled[k], message.arrays[k]) for k in unsampled)


def test_local_epochs_count_public_steps_under_record_level_dp_and_each_round_records_the_declared_event():
    # record level: one epoch at the public rate q = 16 / 96 is ceil(1 / q) = 6 DP-SGD steps whatever a silo's size;
    # without DP it is ceil(n / batch) steps of the silo's own n
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.5, clip=1.0, min_samples=96, noise="seeded",
                              noise_seed=4)
    runtime, federation = runtime_after("mrmtl", 2, privacy=privacy, local_epochs=1, lam=0.5)
    client = runtime.client.inner
    assert client.record_steps() == 6 and client.record_sampling_rate() == 16 / 96
    z = client.noise_multiplier()
    declared = dp_sgd_round_event(1.5, 16 / 96, 6)
    assert client.round_event(z) == declared
    for cid in runtime.training_ids:
        records = runtime.ledgers()[cid].records
        assert [(r.purpose, r.event) for r in records] == [("model_update", declared)] * 2
    plain, _ = _client(0.5, 0.1, batch_size=16)
    data = federation.training_clients[0]
    settings = plain.local_settings(data, MRMTLConfig(local_epochs=2, batch_size=16).round_config(0))
    assert settings["steps"] == 2 * math.ceil(data.num_train / 16)


@pytest.mark.parametrize("settings, message", [
    ({"lam": -0.1}, "lam must be a finite number >= 0, got -0.1"),
    ({"lam": 20.0, "lr": 0.1}, r"lam must be below 2 / lr = 20 \(lr=0.1\).*got 20.0"),
    ({"local_epochs": 0}, "local_epochs must be an integer >= 1, got 0"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ConfigError, match=message):
        METHODS["mrmtl"].make_config(**settings)
