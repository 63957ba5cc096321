"""FedTTA, FedTTA-Prox, FedTTA++: the meta-gradient, the test-time adaptation, the protocol and every privacy mode."""

import dataclasses
import functools
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import Bias
from torch import nn

from accounting import (
    BudgetExceededError,
    GaussianEvent,
    NeighboringRelation,
    NonPrivateEvent,
    analytic_gaussian_sigma,
)
from privfl.config import RunConfig
from privfl.data import build_federation
from privfl.errors import ConfigError
from privfl.experiment import build_runtime
from privfl.federation import ClientContext, Message
from privfl.methods import ModelFactory, get_method
from privfl.methods.fedtta import (
    AdaptationModel,
    MetaLearner,
    adapt,
    meta_loss,
    personalization_loss,
    prediction_entropy,
    proxy_kl,
    record_meta_losses,
)
from privfl.privacy.per_sample import ClippedGradientSum, flat_views
from privfl.privacy.training import TrainingPrivacy, dp_sgd_round_event


class Margin(nn.Module):
    """g(z) = z_1 - z_2 - c per sample, so l_per = sqrt(B) |b_1 - b_2 - c| for the Bias model."""

    def __init__(self, c):
        super().__init__()
        self.lin = nn.Linear(2, 1).double()
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[1.0, -1.0]]))
            self.lin.bias.fill_(-c)

    def forward(self, z):
        return self.lin(z)


def tiny_models(seed=0):
    torch.manual_seed(seed)
    f = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    g = AdaptationModel(3, hidden=4, layers=1).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])
    return f, g, x, y


def test_meta_gradient_matches_finite_differences_for_both_models():
    f, g, x, y = tiny_models()
    psi, phi = dict(f.named_parameters()), dict(g.named_parameters())
    teacher = torch.randn(5, 3, dtype=torch.float64)
    kwargs = dict(inner_lr=0.7, weight_decay=0.01, mu=0.3, teacher_logits=teacher)
    loss, _ = meta_loss(f, g, psi, phi, x, y, **kwargs)
    grads = torch.autograd.grad(loss, list(psi.values()) + list(phi.values()))
    analytic = torch.cat([gr.reshape(-1) for gr in grads])

    def value(flat):
        tensors, start = {}, 0
        for name, p in list(psi.items()) + [("phi." + k, v) for k, v in phi.items()]:
            tensors[name] = flat[start:start + p.numel()].view_as(p)
            start += p.numel()
        p_psi = {k: v for k, v in tensors.items() if not k.startswith("phi.")}
        p_phi = {k[4:]: v for k, v in tensors.items() if k.startswith("phi.")}
        return meta_loss(f, g, p_psi, p_phi, x, y, **kwargs)[0]

    flat = torch.cat([p.detach().reshape(-1) for p in list(psi.values()) + list(phi.values())])
    numeric = torch.zeros_like(flat)
    h = 1e-6
    for i in range(len(flat)):
        up, down = flat.clone().requires_grad_(True), flat.clone().requires_grad_(True)
        with torch.no_grad():
            up[i] += h
            down[i] -= h
        numeric[i] = (value(up) - value(down)).detach() / (2 * h)
    assert torch.allclose(analytic, numeric, atol=1e-6, rtol=1e-5)
    # phi is reached only through the inner gradient (a mixed second derivative): it must not be zero.
    num_psi = sum(p.numel() for p in psi.values())
    assert numeric[num_psi:].abs().max() > 1e-4


def test_a_first_order_inner_step_would_give_phi_no_gradient():
    f, g, x, y = tiny_models(1)
    psi, phi = dict(f.named_parameters()), dict(g.named_parameters())
    loss, _ = meta_loss(f, g, psi, phi, x, y, inner_lr=0.5)
    assert torch.autograd.grad(loss, list(phi.values()))[0].abs().sum() > 0
    # The same loss with the inner gradient detached (what `higher` with track_higher_grads=False computes).
    logits = torch.func.functional_call(f, psi, (x,))
    grads = torch.autograd.grad(personalization_loss(g, phi, logits), list(psi.values()), create_graph=False)
    tilde = {k: p - 0.5 * gr for (k, p), gr in zip(psi.items(), grads)}
    detached = nn.functional.cross_entropy(torch.func.functional_call(f, tilde, (x,)), y)
    assert torch.autograd.grad(detached, list(phi.values()), allow_unused=True)[0] is None


