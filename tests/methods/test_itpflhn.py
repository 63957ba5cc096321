"""IT-PFL-HN (two-phase ODPFL-HN): encoder regression, fine-tuning, serving, ledgers, runs."""

import math

import pytest
import torch

from accounting import ComposedEvent, analytic_gaussian_sigma  # noqa: E402  (after privfl, as in test_pefll)
from accounting import epsilon as accounting_epsilon  # noqa: E402
from privfl.config import RunConfig
from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError, TrainingDivergedError
from privfl.experiment import RunInterrupted, train
from privfl.federation import InProcessRuntime, Message, RunDirectory
from privfl.federation.context import client_context
from privfl.methods import ModelFactory, get_method
from privfl.methods.itpflhn import make_encoder
from privfl.models import DeepSetEncoder, DPDeepSetEncoder, functional_forward
from privfl.modes.wrappers import protect
from privfl.privacy.record import round_event
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


FACTORY = ModelFactory("mlp2nn", (3,), 2)
SMALL = {"hidden_dim": 4, "n_hidden": 1, "embed_dim": 3, "encoder_options": {"hidden": 8}, "lr": 0.1,
         "local_steps": 2, "batch_size": 8}


def make(num_clients=4, **settings):
    spec = get_method("itpflhn")
    config = spec.make_config(**{**SMALL, **settings})
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=num_clients)
    return strategy, spec.client(model_factory=FACTORY, config=config)


def client(cid, n=16, shift=0.0):
    g = torch.Generator().manual_seed(200 + cid)
    x = torch.randn(n, 3, generator=g) + shift
    y = (x[:, 1] > shift).long()
    return TrainingClient(client_id=cid, x_train=x, y_train=y, x_val=x[:4], y_val=y[:4])


def runtime(clients, fraction=1.0, **settings):
    strategy, proc = make(num_clients=len(clients), **settings)
    return InProcessRuntime(strategy=strategy, client=proc, training_clients=clients, seed=0,
                            client_fraction=fraction), strategy, proc


def encode(strategy, weights, x):
    encoder = make_encoder(strategy.config, FACTORY.input_shape, strategy.embed_dim)
    encoder.load_state_dict(weights)
    with torch.no_grad():
        return encoder(x)


def test_phase_one_regresses_the_encoder_onto_the_embedding_rows():
    clients = [client(i, shift=2.0 * i) for i in range(4)]
    rt, strategy, _ = runtime(clients, phase1_rounds=50, encoder_lr=0.02, encoder_steps=10)
    init_encoder = {k: v.clone() for k, v in strategy.encoder_weights.items()}
    init_gap = [float((encode(strategy, init_encoder, c.x_train) - strategy.embedding(c.client_id)).pow(2).sum())
                for c in clients]
    for r in range(8):
        rt.run_round(r)
    gap = [float((encode(strategy, strategy.encoder_weights, c.x_train) - strategy.embedding(c.client_id))
                 .pow(2).sum()) for c in clients]
    assert sum(gap) < 0.35 * sum(init_gap), (gap, init_gap)        # 0.23 with this seed
    # phase-1 rounds are pFedHN then the regression, each a recorded release
    assert [r.purpose for r in rt.wire.ledgers[1].records[:2]] == ["weight_change", "encoder_update"]


def test_a_diverging_encoder_regression_is_refused_naming_encoder_lr():
    clients = [client(i, shift=50.0 * i) for i in range(4)]      # large inputs: lr 1e3 overflows at once
    rt, strategy, _ = runtime(clients, phase1_rounds=50, encoder_lr=1e3, encoder_steps=10)
    before = {k: v.clone() for k, v in strategy.encoder_weights.items()}
    with pytest.raises(TrainingDivergedError, match=r"encoder regression diverged.*encoder_lr \(now 1000.0\)"):
        for r in range(3):
            rt.run_round(r)
    assert all(bool(torch.isfinite(v).all()) for v in strategy.encoder_weights.values())
    assert set(strategy.encoder_weights) == set(before)


