"""Runtimes: the one round loop every engine runs, and the in-process engine.

A runtime drives a method's :class:`~privfl.methods.base.Strategy` (server side) and
:class:`~privfl.methods.base.ClientProcedure` (client side) through messages only; it does not know which method it
runs. :class:`Runtime` holds the round loop (:meth:`Runtime.run_round`: sample, configure, one exchange per stage,
aggregate, commit) and names what an engine must provide: how one stage's messages reach the clients and their
releases come back (:meth:`Runtime.exchange`), how client states are committed, evaluation, novel-client serving,
ledgers, checkpoints, and the secure sum of a round's releases (:meth:`Runtime.secure_sum`) when the strategy may
see only their sum. :class:`InProcessRuntime` provides them in this process;
:class:`privfl.engines.flower.runtime.FlowerRuntime` on Flower nodes. :func:`privfl.experiment.train` runs any
runtime.

Rounds are transactional. A client procedure works on a copy of its state, and client states are committed only
after the server has aggregated, so if a round is interrupted the runtime still holds the consistent state of the
last completed round (:meth:`Runtime.committed_state_dict`). The ledger is never rolled back: a release that was
made stays recorded, even if its round is later run again. A process killed between checkpoints takes with it the
records of the releases made since the last one; :func:`privfl.experiment.train` hands the runtime a run
directory's release journal (``releases.jsonl``, appended before each delivery, :meth:`Runtime.use_journal`) and
replays it into the checkpoint's ledgers on resume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accounting import LedgerBook, PrivacyBudget, PrivacyEvent, ReleaseJournal
from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError, InternalError
from privfl.federation.context import ClientState, client_context
from privfl.federation.messages import Message, Release
from privfl.federation.seeding import derive_rng
from privfl.federation.timing import AGGREGATION, CLIENT, RoundTimer
from privfl.federation.wire import Wire
from privfl.federation.workers import ClientWorkers, check_threads, check_workers

if TYPE_CHECKING:   # the methods sit above this module: only their interfaces are named here
    from privfl.data import FederatedDataset
    from privfl.metrics import ClientScore

Score = Callable[[nn.Module, torch.Tensor, torch.Tensor], "ClientScore"]


def how_to_continue(engine: str, run_dir: Any, *, certs: Any = "CERTS", superlink: str = "HOST:PORT") -> str:
    """How a run of ``engine`` stopped before its last round (interrupted, failed, a full disk) continues from its
    checkpoint, as the end of a message: the command that does it, where one does. ``engine``: ``inprocess``,
    ``flower-sim`` (``privfl train --engine flower-sim``) or ``flower-deployment`` (``privfl flower run``, whose
    ``certs`` directory and ``superlink`` address are named where known)."""
    if engine == "inprocess":
        return f"continue the run with: privfl train --resume {run_dir}"
    if engine == "flower-deployment":
        return (f"continue the run with: privfl flower run --certs {certs} --superlink {superlink} --resume {run_dir} "
                "(on the SuperLink's machine; start any SuperNode that died again first, with its key and node "
                "directory)")
    if engine == "flower-sim":
        return ("a run of Flower's simulation engine cannot be continued yet (its clients' states and ledgers are "
                "on its nodes, and only the in-process engine resumes a run): start it again, into a new --out or "
                "with --overwrite")
    raise InternalError(f"no engine {engine!r}; engines: inprocess, flower-sim, flower-deployment")


def engine_of(state: Mapping[str, Any]) -> str:
    """The engine that saved the runtime ``state`` of a checkpoint: ``inprocess`` unless its wire keeps the ledgers
    on Flower nodes, then the engine it names (a checkpoint that names none is of a deployment: the simulation engine
    never resumed, and its checkpoints name it)."""
    wire = state.get("wire") or {}
    return str(wire.get("engine", "flower-deployment")) if wire.get("ledgers_on_nodes") else "inprocess"


def sample_clients(client_ids: list[int], fraction: float, *, seed: int, round: int) -> list[int]:
    """A seeded uniform sample of ``max(1, round(fraction * len(client_ids)))`` clients for ``round``, sorted."""
    count = max(1, int(round_half_up(fraction * len(client_ids))))
    if count >= len(client_ids):
        return sorted(client_ids)
    chosen = derive_rng(seed, "client_sampling", round).choice(len(client_ids), size=count, replace=False)
    return sorted(client_ids[i] for i in chosen)


def round_half_up(value: float) -> int:
    return int(value + 0.5)


@dataclass(frozen=True)
class RoundRelease:
    """A release the server makes once a round on behalf of every training client (central DP's noisy aggregate): the
    runtime records it in every training client's ledger, sampled that round or not, before the round's messages are
    used (:meth:`privfl.methods.base.Strategy.round_releases`)."""

    event: PrivacyEvent
    purpose: str
    metadata: dict[str, Any] = field(default_factory=dict)
    calibrated_for: PrivacyBudget | None = None
    #: How many times the run plans this release in all (its rounds; public): the ledgers then price the whole plan
    #: once instead of each round's projection (:meth:`accounting.LedgerBook.record_for`). ``None``: unknown.
    planned: int | None = None


@dataclass(frozen=True)
class SecureSum:
    """A strategy's request that the server see the releases of a round's last stage only as their sum (distributed
    client-level DP, :meth:`privfl.methods.base.Strategy.secure_sum`): the runtime has them summed by secure
    aggregation (:meth:`Runtime.secure_sum`) and hands the strategy the sum alone
    (:meth:`privfl.methods.base.Strategy.aggregate_sum`).

    ``like``: zeros shaped like one release, by name: every release must be exactly these arrays. ``bound``: every
    coordinate of a release lies in [-bound, bound] before its noise (an L2 clip C bounds each coordinate by C).
    ``noise_std``: the standard deviation of the Gaussian noise each release carries in every coordinate (its
    share). ``calibrated_for``: what each release's noise is calibrated for over its client's ledger. An engine that
    quantizes sizes its range from these (:mod:`privfl.engines.flower.secagg`).
    """

    like: dict[str, torch.Tensor]
    bound: float
    noise_std: float
    calibrated_for: PrivacyBudget


@dataclass(frozen=True)
class ReleaseSum:
    """What secure aggregation hands the server: the sum of a round's releases (float64, named as
    :attr:`SecureSum.like`), how many releases it sums, and what the aggregation reports about itself (on Flower,
    how many values quantization clipped)."""

    arrays: dict[str, torch.Tensor]
    count: int
    metrics: dict[str, float] = field(default_factory=dict)


def add_releases(releases: Mapping[int, Message], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 sum of ``releases`` (in increasing client id), each of which must hold exactly the arrays of
    ``like``, by name and shape."""
    total = {name: torch.zeros(tuple(t.shape), dtype=torch.float64) for name, t in like.items()}
    for cid in sorted(releases):
        arrays = releases[cid].arrays
        shapes = {name: tuple(t.shape) for name, t in arrays.items()}
        expected = {name: tuple(t.shape) for name, t in like.items()}
        if shapes != expected:
            raise InternalError(f"client {cid}'s release holds arrays {shapes}, but the secure sum is over "
                                f"{expected}: distributed DP sums releases of one declared shape")
        for name in total:
            total[name] += arrays[name].detach().double()
    return total