def test_personalization_loss_is_the_norm_over_the_batch_and_the_mean_over_chunks():
    g = Margin(c=0.0)
    phi = dict(g.named_parameters())
    z = torch.tensor([[3.0, 1.0], [0.0, 1.0], [4.0, 0.0], [1.0, 1.0]], dtype=torch.float64)  # g = 2, -1, 4, 0
    assert personalization_loss(g, phi, z).item() == pytest.approx(math.sqrt(4 + 1 + 16))
    assert personalization_loss(g, phi, z.flip(0)).item() == pytest.approx(math.sqrt(21))
    assert personalization_loss(g, phi, z, chunk=2).item() == pytest.approx((math.sqrt(5) + 4.0) / 2)


def test_proxy_kl_direction_hand_values():
    student = torch.log(torch.tensor([[0.5, 0.5]]))
    teacher = torch.log(torch.tensor([[0.9, 0.1]]))
    teacher_student = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    student_teacher = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert float(proxy_kl(student, teacher)) == pytest.approx(teacher_student)
    assert float(proxy_kl(student, teacher, "student_teacher")) == pytest.approx(student_teacher)


def _staircase(patience, steps=50):
    # l_per = 2 |b1 - b2 - c| on 4 samples; each step moves d = b1 - b2 by s = 2 * lr * 2 = 1 towards c = 2.5:
    # d = 0, 1, 2, 3, 2, 3, ... The entropy falls with |d|, so iterate 3 (d = 3) is the lowest; iterate 4 is higher.
    f, g = Bias([0.0, 0.0]), Margin(c=2.5)
    x = torch.zeros(4, 1, dtype=torch.float64)
    return adapt(f, g, dict(f.named_parameters()), dict(g.named_parameters()), x, inner_lr=0.25, steps=steps,
                 patience=patience, chunk=64)


def test_fedtta_pp_returns_the_lowest_entropy_iterate_not_the_unadapted_or_the_last():
    result = _staircase(patience=1)
    d = float(result.weights["b"][0] - result.weights["b"][1])
    assert result.chosen_step == 3 and d == pytest.approx(3.0)
    assert result.steps_taken == 4  # step 4 went back to d = 2: no strict decrease, patience 1 -> stop
    expected = [prediction_entropy(torch.tensor([[v / 2, -v / 2]])) for v in (0.0, 1.0, 2.0, 3.0, 2.0)]
    assert result.entropies == pytest.approx(expected)
    # Patience 2: step 5 returns to d = 3, equal (not lower) entropy, so iterate 3 stays chosen and it stops there.
    result = _staircase(patience=2)
    assert (result.chosen_step, result.steps_taken) == (3, 5)


def test_fedtta_pp_candidates_with_and_without_the_unadapted_model():
    # Start at d = 3 (the lowest entropy): the steps go d = 2, 3, 2, ... so step 1 raises the entropy.
    f, g = Bias([3.0, 0.0]), Margin(c=2.5)
    x = torch.zeros(4, 1, dtype=torch.float64)

    def run(unadapted_candidate):
        return adapt(f, g, dict(f.named_parameters()), dict(g.named_parameters()), x, inner_lr=0.25, steps=50,
                     patience=1, chunk=64, unadapted_candidate=unadapted_candidate)

    code = run(True)       # the released code's candidates: iterate 0 wins and patience 1 stops after step 1
    assert (code.chosen_step, code.steps_taken) == (0, 1)
    assert code.weights["b"].tolist() == [3.0, 0.0]
    paper = run(False)     # the paper's Algorithm 1: only adapted iterates; step 2 (d = 3) beats step 1 (d = 2)
    assert (paper.chosen_step, paper.steps_taken) == (2, 3)
    assert float(paper.weights["b"][0] - paper.weights["b"][1]) == pytest.approx(3.0)
    expected = [prediction_entropy(torch.tensor([[v / 2, -v / 2]])) for v in (3.0, 2.0, 3.0, 2.0)]
    assert paper.entropies == pytest.approx(expected)    # iterate 0's entropy is recorded, though not a candidate