def test_the_encoder_update_is_the_data_size_weighted_mean_of_the_clients_changes():
    strategy, _ = make(hn_weight_decay=0.0)
    before = {k: v.clone() for k, v in strategy.encoder_weights.items()}
    hn_before = strategy.hypernetwork_state()
    down = strategy.configure_train(0, [1, 2])
    zero = {k: torch.zeros_like(v) for k, v in down[1].arrays.items()}
    stage1 = strategy.configure_stage(0, 1, {cid: Message(arrays=zero, metrics={"num_examples": 5.0, "loss": 0.0})
                                             for cid in (1, 2)})
    # stage 1 sends the encoder and the row the round's model came from (before this round's update)
    assert torch.equal(stage1[2].arrays["embedding"], strategy.embedding(2))
    assert torch.equal(stage1[2].subset("encoder/")["psi.2.bias"], before["psi.2.bias"])

    def const(value):
        return {k: torch.full_like(v, value) for k, v in before.items()}

    strategy.aggregate_train(0, {1: Message(arrays=const(1.0), metrics={"num_examples": 10.0, "encoder_loss": 1.0}),
                                 2: Message(arrays=const(4.0), metrics={"num_examples": 30.0, "encoder_loss": 2.0})})
    for k in before:                       # (10 * 1 + 30 * 4) / 40 = 3.25
        assert torch.allclose(strategy.encoder_weights[k], before[k] + 3.25)
    # a zero weight change with no weight decay leaves the hypernetwork where it was
    assert all(torch.equal(v, hn_before[k]) for k, v in strategy.hypernetwork_state().items())


def test_phase_two_fine_tunes_only_the_hypernetwork_and_training_clients_keep_the_pre_fine_tune_one():
    clients = [client(i, shift=float(i)) for i in range(3)]
    rt, strategy, proc = runtime(clients, phase1_rounds=2, finetune_lr=0.05)
    rt.run_round(0)
    rt.run_round(1)
    end_of_phase1 = strategy.hypernetwork_state()
    rows = {cid: row.clone() for cid, row in strategy.embeddings.items()}
    encoder = {k: v.clone() for k, v in strategy.encoder_weights.items()}
    assert strategy.pre_finetune is None
    rt.run_round(2)
    rt.run_round(3)
    assert all(torch.equal(strategy.pre_finetune[k], v) for k, v in end_of_phase1.items())
    assert any(not torch.equal(v, end_of_phase1[k]) for k, v in strategy.hypernetwork_state().items())
    assert all(torch.equal(strategy.embeddings[cid], row) for cid, row in rows.items())
    assert all(torch.equal(strategy.encoder_weights[k], v) for k, v in encoder.items())
    # phase-2 rounds: descriptor up, model down, weight change up
    assert [r.purpose for r in rt.wire.ledgers[0].records] == ["weight_change", "encoder_update"] * 2 + [
        "descriptor", "weight_change"] * 2
    # training clients are scored with f_pre(e_i), not the fine-tuned hypernetwork
    x = torch.randn(6, 3)
    model = rt.training_client_model(1)
    pre = torch.func.functional_call(strategy.hnet, end_of_phase1, (rows[1],))
    assert torch.allclose(model(x), functional_forward(FACTORY(), pre, x), atol=1e-6)
    assert not torch.allclose(model(x), functional_forward(FACTORY(), strategy.hnet(rows[1]), x), atol=1e-4)


def test_phase_two_gradient_goes_through_the_descriptor_the_client_sent():
    """One plain full-batch SGD step: theta moves by -finetune_lr * eta * dL/dtheta at w = f(g(X_i))."""
    c = client(4)
    eta = 0.2
    rt, strategy, _ = runtime([c], phase1_rounds=0, lr=eta, local_steps=1, batch_size=64, momentum=0.0,
                              weight_decay=0.0, grad_clip=None, server_grad_clip=None, hn_momentum=0.0,
                              hn_weight_decay=0.0, finetune_lr=0.5)
    descriptor = encode(strategy, strategy.encoder_weights, c.x_train)
    params = dict(strategy.hnet.named_parameters())
    loss = torch.nn.functional.cross_entropy(functional_forward(FACTORY(), strategy.hnet(descriptor), c.x_train),
                                             c.y_train)
    true = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    before = {k: v.detach().clone() for k, v in params.items()}
    rt.run_round(0)
    for name in params:
        assert torch.allclose(strategy.last_gradients["hypernetwork"][name], eta * true[name], rtol=1e-4, atol=1e-7)
        assert torch.allclose(params[name].detach(), before[name] - 0.5 * eta * true[name], rtol=1e-4, atol=1e-6)
    assert strategy.last_gradients["embeddings"] == {} and strategy.embeddings == {}


