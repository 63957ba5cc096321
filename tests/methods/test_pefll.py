"""PeFLL: descriptor = mean of per-example embeddings, the split chain rule, the unseen-client protocol, privacy."""

import json

import pytest
import torch
from torch import nn

from accounting import ComposedEvent, NeighboringRelation, analytic_gaussian_sigma  # noqa: E402  (after privfl: tests/accounting would shadow it)
from privfl.config import RunConfig
from privfl.data import NovelClient, TrainingClient, build_federation
from privfl.errors import ConfigError, TrainingDivergedError
from privfl.experiment import build_runtime, train
from privfl.federation import InProcessRuntime
from privfl.methods import ModelFactory, get_method
from privfl.methods.pefll import PeFLLConfig, descriptor_of, unseen_clients_with_labels
from privfl.models import functional_forward
from privfl.models.hypernetwork import backprop_weight_change
from privfl.models.pefll import EmbeddingNetwork
from privfl.modes.wrappers import protect
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

torch.set_num_threads(1)

FACTORY = ModelFactory("mlp2nn", (4,), 3)
SMALL = {"hidden_dim": 8, "n_hidden": 1, "embed_dim": 3}  # a small hypernetwork keeps every test fast


def _client(cid, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 4, 4, generator=g)
    y = torch.randint(0, 3, (n + 4,), generator=g)
    return TrainingClient(cid, x[:n], y[:n], x[n:], y[n:])


def _runtime(clients, novel_privacy=None, **settings):
    spec = get_method("pefll")
    config = spec.make_config(**{**SMALL, **settings})
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=len(clients))
    client = spec.client(model_factory=FACTORY, config=config, novel_privacy=novel_privacy)
    return InProcessRuntime(strategy=strategy, client=client, training_clients=clients, seed=0)


def _private_runtime(clients, privacy, rounds=2, bound=0.5, **settings):
    """PeFLL under ``privacy`` as :func:`privfl.config.build_method` builds it (every client every round), the
    embeddings clipped to the novel bound ``bound``."""
    spec = get_method("pefll")
    config = spec.make_config(**{**SMALL, "grad_clip": 0.0, **settings})
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=len(clients))
    client = spec.client(model_factory=FACTORY, config=config, privacy=privacy, participations=rounds,
                         novel_privacy=NovelPrivacy(bound=bound))
    strategy, wrapped = protect(spec, strategy, client, privacy, rounds=rounds, client_fraction=1.0, seed=0,
                                num_training_clients=len(clients))
    return InProcessRuntime(strategy=strategy, client=wrapped, training_clients=clients, seed=0), client


# -- the descriptor -------------------------------------------------------------------------------------------------


def test_descriptor_is_the_mean_of_per_example_embeddings_hand_computed_and_permutation_invariant():
    net = EmbeddingNetwork((2,), 3, embed_dim=2, kind="linear")  # v = W * (label frequencies) + b
    with torch.no_grad():
        net.fc.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]]))
        net.fc.bias.copy_(torch.tensor([0.5, -0.5]))
    x, y = torch.zeros(4, 2), torch.tensor([0, 2, 2, 1])
    # label frequencies (1/4, 1/4, 1/2): (0.25 + 0.5 + 1.5 + 0.5, 0 - 0.25 + 2 - 0.5)
    assert net.descriptor(x, y).tolist() == pytest.approx([2.75, 1.25])
    # clipped to B = 1 per example: rows (1.5, -0.5), (3.5, 3.5) x2, (2.5, -1.5) -> each projected to the unit ball
    rows = torch.tensor([[1.5, -0.5], [3.5, 3.5], [3.5, 3.5], [2.5, -1.5]])
    expected = (rows / rows.norm(dim=1, keepdim=True)).mean(dim=0)
    assert torch.allclose(net.descriptor(x, y, bound=1.0), expected)

    cnn = EmbeddingNetwork((1, 16, 16), 10, embed_dim=5, kind="cnn")
    xs, ys = torch.randn(9, 1, 16, 16), torch.randint(0, 10, (9,))
    perm = torch.randperm(9)
    v = cnn.descriptor(xs, ys)
    assert torch.allclose(v, cnn(xs, ys).mean(dim=0), atol=1e-6)
    assert torch.allclose(v, cnn.descriptor(xs[perm], ys[perm]), atol=1e-6)
    # labels are inputs: changing one label changes the descriptor
    ys2 = ys.clone()
    ys2[0] = (ys[0] + 1) % 10
    assert not torch.allclose(v, cnn.descriptor(xs, ys2))