def test_fedtta_takes_one_step_and_keeps_the_last_iterate():
    result = _staircase(patience=None, steps=1)
    assert result.chosen_step == 1 and result.entropies == ()
    assert float(result.weights["b"][0] - result.weights["b"][1]) == pytest.approx(1.0)
    assert _staircase(patience=None, steps=0).weights["b"].tolist() == [0.0, 0.0]


FACTORY = ModelFactory("mlp2nn", (3,), 2)


def make(name, **settings):
    spec = get_method(name)
    config = spec.make_config(**settings)
    return spec.strategy(model_factory=FACTORY, config=config, seed=0, num_training_clients=2), config


@pytest.mark.parametrize("weighted, expected", [(False, 2.5), (True, (10 * 1.0 + 30 * 4.0) / 40)])
def test_server_averages_both_models(weighted, expected):
    strategy, _ = make("fedtta", weighted=weighted)
    psi, phi = dict(strategy.psi), dict(strategy.phi)
    message = strategy.configure_train(0, [0])[0]
    assert set(message.subset("psi.")) == set(psi) and set(message.subset("phi.")) == set(phi)

    def reply(value, n):
        return Message(arrays={k: torch.full_like(v, value) for k, v in message.arrays.items()},
                       metrics={"num_examples": n, "loss": 0.5})

    strategy.aggregate_train(0, {1: reply(1.0, 10.0), 2: reply(4.0, 30.0)})
    for k in psi:
        assert torch.allclose(strategy.psi[k], psi[k] + expected)
    for k in phi:
        assert torch.allclose(strategy.phi[k], phi[k] + expected)


def test_registered_variants_carry_the_papers_mnist_settings():
    _, fedtta = make("fedtta")
    _, prox = make("fedtta_prox")
    _, pp = make("fedtta_pp")
    assert (fedtta.mu, fedtta.tta_steps, fedtta.patience, fedtta.adapt_lr) == (0.0, 1, None, 0.01)
    assert (prox.mu, prox.tta_steps, prox.patience, prox.adapt_lr) == (0.01, 1, None, 0.001)
    assert (pp.mu, pp.tta_steps, pp.patience) == (0.01, 50, 1)
    assert fedtta.round_config(20)["inner_lr"] == 0.5
    assert make("fedtta", lr_decay=0.5)[1].round_config(20)["inner_lr"] == pytest.approx(0.125)


@pytest.mark.parametrize("settings, name", [
    ({"patience": 0}, "patience"),
    ({"tta_steps": 0, "patience": 1}, "tta_steps"),
    ({"kl_direction": "forward"}, "kl_direction"),
    ({"inner_lr": 0.0}, "inner_lr"),
    ({"dp_epsilon": 1.0}, "no setting dp_epsilon"),     # the privacy layer's TrainingPrivacy replaced dp_*
    ({"unadapted_candidate": "no"}, "unadapted_candidate"),
])
def test_bad_settings_are_refused_by_name(settings, name):
    with pytest.raises(ConfigError, match=name):
        get_method("fedtta").make_config(**settings)


def _run(make_spec, method, rounds=1, **settings):
    spec = make_spec(num_clients=6, novel_fraction=0.5)
    config = RunConfig(federation=spec, method=method, model="mlp2nn", rounds=rounds,
                       method_config={"local_steps": 2, "batch_size": 16, **settings})
    federation = build_federation(spec, seed=0)
    runtime = build_runtime(config, federation)
    for r in range(rounds):
        runtime.run_round(r)
    return federation, runtime