@pytest.mark.parametrize("encoder, cls", [("deepset", DeepSetEncoder), ("dp_deepset", DPDeepSetEncoder)])
def test_a_novel_client_releases_exactly_one_descriptor_and_gets_the_fine_tuned_model(encoder, cls):
    rt, strategy, proc = runtime([client(0), client(1)], phase1_rounds=1, encoder=encoder)
    rt.run_round(0)
    rt.run_round(1)
    novel = NovelClient(42, torch.randn(25, 3, generator=torch.Generator().manual_seed(5)))
    model = rt.novel_client_model(novel)
    records = rt.wire.ledgers[42].records
    assert [r.purpose for r in records] == ["descriptor"] and records[0].round is None
    assert records[0].metadata["bytes"] == strategy.embed_dim * 4        # one float32 descriptor, nothing else
    assert math.isinf(rt.wire.ledgers.epsilons(1e-5)[42])                # sent without noise: recorded as such
    assert isinstance(proc.encoder_from(strategy.novel_request(42)), cls)
    descriptor = encode(strategy, strategy.encoder_weights, novel.x)
    x = torch.randn(5, 3)
    assert torch.allclose(model(x), functional_forward(FACTORY(), strategy.hnet(descriptor), x), atol=1e-6)


def test_a_malformed_descriptor_is_refused():
    strategy, _ = make()
    with pytest.raises(ConfigError, match="shape \\(2,\\)"):
        strategy.novel_reply(9, Message(arrays={"descriptor": torch.zeros(2)}))
    with pytest.raises(ConfigError, match="sent none"):
        strategy.novel_reply(9, None)


@pytest.mark.parametrize("bad, match", [
    ({"encoder": "lstm"}, "unknown encoder 'lstm'; valid choices: deepset, dp_deepset, dss, set_transformer"),
    ({"encoder_options": {"width": 3}}, "encoder_options must be a dict of options of 'deepset': hidden"),
    ({"encoder_steps": 0}, "encoder_steps must be an integer >= 1, got 0"),
    ({"phase1_rounds": -1}, "phase1_rounds must be an integer >= 0, got -1"),
    ({"finetune_lr": 0.0}, "finetune_lr must be None \\(hn_lr\\) or a finite number > 0, got 0.0"),
])
def test_bad_settings_raise_naming_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        get_method("itpflhn").make_config(**bad)