def validation_report(score: ClientScore) -> Release:
    """A training client's validation score as a release (model selection on validation needs it on the server)."""
    report = Message(metrics={"num_samples": float(score.num_samples), "correct": float(score.correct),
                              "loss_sum": float(score.loss_sum)})
    return Release.non_private(report, "validation_metrics")


class Runtime(ABC):
    """The round loop over a method's strategy and client procedure, and what an engine provides to it.

    Attributes every engine keeps: ``strategy``, ``client`` (the procedure, or on Flower its class's flags),
    ``training_ids`` (sorted), ``seed``, ``client_fraction``, ``completed_rounds``, and the bytes moved per client
    (``bytes_up``, ``bytes_down``).
    """

    def __init__(self, *, strategy: Any, client: Any, training_ids: list[int], seed: int,
                 client_fraction: float) -> None:
        self.strategy = strategy
        self.client = client
        self.training_ids = sorted(training_ids)
        self.seed = seed
        self.client_fraction = client_fraction
        self.completed_rounds = 0
        self.serving_only = False    # restored to a serving snapshot: for scoring and serving, no more rounds
        self.timer = RoundTimer()    # where the rounds' time goes (privfl.federation.timing)

    # -- the one round loop ---------------------------------------------------------------------------------------

    def run_round(self, round: int) -> dict[str, float]:
        """One round: sample, configure, one exchange per stage with the sampled clients, aggregate, commit.

        When the strategy asks for a secure sum (:meth:`privfl.methods.base.Strategy.secure_sum`), the last stage's
        releases reach it only as their sum (:meth:`secure_sum`, :meth:`~privfl.methods.base.Strategy.aggregate_sum`).
        The exchanges and the aggregation are timed in :attr:`timer` (:mod:`privfl.federation.timing`).
        """
        if round != self.completed_rounds:
            raise InternalError(f"round {round} requested but {self.completed_rounds} rounds are completed")
        if self.serving_only:
            raise InternalError(f"round {round} requested after a serving snapshot was restored: it holds no "
                                "optimiser state, so training cannot continue from it")
        sampled = self.strategy.sample_clients(round, self.training_ids, self.client_fraction, self.seed)
        self.begin_round(round, sampled)
        secure = self.strategy.secure_sum()
        last = self.strategy.train_stages - 1
        replies: dict[int, Message] = {}
        total = None
        for stage in range(last + 1):
            messages = self.strategy.configure_train(round, sampled) if stage == 0 else \
                self.strategy.configure_stage(round, stage, replies)
            with self.timer.part(CLIENT):
                if secure is not None and stage == last:
                    total = self.secure_sum(round, stage, messages, secure)
                else:
                    replies = self.exchange(round, stage, messages)
        for release in self.strategy.round_releases(round):
            self.record_for_everyone(release, round)
        with self.timer.part(AGGREGATION):
            metrics = self.strategy.aggregate_train(round, replies) if total is None else \
                self.strategy.aggregate_sum(round, total)
        self.commit_round(round, sampled)
        return {"clients": float(len(sampled)), **metrics}

    def begin_round(self, round: int, sampled: list[int]) -> None:  # noqa: B027 (an optional hook)
        """Before a round's first exchange (the in-process runtime copies the sampled clients' states here)."""

    @abstractmethod
    def exchange(self, round: int, stage: int, messages: dict[int, Message]) -> dict[int, Message]:
        """Stage ``stage`` of ``round``: each message down to its client, the client's work on its working state,
        and the releases that came up (recorded in the clients' ledgers before delivery), by client id."""

    @abstractmethod
    def secure_sum(self, round: int, stage: int, messages: dict[int, Message], secure: SecureSum) -> ReleaseSum:
        """Stage ``stage`` of ``round`` as :meth:`exchange` runs it, except that the server gets only the sum of the
        releases, each of them recorded in its client's ledger first; every client sent a message must release,
        or nothing is summed (a sum short of a share carries less noise than its calibration)."""

    def secure_aggregation(self) -> dict[str, Any]:
        """How :meth:`secure_sum` sums, for the run summary (``privacy.secure_aggregation``)."""
        return {"protocol": "simulated",
                "description": "simulated in this process: the server adds the clients' releases itself, so it "
                               "sees each of them; the epsilons hold for an observer of each round's sum only (on "
                               "Flower the releases are summed under SecAgg+)"}

    @abstractmethod
    def commit_round(self, round: int, sampled: list[int]) -> None:
        """The round completed: commit the sampled clients' working states, count the round."""

    @abstractmethod
    def record_for_everyone(self, release: RoundRelease, round: int) -> None:
        """Record ``release`` in every training client's ledger (raising, before anything is used, if one refuses)."""

    # -- evaluation and novel clients -----------------------------------------------------------------------------

    @property
    def serves_novel_clients(self) -> bool:
        return bool(self.client.serves_novel_clients)

    @abstractmethod
    def evaluate_training_clients(self, score: Score, *, report_to_server: bool,
                                  round: int | None) -> dict[int, ClientScore]:
        """Score every training client on its own validation split, on the client, with ``score(model, x, y)``.

        With ``report_to_server`` (model selection on validation needs it) each client sends its score, and that
        message is a recorded release like any other; otherwise the score stays with the experimenter.
        """

    @abstractmethod
    def score_novel_clients(self, federation: FederatedDataset, score: Score) -> dict[int, ClientScore]:
        """Serve the novel clients through the two-down, one-up protocol (their queries are recorded releases) and
        score each served model with that client's hidden labels, which no method sees."""

    # -- privacy records, state -------------------------------------------------------------------------------------

    @abstractmethod
    def ledgers(self) -> LedgerBook:
        """Every client's ledger as it stands."""

    def lifetime_ledgers(self) -> LedgerBook | None:
        """The clients' ledgers over their lifetime where they outlive the run (a Flower node keeps every run's
        releases), saved beside the run's own as :attr:`RunDirectory.NODE_LEDGERS`; None where the run's ledgers are
        the whole story (in process)."""
        return None

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release what the engine holds beyond the run's state (worker processes); the run is over, or stopped."""

    def use_journal(self, journal: ReleaseJournal, *, replay: bool) -> None:  # noqa: B027 (an optional hook)
        """Append each release's ledger record to ``journal`` before it is delivered; with ``replay`` (a resumed
        run), first put the journal's records that the checkpoint's ledgers lack back into them. An engine whose
        clients keep their ledgers themselves (Flower nodes) has nothing to add here."""

    def summary(self) -> dict[str, Any]:
        """What the run's ``summary.json`` records about the engine beyond the common keys (nothing in-process)."""
        return {}

    @property
    @abstractmethod
    def bytes_up(self) -> Mapping[int, int]: ...

    @property
    @abstractmethod
    def bytes_down(self) -> Mapping[int, int]: ...

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The server state and client states now (by reference: they are replaced, never mutated in place)."""

    def serving_snapshot(self) -> dict[str, Any]:
        """:meth:`snapshot` without the strategy's training-only state
        (:meth:`~privfl.methods.base.Strategy.serving_state`: momentum, optimiser moments): what a best-validation
        snapshot is restored for, scoring training clients and serving novel ones, needs nothing more."""
        snapshot = self.snapshot()
        return {**snapshot, "strategy": self.strategy.serving_state(snapshot["strategy"]), "serving_only": True}

    @abstractmethod
    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return server and client states to ``snapshot``; the ledgers are untouched. After a
        :meth:`serving_snapshot` no round runs (:attr:`serving_only`)."""

    @abstractmethod
    def committed_state_dict(self) -> dict[str, Any]:
        """The state at the end of the last completed round, plus the ledgers (which never roll back)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`committed_state_dict` (a resumed run)."""