@pytest.mark.parametrize("method", ["fedtta", "fedtta_pp"])
def test_novel_clients_adapt_locally_and_send_nothing(make_spec, method):
    federation, runtime = _run(make_spec, method)
    downloaded = runtime.strategy.psi
    for novel in federation.novel_clients:
        model = runtime.novel_client_model(novel)
        assert novel.client_id not in runtime.wire.ledgers
        assert runtime.wire.bytes_up.get(novel.client_id, 0) == 0
        assert runtime.wire.bytes_down[novel.client_id] > 0
        with torch.no_grad():
            out = model(novel.x)
        assert out.shape == (novel.num_samples, federation.num_classes)
    if method == "fedtta":  # one adaptation step, always kept: the served model is not the download
        for novel in federation.novel_clients:
            weights = runtime.novel_client_model(novel).state_dict()
            assert any(not torch.equal(weights[k], downloaded[k]) for k in downloaded)
    for client in federation.training_clients:
        records = runtime.wire.ledgers[client.client_id].records
        assert len(records) == 1 and all(isinstance(r.event, NonPrivateEvent) for r in records)
    assert math.isinf(runtime.wire.ledgers.epsilons(1e-5)[federation.training_clients[0].client_id])


def test_the_adaptation_log_keeps_each_novel_clients_chosen_iterate_and_sends_nothing(make_spec):
    federation, runtime = _run(make_spec, "fedtta_pp")
    runtime.client.adaptation_log = []
    served = [runtime.novel_client_model(novel).state_dict() for novel in federation.novel_clients]
    log = runtime.client.adaptation_log
    assert len(log) == len(federation.novel_clients)
    for weights, outcome in zip(served, log):
        assert all(torch.equal(weights[k], v) for k, v in outcome.weights.items())   # the logged iterate is served
        h, chosen = outcome.entropies, outcome.chosen_step
        assert len(h) == outcome.steps_taken + 1 and h[chosen] == min(h)
        assert all(a > b for a, b in zip(h[:chosen], h[1:chosen + 1]))      # strictly falling up to the choice
        # patience 1: the first step without a strict decrease ends the adaptation (or the 50-step cap does)
        assert outcome.steps_taken == 50 or (outcome.steps_taken == chosen + 1 and h[-1] >= h[chosen])
    assert all(novel.client_id not in runtime.wire.ledgers for novel in federation.novel_clients)


def test_test_time_adaptation_runs_in_eval_mode_so_a_dropout_model_adapts_the_same_way_every_time(make_spec):
    federation = build_federation(make_spec(num_clients=6, novel_fraction=0.5), seed=0)
    spec = get_method("fedtta_pp")
    config = spec.make_config(local_steps=1, batch_size=8)
    factory = ModelFactory("feature_mlp", federation.input_shape, federation.num_classes)   # has dropout
    strategy = spec.strategy(model_factory=factory, config=config, seed=0, num_training_clients=3)
    client = spec.client(model_factory=factory, config=config)
    client.workspace_model().train()                  # as local training leaves it
    novel, served = federation.novel_clients[0], []
    client.adaptation_log = []
    for seed in range(3):                             # other global random streams: dropout would draw other masks
        torch.manual_seed(seed)
        model = client.novel_model(novel, strategy.novel_request(novel.client_id))
        assert not model.training
        served.append({k: v.clone() for k, v in model.state_dict().items()})
    log = client.adaptation_log
    assert len({(a.chosen_step, tuple(a.entropies)) for a in log}) == 1 and log[0].steps_taken > 1
    assert all(torch.equal(served[0][k], other[k]) for other in served[1:] for k in served[0])


# --- privacy: the run's privacy layer around FedTTA --------------------------------------------------------------


def _private_run(make_spec, privacy, method="fedtta", rounds=1, **settings):
    spec = make_spec(num_clients=6, novel_fraction=0.5)
    config = RunConfig(federation=spec, method=method, model="mlp2nn", rounds=rounds, select="last",
                       method_config={"local_steps": 2, "batch_size": 8, **settings}, privacy=privacy)
    federation = build_federation(spec, seed=0)
    return federation, build_runtime(config, federation)


def _context(data, round=0):
    return ClientContext(client_id=data.client_id, round=round, run_seed=0, rng=np.random.default_rng(round))