def test_the_mean_divides_by_the_number_of_examples_not_twice_the_number_of_batches():
    net = EmbeddingNetwork((4,), 3, embed_dim=2, kind="mlp")
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    with torch.no_grad():
        v = descriptor_of(net, x, y, bound=None, chunk=32)  # two batches of 32
        batch_means = (net(x[:32], y[:32]).mean(dim=0), net(x[32:], y[32:]).mean(dim=0))
        code_quirk = net(x, y).sum(dim=0) / (2 * 2)  # the authors' code: sum / (2 * #batches)
    assert torch.allclose(v, (batch_means[0] + batch_means[1]) / 2, atol=1e-6)
    assert torch.allclose(code_quirk, 16 * v, atol=1e-5)


# -- one round: the chain rule across the six messages ---------------------------------------------------------------


def test_one_plain_sgd_step_gives_lr_times_the_true_gradient_through_the_whole_chain():
    lr = 0.5
    clients = [_client(0, seed=1), _client(1, seed=2)]
    runtime = _runtime(clients, lr=lr, local_steps=1, batch_size=12, momentum=0.0, grad_clip=0.0, lambda_theta=0.0,
                       lambda_h=0.0, lambda_v=0.0, server_optimizer="sgd", server_lr=1.0, server_momentum=0.0,
                       server_grad_clip=0.0, descriptor_batch=12)
    strategy = runtime.strategy
    hnet0 = {k: v.clone() for k, v in strategy.hnet.state_dict().items()}
    embed0 = {k: v.clone() for k, v in strategy.embedding.state_dict().items()}

    # The true gradient of the mean client loss L_i(f(x_i; h(v(S_i; eta_v); eta_h))) over the same full batches.
    params = [*strategy.hnet.parameters(), *strategy.embedding.parameters()]
    target = FACTORY()
    loss = sum(nn.functional.cross_entropy(
        functional_forward(target, strategy.hnet(strategy.embedding.descriptor(c.x_train, c.y_train)), c.x_train),
        c.y_train) for c in clients) / 2
    true = torch.autograd.grad(loss, params)
    n_hnet = len(list(strategy.hnet.parameters()))

    metrics = runtime.run_round(0)
    assert metrics["clients"] == 2.0
    for (name, before), grad in zip(hnet0.items(), true[:n_hnet], strict=True):
        change = before - strategy.hnet.state_dict()[name]
        assert torch.allclose(change, lr * grad, rtol=1e-3, atol=1e-6), name
    for (name, before), grad in zip(embed0.items(), true[n_hnet:], strict=True):
        change = before - strategy.embedding.state_dict()[name]
        assert torch.allclose(change, lr * grad, rtol=1e-3, atol=1e-6), name
    assert any(g.abs().max() > 1e-4 for g in true[n_hnet:])  # the embedding network really moved

    # Every message up is a recorded release, in protocol order; nothing persists on the client (stateless).
    assert [r.purpose for r in runtime.wire.ledgers[0].records] == ["descriptor", "weight_change",
                                                                    "embedding_gradient"]
    assert runtime.client_states == {0: {}, 1: {}}


