"""FedAvg, FedProx and SCAFFOLD arithmetic, checked against values computed by hand."""

import numpy as np
import pytest
import torch

from privfl.data import TrainingClient
from privfl.errors import ConfigError
from privfl.federation import ClientContext, Message
from privfl.methods import ModelFactory, get_method
from privfl.methods.local_training import minibatches

FACTORY = ModelFactory("mlp2nn", (3,), 2)


def make(name, num_clients=4, **settings):
    spec = get_method(name)
    config = spec.make_config(**settings)
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=num_clients)
    return strategy, spec.client(model_factory=FACTORY, config=config)


def const_like(weights, value):
    return {k: torch.full_like(v, value) for k, v in weights.items()}


def client_data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = (x[:, 0] > 0).long()
    return TrainingClient(client_id=seed, x_train=x, y_train=y, x_val=x[:2], y_val=y[:2])


def ctx(cid=0):
    return ClientContext(client_id=cid, round=0, run_seed=0, rng=np.random.default_rng(cid))


def test_fedavg_is_sample_size_weighted():
    strategy, _ = make("fedavg")
    before = {k: v.clone() for k, v in strategy.weights.items()}
    replies = {
        1: Message(arrays=const_like(before, 1.0), metrics={"num_examples": 10.0, "loss": 1.0}),
        2: Message(arrays=const_like(before, 4.0), metrics={"num_examples": 30.0, "loss": 3.0}),
    }
    metrics = strategy.aggregate_train(0, replies)
    # (10 * 1 + 30 * 4) / 40 = 3.25
    for k in before:
        assert torch.allclose(strategy.weights[k], before[k] + 3.25)
    assert metrics["train_loss"] == pytest.approx((10 * 1 + 30 * 3) / 40)


def test_fedavg_server_lr_scales_the_mean_change():
    strategy, _ = make("fedavg", server_lr=0.5)
    before = {k: v.clone() for k, v in strategy.weights.items()}
    strategy.aggregate_train(0, {0: Message(arrays=const_like(before, 2.0), metrics={"num_examples": 5.0,
                                                                                     "loss": 0.0})})
    for k in before:
        assert torch.allclose(strategy.weights[k], before[k] + 1.0)


def test_fedavg_server_momentum_accumulates_the_mean_changes_and_is_kept_in_the_checkpoint_state():
    strategy, _ = make("fedavg", server_lr=0.5, server_momentum=0.9)
    before = {k: v.clone() for k, v in strategy.weights.items()}
    strategy.apply_mean(0, const_like(before, 2.0), 3.0)            # v = 2, w += 0.5 * 2
    strategy.apply_mean(1, const_like(before, 1.0), 3.0)            # v = 0.9 * 2 + 1 = 2.8, w += 0.5 * 2.8
    for k in before:
        assert torch.allclose(strategy.weights[k], before[k] + 1.0 + 1.4)
    resumed, _ = make("fedavg", server_lr=0.5, server_momentum=0.9)
    resumed.load_state_dict(strategy.state_dict())
    for s in (strategy, resumed):                                   # v = 2.52, w += 1.26 on both
        s.aggregate_train(2, {0: Message(arrays=const_like(before, 0.0), metrics={"num_examples": 1.0})})
    for k in before:
        assert torch.allclose(resumed.weights[k], before[k] + 1.0 + 1.4 + 1.26)
        assert torch.equal(resumed.weights[k], strategy.weights[k])
    with pytest.raises(ConfigError, match=r"server_momentum must be a number in \[0, 1\).*got 1.0"):
        get_method("fedavg").make_config(server_momentum=1.0)
    with pytest.raises(ConfigError, match="server_momentum=0.5 is applied by FedAvg's own server step"):
        make("fedgma", server_momentum=0.5)


def test_fedavg_client_update_is_the_sgd_weight_change():
    strategy, client = make("fedavg", lr=0.05, local_steps=1, batch_size=8)
    data = client_data()
    message = strategy.configure_train(0, [0])[0]
    release = client.train(data, message.copy(), {}, ctx())
    # one full-batch step: delta = -lr * grad (the batch is a permutation of all 8 samples; the mean loss is the same)
    model = FACTORY()
    model.load_state_dict(message.arrays)
    loss = torch.nn.functional.cross_entropy(model(data.x_train), data.y_train)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for (name, _), g in zip(model.named_parameters(), grads):
        assert torch.allclose(release.message.arrays[name], -0.05 * g, atol=1e-6)
    assert release.message.metrics["num_examples"] == 8
    assert release.purpose == "model_update"