def test_client_level_dp_releases_are_recorded_reach_the_target_and_are_capped(make_spec):
    privacy = TrainingPrivacy(mode="local", epsilon=2.0, clip=0.5, participations=2)
    federation, runtime = _private_run(make_spec, privacy, rounds=2)
    for round in range(2):
        runtime.run_round(round)
    data = federation.training_clients[0]
    sigma = analytic_gaussian_sigma(2.0, 1e-5, 2 * 0.5 * math.sqrt(2))    # 2 C sqrt(k): two releases of 2 C
    event = GaussianEvent(sigma=sigma, sensitivity=1.0, relation=NeighboringRelation.REPLACE_ONE)
    assert runtime.wire.ledgers[data.client_id].events == (event,) * 2
    assert runtime.wire.ledgers.epsilons(1e-5)[data.client_id] == pytest.approx(2.0, rel=1e-3)
    # A third release is refused by the ledger before anything is delivered, whatever the client's state says: a
    # run resumed from a checkpoint rolls the state back, not the ledger.
    message = runtime.strategy.configure_train(2, [data.client_id])[data.client_id]
    for kept_state in (runtime.client_states[data.client_id], {}):
        release = runtime.client.train(data, message, kept_state, _context(data, 2))
        assert release.event == event
        with pytest.raises(BudgetExceededError, match=r"from 2.0000 to 2.5105 .*over the budget epsilon=2,"):
            runtime.wire.client_to_server(data.client_id, release, round=2)
    assert len(runtime.wire.ledgers[data.client_id]) == 2


def _diverging(data, message, diverge):
    if diverge == "loss":
        message.config["inner_lr"] = float("inf")       # the local loss turns non-finite
        return data
    # inputs of 1e25: the mean loss stays finite (~1e23) but the last step overflows the weights to inf/nan, which
    # must count as diverged too, not fail the release (a failure would depend on the data)
    return dataclasses.replace(data, x_train=data.x_train * 1e25)


@pytest.mark.parametrize("diverge", ["loss", "weights"])
def test_under_client_level_dp_a_diverged_client_still_releases_noise_so_its_silence_reveals_nothing(make_spec,
                                                                                                   diverge):
    privacy = TrainingPrivacy(mode="local", epsilon=1.0, clip=1e-3, participations=1)
    federation, runtime = _private_run(make_spec, privacy)
    data = federation.training_clients[0]
    message = runtime.strategy.configure_train(0, [data.client_id])[data.client_id]
    data = _diverging(data, message, diverge)
    assert runtime.client.inner.train(data, message, {}, _context(data)) is not None   # a zero update, not silence
    release = runtime.client.train(data, message, {}, _context(data))
    flat = torch.cat([v.reshape(-1) for v in release.message.arrays.values()])
    sigma = analytic_gaussian_sigma(1.0, 1e-5, 2 * 1e-3)
    assert bool(torch.isfinite(flat).all()) and float(flat.std()) == pytest.approx(sigma, rel=0.02)
    assert release.metadata["noise"] == "secure"
    # without DP the diverged client stays silent, as the authors' code has it
    _, plain = _private_run(make_spec, TrainingPrivacy())
    message = plain.strategy.configure_train(0, [data.client_id])[data.client_id]
    data = _diverging(federation.training_clients[0], message, diverge)
    assert plain.client.train(data, message, {}, _context(data)) is None


def test_client_level_dp_release_is_the_clipped_update_plus_noise_of_the_calibrated_scale(make_spec):
    privacy = TrainingPrivacy(mode="local", epsilon=1.0, clip=1e-3, participations=1)
    federation, runtime = _private_run(make_spec, privacy)
    data = federation.training_clients[0]
    message = runtime.strategy.configure_train(0, [data.client_id])[data.client_id]
    plain = runtime.client.inner.train(data, message, {}, _context(data))
    assert set(plain.message.arrays) == set(message.arrays) and plain.message.metrics == {}
    release = runtime.client.train(data, message, {}, _context(data))
    flat = torch.cat([v.reshape(-1) for v in release.message.arrays.values()])
    # The clipped update has norm <= 1e-3, so the release is essentially noise: its std must be sigma.
    assert float(flat.std()) == pytest.approx(analytic_gaussian_sigma(1.0, 1e-5, 2e-3), rel=0.02)
    assert release.message.metrics == {}