def test_server_regularisers_add_two_lambda_eta_to_the_averaged_gradient():
    clients = [_client(0, seed=1)]
    base = dict(lr=0.1, local_steps=1, batch_size=12, momentum=0.0, grad_clip=0.0, lambda_theta=0.0,
                server_optimizer="sgd", server_lr=1.0, server_momentum=0.0, server_grad_clip=0.0, descriptor_batch=12)
    plain, regular = _runtime(clients, lambda_h=0.0, lambda_v=0.0, **base), _runtime(clients, lambda_h=0.01,
                                                                                       lambda_v=0.02, **base)
    start_h = regular.strategy.hnet.trunk[0].weight.detach().clone()
    start_v = regular.strategy.embedding.fc1.weight.detach().clone()
    plain.run_round(0)
    regular.run_round(0)
    diff_h = plain.strategy.hnet.trunk[0].weight - regular.strategy.hnet.trunk[0].weight
    diff_v = plain.strategy.embedding.fc1.weight - regular.strategy.embedding.fc1.weight
    assert torch.allclose(diff_h, 2 * 0.01 * start_h, atol=1e-6)
    assert torch.allclose(diff_v, 2 * 0.02 * start_v, atol=1e-6)


# -- unseen clients: two down, one up --------------------------------------------------------------------------------


def test_an_unseen_client_releases_exactly_one_descriptor_and_gets_its_generated_model():
    runtime = _runtime([_client(0)])
    unseen = _client(7, n=20, seed=5)
    model = runtime.novel_client_model(unseen)
    records = runtime.wire.ledgers[7].records
    assert [r.purpose for r in records] == ["descriptor"] and records[0].metadata["bytes"] == 3 * 4
    # down: the embedding network, then the generated model; never the hypernetwork
    embed_bytes = sum(p.numel() * 4 for p in runtime.strategy.embedding.parameters())
    target_bytes = sum(p.numel() * 4 for p in FACTORY().parameters())
    assert runtime.wire.bytes_down[7] == embed_bytes + target_bytes
    expected = runtime.strategy.generate(runtime.strategy.embedding.descriptor(unseen.x_train, unseen.y_train))
    for name, param in model.named_parameters():
        assert torch.allclose(param, expected[name], atol=1e-6)
    with pytest.raises(ConfigError, match="without labels"):
        runtime.novel_client_model(NovelClient(8, unseen.x_train))


def test_unseen_clients_with_labels_splits_novel_clients_into_disjoint_descriptor_and_scoring_parts(make_spec):
    federation = build_federation(make_spec(), seed=0)
    clients = unseen_clients_with_labels(federation, score_fraction=0.2)
    assert [c.client_id for c in clients] == [c.client_id for c in federation.novel_clients]
    for client, novel in zip(clients, federation.novel_clients, strict=True):
        k = int(0.2 * novel.num_samples)
        assert client.num_val == k and client.num_train == novel.num_samples - k
        assert torch.equal(torch.cat([client.x_val, client.x_train]), novel.x)
        assert torch.equal(torch.cat([client.y_val, client.y_train]), federation.novel_labels.labels(novel.client_id))


def test_a_private_unseen_descriptor_has_the_requested_epsilon_and_the_analytic_sigma_for_2b_over_n():
    runtime = _runtime([_client(0)], novel_privacy=NovelPrivacy(epsilon=2.0, delta=1e-5, bound=0.5),
                       eval_descriptor_samples=16)
    unseen = _client(9, n=40, seed=3)
    runtime.novel_client_model(unseen)
    (record,) = runtime.wire.ledgers[9].records
    assert record.purpose == "descriptor"
    assert record.event.sensitivity == pytest.approx(2 * 0.5 / 16)       # 2B/n over the n = 16 examples used
    assert record.event.sigma == pytest.approx(analytic_gaussian_sigma(2.0, 1e-5, 2 * 0.5 / 16), rel=1e-12)
    assert runtime.wire.ledgers.epsilons(1e-5)[9] == pytest.approx(2.0, rel=1e-3)
    assert set(runtime.wire.ledgers.epsilons(1e-5)) == {9}               # nobody else released anything


