"""pFedHN and the PFL baselines (PFL-sampled, -ensemble, -nearest): server arithmetic, serving, ledgers, runs."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from accounting import ComposedEvent  # noqa: E402  (after privfl, as in test_pefll)
from accounting import epsilon as accounting_epsilon
from privfl.config import RunConfig
from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError, TrainingDivergedError
from privfl.experiment import RunInterrupted, train
from privfl.federation import InProcessRuntime, RunDirectory, sample_clients
from privfl.federation.messages import Message
from privfl.methods import ModelFactory, get_method
from privfl.methods.local_training import sgd_settings
from privfl.methods.pfl_baselines import LogitEnsemble, proxy_a_distance
from privfl.metrics import ExpectedModel, score_model
from privfl.models import functional_forward
from privfl.models.hypernetwork import backprop_weight_change
from privfl.modes.wrappers import protect
from privfl.privacy.training import TrainingPrivacy

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


FACTORY = ModelFactory("mlp2nn", (3,), 2)
TINY_HN = {"hidden_dim": 4, "n_hidden": 1, "embed_dim": 3}


def make(name, num_clients=4, factory=FACTORY, **settings):
    spec = get_method(name)
    config = spec.make_config(**{**TINY_HN, **settings})
    strategy = spec.strategy(model_factory=factory, config=config, seed=0, num_training_clients=num_clients)
    return strategy, spec.client(model_factory=factory, config=config)


def client(cid, n=12, shift=0.0, dim=3):
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(n, dim, generator=g) + shift
    y = (x[:, 0] > shift).long()
    return TrainingClient(client_id=cid, x_train=x, y_train=y, x_val=x[:4], y_val=y[:4])


def runtime(name, clients, fraction=1.0, **settings):
    strategy, proc = make(name, num_clients=len(clients), **settings)
    return InProcessRuntime(strategy=strategy, client=proc, training_clients=clients, seed=0,
                            client_fraction=fraction), strategy


def test_one_plain_sgd_step_gives_the_server_lr_times_the_true_gradient():
    """d = before - after of one full-batch plain SGD step is eta * dL/dw, so the server's averaged gradient must be
    eta * the gradient of the clients' mean loss through w = f(e) (the sign of pFedHN's code; docs/papers.md,
    ODPFL-HN, E1)."""
    clients = [client(3), client(7)]
    eta = 0.3
    rt, strategy = runtime("pfedhn", clients, lr=eta, local_steps=1, batch_size=64, momentum=0.0, weight_decay=0.0,
                           grad_clip=None, server_grad_clip=None, hn_momentum=0.0, hn_weight_decay=0.0, hn_lr=0.5,
                           embed_lr=0.25)
    target = FACTORY()
    params = dict(strategy.hnet.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    rows = {c.client_id: strategy.embedding(c.client_id).clone().requires_grad_(True) for c in clients}
    true_hn = {k: torch.zeros_like(v) for k, v in params.items()}
    true_rows = {}
    for c in clients:
        loss = nn.functional.cross_entropy(functional_forward(target, strategy.hnet(rows[c.client_id]), c.x_train),
                                           c.y_train)
        grads = torch.autograd.grad(loss, [*params.values(), rows[c.client_id]])
        for name, g in zip(params, grads[:-1]):
            true_hn[name] += g / len(clients)
        true_rows[c.client_id] = grads[-1] / len(clients)

    rt.run_round(0)
    got = strategy.last_gradients
    for name in params:
        assert torch.allclose(got["hypernetwork"][name], eta * true_hn[name], rtol=1e-4, atol=1e-7), name
    for cid in rows:
        assert torch.allclose(got["embeddings"][cid], eta * true_rows[cid], rtol=1e-4, atol=1e-7)
    # plain SGD with separate learning rates: theta -= 0.5 * g, e_i -= 0.25 * g_e_i
    for name in params:
        assert torch.allclose(params[name].detach(), before[name] - 0.5 * eta * true_hn[name], rtol=1e-4, atol=1e-6)
    for cid, row in rows.items():
        assert torch.allclose(strategy.embeddings[cid], row.detach() - 0.25 * eta * true_rows[cid], atol=1e-6)
    assert [r.purpose for r in rt.wire.ledgers[3].records] == ["weight_change"]


def test_the_server_mean_is_the_per_client_sum_of_g_over_count_to_the_last_bit_and_leaves_replies_untouched():
    """The in-place accumulation must round exactly as ``sum_i g_i / count`` in client order did, so runs stored
    before it reproduce; and it must not write into a reply's tensors (a head's bias gradient can alias them)."""
    strategy, _ = make("pfedhn", num_clients=3, server_grad_clip=None)
    ids = [0, 1, 2]
    shapes = {k: v.shape for k, v in strategy.hnet(strategy.embedding(0)).items()}
    g = torch.Generator().manual_seed(5)
    replies = {cid: Message(arrays={k: torch.randn(shape, generator=g) for k, shape in shapes.items()},
                            metrics={"loss": 1.0, "num_examples": 10.0}) for cid in ids}
    sent = {cid: {k: v.clone() for k, v in replies[cid].arrays.items()} for cid in ids}
    descriptors = {cid: strategy.embedding(cid) for cid in ids}
    expected, expected_rows = {}, {}
    for cid in ids:
        grads, row = backprop_weight_change(strategy.hnet, descriptors[cid], replies[cid].arrays)
        for name, grad in grads.items():
            expected[name] = expected[name] + grad / 3 if name in expected else grad / 3
        expected_rows[cid] = row / 3
    strategy.hypernetwork_update(descriptors, replies, update_embeddings=True, lr=0.1)
    got = strategy.last_gradients
    assert got["hypernetwork"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got["hypernetwork"][name], value), name
    for cid in ids:
        assert torch.equal(got["embeddings"][cid], expected_rows[cid])
        assert all(torch.equal(replies[cid].arrays[k], v) for k, v in sent[cid].items()), cid


def test_an_absent_clients_embedding_row_does_not_move_even_with_momentum_and_weight_decay():
    clients = [client(i) for i in range(6)]
    rt, strategy = runtime("pfedhn", clients, fraction=0.5, lr=0.1, local_steps=2, batch_size=4,
                           hn_weight_decay=0.1, hn_momentum=0.9)
    rt.run_round(0)
    rt.run_round(1)
    rows = {cid: row.clone() for cid, row in strategy.embeddings.items()}
    sampled = sample_clients(sorted(c.client_id for c in clients), 0.5, seed=0, round=2)
    absent_with_momentum = [cid for cid in rows if cid not in sampled]
    assert absent_with_momentum, "pick a seed where a client trained earlier and sits out round 2"
    rt.run_round(2)
    for cid in absent_with_momentum:
        assert torch.equal(strategy.embeddings[cid], rows[cid]), cid
    for cid in sampled:
        assert not torch.allclose(strategy.embedding(cid), rows.get(cid, strategy.initial_embedding(cid))), cid
    # rows start N(0, 1) from (seed, client id), whatever order clients first appear in
    assert torch.equal(strategy.initial_embedding(4), make("pfedhn", num_clients=6)[0].initial_embedding(4))


def test_the_server_gradient_is_clipped_to_the_configured_norm():
    rt, strategy = runtime("pfedhn", [client(0), client(1)], lr=0.5, local_steps=3, batch_size=4,
                           server_grad_clip=1e-3)
    rt.run_round(0)
    grads = strategy.last_gradients
    clipped = math.sqrt(sum(float(g.pow(2).sum()) for g in [*grads["hypernetwork"].values(),
                                                           *grads["embeddings"].values()]))
    assert grads["norm"] > 1e-3
    assert clipped == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_change_is_refused_before_the_hypernetwork_steps(bad):
    strategy, _ = make("pfedhn", hn_lr=0.05, lr=0.2)
    before = {k: v.clone() for k, v in strategy.hnet.state_dict().items()}
    row = strategy.embedding(0).clone()
    change = {k: torch.full_like(v, bad) for k, v in FACTORY().state_dict().items()}
    replies = {0: Message(arrays=change, metrics={"num_examples": 12.0, "loss": 1.0})}
    refusal = r"diverged.*clients \[0\].*hypernetwork lr \(now 0.05\).*local lr \(now 0.2\)"
    with pytest.raises(TrainingDivergedError, match=refusal):
        strategy.aggregate_train(0, replies)
    assert all(torch.equal(v, before[k]) for k, v in strategy.hnet.state_dict().items())
    assert torch.equal(strategy.embedding(0), row)


def test_training_clients_are_scored_with_their_own_generated_model_and_pfedhn_serves_no_novel_client():
    strategy, proc = make("pfedhn")
    assert proc.serves_novel_clients is False
    message = strategy.configure_evaluate(5)
    x = torch.randn(7, 3)
    model = proc.evaluation_model(client(5), message, {})
    expected = functional_forward(FACTORY(), strategy.generate(strategy.embedding(5)), x)
    assert torch.allclose(model(x), expected)
    with pytest.raises(ConfigError, match="pfl_sampled"):
        strategy.novel_request(99)


def _pool_strategy(name):
    strategy, proc = make(name)
    g = torch.Generator().manual_seed(1)
    strategy.embeddings = {cid: torch.randn(3, generator=g) * 3 for cid in (2, 5, 9)}
    return strategy, proc


def test_pfl_sampled_scores_the_mean_of_the_members_accuracies():
    strategy, proc = _pool_strategy("pfl_sampled")
    novel = NovelClient(50, torch.randn(40, 3, generator=torch.Generator().manual_seed(2)))
    model = proc.novel_model(novel, strategy.novel_reply(50, proc.novel_query(novel, strategy.novel_request(50))))
    assert isinstance(model, ExpectedModel) and len(model.members) == 3
    y = (novel.x[:, 1] > 0).long()
    members = [score_model(functional_forward_module(strategy, j), novel.x, y) for j in (2, 5, 9)]
    accuracies = [m.accuracy for m in members]
    assert len(set(accuracies)) > 1                  # the members disagree, so a mean is not a member's value
    score = score_model(model, novel.x, y)
    assert score.accuracy == pytest.approx(sum(accuracies) / 3, abs=1e-12)
    assert score.loss == pytest.approx(sum(m.loss for m in members) / 3, rel=1e-6)
    with pytest.raises(TypeError, match="no single prediction"):
        model(novel.x)
    assert proc.novel_query(novel, strategy.novel_request(50)) is None     # the novel client sends nothing


def functional_forward_module(strategy, cid):
    model = FACTORY()
    model.load_state_dict(strategy.generate(strategy.embeddings[cid]))
    return model


def test_pfl_ensemble_averages_logits_not_probabilities():
    strategy, proc = _pool_strategy("pfl_ensemble")
    novel = NovelClient(50, torch.randn(30, 3, generator=torch.Generator().manual_seed(3)))
    model = proc.novel_model(novel, strategy.novel_request(50))
    assert isinstance(model, LogitEnsemble)
    logits = torch.stack([functional_forward_module(strategy, j)(novel.x) for j in (2, 5, 9)])
    out = model(novel.x)
    assert torch.allclose(out, logits.mean(0), atol=1e-6)
    assert not torch.allclose(out.softmax(1), logits.softmax(2).mean(0), atol=1e-3)

    # hand-made members where the two rules disagree: mean logits pick class 1, mean probabilities class 0
    class Fixed(nn.Module):
        def __init__(self, row):
            super().__init__()
            self.row = torch.tensor([row])

        def forward(self, x):
            return self.row.expand(len(x), -1)

    ensemble = LogitEnsemble([Fixed([2.0, 0.0]), Fixed([2.0, 0.0]), Fixed([-5.0, 0.0])])
    assert ensemble(torch.zeros(1, 3)).argmax(1).item() == 1
    probs = torch.stack([m(torch.zeros(1, 3)).softmax(1) for m in ensemble.members]).mean(0)
    assert probs.argmax(1).item() == 0


def test_proxy_a_distance_is_near_zero_for_one_distribution_and_near_two_for_separated_ones():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(200, 4, generator=g), torch.randn(200, 4, generator=g)
    far = torch.randn(200, 4, generator=g) + 6.0
    rng = np.random.default_rng(0)
    assert abs(proxy_a_distance(a, b, rng=rng)) < 0.35
    assert proxy_a_distance(a, far, rng=rng) == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="at least 4"):
        proxy_a_distance(a[:3], b, rng=rng)


def test_pfl_nearest_picks_the_training_client_with_matching_inputs_and_records_every_raw_input_release():
    shifts = {0: -4.0, 1: 0.0, 2: 4.0, 3: 8.0}
    clients = [client(cid, n=40, shift=s) for cid, s in shifts.items()]
    rt, strategy = runtime("pfl_nearest", clients, lr=0.1, local_steps=2, batch_size=8, nearest_max_inputs=30)
    rt.run_round(0)
    rt.run_round(1)
    # inputs are collected once per training client (first round it takes part in), capped at 30
    assert [r.purpose for r in rt.wire.ledgers[2].records] == ["weight_change", "raw_inputs", "weight_change"]
    assert sorted(strategy.inputs) == [0, 1, 2, 3] and strategy.inputs[2].shape == (30, 3)
    novel = NovelClient(77, torch.randn(50, 3, generator=torch.Generator().manual_seed(9)) + 4.0)
    model = rt.novel_client_model(novel)
    chosen, distances = strategy.last_nearest[77]
    assert chosen == 2 and distances[2] < 0.6 and min(distances[j] for j in (0, 1, 3)) > 1.5
    x = torch.randn(5, 3)
    assert torch.allclose(model(x), functional_forward_module(strategy, 2)(x))
    records = rt.wire.ledgers[77].records
    assert [r.purpose for r in records] == ["raw_inputs"] and math.isinf(rt.wire.ledgers.epsilons(1e-5)[77])
    assert records[0].metadata["bytes"] == 30 * 3 * 4


def test_pfl_nearest_skips_training_clients_too_small_for_a_distance():
    # client 2 (shift 4) is near the novel inputs (shift 7.5) but holds 2 images (Dirichlet 0.1 makes such
    # clients): no distance to it is measured, and of the others client 3 (shift 8) is nearest
    shifts = {0: -4.0, 1: 0.0, 2: 4.0, 3: 8.0}
    clients = [client(cid, n=2 if cid == 2 else 40, shift=s) for cid, s in shifts.items()]
    rt, strategy = runtime("pfl_nearest", clients, lr=0.1, local_steps=2, batch_size=8, nearest_max_inputs=30)
    rt.run_round(0)
    assert len(strategy.inputs[2]) == 2
    novel = NovelClient(77, torch.randn(50, 3, generator=torch.Generator().manual_seed(9)) + 7.5)
    rt.novel_client_model(novel)
    chosen, distances = strategy.last_nearest[77]
    assert sorted(distances) == [0, 1, 3] and chosen == 3 and distances[3] < 1.5 < distances[0], distances
    with pytest.raises(ConfigError, match="sent 3 inputs; the proxy A-distance needs at least 4"):
        rt.novel_client_model(NovelClient(78, torch.randn(3, 3)))


def test_the_pfl_baselines_train_exactly_as_pfedhn():
    clients = [client(i, n=10) for i in range(4)]
    settings = dict(lr=0.1, local_steps=2, batch_size=4)
    states = []
    for name in ("pfedhn", "pfl_nearest", "pfl_sampled"):
        rt, strategy = runtime(name, clients, fraction=0.5, **settings)
        rt.run_round(0)
        rt.run_round(1)
        states.append(strategy.state_dict())
    for other in states[1:]:
        for group in ("hypernetwork", "embeddings", "embedding_momentum"):
            assert other[group].keys() == states[0][group].keys()
            assert all(torch.equal(other[group][k], states[0][group][k]) for k in states[0][group]), group


def test_momentum_reaches_local_sgd_only_when_the_config_carries_it():
    base = {"lr": 0.1, "local_steps": 1, "batch_size": 2}
    assert "momentum" not in sgd_settings(base)
    assert sgd_settings({**base, "momentum": 0.9})["momentum"] == 0.9
    strategy, _ = make("pfedhn", momentum=0.5)
    assert strategy.configure_train(0, [1])[1].config["momentum"] == 0.5


@pytest.mark.parametrize("bad, match", [
    ({"momentum": 1.0}, "momentum must be in \\[0, 1\\), got 1.0"),
    ({"embed_dim_rule": "half"}, "embed_dim_rule must be one of quarter, pfedhn, got 'half'"),
    ({"server_grad_clip": 0}, "server_grad_clip must be None or a finite number > 0, got 0"),
    ({"embed_lr": -1.0}, "embed_lr must be a finite number > 0"),
    ({"nearest_max_inputs": 2}, "nearest_max_inputs must be an integer >= 4, got 2"),
])
def test_bad_settings_raise_naming_the_value(bad, match):
    name = "pfl_nearest" if "nearest_max_inputs" in bad else "pfedhn"
    with pytest.raises(ConfigError, match=match):
        get_method(name).make_config(**bad)


# -- the privacy layer ---------------------------------------------------------------------------------------------


def private_runtime(name, clients, privacy, rounds=2, **settings):
    """``name`` under ``privacy`` as :func:`privfl.config.build_method` builds it (every client in every round)."""
    spec = get_method(name)
    config = spec.make_config(**{**TINY_HN, "grad_clip": None, **settings})
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=len(clients))
    proc = spec.client(model_factory=FACTORY, config=config, privacy=privacy, participations=rounds)
    strategy, proc = protect(spec, strategy, proc, privacy, rounds=rounds, client_fraction=1.0, seed=0,
                             num_training_clients=len(clients))
    return InProcessRuntime(strategy=strategy, client=proc, training_clients=clients, seed=0), proc.inner


@pytest.mark.parametrize("name", ["pfedhn", "pfl_sampled", "pfl_ensemble"])
def test_a_record_level_round_records_exactly_the_declared_round_event_and_no_metrics(name):
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.3, clip=0.5, noise="seeded", noise_seed=2)
    clients = [client(0, n=20), client(1, n=30)]
    rt, proc = private_runtime(name, clients, privacy, local_steps=3, batch_size=5)
    seen = {}
    original = rt.strategy.aggregate_train
    rt.strategy.aggregate_train = lambda r, replies: seen.update(replies) or original(r, replies)
    rt.run_round(0)
    for c in clients:
        (record,) = rt.wire.ledgers[c.client_id].records
        # one DP-SGD fit of 3 steps at the public q = 5 / min_samples 8 and z = 1.3: what round_event declares
        assert record.event == proc.round_event(1.3)
        assert record.event.event.sampling_probability == pytest.approx(5 / 8) and record.event.count == 3
        assert record.purpose == "weight_change" and seen[c.client_id].metrics == {}


def test_a_target_epsilon_is_spent_exactly_over_the_planned_rounds():
    privacy = TrainingPrivacy(mode="record", epsilon=3.0, clip=0.5, noise="seeded")
    clients = [client(0, n=20), client(1, n=40)]
    rt, proc = private_runtime("pfedhn", clients, privacy, rounds=2, local_steps=3, batch_size=5)
    for r in range(2):
        rt.run_round(r)
    for c in clients:
        # the calibration composes round_event over the 2 planned rounds; the ledger composes what was released
        assert rt.wire.ledgers[c.client_id].spent(1e-5).epsilon == pytest.approx(3.0, rel=1e-2)
        assert accounting_epsilon(ComposedEvent((proc.round_event(proc.noise_multiplier()),) * 2), 1e-5) \
            == pytest.approx(3.0, rel=1e-2)


@pytest.mark.parametrize("name", ["pfedhn", "pfl_sampled", "pfl_ensemble"])
def test_record_level_refuses_the_batch_clip_before_the_run(name, make_spec):
    record = TrainingPrivacy(mode="record", noise_multiplier=1.0)
    refusal = ("grad_clip=50.0 clips each local step's batch gradient.*set grad_clip to None .* "
               "with privacy mode 'record'")
    with pytest.raises(ConfigError, match=refusal):
        RunConfig(federation=make_spec(), method=name, privacy=record, select="last")
    with pytest.raises(ConfigError, match=refusal):
        get_method(name).client(model_factory=FACTORY, config=get_method(name).make_config(), privacy=record)


def test_central_dp_moves_the_hypernetwork_from_the_noisy_mean_alone_and_each_row_from_its_own_gradient():
    strategy, _ = make("pfedhn", server_grad_clip=1.0, hn_momentum=0.0, hn_weight_decay=0.0, hn_lr=0.1,
                       embed_lr=0.2)
    messages = strategy.configure_train(0, [0, 2])
    g = torch.Generator().manual_seed(0)
    replies = {cid: Message(arrays={k: torch.randn(v.shape, generator=g) for k, v in messages[cid].arrays.items()})
               for cid in (0, 2)}
    rows = {cid: strategy.embedding(cid).clone() for cid in (0, 2)}
    contributions = dict(strategy.contributions(0, replies))
    assert set(contributions[0]) == set(strategy.contribution_shapes())
    row_grads = {}
    for cid in (0, 2):
        expected, row_grads[cid] = backprop_weight_change(strategy.hnet, rows[cid], replies[cid].arrays)
        assert all(torch.equal(contributions[cid]["hn." + k], v) for k, v in expected.items())
    # a stand-in for the layer's noisy mean, of norm 5 > server_grad_clip = 1: clipped on its own
    mean = {k: torch.randn(v.shape, generator=g) for k, v in strategy.contribution_shapes().items()}
    scale = 5.0 / math.sqrt(sum(float(v.pow(2).sum()) for v in mean.values()))
    mean = {k: v * scale for k, v in mean.items()}
    before = {k: v.detach().clone() for k, v in strategy.hnet.named_parameters()}
    metrics = strategy.apply_mean(0, mean, 1.5)
    assert metrics["hn_grad_norm"] == pytest.approx(5.0)
    for name, p in strategy.hnet.named_parameters():
        assert torch.allclose(p, before[name] - 0.1 * mean["hn." + name] / (5.0 + 1e-6), atol=1e-6)
    # each row moved by its own gradient / q N, clipped alone (weight decay 0: the hypernetwork's)
    for cid in (0, 2):
        step = row_grads[cid] / 1.5
        step = step * min(1.0, 1.0 / (float(step.norm()) + 1e-6))
        assert torch.allclose(strategy.embedding(cid), rows[cid] - 0.2 * step, atol=1e-6)
    assert not torch.equal(strategy.embedding(0), rows[0])


def test_under_central_dp_a_client_s_clear_change_reaches_the_hypernetwork_only_through_the_noisy_mean():
    """Scale one client's weight change from 1e-4 to 1e3: its row moves differently, but the hypernetwork, given the
    same noisy mean, takes exactly the same step (its clip does not read the rows)."""
    steps = []
    for factor in (1e-4, 1e3):
        strategy, _ = make("pfedhn", server_grad_clip=1.0)
        messages = strategy.configure_train(0, [0, 1])
        replies = {cid: Message(arrays={k: factor ** (cid == 0) * torch.ones_like(v) for k, v in
                                        messages[cid].arrays.items()}) for cid in (0, 1)}
        list(strategy.contributions(0, replies))
        mean = {k: torch.full_like(v, 0.01) for k, v in strategy.contribution_shapes().items()}
        strategy.apply_mean(0, mean, 2.0)
        steps.append(({k: v.detach().clone() for k, v in strategy.hnet.named_parameters()},
                      strategy.embedding(0).clone()))
    assert all(torch.equal(steps[0][0][k], steps[1][0][k]) for k in steps[0][0])
    assert not torch.equal(steps[0][1], steps[1][1])


def _run_config(make_spec, method, **overrides):
    extra = {"nearest_max_inputs": 40} if method == "pfl_nearest" else {}
    values = dict(federation=make_spec(), method=method,
                  method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16, "hn_lr": 0.05, **TINY_HN, **extra},
                  rounds=4, eval_every=2, checkpoint_every=2, seed=3, select="last")
    values.update(overrides)
    return RunConfig(**values)


@pytest.mark.parametrize("method", ["pfedhn", "pfl_sampled", "pfl_ensemble", "pfl_nearest"])
def test_end_to_end_run(tmp_path, make_spec, method):
    summary = train(_run_config(make_spec, method), str(tmp_path / method), progress=False)
    assert summary["training_val"]["num_clients"] == 9
    assert summary["training_val"]["accuracy_mean"] > 40.0                # 4 classes: chance is 25%
    rows = RunDirectory(tmp_path / method).read_clients()
    novel_eps = [float(r["epsilon"]) for r in rows if r["role"] == "novel"]
    if method == "pfedhn":
        assert summary["novel"]["num_clients"] == 0 and novel_eps == [0.0] * 3
    else:
        assert summary["novel"]["num_clients"] == 3 and summary["novel"]["accuracy_mean"] > 30.0
        # only PFL-nearest's novel clients release anything (their raw inputs)
        assert all(math.isinf(e) for e in novel_eps) == (method == "pfl_nearest")
        assert all(e == 0.0 for e in novel_eps) == (method != "pfl_nearest")


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, make_spec):
    """PFL-nearest's state is pFedHN's plus the stored inputs, so this covers pFedHN's resume too."""
    cfg = _run_config(make_spec, "pfl_nearest", rounds=4, client_fraction=0.5, checkpoint_every=3, select="best_val")
    full = train(cfg, str(tmp_path / "full"), progress=False)
    with pytest.raises(RunInterrupted):
        train(cfg, str(tmp_path / "cut"), progress=False, stop_after_round=2)
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    for key in ("novel", "training_val", "selected_round"):
        assert resumed[key] == full[key], key
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]
    b = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]
    assert a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