def test_central_and_distributed_dp_step_the_server_from_the_mean_update():
    strategy, _ = make("fedtta")
    psi, phi = dict(strategy.psi), dict(strategy.phi)
    like = strategy.contribution_shapes()
    assert set(like) == set(strategy.configure_train(0, [0])[0].arrays)
    assert all(float(v.abs().sum()) == 0 for v in like.values())
    mean = {k: torch.full_like(v, 0.25) for k, v in like.items()}
    assert strategy.apply_mean(3, mean, 2.0) == {}
    assert all(torch.allclose(strategy.psi[k], psi[k] + 0.25) for k in psi)
    assert all(torch.allclose(strategy.phi[k], phi[k] + 0.25) for k in phi)
    assert strategy.rounds_done == 4      # the novel clients' test-time rate follows the rounds stepped


@pytest.mark.parametrize("mode", ["record", "local", "central", "distributed"])
def test_weighted_needs_sample_counts_that_private_clients_do_not_send(make_spec, mode):
    privacy = TrainingPrivacy(mode=mode, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match=f"weighted=True .*set weighted=False with privacy mode '{mode}'"):
        _private_run(make_spec, privacy, weighted=True)


# --- record level: DP-SGD on the per-record meta-loss -------------------------------------------------------------


def _learner(scale=1.0, seed=0):
    f, g, x, y = tiny_models(seed)
    return MetaLearner(f, g, scale), x, y


@pytest.mark.parametrize("mu", [0.0, 0.3])
def test_the_per_record_meta_loss_is_the_papers_meta_loss_on_a_batch_of_one(mu):
    learner, x, y = _learner()
    teacher = {k: v.detach() + 0.1 for k, v in learner.f.named_parameters()}
    losses = record_meta_losses(learner, x, y, inner_lr=0.7, weight_decay=0.01, mu=mu, teacher=teacher)
    psi, phi = dict(learner.f.named_parameters()), dict(learner.g.named_parameters())
    for i in range(len(y)):
        teacher_logits = torch.func.functional_call(learner.f, teacher, (x[i:i + 1],))
        alone, _ = meta_loss(learner.f, learner.g, psi, phi, x[i:i + 1], y[i:i + 1], inner_lr=0.7,
                             weight_decay=0.01, mu=mu, teacher_logits=teacher_logits)
        assert float(losses[i].detach()) == pytest.approx(float(alone.detach()), rel=1e-10)
    # each record's loss reads that record only: changing another record leaves it unchanged
    other = x.clone()
    other[1:] = torch.randn_like(other[1:]) * 10
    changed = record_meta_losses(learner, other, y, inner_lr=0.7, weight_decay=0.01, mu=mu, teacher=teacher)
    assert float(changed[0].detach()) == pytest.approx(float(losses[0].detach()), rel=1e-12)


def test_dp_sgd_clips_the_per_record_meta_gradient_over_psi_and_phi_by_the_torch_func_path():
    learner, x, y = _learner(scale=0.5)
    params = dict(learner.named_parameters())
    loss = functools.partial(record_meta_losses, inner_lr=0.7)

    def clipped_sum(path, rows):
        engine = ClippedGradientSum(learner, params, loss, path=path)
        flat = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine(x[rows], y[rows], 0.05, flat_views(params, flat))
        return engine, flat

    engine, total = clipped_sum("auto", slice(None))
    # the batched "fast" path cannot see per-record inner steps: it refuses the loss, and torch.func computes it
    assert engine.path == "vmap" and "g.net.0.weight" in engine.reason
    assert torch.allclose(total, clipped_sum("loop", slice(None))[1], atol=1e-10)
    alone = [clipped_sum("loop", slice(i, i + 1))[1] for i in range(len(y))]
    assert torch.allclose(total, sum(alone), atol=1e-10)          # the sum of each record's own clipped gradient
    assert [float(a.norm()) for a in alone] == pytest.approx([0.05] * len(y), rel=1e-9)   # each clipped to C
    start = sum(p.numel() for name, p in params.items() if name.startswith("f."))
    assert all(float(a[start:].abs().max()) > 0 for a in alone)   # phi's gradient (through the inner step) is in it