def test_private_descriptor_noise_is_secure_by_default_and_no_seed_comes_from_the_server():
    runtime = _runtime([_client(0)], novel_privacy=NovelPrivacy(epsilon=2.0, bound=0.5), eval_descriptor_samples=16)
    message = runtime.strategy.configure_evaluate(9)
    assert not any("seed" in key for key in message.config)      # the server cannot choose (or know) the noise
    weights = [torch.cat([p.detach().clone().reshape(-1)    # clone: the client reuses one workspace model
                          for p in runtime.novel_client_model(_client(9, n=40, seed=3)).parameters()])
               for _ in range(2)]
    assert not torch.equal(*weights)                                  # same data, same run seed, fresh noise
    record = runtime.wire.ledgers[9].records[-1]
    assert record.metadata["noise"] == "secure" and record.metadata["bound"] == 0.5


def test_invalid_settings_name_the_value_and_what_is_valid():
    # the privacy of unseen clients is the run's novel_privacy now, not a setting of the method
    for removed in ("descriptor_epsilon", "descriptor_delta", "embed_bound", "descriptor_noise",
                    "descriptor_noise_seed"):
        with pytest.raises(ConfigError, match=f"method 'pefll' has no setting {removed}; valid settings: "):
            get_method("pefll").make_config(**{removed: 1.0})
    with pytest.raises(ConfigError, match="server_optimizer must be one of adam, sgd, got 'rmsprop'"):
        PeFLLConfig(server_optimizer="rmsprop")
    with pytest.raises(ConfigError, match="embed_kind"):
        PeFLLConfig(embed_kind="transformer")
    with pytest.raises(ConfigError, match="momentum must be in \\[0, 1\\), got 1.5"):
        PeFLLConfig(momentum=1.5)


# -- training clients under the privacy layer -----------------------------------------------------------------------

RECORD = TrainingPrivacy(mode="record", noise_multiplier=1.1, clip=0.6, noise="seeded", noise_seed=3, min_samples=6)


def test_a_record_level_round_records_exactly_the_declared_three_releases_over_the_whole_split():
    clients = [_client(0, n=12), _client(1, n=20, seed=1)]
    runtime, client = _private_runtime(clients, RECORD, local_steps=3, batch_size=4)
    runtime.run_round(0)
    for c in clients:
        records = runtime.wire.ledgers[c.client_id].records
        assert [r.purpose for r in records] == ["descriptor", "weight_change", "embedding_gradient"]
        assert ComposedEvent(tuple(r.event for r in records)) == client.round_event(1.1)
        descriptor, fit, gradient = (r.event for r in records)
        # add/remove-one, n private: 2B / min_samples and 2C / min_samples, whatever n; DP-SGD at q = 4 / min_samples
        assert (descriptor.sensitivity, gradient.sensitivity) == pytest.approx((2 * 0.5 / 6, 2 * 0.6 / 6))
        assert descriptor.sigma == pytest.approx(1.1 * 2 * 0.5 / 6)
        assert descriptor.relation is gradient.relation is NeighboringRelation.ADD_OR_REMOVE_ONE
        assert fit.event.sampling_probability == pytest.approx(4 / 6) and fit.count == 3
        assert all(r.metadata["min_samples"] == 6 and "n" not in r.metadata for r in records)


def test_the_record_level_descriptor_is_the_clipped_mean_of_the_whole_split_plus_the_declared_noise(noise_floor_lifted):
    clients = [_client(0, n=12)]
    tiny = TrainingPrivacy(mode="record", noise_multiplier=1e-9, clip=0.6, noise="seeded", min_samples=6)
    runtime, _ = _private_runtime(clients, tiny)
    runtime.begin_round(0, [0])
    replies = runtime.exchange(0, 0, runtime.strategy.configure_train(0, [0]))
    with torch.no_grad():
        expected = runtime.strategy.embedding.descriptor(clients[0].x_train, clients[0].y_train, bound=0.5)
    assert torch.allclose(replies[0].arrays["descriptor"], expected, atol=1e-6)