# -- generating only the head (the rest shared, FedAvg's step; privfl.methods.shared_part) ----------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_with_a_generated_head_the_shared_part_moves_by_the_mean_change_in_both_phases_and_serves_from_phase_1(
        momentum):
    clients = [client(0), client(1, shift=0.5)]
    rt, strategy, proc = runtime(clients, generated="head", shared_lr=0.7, shared_momentum=momentum, grad_clip=None,
                                 phase1_rounds=1)
    names = [n for n, _ in FACTORY().named_parameters()]
    assert list(strategy.hnet.shapes) == ["fc3.weight", "fc3.bias"] and list(strategy.shared_part) == names[:-2]
    seen = {}
    stage, aggregate = strategy.configure_stage, strategy.aggregate_train

    def copies(replies):
        return {cid: {k: v.clone() for k, v in m.arrays.items()} for cid, m in replies.items()}

    def stage_spy(round, index, replies):   # phase 1: the weight changes come back before stage 1
        if not strategy.in_phase2(round):
            seen[round] = copies(replies)
        return stage(round, index, replies)

    def aggregate_spy(round, replies):      # phase 2: they are the round's last replies
        if strategy.in_phase2(round):
            seen[round] = copies(replies)
        return aggregate(round, replies)

    strategy.configure_stage, strategy.aggregate_train = stage_spy, aggregate_spy
    start = strategy.shared_part.snapshot()
    rt.run_round(0)
    after_one = strategy.shared_part.snapshot()
    rt.run_round(1)
    m0, m1 = ({k: (seen[r][0][k] + seen[r][1][k]) / 2 for k in start} for r in (0, 1))
    for k in start:   # phase 1: shared -= 0.7 m0; phase 2 starts its momentum afresh: shared -= 0.7 m1
        torch.testing.assert_close(after_one[k], start[k] - 0.7 * m0[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(strategy.shared_part.values[k], after_one[k] - 0.7 * m1[k], rtol=0, atol=1e-6)
    # training clients are served the pre-fine-tune hypernetwork with the end-of-phase-1 shared part
    served = strategy.configure_evaluate(1).arrays
    assert list(served) == names and all(torch.equal(served[k], after_one[k].cpu()) for k in start)
    state = strategy.state_dict()
    assert sorted(state["shared"]) == sorted(start) and sorted(state["pre_finetune_shared"]) == sorted(start)
    again, _ = make(num_clients=2, generated="head", shared_lr=0.7, shared_momentum=momentum, phase1_rounds=1)
    again.load_state_dict(state)
    assert all(torch.equal(again.shared_part.values[k], strategy.shared_part.values[k]) for k in start)
    assert all(torch.equal(a, b) for a, b in zip(again.configure_evaluate(1).arrays.values(), served.values(),
                                                  strict=True))


@pytest.mark.parametrize("bad, match", [
    ({"generated": "trunk"}, "generated must be one of all, head, head_bias, got 'trunk'"),
    ({"shared_lr": -1.0}, "shared_lr must be a finite number > 0, got -1.0"),
    ({"shared_momentum": -0.1}, r"shared_momentum must be in \[0, 1\), got -0.1"),
])
def test_bad_generated_settings_are_refused_naming_the_value_and_the_valid_ones(bad, match):
    with pytest.raises(ConfigError, match=match):
        get_method("itpflhn").make_config(**bad)


# -- the privacy layer ---------------------------------------------------------------------------------------------

DP = {"encoder": "dp_deepset", "grad_clip": None}


NOVEL_PRIVACY = NovelPrivacy(bound=0.5)


def private_runtime(clients, privacy, rounds=2, novel_privacy=NOVEL_PRIVACY, **settings):
    """IT-PFL-HN under ``privacy`` as :func:`privfl.config.build_method` builds it (every client every round)."""
    spec = get_method("itpflhn")
    config = spec.make_config(**{**SMALL, **DP, **settings})
    strategy = spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=len(clients))
    proc = spec.client(model_factory=FACTORY, config=config, privacy=privacy, participations=rounds,
                       novel_privacy=novel_privacy)
    strategy, wrapped = protect(spec, strategy, proc, privacy, rounds=rounds, client_fraction=1.0, seed=0,
                                num_training_clients=len(clients))
    return InProcessRuntime(strategy=strategy, client=wrapped, training_clients=clients, seed=0), proc


RECORD = TrainingPrivacy(mode="record", noise_multiplier=1.2, clip=0.7, noise="seeded", noise_seed=4, min_samples=6)


def test_record_level_rounds_record_the_declared_events_phase_one_exactly_and_phase_two_within_it():
    clients = [client(0, n=16), client(1, n=24)]
    rt, proc = private_runtime(clients, RECORD, phase1_rounds=1, encoder_steps=3)
    rt.run_round(0)
    rt.run_round(1)
    for c in clients:
        records = rt.wire.ledgers[c.client_id].records
        assert [r.purpose for r in records] == ["weight_change", "encoder_update", "descriptor", "weight_change"]
        declared = proc.round_event(1.2)
        assert ComposedEvent(tuple(r.event for r in records[:2])) == declared
        # each regression step: phi's mean (2B / min_samples) and phi's gradient (2C / min_samples), both at z = 1.2
        mean, gradient = records[1].event.event.events
        assert (mean.sensitivity, mean.sigma, records[1].event.count) == pytest.approx((2 * 0.5 / 6, 1.2 / 6, 3))
        assert (gradient.sensitivity, gradient.sigma) == pytest.approx((2 * 0.7 / 6, 1.2 * 1.4 / 6))
        phase2 = ComposedEvent(tuple(r.event for r in records[2:]))
        assert phase2 == round_event(proc.phase2_releases(), 1.2)
        assert accounting_epsilon(phase2, 1e-5) < accounting_epsilon(declared, 1e-5)
        assert all(r.metadata.get("min_samples") == 6 or r.purpose == "weight_change" for r in records)


def test_a_target_epsilon_is_spent_exactly_over_phase_one_rounds_and_is_not_exceeded_with_phase_two():
    clients = [client(0, n=16), client(1, n=24)]
    for phase1_rounds, check in ((2, lambda eps: eps == pytest.approx(2.0, rel=1e-2)), (1, lambda eps: eps < 1.9)):
        privacy = TrainingPrivacy(mode="record", epsilon=2.0, clip=0.7, noise="seeded", min_samples=6)
        rt, _ = private_runtime(clients, privacy, phase1_rounds=phase1_rounds, encoder_steps=1)
        rt.run_round(0)
        rt.run_round(1)
        spent = [rt.wire.ledgers[c.client_id].spent(1e-5).epsilon for c in clients]
        assert all(check(eps) for eps in spent), (phase1_rounds, spent)


def test_the_private_regression_step_is_the_regression_gradient_when_noise_and_clipping_vanish(noise_floor_lifted):
    """z -> 0 and a clip no norm reaches: the two releases of each step give the exact regression gradient (the
    cotangent is taken at the noisy mean, which is then the true one)."""
    clients = [client(0, n=12)]
    tiny = TrainingPrivacy(mode="record", noise_multiplier=1e-9, clip=1e3, noise="seeded", min_samples=6)
    changes = []
    for privacy in (tiny, None):
        if privacy is None:
            rt, strategy, proc = runtime(clients, **DP, encoder_steps=2)
        else:
            rt, proc = private_runtime(clients, privacy, novel_privacy=NovelPrivacy(bound=1e3), encoder_steps=2)
            strategy = rt.strategy
        message = strategy.configure_train(0, [0])
        stage = strategy.configure_stage(0, 1, {0: Message(arrays={k: torch.zeros_like(v) for k, v in
                                                                   message[0].arrays.items()})})
        ctx = client_context(0, 0, 0, 1)
        release = (proc.private_encoder_regression(clients[0], stage[0], ctx) if privacy is not None
                   else proc.encoder_regression(clients[0], stage[0]))
        changes.append(release.message.arrays)
    for name in changes[1]:
        assert torch.allclose(changes[0][name], changes[1][name], atol=1e-5, rtol=1e-4), name
    assert any(float(v.abs().max()) > 1e-3 for v in changes[1].values())


def test_record_level_and_private_novel_clients_refuse_an_encoder_that_is_not_a_clipped_mean(make_spec):
    spec = get_method("itpflhn")
    record = TrainingPrivacy(mode="record", noise_multiplier=1.0)
    refusal = "itpflhn with privacy mode 'record' .* encoder='deepset' cannot be made private: its max-pooled half"
    with pytest.raises(ConfigError, match=refusal):      # before the run: the run's config refuses it
        RunConfig(federation=make_spec(), method="itpflhn", method_config={"grad_clip": None}, privacy=record,
                  select="last")
    config = spec.make_config(**SMALL, grad_clip=None)      # the mean+max DeepSet
    with pytest.raises(ConfigError, match=refusal):      # and so does a client built without one
        spec.client(model_factory=FACTORY, config=config, privacy=record)
    with pytest.raises(ConfigError, match="itpflhn with novel_privacy .* encoder='set_transformer'"):
        spec.client(model_factory=FACTORY, config=spec.make_config(**{**SMALL, "encoder": "set_transformer",
                                                                      "encoder_options": {}}),
                    novel_privacy=NovelPrivacy(epsilon=1.0))


def test_a_private_novel_descriptor_has_the_analytic_sigma_for_2b_over_n_and_spends_the_novel_epsilon():
    rt, proc = private_runtime([client(0), client(1)], TrainingPrivacy(), rounds=1, phase1_rounds=1,
                               novel_privacy=NovelPrivacy(epsilon=2.0, delta=1e-6, bound=0.5, noise="seeded"))
    rt.run_round(0)
    novel = NovelClient(42, torch.randn(25, 3, generator=torch.Generator().manual_seed(5)))
    rt.novel_client_model(novel)
    (record,) = rt.wire.ledgers[42].records
    assert record.purpose == "descriptor" and record.event.sensitivity == pytest.approx(2 * 0.5 / 25)
    assert record.event.sigma == pytest.approx(analytic_gaussian_sigma(2.0, 1e-6, 2 * 0.5 / 25), rel=1e-12)
    assert rt.wire.ledgers[42].spent(1e-6).epsilon == pytest.approx(2.0, rel=1e-3)


def test_central_dp_moves_the_encoder_by_the_noisy_mean_in_phase_one_and_not_at_all_in_phase_two():
    strategy, _ = make(**DP, phase1_rounds=1)
    messages = strategy.configure_train(0, [0, 1])
    changes = {cid: Message(arrays={k: torch.ones_like(v) for k, v in messages[cid].arrays.items()}) for cid in (0, 1)}
    stage = strategy.configure_stage(0, 1, changes)
    encoder_changes = {cid: Message(arrays={k: torch.full_like(v, float(cid + 1)) for k, v in
                                            strategy.encoder_weights.items()}) for cid in stage}
    contributions = dict(strategy.contributions(0, encoder_changes))
    assert set(contributions[1]) == set(strategy.contribution_shapes())
    assert all(torch.equal(contributions[1]["enc." + k], torch.full_like(v, 2.0))
               for k, v in strategy.encoder_weights.items())
    before = {k: v.clone() for k, v in strategy.encoder_weights.items()}
    mean = {k: torch.full_like(v, 0.25) for k, v in strategy.contribution_shapes().items()}
    strategy.apply_mean(0, mean, 1.5)
    assert all(torch.allclose(strategy.encoder_weights[k], before[k] + 0.25) for k in before)
    # phase 2: the encoder is frozen, its part of a contribution is zeros, and the noisy mean's part is ignored
    messages = strategy.configure_train(1, [0])
    descriptors = {0: Message(arrays={"descriptor": torch.zeros(strategy.embed_dim)})}
    generated = strategy.configure_stage(1, 1, descriptors)
    weight_changes = {0: Message(arrays={k: torch.ones_like(v) for k, v in generated[0].arrays.items()})}
    (cid, contribution), = strategy.contributions(1, weight_changes)
    assert all(float(contribution["enc." + k].abs().max()) == 0 for k in strategy.encoder_weights)
    frozen = {k: v.clone() for k, v in strategy.encoder_weights.items()}
    strategy.apply_mean(1, mean, 1.5)
    assert all(torch.equal(strategy.encoder_weights[k], frozen[k]) for k in frozen)


def _run_config(make_spec, **overrides):
    values = dict(federation=make_spec(), method="itpflhn",
                  method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16, "hn_lr": 0.05, "hidden_dim": 4,
                                 "n_hidden": 1, "embed_dim": 3, "encoder_options": {"hidden": 8},
                                 "phase1_rounds": 3},
                  rounds=5, eval_every=2, checkpoint_every=2, seed=3, select="last")
    values.update(overrides)
    return RunConfig(**values)