def test_fedprox_gradient_includes_the_proximal_pull():
    _, client = make("fedprox", mu=0.7)
    anchor = {k: v.detach().clone() for k, v in FACTORY.init(0).named_parameters()}
    params = {k: (v + 0.5).requires_grad_(True) for k, v in anchor.items()}
    term = client.local_objective(anchor, {})(params)
    grads = torch.autograd.grad(term, list(params.values()))
    for g in grads:  # d/dw (mu/2)||w - w0||^2 = mu (w - w0) = 0.7 * 0.5
        assert torch.allclose(g, torch.full_like(g, 0.35))


def test_scaffold_client_step_and_control_variate_option_two():
    strategy, client = make("scaffold", lr=0.1, local_steps=1, batch_size=8, server_lr=1.5)
    strategy.control = const_like(strategy.weights, 0.2)          # c
    state = {f"c_i.{k}": torch.full_like(v, -0.1) for k, v in strategy.weights.items()}  # c_i
    data = client_data()
    message = strategy.configure_train(0, [0])[0].copy()
    release = client.train(data, message, state, ctx())
    x = message.subset("x.")
    model = FACTORY()
    model.load_state_dict(x)
    loss = torch.nn.functional.cross_entropy(model(data.x_train), data.y_train)
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    for name, g in grads.items():
        expected_y = x[name] - 0.1 * (g - (-0.1) + 0.2)            # y = x - lr (g - c_i + c)
        dy = release.message.arrays[f"dy.{name}"]
        assert torch.allclose(dy, expected_y - x[name], atol=1e-6)
        c_i_new = -0.1 - 0.2 + (x[name] - expected_y) / (1 * 0.1)   # option II
        assert torch.allclose(state[f"c_i.{name}"], c_i_new, atol=1e-5)
        assert torch.allclose(release.message.arrays[f"dc.{name}"], c_i_new - (-0.1), atol=1e-5)


def test_scaffold_server_update():
    strategy, _ = make("scaffold", num_clients=10, server_lr=1.5)
    x0 = {k: v.clone() for k, v in strategy.weights.items()}
    replies = {}
    for cid, (dy, dc) in enumerate([(1.0, 2.0), (3.0, 4.0)]):
        arrays = {f"dy.{k}": torch.full_like(v, dy) for k, v in x0.items()}
        arrays.update({f"dc.{k}": torch.full_like(v, dc) for k, v in x0.items()})
        replies[cid] = Message(arrays=arrays, metrics={"num_examples": 1.0 + 99 * cid, "loss": 0.0})
    strategy.aggregate_train(0, replies)
    for k in x0:  # uniform means: x += 1.5 * 2 ; c += (2/10) * 3
        assert torch.allclose(strategy.weights[k], x0[k] + 3.0)
        assert torch.allclose(strategy.control[k], torch.full_like(x0[k], 0.6))


def test_minibatches_cover_each_epoch_without_replacement():
    batches = list(minibatches(10, 4, 5, np.random.default_rng(0)))
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4]
    assert len(set(np.concatenate(batches[:2]).tolist())) == 8   # one epoch: no repeats


def test_method_settings_are_validated():
    with pytest.raises(ConfigError, match="unknown method 'fedsgd'.*fedavg"):
        get_method("fedsgd")
    with pytest.raises(ConfigError, match="lr must be a finite number > 0, got -0.1"):
        get_method("fedavg").make_config(lr=-0.1)
    with pytest.raises(ConfigError, match="no setting mu"):
        get_method("fedavg").make_config(mu=0.1)
    with pytest.raises(ConfigError, match="mu must be"):
        get_method("fedprox").make_config(mu=-1.0)


def test_code_stabilisers_clip_decay_and_schedule():
    from privfl.methods.base import LocalTrainingConfig
    from privfl.methods.local_training import local_sgd

    config = LocalTrainingConfig(lr=0.5, lr_decay=0.99, grad_clip=0.01, weight_decay=0.0)
    assert config.round_config(0)["lr"] == 0.5
    assert config.round_config(20)["lr"] == pytest.approx(0.5 * 0.99 ** 2)
    model = FACTORY.init(0)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    data = client_data()
    local_sgd(model, data.x_train, data.y_train, lr=0.5, steps=1, batch_size=8, rng=np.random.default_rng(0),
              grad_clip=0.01)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.linalg.vector_norm(after - before) == pytest.approx(0.5 * 0.01, rel=1e-4)  # clipped to 0.01
    with pytest.raises(ConfigError, match="grad_clip"):
        LocalTrainingConfig(grad_clip=-1.0)
    with pytest.raises(ConfigError, match="lr_decay"):
        LocalTrainingConfig(lr_decay=1.5)