def test_the_record_level_embedding_gradient_is_the_true_one_when_noise_and_clipping_vanish(noise_floor_lifted):
    """z -> 0, a clip no gradient reaches: the clipped, noised per-record mean is the chain rule of line 14."""
    clients = [_client(0, n=12)]
    results = []
    for privacy in (TrainingPrivacy(mode="record", noise_multiplier=1e-9, clip=1e3, noise="seeded", min_samples=6),
                    None):
        if privacy is None:
            runtime = _runtime(clients, grad_clip=0.0, descriptor_batch=12)
        else:
            runtime, _ = _private_runtime(clients, privacy, bound=1e3, descriptor_batch=12)
        runtime.begin_round(0, [0])
        replies = runtime.exchange(0, 0, runtime.strategy.configure_train(0, [0]))
        replies = runtime.exchange(0, 1, runtime.strategy.configure_stage(0, 1, replies))
        down = runtime.strategy.configure_stage(0, 2, replies)
        down[0].arrays["descriptor_grad"] = torch.tensor([0.3, -0.2, 0.5])      # the same cotangent for both
        results.append(runtime.exchange(0, 2, down)[0].arrays)
    for name in results[1]:
        assert torch.allclose(results[0][name], results[1][name], atol=1e-5, rtol=1e-4), name
    assert any(float(v.abs().max()) > 1e-3 for v in results[1].values())


def test_a_target_epsilon_is_spent_exactly_over_the_planned_rounds():
    clients = [_client(0, n=12), _client(1, n=30, seed=1)]
    runtime, _ = _private_runtime(clients, TrainingPrivacy(mode="record", epsilon=4.0, clip=0.6, min_samples=6),
                                  local_steps=2, batch_size=4)
    for r in range(2):
        runtime.run_round(r)
    for c in clients:
        assert runtime.wire.ledgers[c.client_id].spent(1e-5).epsilon == pytest.approx(4.0, rel=1e-2)


def test_record_level_refuses_the_batch_clip_and_a_client_below_min_samples_without_its_size(make_spec):
    with pytest.raises(ConfigError, match="grad_clip=50.0 clips each local step's batch gradient"):
        RunConfig(federation=make_spec(), method="pefll", privacy=RECORD, select="last")
    with pytest.raises(ConfigError, match="grad_clip=50.0 clips each local step's batch gradient"):
        get_method("pefll").client(model_factory=FACTORY, config=get_method("pefll").make_config(**SMALL),
                                   privacy=RECORD)
    runtime, _ = _private_runtime([_client(0, n=4)], RECORD)
    with pytest.raises(ConfigError, match="fewer labelled records than the public lower bound min_samples=6") as err:
        runtime.run_round(0)
    assert " 4 " not in str(err.value) and len(runtime.wire.ledgers[0]) == 0


def test_central_dp_steps_both_networks_from_the_noisy_mean_and_never_serves_another_client_s_descriptor():
    runtime = _runtime([_client(0), _client(1, seed=1)])
    strategy = runtime.strategy
    runtime.begin_round(0, [0, 1])
    replies = runtime.exchange(0, 0, strategy.configure_train(0, [0, 1]))
    replies = runtime.exchange(0, 1, strategy.configure_stage(0, 1, replies))
    replies = runtime.exchange(0, 2, strategy.configure_stage(0, 2, replies))
    contributions = dict(strategy.contributions(0, replies))
    assert set(contributions[0]) == set(strategy.contribution_shapes())
    for cid in (0, 1):
        expected, _ = backprop_weight_change(strategy.hnet, *strategy._round["hnet_grads"].inputs(cid))
        assert all(torch.equal(contributions[cid]["hnet." + k], v) for k, v in expected.items())
        assert all(torch.equal(contributions[cid]["embed." + k], replies[cid].arrays["embed." + k])
                   for k, _ in strategy.embedding.named_parameters())
    # line 18 from the noisy mean: g = mean + 2 lambda eta, joint clip, one Adam step, nothing else
    mean = {k: 0.01 * torch.ones_like(v) for k, v in strategy.contribution_shapes().items()}
    cfg = strategy.config
    groups = [{f"{prefix}.{n}": p.detach().clone().requires_grad_(True) for n, p in network.named_parameters()}
              for prefix, network in (("hnet", strategy.hnet), ("embed", strategy.embedding))]
    for group, lam in zip(groups, (cfg.lambda_h, cfg.lambda_v)):
        for name, p in group.items():
            p.grad = mean[name] + 2 * lam * p.detach()
    copies = [*groups[0].values(), *groups[1].values()]
    torch.nn.utils.clip_grad_norm_(copies, cfg.server_grad_clip)
    torch.optim.Adam([{"params": list(groups[0].values())}, {"params": list(groups[1].values())}],
                     lr=cfg.server_lr).step()
    strategy.apply_mean(0, mean, 1.5)
    named = [*strategy.hnet.named_parameters(prefix="hnet"), *strategy.embedding.named_parameters(prefix="embed")]
    for name, p in named:
        assert torch.allclose(p, groups[0].get(name, groups[1].get(name)), atol=1e-7), name
    # a training client that never trained gets h(0), not h(mean of the others' descriptors), once the aggregator
    # of central DP has marked the strategy's per-client state confidential
    strategy.confidential = True
    zero = strategy.generate(torch.zeros(strategy.embed_dim))
    assert all(torch.equal(strategy.configure_evaluate(7).arrays[k], v) for k, v in zero.items())