def test_end_to_end_run_serves_novel_clients_through_one_descriptor_each(tmp_path, make_spec):
    summary = train(_run_config(make_spec), str(tmp_path / "run"), progress=False)
    assert summary["novel"]["num_clients"] == 3 and summary["training_val"]["num_clients"] == 9
    assert summary["training_val"]["accuracy_mean"] > 40.0 and summary["novel"]["accuracy_mean"] > 30.0
    rows = RunDirectory(tmp_path / "run").read_clients()
    assert all(math.isinf(float(r["epsilon"])) for r in rows)
    novel_up = [int(r["bytes_up"]) for r in rows if r["role"] == "novel"]
    assert novel_up == [3 * 4] * 3


def test_interrupted_in_phase_two_then_resumed_equals_uninterrupted(tmp_path, make_spec):
    cfg = _run_config(make_spec, client_fraction=0.5, checkpoint_every=2, select="best_val")
    full = train(cfg, str(tmp_path / "full"), progress=False)
    with pytest.raises(RunInterrupted):
        train(cfg, str(tmp_path / "cut"), progress=False, stop_after_round=4)     # after one phase-2 round
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    for key in ("novel", "training_val", "selected_round"):
        assert resumed[key] == full[key], key
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]
    b = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]
    assert "pre_finetune" in a and a.keys() == b.keys()
    assert all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])