# -- generating only the head (the rest shared, FedAvg's step; privfl.methods.shared_part) ----------------------------


def _changes_spy(strategy):
    """Wrap ``strategy.aggregate_train`` to keep each round's weight changes (copies), by round."""
    seen, aggregate = {}, strategy.aggregate_train

    def spy(round, replies):
        seen[round] = {cid: {k: v.clone() for k, v in m.arrays.items()} for cid, m in replies.items()}
        return aggregate(round, replies)

    strategy.aggregate_train = spy
    return seen


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_with_a_generated_head_the_shared_part_moves_by_exactly_the_mean_change_and_the_state_keeps_it(momentum):
    clients = [client(0), client(1, shift=0.5)]
    rt, strategy = runtime("pfedhn", clients, generated="head", shared_lr=0.7, shared_momentum=momentum,
                           grad_clip=None, local_steps=2, batch_size=4)
    names = [n for n, _ in FACTORY().named_parameters()]
    assert list(strategy.hnet.shapes) == ["fc3.weight", "fc3.bias"] and list(strategy.shared_part) == names[:-2]
    # every message carries the whole target: the shared part as it stands, the head from the embedding
    weights = strategy.generate(strategy.embedding(0))
    assert list(weights) == names
    assert all(torch.equal(weights[k], v.cpu()) for k, v in strategy.shared_part.values.items())
    seen = _changes_spy(strategy)
    start = {k: v.clone() for k, v in strategy.shared_part.values.items()}
    rt.run_round(0)
    after_one = {k: v.clone() for k, v in strategy.shared_part.values.items()}
    rt.run_round(1)
    m0, m1 = ({k: (seen[r][0][k] + seen[r][1][k]) / 2 for k in start} for r in (0, 1))
    for k in start:   # b0 = m0; shared -= 0.7 b0; b1 = mu b0 + m1; shared -= 0.7 b1
        torch.testing.assert_close(after_one[k], start[k] - 0.7 * m0[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(strategy.shared_part.values[k],
                                   after_one[k] - 0.7 * (momentum * m0[k] + m1[k]), rtol=0, atol=1e-6)
    assert (sorted(strategy.shared_part.momentum) == sorted(start)) == (momentum > 0)
    state = strategy.state_dict()
    assert sorted(state["shared"]) == sorted(start) and "shared_momentum" in strategy.training_only
    again, _ = make("pfedhn", num_clients=2, generated="head", shared_lr=0.7, shared_momentum=momentum)
    again.load_state_dict(state)
    assert all(torch.equal(again.shared_part.values[k], strategy.shared_part.values[k]) for k in start)
    assert all(torch.equal(a, b) for a, b in zip(again.generate(again.embedding(1)).values(),
                                                  strategy.generate(strategy.embedding(1)).values(), strict=True))


def test_with_a_generated_head_the_hypernetwork_reads_only_the_head_of_each_change():
    rt, strategy = runtime("pfedhn", [client(0), client(1)], generated="head", grad_clip=None, local_steps=2)
    seen = _changes_spy(strategy)
    rt.run_round(0)
    for cid, change in seen[0].items():
        e = strategy.initial_embedding(cid)
        head_only = {k: v if k.startswith("fc3.") else torch.zeros_like(v) for k, v in change.items()}
        full, dfull = backprop_weight_change(strategy.hnet, e, change)
        part, dpart = backprop_weight_change(strategy.hnet, e, head_only)
        assert torch.equal(dfull, dpart) and all(torch.equal(full[k], part[k]) for k in full)


def test_generating_everything_is_pfedhn_with_no_shared_part():
    strategy, _ = make("pfedhn")
    assert strategy.config.generated == "all" and not strategy.shared_part
    assert "shared" not in strategy.state_dict() and list(strategy.hnet.shapes) == [n for n, _ in
                                                                                    FACTORY().named_parameters()]


@pytest.mark.parametrize("name", ["pfedhn", "pfl_nearest"])
@pytest.mark.parametrize("bad, match", [
    ({"generated": "trunk"}, "generated must be one of all, head, head_bias, got 'trunk'"),
    ({"shared_lr": 0.0}, "shared_lr must be a finite number > 0, got 0.0"),
    ({"shared_momentum": 1.0}, r"shared_momentum must be in \[0, 1\), got 1.0"),
])
def test_bad_generated_settings_are_refused_naming_the_value_and_the_valid_ones(name, bad, match):
    with pytest.raises(ConfigError, match=match):
        get_method(name).make_config(**bad)