# -- end to end ------------------------------------------------------------------------------------------------------


def test_train_end_to_end_records_every_release_and_resumes_to_the_same_numbers(make_spec, tmp_path):
    settings = {**SMALL, "local_steps": 3, "lr": 0.05, "server_lr": 1e-2}
    config = RunConfig(federation=make_spec(), method="pefll", method_config=settings, rounds=4, eval_every=2,
                       checkpoint_every=1, client_fraction=0.35, seed=3, select="last")
    summary = train(config, str(tmp_path / "full"), progress=False)
    assert summary["rounds_completed"] == 4 and summary["training_val"]["num_clients"] == 9
    assert summary["novel"]["num_clients"] == 0        # unlabelled novel clients are not served (no descriptor)
    assert summary["training_val"]["accuracy_mean"] > 0
    ledger = json.loads((tmp_path / "full" / "ledger.json").read_text())
    assert ledger  # written
    assert summary["privacy"]["epsilon_max_training"] == float("inf")

    from privfl.experiment import RunInterrupted
    with pytest.raises(RunInterrupted):
        train(config, str(tmp_path / "resumed"), progress=False, stop_after_round=2)
    resumed = train(config, str(tmp_path / "resumed"), resume=True, progress=False)
    assert resumed["training_val"] == summary["training_val"]

    federation = build_federation(config.federation, seed=3)
    runtime = build_runtime(config, federation)
    from privfl.federation.rundir import RunDirectory
    runtime.load_state_dict(RunDirectory(str(tmp_path / "full")).load_checkpoint()["runtime"])
    other = build_runtime(config, federation)
    other.load_state_dict(RunDirectory(str(tmp_path / "resumed")).load_checkpoint()["runtime"])
    for (name, a), b in zip(runtime.strategy.hnet.state_dict().items(), other.strategy.hnet.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_diverged_round_is_refused_before_the_server_steps_so_the_networks_stay_finite():
    def client(cid, seed, n=40):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(n + 4, 4, generator=g) * 50, torch.randint(0, 3, (n + 4,), generator=g)
        return TrainingClient(cid, x[:n], y[:n], x[n:], y[n:])

    spec = get_method("pefll")
    cfg = spec.make_config(hidden_dim=8, n_hidden=1, embed_dim=3, lr=50.0, grad_clip=0.0, local_steps=20)
    factory = ModelFactory("mlp2nn", (4,), 3)
    strategy = spec.strategy(model_factory=factory, config=cfg, seed=0, num_training_clients=2)
    runtime = InProcessRuntime(strategy=strategy, client=spec.client(model_factory=factory, config=cfg),
                               training_clients=[client(0, 1), client(1, 2)], seed=0)
    before = runtime.strategy.state_dict()
    with pytest.raises(TrainingDivergedError,
                       match=r"round 0: PeFLL training diverged \(non-finite gradients from clients \[0, 1\]\); "
                             r"lower lr \(now 50.0\)"):
        runtime.run_round(0)
    after = runtime.strategy.state_dict()
    for part in ("hypernetwork", "embedding"):
        assert all(torch.equal(before[part][k], after[part][k]) for k in before[part])


# -- generating only the head (the rest shared, FedAvg's step; privfl.methods.shared_part) ----------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_with_a_generated_head_the_shared_part_moves_by_exactly_the_mean_change_and_the_state_keeps_it(momentum):
    clients = [_client(0), _client(1, seed=1)]
    settings = {"generated": "head", "shared_lr": 0.7, "shared_momentum": momentum, "local_steps": 2}
    runtime = _runtime(clients, **settings)
    strategy = runtime.strategy
    names = [n for n, _ in FACTORY().named_parameters()]
    assert list(strategy.hnet.shapes) == ["fc3.weight", "fc3.bias"] and list(strategy.shared_part) == names[:-2]
    weights = strategy.generate(torch.zeros(strategy.embed_dim))
    assert list(weights) == names
    assert all(torch.equal(weights[k], v.cpu()) for k, v in strategy.shared_part.values.items())
    seen, stage = {}, strategy.configure_stage

    def spy(round, index, replies):   # stage 2 answers the weight changes
        if index == 2:
            seen[round] = {cid: {k: v.clone() for k, v in m.arrays.items()} for cid, m in replies.items()}
        return stage(round, index, replies)

    strategy.configure_stage = spy
    start = strategy.shared_part.snapshot()
    hnet_before = {k: v.clone() for k, v in strategy.hnet.state_dict().items()}
    runtime.run_round(0)
    after_one = strategy.shared_part.snapshot()
    runtime.run_round(1)
    m0, m1 = ({k: (seen[r][0][k] + seen[r][1][k]) / 2 for k in start} for r in (0, 1))
    for k in start:   # b0 = m0; shared -= 0.7 b0; b1 = mu b0 + m1; shared -= 0.7 b1 (beside Adam, which moves h)
        torch.testing.assert_close(after_one[k], start[k] - 0.7 * m0[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(strategy.shared_part.values[k],
                                   after_one[k] - 0.7 * (momentum * m0[k] + m1[k]), rtol=0, atol=1e-6)
    assert (sorted(strategy.shared_part.momentum) == sorted(start)) == (momentum > 0)
    # h reads only the head of each change
    v = strategy.descriptors[0]
    change = seen[1][0]
    head_only = {k: t if k.startswith("fc3.") else torch.zeros_like(t) for k, t in change.items()}
    full, part = (backprop_weight_change(strategy.hnet, v, c) for c in (change, head_only))
    assert torch.equal(full[1], part[1]) and all(torch.equal(full[0][k], part[0][k]) for k in full[0])
    assert any(not torch.equal(t, hnet_before[k]) for k, t in strategy.hnet.state_dict().items())
    state = strategy.state_dict()
    assert sorted(state["shared"]) == sorted(start) and "shared_momentum" in strategy.training_only
    again = _runtime(clients, **settings).strategy
    again.load_state_dict(state)
    assert all(torch.equal(again.shared_part.values[k], strategy.shared_part.values[k]) for k in start)
    assert all(torch.equal(a, b) for a, b in zip(again.configure_evaluate(0).arrays.values(),
                                                  strategy.configure_evaluate(0).arrays.values(), strict=True))


def test_generating_everything_is_pefll_with_no_shared_part():
    strategy = _runtime([_client(0)]).strategy
    assert strategy.config.generated == "all" and not strategy.shared_part and "shared" not in strategy.state_dict()


@pytest.mark.parametrize("bad, match", [
    ({"generated": "trunk"}, "generated must be one of all, head, head_bias, got 'trunk'"),
    ({"shared_lr": float("inf")}, "shared_lr must be a finite number > 0, got inf"),
    ({"shared_momentum": 1.0}, r"shared_momentum must be in \[0, 1\), got 1.0"),
])
def test_bad_generated_settings_are_refused_naming_the_value_and_the_valid_ones(bad, match):
    with pytest.raises(ConfigError, match=match):
        PeFLLConfig(**bad)