class InProcessRuntime(Runtime):
    """Runs a method's rounds on the training clients of one federation, all in this process."""

    def __init__(self, *, strategy: Any, client: Any, training_clients: list[TrainingClient],
                 seed: int, client_fraction: float = 1.0, wire: Wire | None = None, workers: int = 1) -> None:
        super().__init__(strategy=strategy, client=client, training_ids=[c.client_id for c in training_clients],
                         seed=seed, client_fraction=client_fraction)
        self.clients = {c.client_id: c for c in training_clients}
        self.wire = wire if wire is not None else Wire()
        self.client_states: dict[int, ClientState] = {cid: {} for cid in self.clients}
        self._working: dict[int, ClientState] = {}
        self._committed = self.snapshot()
        self.workers = check_workers(workers)
        check_threads(self.workers)
        self._pool: ClientWorkers | None = None
        with torch.random.fork_rng(devices=[]):
            client.workspace_model()   # built outside any client's seeded stream, as on a Flower node

    def begin_round(self, round: int, sampled: list[int]) -> None:
        self._working = {cid: dict(self.client_states[cid]) for cid in sampled}

    def exchange(self, round: int, stage: int, messages: dict[int, Message]) -> dict[int, Message]:
        """The clients one after another in increasing id, or with ``workers > 1`` spread over worker processes
        (:class:`~privfl.federation.workers.ClientWorkers`): the same numbers, and the releases recorded here in
        the same order."""
        if self.workers > 1 and len(messages) > 1:
            return self._exchange_in_workers(round, stage, messages)
        replies = {}
        hand_over = self.client.hands_over_messages()    # messages go over uncopied, checked unmodified
        self.wire.hand_over = hand_over
        try:
            for cid in sorted(messages):
                delivered = self.wire.server_to_client(cid, messages[cid])
                versions = [t._version for t in delivered.arrays.values()] if hand_over else None
                ctx = client_context(self.seed, cid, round, stage)
                if stage == 0:
                    release = self.client.train(self.clients[cid], delivered, self._working[cid], ctx)
                else:
                    release = self.client.train_stage(stage, self.clients[cid], delivered, self._working[cid], ctx)
                if versions is not None and versions != [t._version for t in delivered.arrays.values()]:
                    raise InternalError(f"client {cid} modified the tensors of the message it received in place at "
                                        f"stage {stage} of round {round}, although its procedure "
                                        f"({type(self.client).__name__}) declares shares_messages: it must not")
                if release is not None:
                    replies[cid] = self.wire.client_to_server(cid, release, round=round)
        finally:
            self.wire.hand_over = False
        return replies

    def _exchange_in_workers(self, round: int, stage: int, messages: dict[int, Message]) -> dict[int, Message]:
        if self._pool is None:   # forked once, holding the clients' data and the procedure
            self._pool = ClientWorkers(self.workers, self.client, self.clients)
        for cid in sorted(messages):   # the workers read their own copies from bytes
            self.wire.count_down(cid, messages[cid])
        results = self._pool.run(seed=self.seed, round=round, stage=stage, messages=messages,
                                 states={cid: self._working[cid] for cid in messages})
        replies = {}
        for cid in sorted(results):
            result = results[cid]
            if isinstance(result, Exception):
                raise result
            release, self._working[cid] = result
            if release is not None:
                replies[cid] = self.wire.client_to_server(cid, release, round=round)
        return replies

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def secure_sum(self, round: int, stage: int, messages: dict[int, Message], secure: SecureSum) -> ReleaseSum:
        """Simulated: the releases come to this process, recorded by the wire, and are added here."""
        replies = self.exchange(round, stage, messages)
        silent = sorted(set(messages) - set(replies))
        if silent:
            raise InternalError(f"clients {silent} released nothing at stage {stage} of round {round}: the secure sum "
                                "needs every sampled client's release")
        return ReleaseSum(arrays=add_releases(replies, secure.like), count=len(replies))

    def record_for_everyone(self, release: RoundRelease, round: int) -> None:
        self.wire.record_for(self.training_ids, release, round=round)

    def commit_round(self, round: int, sampled: list[int]) -> None:
        self.client_states.update(self._working)
        self._working = {}
        self.completed_rounds = round + 1
        self._committed = self.snapshot()

    def training_client_model(self, client_id: int) -> nn.Module:
        """The model training client ``client_id`` is scored with, built on the client from the server's message."""
        message = self.wire.server_to_client(client_id, self.strategy.configure_evaluate(client_id))
        model: nn.Module = self.client.evaluation_model(self.clients[client_id], message,
                                                        self.client_states[client_id])
        return model

    def novel_client_model(self, novel: NovelClient) -> nn.Module:
        """Serve one novel client through the two-down, one-up protocol; its query (if any) is a recorded release."""
        cid = novel.client_id
        request = self.wire.server_to_client(cid, self.strategy.novel_request(cid))
        release = self.client.novel_query(novel, request)
        delivered = None if release is None else self.wire.client_to_server(cid, release, round=None)
        reply = self.wire.server_to_client(cid, self.strategy.novel_reply(cid, delivered))
        model: nn.Module = self.client.novel_model(novel, reply)
        return model

    def evaluate_training_clients(self, score: Score, *, report_to_server: bool,
                                  round: int | None) -> dict[int, ClientScore]:
        scores = {}
        for cid, data in self.clients.items():
            result = score(self.training_client_model(cid), data.x_val, data.y_val)
            if report_to_server:
                self.wire.client_to_server(cid, validation_report(result), round=round)
            scores[cid] = result
        return scores

    def score_novel_clients(self, federation: FederatedDataset, score: Score) -> dict[int, ClientScore]:
        if not self.serves_novel_clients:
            return {}
        return {novel.client_id: score(self.novel_client_model(novel), novel.x,
                                       federation.novel_labels.labels(novel.client_id))
                for novel in federation.novel_clients}

    def ledgers(self) -> LedgerBook:
        return self.wire.ledgers

    def use_journal(self, journal: ReleaseJournal, *, replay: bool) -> None:
        if replay:
            journal.replay_into(self.wire.ledgers)
        self.wire.journal = journal

    @property
    def bytes_up(self) -> Mapping[int, int]:
        return self.wire.bytes_up

    @property
    def bytes_down(self) -> Mapping[int, int]:
        return self.wire.bytes_down

    def snapshot(self) -> dict[str, Any]:
        return {
            "completed_rounds": self.completed_rounds,
            "strategy": self.strategy.state_dict(),
            "client_states": {cid: dict(state) for cid, state in self.client_states.items()},
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.strategy.load_state_dict(snapshot["strategy"])
        self.client_states = {int(cid): dict(s) for cid, s in snapshot["client_states"].items()}
        self.completed_rounds = int(snapshot["completed_rounds"])
        self.serving_only = bool(snapshot.get("serving_only", False))
        self._committed = self.snapshot()

    def committed_state_dict(self) -> dict[str, Any]:
        return {**self._committed, "wire": self.wire.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        engine = engine_of(state)
        if engine != "inprocess":
            raise ConfigError("this run ran on Flower nodes, which keep its ledgers and client states, so the "
                              "in-process engine cannot continue it; " + how_to_continue(engine, "RUN_DIR"))
        self.restore(state)
        self.wire.load_state_dict(state["wire"])