def test_record_level_meta_fit_moves_psi_at_eta_out_and_phi_at_eta_ad_with_their_weight_decay(make_spec,
                                                                                            noise_floor_lifted):
    # q = 1 (batch_size >= n), noise negligible, clip never reached: one DP-SGD step is the per-record gradients summed
    # and divided by batch_size
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1e-12, clip=1e3, noise="seeded")   # noise std 1e-9
    spec = get_method("fedtta")
    config = spec.make_config(local_steps=1, batch_size=256, lr=0.3, adapt_lr=0.012, inner_lr=0.5,
                              weight_decay=0.05, adapt_hidden=4, adapt_layers=1)
    federation = build_federation(make_spec(num_clients=6, novel_fraction=0.5), seed=0)
    factory = ModelFactory("mlp2nn", federation.input_shape, federation.num_classes)
    client = spec.client(model_factory=factory, config=config, privacy=privacy)
    strategy = spec.strategy(model_factory=factory, config=config, seed=0, num_training_clients=3)
    data = federation.training_clients[0]
    assert data.num_train <= 256
    message = strategy.configure_train(0, [data.client_id])[data.client_id]
    release = client.train(data, message, {}, _context(data))
    f, g = factory(), AdaptationModel(federation.num_classes, 4, 1)
    f.load_state_dict(message.subset("psi."))
    g.load_state_dict(message.subset("phi."))
    losses = record_meta_losses(MetaLearner(f, g, 1.0), data.x_train, data.y_train, inner_lr=0.5, weight_decay=0.05)
    psi, phi = list(f.parameters()), list(g.parameters())
    grads = torch.autograd.grad(losses.sum() / 256, psi + phi)
    expected = [-0.3 * (gr + 0.05 * p) for p, gr in zip(psi, grads[:len(psi)])] + \
               [-0.012 * (gr + 0.05 * p) for p, gr in zip(phi, grads[len(psi):])]
    got = list(release.message.subset("psi.").values()) + list(release.message.subset("phi.").values())
    for want, have in zip(expected, got, strict=True):
        assert torch.allclose(have, want.detach(), atol=1e-6, rtol=1e-4)
    assert release.message.metrics == {}


def test_a_record_level_round_records_the_event_its_round_event_declares(make_spec):
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.3, noise="seeded")
    federation, runtime = _private_run(make_spec, privacy, method="fedtta_prox", rounds=1)
    runtime.run_round(0)
    for data in federation.training_clients:
        records = runtime.wire.ledgers[data.client_id].records
        assert [r.event for r in records] == [runtime.client.inner.round_event(1.3)]
        assert records[0].event == dp_sgd_round_event(1.3, 1.0, 2)   # q = min(1, batch 8 / min_samples 8)
    # g was trained on the per-record statistic, so the test-time loss is per record too
    assert runtime.client.inner.tta_chunk == 1
    _, plain = _private_run(make_spec, TrainingPrivacy(), method="fedtta_prox")
    assert plain.client.tta_chunk == 8   # batch_size


@pytest.mark.parametrize("settings, refusal", [
    ({"adapt_momentum": 0.9}, "adapt_momentum=0.9 puts momentum on phi only"),
    ({"grad_clip": 10.0}, "grad_clip=10.0 clips each step's batch gradient"),
])
def test_record_level_refuses_before_the_run_what_dp_sgd_cannot_honour(make_spec, settings, refusal):
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.0)
    with pytest.raises(ConfigError, match=refusal):
        _private_run(make_spec, privacy, **settings)
    # the same settings are the authors' code's stabilisers, and run under client-level DP
    _private_run(make_spec, TrainingPrivacy(mode="local", noise_multiplier=1.0), **settings)


def test_at_record_level_records_whose_meta_gradient_is_not_finite_drop_out_and_the_client_still_releases(make_spec):
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.0, noise="seeded")
    federation, runtime = _private_run(make_spec, privacy)
    data = federation.training_clients[0]
    message = runtime.strategy.configure_train(0, [data.client_id])[data.client_id]
    # an infinite inner rate makes every record's meta-gradient non-finite: each is left out of the clipped sum
    # (privfl.privacy.per_sample), so the step is the noise alone and the release is finite, not a diverged zero
    message.config["inner_lr"] = float("inf")
    release = runtime.client.train(data, message, {}, _context(data))
    assert all(bool(torch.isfinite(v).all()) and float(v.abs().sum()) > 0 for v in release.message.arrays.values())
    assert release.event == runtime.client.inner.round_event(1.0)   # the spent steps are recorded
