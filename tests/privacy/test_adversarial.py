"""Adversarial privacy tests over every registered method and every mode it runs (``sorted(METHODS)``): a new method
gets them by registering. What they check (``docs/record_level.md``, ``docs/invariants.md`` rule 10):

* **Neighbouring datasets.** The same seeded run on D and on a neighbour D' (record level: one record added to one
  client, so n and n + 1, or under a replace-one release one record replaced; client level: that client's whole
  dataset replaced) makes, for every client, the same
  sequence of releases with the same events, and draws every noise at the same scale: only the data term may
  differ. A noise multiplier, sampling rate or step count calibrated to a client's own size fails here.
* **Only noised releases cross to others.** In the run on D', what left the changed client through the privacy
  layer is replaced by what the run on D released (record, local, distributed: that client's releases; central: the
  aggregator's noisy mean of each round). Every message any *other* client then receives (training stages,
  evaluation, novel clients) must be bit-identical to the run on D: it is post-processing of noised releases and
  public data. A server that sends one client something computed from another client's data in the clear fails here.
* **A hostile server.** A strategy whose messages carry zeros in place of every tensor, or ask for more local work
  than the plan, does not change the event of any release (the run may refuse, releasing nothing more).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest
import torch

from accounting import NeighboringRelation
from privfl.config import RunConfig, run_federation
from privfl.data import FederationSpec
from privfl.errors import ConfigError
from privfl.experiment import build_runtime
from privfl.federation.messages import Message
from privfl.methods import METHODS
from privfl.metrics import score_model
from privfl.privacy import dp_sgd, mechanisms
from privfl.privacy.training import CENTRAL, MODES, RECORD, TrainingPrivacy

METHOD_NAMES = sorted(METHODS)
SUPPORTED = [(method, mode) for method in METHOD_NAMES for mode in MODES if METHODS[method].privacy[mode] is None]
QUICK = {"local_steps": 2, "batch_size": 16}
#: The position, among the training clients, of the client whose data differs between the two neighbouring runs.
CHANGED = 1
ROUNDS = 2


#: A federation of images (scikit-learn's 8x8 digits) for the runs with a feature stage in front of the method.
DIGITS = FederationSpec(source="digits", num_clients=8, partition="iid", novel_fraction=0.25, val_fraction=0.2)


def config_for(method: str, mode: str, *, seed: int = 5, client_fraction: float | None = None,
               settings: dict | None = None, features: str | None = None) -> RunConfig:
    """A 2-round run on a small synthetic federation with seeded noise (with ``features``, the digits through that
    feature stage and a linear head). Record level calibrates z for a target epsilon (the calibration is what must
    not read a client's size); client level takes a noise multiplier. ``settings`` override the method's."""
    spec = METHODS[method]
    federation = DIGITS if features else FederationSpec(
        source="synthetic", source_options={"num_samples": 600, "dim": 8, "num_classes": 3}, num_clients=8,
        partition="iid", novel_fraction=0.25, val_fraction=0.2)
    noise = {"epsilon": 4.0} if mode == RECORD else {"noise_multiplier": 1.0}
    privacy = TrainingPrivacy(mode=mode, clip=1.0, noise="seeded", noise_seed=11, min_samples=8, **noise)
    fields = {f.name for f in dataclasses.fields(spec.config)}
    method_settings = {k: v for k, v in QUICK.items() if k in fields} | dict(spec.smoke_settings) | (settings or {})
    fraction = client_fraction if client_fraction is not None else (0.5 if mode == CENTRAL else 1.0)
    stage = {} if features is None else {"features": features, "features_options": {"groups": 9}, "model": "linear"}
    return RunConfig(federation=federation, method=method, method_config=method_settings, rounds=ROUNDS,
                     select="last", seed=seed, privacy=privacy, client_fraction=fraction, **stage)


def neighbour(federation, mode: str, relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE):
    """``federation`` with training client number :data:`CHANGED`'s data changed: at record level one record added
    (add/remove-one) or one replaced by another of the same label (the releases' relation is replace-one, as
    DP-FedPFT's within its public class histogram); at client level its whole training split replaced by other
    records of the same shapes."""
    clients = list(federation.training_clients)
    index = CHANGED
    client = clients[index]
    generator = torch.Generator().manual_seed(99)
    if mode == RECORD and relation is NeighboringRelation.REPLACE_ONE:
        x = client.x_train.clone()
        x[0] = 3.0 * torch.randn(x.shape[1:], generator=generator, dtype=x.dtype)
        changed = dataclasses.replace(client, x_train=x)
    elif mode == RECORD:
        extra_x = 3.0 * torch.randn((1, *client.x_train.shape[1:]), generator=generator, dtype=client.x_train.dtype)
        extra_y = client.y_train[:1].clone()
        changed = dataclasses.replace(client, x_train=torch.cat([client.x_train, extra_x]),
                                      y_train=torch.cat([client.y_train, extra_y]))
    else:
        x = 2.0 * torch.randn(client.x_train.shape, generator=generator, dtype=client.x_train.dtype)
        changed = dataclasses.replace(client, x_train=x, y_train=client.y_train.flip(0).clone())
    clients[index] = changed
    return dataclasses.replace(federation, training_clients=clients)


@dataclasses.dataclass
class Trace:
    """What one run made: every client's releases (purpose, event, audience), every noise scale drawn in order, every
    message down by client, what crossed the privacy boundary, the round the run stopped at (a refusal)."""

    events: dict[int, list] = dataclasses.field(default_factory=dict)
    noise: list[float] = dataclasses.field(default_factory=list)
    down: dict[int, list[Message]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    boundary: list = dataclasses.field(default_factory=list)
    refused: str | None = None
    training_ids: list[int] = dataclasses.field(default_factory=list)
    changed: int = -1


def _copy(message: Message) -> Message:
    return Message(arrays={k: v.detach().clone() for k, v in message.arrays.items()}, config=dict(message.config),
                   metrics=dict(message.metrics))


def run(method: str, mode: str, *, changed: NeighboringRelation | None = None, substitute: Trace | None = None,
        hostile=None, monkeypatch, **config_options) -> Trace:
    """Run the config's rounds, score every training client and serve every novel client, recording a
    :class:`Trace`. ``substitute``: replace what crosses the privacy boundary from the changed client (central: the
    noisy mean) by that trace's. ``hostile(message) -> message``: the server's messages pass through it."""
    config = config_for(method, mode, **config_options)
    federation = run_federation(config)
    if changed is not None:
        federation = neighbour(federation, mode, changed)
    runtime = build_runtime(config, federation)
    trace = Trace(training_ids=[c.client_id for c in federation.training_clients],
                  changed=federation.training_clients[CHANGED].client_id)
    wire = runtime.wire

    spies = pytest.MonkeyPatch()      # the run's own: undone at its end, leaving the test's patches (environment)
    deliver_down = wire.server_to_client

    def server_to_client(cid, message):
        if hostile is not None:
            message = hostile(message)
        trace.down[cid].append(_copy(message))
        return deliver_down(cid, message)

    deliver_up = wire.client_to_server
    crossed = iter(substitute.boundary) if substitute is not None else None

    def client_to_server(cid, release, *, round):
        delivered = deliver_up(cid, release, round=round)
        if cid == trace.changed and mode != CENTRAL:
            trace.boundary.append(_copy(delivered))
            if crossed is not None:
                return _copy(next(crossed))
        return delivered

    spies.setattr(wire, "server_to_client", server_to_client)
    spies.setattr(wire, "client_to_server", client_to_server)
    if mode == CENTRAL:
        inner = runtime.strategy.inner
        apply_mean = inner.apply_mean

        def noisy_mean(round, mean, count):
            trace.boundary.append({k: v.clone() for k, v in mean.items()})
            if crossed is not None:
                mean = {k: v.clone() for k, v in next(crossed).items()}
            return apply_mean(round, mean, count)

        spies.setattr(inner, "apply_mean", noisy_mean)
    add_noise = mechanisms.GaussianMechanism.add_noise
    gaussian_noise = dp_sgd._gaussian_noise
    spies.setattr(mechanisms.GaussianMechanism, "add_noise",
                  lambda self, value: trace.noise.append(self.sigma) or add_noise(self, value))
    spies.setattr(dp_sgd, "_gaussian_noise",
                  lambda out, std, *a, **k: trace.noise.append(std) or gaussian_noise(out, std, *a, **k))
    torch.manual_seed(config.seed)
    try:
        for round in range(config.rounds):
            runtime.run_round(round)
        runtime.evaluate_training_clients(score_model, report_to_server=False, round=None)
        if runtime.serves_novel_clients:
            for novel in federation.novel_clients:
                runtime.novel_client_model(novel)
    except ConfigError as error:
        trace.refused = str(error)
    finally:
        runtime.close()
        spies.undo()
    trace.events = {cid: [(r.purpose, r.event, r.audience) for r in ledger.records]
                    for cid, ledger in runtime.wire.ledgers.items()}
    return trace


def _same_message(a: Message, b: Message) -> bool:
    return (sorted(a.arrays) == sorted(b.arrays) and a.config == b.config
            and all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays))


def _check_neighbours(method: str, mode: str, monkeypatch, **options) -> tuple[Trace, Trace]:
    """Runs on D and on the neighbour D' (with D's boundary crossings substituted); asserts the events, the noise
    scales and every message to a client other than the changed one are the same."""
    on_d = run(method, mode, monkeypatch=monkeypatch, **options)
    assert on_d.refused is None, on_d.refused
    relations = {event.relation for _, event, _ in on_d.events.get(on_d.changed, []) if event.relation is not None}
    relation = relations.pop() if len(relations) == 1 else NeighboringRelation.ADD_OR_REMOVE_ONE
    on_neighbour = run(method, mode, changed=relation, substitute=on_d, monkeypatch=monkeypatch, **options)
    assert on_neighbour.refused is None, on_neighbour.refused
    assert on_neighbour.events == on_d.events, "a release's event depends on a client's data"
    assert on_neighbour.noise == on_d.noise, "a noise scale depends on a client's data"
    assert len(on_neighbour.boundary) == len(on_d.boundary)
    for cid in sorted(set(on_d.down) | set(on_neighbour.down)):
        if cid == on_d.changed:
            continue
        mine, theirs = on_d.down.get(cid, []), on_neighbour.down.get(cid, [])
        assert len(mine) == len(theirs), (cid, len(mine), len(theirs))
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert _same_message(a, b), (f"message {index} to client {cid} moved when client {on_d.changed}'s data "
                                         "changed, although every noised release it could depend on was the same")
    return on_d, on_neighbour


@pytest.mark.parametrize("method, mode", SUPPORTED)
def test_neighbouring_runs_make_the_same_events_and_others_see_only_noised_releases(method, mode, monkeypatch):
    on_d, _ = _check_neighbours(method, mode, monkeypatch)
    if METHODS[method].releases_per_round > 0 or mode == CENTRAL:
        assert on_d.events.get(on_d.changed), "the changed client made no release: the test would see nothing"
        assert any(on_d.events.get(cid) for cid in on_d.training_ids if cid != on_d.changed)


def _modes(method: str) -> list[str]:
    return [mode for mode in MODES if METHODS[method].privacy[mode] is None]


#: The methods whose hypernetwork can generate only the target's head (a ``generated`` setting), with each mode they
#: run and the part generated (every one with the head; ODPFL-HN with its bias too).
HEAD_METHODS = [m for m in METHOD_NAMES if "generated" in {f.name for f in dataclasses.fields(METHODS[m].config)}]
HEAD_CASES = ([(m, mode, "head") for m in HEAD_METHODS for mode in _modes(m)]
              + [("odpflhn", mode, "head_bias") for mode in _modes("odpflhn")])


@pytest.mark.parametrize("method, mode, generated", HEAD_CASES)
def test_hypernetworks_generating_only_the_head_keep_the_neighbouring_guarantees(method, mode, generated,
                                                                                monkeypatch):
    # the shared part moves by the mean of the clients' weight changes: post-processing of their releases (record,
    # local) or of the noisy mean (central), so the same checks hold
    on_d, _ = _check_neighbours(method, mode, monkeypatch, settings={"generated": generated, "shared_momentum": 0.5})
    assert on_d.events.get(on_d.changed), "the changed client made no release: the test would see nothing"


@pytest.mark.parametrize("method, mode", [(m, mode) for m, mode, generated in HEAD_CASES if generated == "head"])
def test_a_hostile_server_changes_no_release_s_event_when_only_the_head_is_generated(method, mode, monkeypatch):
    _check_hostile(method, mode, monkeypatch, settings={"generated": "head", "shared_momentum": 0.5})


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("features"))


@pytest.mark.parametrize("mode", _modes("fedavg"))
def test_a_feature_stage_in_front_keeps_the_neighbouring_guarantees(mode, monkeypatch, feature_cache):
    # the stage maps each record by itself (ScatterNet, per-record group norm): it spends nothing and couples nothing
    monkeypatch.setenv("PRIVFL_CACHE_DIR", feature_cache)
    on_d, _ = _check_neighbours("fedavg", mode, monkeypatch, features="scatter")
    assert on_d.events.get(on_d.changed)


def _zeros(message: Message) -> Message:
    return Message(arrays={k: torch.zeros_like(v) for k, v in message.arrays.items()}, config=dict(message.config))


#: Settings a hostile server may ask for more of: local steps, private regression steps, batch sizes.
WORK = ("local_steps", "steps", "encoder_steps", "batch_size", "local_epochs")


def _more_work(message: Message) -> Message:
    config = {k: (3 * v + 1 if k in WORK and isinstance(v, int) and not isinstance(v, bool) else v)
              for k, v in message.config.items()}
    return Message(arrays=dict(message.arrays), config=config)


@pytest.mark.parametrize("method, mode", SUPPORTED)
def test_a_hostile_server_changes_no_release_s_event(method, mode, monkeypatch):
    _check_hostile(method, mode, monkeypatch)


def _check_hostile(method: str, mode: str, monkeypatch, **options) -> None:
    honest = run(method, mode, monkeypatch=monkeypatch, **options)
    for hostile in (_zeros, _more_work):
        attacked = run(method, mode, hostile=hostile, monkeypatch=monkeypatch, **options)
        for cid, events in attacked.events.items():
            # what was released is what an honest round releases, event for event; a refusal releases nothing more
            assert events == honest.events.get(cid, [])[:len(events)], (hostile.__name__, cid)
            if attacked.refused is None:
                assert events == honest.events.get(cid, []), (hostile.__name__, cid)
        if hostile is _more_work and attacked.refused is not None:
            assert "plan" in attacked.refused or "calibrated" in attacked.refused, attacked.refused


# -- the two reproductions of the audit that found both defects -----------------------------------------------------

def _record_client(n: int, epsilon: float = 1.0):
    """An ODPFL-HN record-level client procedure at a target epsilon, and a training client of ``n`` records."""
    from privfl.data import TrainingClient
    from privfl.methods.base import ModelFactory
    from privfl.methods.odpflhn import ODPFLHNClient, ODPFLHNConfig

    config = ODPFLHNConfig(encoder_hidden=8, embed_dim=4, hn_hidden=8, local_steps=10, batch_size=64)
    privacy = TrainingPrivacy(mode=RECORD, epsilon=epsilon, min_samples=200, noise="seeded", noise_seed=3)
    client = ODPFLHNClient(model_factory=ModelFactory("mlp2nn", (8,), 3), config=config, privacy=privacy,
                           participations=8)
    generator = torch.Generator().manual_seed(0)
    data = TrainingClient(client_id=0, x_train=torch.randn(n, 8, generator=generator),
                          y_train=torch.randint(0, 3, (n,), generator=generator),
                          x_val=torch.zeros(0, 8), y_val=torch.zeros(0, dtype=torch.int64))
    return client, data


def test_record_level_z_and_every_release_sigma_are_equal_for_n_and_n_plus_one():
    small, data = _record_client(340)
    large, bigger = _record_client(341)
    assert small.noise_multiplier() == large.noise_multiplier()
    assert small.round_event(small.noise_multiplier()) == large.round_event(large.noise_multiplier())
    # the calibration reaches the target over the client's 8 rounds, whatever its size
    from accounting import SelfComposedEvent
    from accounting import epsilon as accounting_epsilon

    z = small.noise_multiplier()
    assert accounting_epsilon(SelfComposedEvent(small.round_event(z), 8), 1e-5) == pytest.approx(1.0, abs=2e-3)
    assert small.record_sampling_rate() == 64 / 200


def test_a_zero_descriptor_gradient_gives_the_same_encoder_gradient_release_for_n_and_n_plus_one():
    # the audit's reproduction: a server that sends descriptor_grad = 0 receives pure noise; with the noise scale
    # tied to n it told n from n + 1 (privacy loss about 1.5 per release where the ledger recorded 0.2)
    from privfl.federation.context import ClientContext
    from privfl.methods.odpflhn import ODPFLHNStrategy

    releases = []
    for n in (340, 341):
        client, data = _record_client(n)
        strategy = ODPFLHNStrategy(model_factory=client.model_factory, config=client.config, seed=0,
                                   num_training_clients=4)
        state = {}
        stage0 = strategy.configure_train(0, [0])[0]
        client.train(data, stage0, state, ClientContext(client_id=0, round=0, run_seed=0,
                                                        rng=np.random.default_rng(0)))
        stage2 = strategy._encoder_message(stage=2)
        stage2.arrays["descriptor_grad"] = torch.zeros(strategy.embed_dim)
        releases.append(client.train_stage(2, data, stage2, state, ClientContext(
            client_id=0, round=0, run_seed=0, rng=np.random.default_rng(0))))
    first, second = releases
    assert first.event == second.event and first.purpose == "encoder_gradient"
    assert sorted(first.message.arrays) == sorted(second.message.arrays)
    assert all(torch.equal(first.message.arrays[k], second.message.arrays[k]) for k in first.message.arrays)
    assert any(float(v.abs().sum()) > 0 for v in first.message.arrays.values())   # the noise is there


def test_central_mode_messages_to_never_sampled_clients_do_not_move_with_another_client_s_data(monkeypatch):
    # the audit's reproduction: ODPFL-HN scored a never-sampled client with f(mean of the others' descriptors), which
    # the aggregator holds in the clear
    on_d, _ = _check_neighbours("odpflhn", CENTRAL, monkeypatch, client_fraction=0.5, seed=5)
    sampled = {cid for cid in on_d.training_ids
               if any(purpose != "central_aggregate" for purpose, _, _ in on_d.events.get(cid, []))}
    assert on_d.changed in sampled and set(on_d.training_ids) - sampled, \
        "the seed must sample the changed client and leave another unsampled for this test to mean anything"
