"""The runtime on Flower: the round loop of :class:`~privfl.federation.runtime.Runtime`, each exchange on nodes.

:class:`FlowerRuntime` runs the same loop as the in-process runtime (the same clients sampled, the same messages
configured by the same strategy, replies aggregated in increasing client id), so a Flower run goes through the same
training loop, evaluation, model selection, checkpoints and run directory (:func:`privfl.experiment.train`) and ends
with the same numbers. What differs is where the clients are: each stage of a round is one exchange with the nodes of
the sampled clients (:class:`~privfl.engines.flower.transport.GridTransport`, one Flower message per node), and
each node computes with the same per-client context and torch seed
(:func:`privfl.federation.context.client_context`).

The server never sees a ledger entry being made: the nodes record their releases. The summary's epsilons come from
the ledgers the nodes report (``query.ledger``); the originals stay on the nodes.

Distributed DP (:mod:`privfl.privacy.training`): the strategy asks for the round's releases as a secure sum
(:meth:`~privfl.methods.base.Strategy.secure_sum`), and the last stage of each round runs under Flower's SecAgg+
(:mod:`privfl.engines.flower.secagg`): each node masks the sum of its clients' releases, the server unmasks only
the total and never sees a single release; a node that fails or is silent stops the run before the round's sum is
used. The summary's ``privacy.secure_aggregation`` gives the protocol's parameters, per round too.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from flwr.serverapp import Grid

from accounting import ClientId, LedgerBook, PrivacyLedger, ReleaseJournal, ReleaseRecord
from privfl.config import RunConfig
from privfl.engines.flower import protocol as p
from privfl.engines.flower.nodes import connect
from privfl.engines.flower.transport import FlowerClientError, GridTransport
from privfl.errors import ConfigError, InternalError
from privfl.federation.messages import Message
from privfl.federation.runtime import ReleaseSum, RoundRelease, Runtime, Score, SecureSum, how_to_continue
from privfl.federation.spend import lifetime_of
from privfl.metrics import ClientScore

logger = logging.getLogger(__name__)

#: The summary section a Flower run adds (``summary.json``): nodes, timings, and clients left out.
SUMMARY_KEY = "flower"


class FlowerRuntime(Runtime):
    """Runs a method's rounds on Flower nodes through ``grid``.

    ``serve`` (novel client ids) makes a serving runtime: it connects to the nodes of those novel clients only, and
    :meth:`serve` serves them; training nodes may be absent.
    """

    def __init__(self, grid: Grid, *, strategy, client, federation, config: RunConfig,
                 options: p.FlowerOptions | None = None, serve: list[int] | None = None, run_id: str = "",
                 engine: str = "flower-deployment") -> None:
        super().__init__(strategy=strategy, client=client,
                         training_ids=[c.client_id for c in federation.training_clients], seed=config.seed,
                         client_fraction=config.client_fraction)
        self.config = config
        self.options = options or p.FlowerOptions()
        self.novel_ids = sorted(c.client_id for c in federation.novel_clients)
        self.transport = GridTransport(grid, self.options)
        self.run_id = self.transport.run_id = run_id     # named in every message; the nodes tag their records
        self.engine = engine                       # flower-deployment or flower-sim, in checkpoints (how_to_continue)
        self._journal: ReleaseJournal | None = None
        self._lifetime = LedgerBook()              # the node ledgers as reported at the end: every run's releases
        self.transport.on_reply = self._arrived
        self._bytes_down: dict[int, int] = defaultdict(int)
        self._bytes_up: dict[int, int] = defaultdict(int)
        self._ledgers: dict[int, str] = {}        # client id -> its ledger (JSON) as its node last reported it
        self._server_book = LedgerBook()           # releases the server makes for every client (central DP)
        self._rounds_done = 0                      # rounds ever completed (restore() may go back to an earlier one)
        self._snapshot_round: int | None = None    # the round of the last snapshot handed out (nodes keep its state)
        self._state_round = -1                     # evaluate with the client states of this round (-1: latest)
        self._state_of: dict[int, int] = {}        # client id -> last completed round it trained in (its state's)
        self._committed = self._state(0)
        self._round_started = 0.0
        self.round_seconds: list[float] = []
        self.outside_ledger: Counter[str] = Counter()   # replies that reached the server without a ledger record
        self.directory = connect(self.transport, config, training_ids=self.training_ids, novel_ids=self.novel_ids,
                                 serves_novel_clients=self.serves_novel_clients, serve=serve)
        self.secagg = None                         # SecAgg+, when the strategy asks for a secure sum
        secure = strategy.secure_sum() if serve is None else None
        if secure is not None:
            from privfl.engines.flower.secagg import SecAggPlus

            # at most every training client's every value in every round
            values = config.rounds * len(self.training_ids) * sum(t.numel() for t in secure.like.values())
            self.secagg = SecAggPlus(self.transport, self.options, secure, values=values)

    @property
    def nodes(self) -> dict[int, int]:
        """Client id -> the Flower node that holds it."""
        return self.directory.nodes

    # -- sending, and what comes back -------------------------------------------------------------------------------

    def _send(self, outgoing: Mapping[int, tuple[Message, dict[str, Any]]], op: str, header: dict[str, Any], *,
              group: str = "", count: bool = True) -> dict[int, tuple[Message, dict[str, Any]]]:
        """Send each client its message through the transport, counting bytes down; note what the replies carry
        outside the ledger, and keep the ledgers the nodes report."""
        if count:
            for cid, (message, _) in outgoing.items():
                self._bytes_down[cid] += message.num_bytes()
        replies = self.transport.send(outgoing, op, header, group=group)
        for cid, (message, reply_header) in replies.items():
            if reply_header.get("kind") == p.TELEMETRY and (message.metrics or message.arrays):
                self.outside_ledger[op] += 1                       # a score (the ledger op's reply is empty)
            if "ledger" in reply_header:
                self.outside_ledger["ledger"] += 1
                self._ledgers[cid] = reply_header["ledger"]        # the node's ledger as of this reply
            elif reply_header.get("kind") == p.RELEASE:
                self._ledgers.pop(cid, None)                       # a release since the last report
        return replies

    def _arrived(self, node: int, content) -> None:
        """A node's reply as it arrives (before the exchange is complete, so a later failure keeps it): journal the
        records of the releases it carries, read from the clients' reply headers (no payload is decoded)."""
        for key in content.keys():
            if not (key.startswith("h") and key[1:].isdigit()):
                continue
            header = content[key]
            if header.get("kind") == p.RELEASE and header.get("record"):
                if self._journal is not None:
                    self._journal.append(int(key[1:]), ReleaseRecord.from_dict(json.loads(str(header["record"]))))

    def _delivered(self, replies: dict[int, tuple[Message, dict[str, Any]]]) -> dict[int, Message]:
        """The releases among ``replies`` (what the server may use), counted as bytes up."""
        delivered = {}
        for cid, (message, header) in replies.items():
            if header.get("kind") == p.RELEASE:
                self._bytes_up[cid] += message.num_bytes()
                delivered[cid] = message
        return delivered

    # -- the round loop's engine part ---------------------------------------------------------------------------------

    def begin_round(self, round: int, sampled: list[int]) -> None:
        self._round_started = time.perf_counter()

    def exchange(self, round: int, stage: int, messages: dict[int, Message]) -> dict[int, Message]:
        op = "train" if stage == 0 else "train_stage"
        header = {"round": round, "stage": stage, "completed_rounds": self._rounds_done}
        outgoing = {cid: (m, {"state_of": self._state_of.get(cid, -1)}) for cid, m in messages.items()}
        return self._delivered(self._send(outgoing, op, header, group=str(round)))

    def secure_sum(self, round: int, stage: int, messages: dict[int, Message], secure: SecureSum) -> ReleaseSum:
        """The exchange of :meth:`exchange`, under SecAgg+ (see the module docstring): the nodes record their
        clients' releases and send their sum masked; the server unmasks the round's total only. Bytes up count each
        release's payload as the ledger does (the node sends it masked, 8 bytes a value, with the protocol's keys)."""
        if self.secagg is None:
            raise InternalError("a secure sum was asked of a runtime built without one")
        op = "train" if stage == 0 else "train_stage"
        header = {"round": round, "stage": stage, "completed_rounds": self._rounds_done}
        outgoing = {cid: (m, {"state_of": self._state_of.get(cid, -1)}) for cid, m in messages.items()}
        for cid, (message, _) in outgoing.items():
            self._bytes_down[cid] += message.num_bytes()
        total = self.secagg.sum(outgoing, op, header, secure, round)
        release_bytes = sum(t.numel() * t.element_size() for t in secure.like.values())
        for cid in outgoing:
            self._ledgers.pop(cid, None)                            # a release since the last report
            self._bytes_up[cid] += release_bytes
        return total

    def secure_aggregation(self) -> dict[str, Any]:
        if self.secagg is None:
            return super().secure_aggregation()
        return self.secagg.describe()

    def record_for_everyone(self, release: RoundRelease, round: int) -> None:
        """Central DP: the server is the trusted aggregator, so it keeps the ledger of its aggregates itself (every
        training client's); :meth:`ledgers` adds them to what the nodes report."""
        metadata = {**release.metadata, **({p.RUN_KEY: self.run_id} if self.run_id else {})}
        record = self._server_book.record_for(self.training_ids, release.event, purpose=release.purpose,
                                              round=round, metadata=metadata, calibrated_for=release.calibrated_for,
                                              planned=release.planned)
        if self._journal is not None:
            self._journal.append_for(self.training_ids, record)

    def commit_round(self, round: int, sampled: list[int]) -> None:
        self.completed_rounds = self._rounds_done = round + 1
        self._state_of.update({cid: round for cid in sampled})   # the nodes commit these clients' states of this round
        self._state_round = -1
        self._committed = self._state(self.completed_rounds)
        self.round_seconds.append(time.perf_counter() - self._round_started)
        logger.info("round %d of %d done in %.1f s (%d clients)", round + 1, self.config.rounds,
                    self.round_seconds[-1], len(sampled))

    def evaluate_training_clients(self, score: Score, *, report_to_server: bool,
                                  round: int | None) -> dict[int, ClientScore]:
        """Every training node scores its evaluation model on its validation split (with ``score_model``; ``score``
        names the function the in-process runtime would call, which the nodes run themselves).

        With ``report_to_server`` each score is a release the node records; otherwise it comes back as telemetry
        for the experimenter, outside the ledger, as the in-process runtime reads it directly.
        """
        header = {"completed_rounds": self._rounds_done, "report": bool(report_to_server),
                  "round": -1 if round is None else round, "pin": round is not None,
                  "keep_pins": "" if self._snapshot_round is None else str(self._snapshot_round),
                  "state_round": self._state_round, "send_ledger": round is None}
        outgoing = {cid: (self.strategy.configure_evaluate(cid), {"state_of": self._state_of.get(cid, -1)})
                    for cid in self.training_ids}
        replies = self._send(outgoing, "evaluate", header)
        self._delivered(replies)
        return {cid: _score(message) for cid, (message, _) in replies.items()}

    def score_novel_clients(self, federation, score: Score) -> dict[int, ClientScore]:
        """Serve every novel client the run holds through the two-down, one-up protocol; the node builds its model,
        scores it with the hidden labels it holds, and sends back the score (telemetry)."""
        if not self.serves_novel_clients:
            return {}
        return self.serve([c.client_id for c in federation.novel_clients if c.client_id in self.nodes])

    def serve(self, ids: list[int]) -> dict[int, ClientScore]:
        """Serve novel clients ``ids``: request down, query up (a release the node records, or nothing), model
        down; each node scores its model and reports its ledger."""
        if not ids:
            return {}
        queries = self._delivered(self._send({cid: (self.strategy.novel_request(cid), {}) for cid in ids},
                                             "novel_request", {}))
        replies = self._send({cid: (self.strategy.novel_reply(cid, queries.get(cid)), {}) for cid in ids},
                             "novel_model", {"send_ledger": True})
        return {cid: _score(message) for cid, (message, _) in replies.items()}

    # -- ledgers, bytes, state --------------------------------------------------------------------------------------

    def ledgers(self, ids: list[int] | None = None) -> LedgerBook:
        """A book of this run's releases, from the ledgers the nodes reported (nodes whose last report predates a
        release are asked again) and the server's own records.

        A node's ledger is the client's lifetime: with a run id, its records of other runs (tagged with theirs, or
        untagged from before run ids) are left out here and kept in :attr:`lifetime`, whose epsilons the summary
        reports beside this run's."""
        ids = sorted(self.nodes) if ids is None else ids
        stale = [cid for cid in ids if cid not in self._ledgers]
        self._send({cid: (Message(), {}) for cid in stale}, "ledger", {}, count=False)
        book, lifetime = LedgerBook(), LedgerBook()
        for cid in ids:
            ledger = None
            if self._ledgers.get(cid):
                reported = PrivacyLedger.from_state_dict(json.loads(self._ledgers[cid]))
                if reported.client_id != cid:
                    raise FlowerClientError(f"the node of client {cid} reported the ledger of client "
                                            f"{reported.client_id!r}")
                lifetime.add(reported)
                ledger = PrivacyLedger(cid)
                for record in reported.records:
                    if not self.run_id or record.metadata.get(p.RUN_KEY) == self.run_id:
                        ledger._append_history(record)
            ledger = self._with_server_records(cid, ledger)
            if ledger is not None and (len(ledger) or cid in self._server_book):
                book.add(ledger)
        self._lifetime = lifetime
        return book

    def _with_server_records(self, cid: ClientId, ledger: PrivacyLedger | None) -> PrivacyLedger | None:
        if cid in self._server_book:
            ledger = ledger or PrivacyLedger(cid)
            for record in self._server_book[cid].records:
                ledger._append_history(record)
        return ledger

    def lifetime_ledgers(self) -> LedgerBook:
        """Each client's ledger over its lifetime: every record its node ledger held when last reported
        (:meth:`ledgers`), every run's, with this run's server records."""
        book = LedgerBook()
        for cid in sorted(set(self._lifetime) | set(self._server_book)):
            ledger = PrivacyLedger(cid)
            for record in self._lifetime[cid].records if cid in self._lifetime else []:
                ledger._append_history(record)
            merged = self._with_server_records(cid, ledger)
            assert merged is not None   # given a ledger, it returns one
            book.add(merged)
        return book

    def lifetime(self, delta: float) -> dict[str, Any]:
        """Each client's lifetime epsilon at ``delta`` (:meth:`lifetime_ledgers`) and the earlier runs it includes
        (:func:`lifetime_of`)."""
        return lifetime_of(self.lifetime_ledgers(), self.run_id, delta, clients=list(self.nodes))

    @property
    def bytes_up(self) -> Mapping[int, int]:
        return self._bytes_up

    @property
    def bytes_down(self) -> Mapping[int, int]:
        return self._bytes_down

    def _state(self, completed_rounds: int) -> dict[str, Any]:
        # Client states live on the nodes; the server's snapshot holds the server state and the round only.
        return {"completed_rounds": completed_rounds, "strategy": self.strategy.state_dict(), "client_states": {}}

    def snapshot(self) -> dict[str, Any]:
        """The server state now; the nodes keep their client states of this round until a later snapshot."""
        self._snapshot_round = self.completed_rounds
        return self._state(self.completed_rounds)

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return to ``snapshot``: the server state here, and the nodes evaluate with their states of that round."""
        self.strategy.load_state_dict(snapshot["strategy"])
        self.completed_rounds = int(snapshot["completed_rounds"])
        self._state_round = self.completed_rounds if self.completed_rounds < self._rounds_done else -1
        self._committed = self._state(self.completed_rounds)

    def committed_state_dict(self) -> dict[str, Any]:
        return {**self._committed, "wire": {"ledgers_on_nodes": True, "server_book": self._server_book.state_dict(),
                                            "bytes_down": [[k, v] for k, v in self._bytes_down.items()],
                                            "bytes_up": [[k, v] for k, v in self._bytes_up.items()],
                                            "run_id": self.run_id, "engine": self.engine,
                                            "state_of": [[k, v] for k, v in sorted(self._state_of.items())]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint of a run on Flower (``privfl flower run --resume``): the server state, the
        round each client's node holds its state of, the server's own records and the byte counts. The nodes keep
        their ledgers (a round run again releases again, recorded under the same run id) and their client states
        (each refuses to go on unless it holds the state of the round the server expects)."""
        wire = state.get("wire") or {}
        if not wire.get("ledgers_on_nodes") or "state_of" not in wire:
            raise ConfigError("the checkpoint is not one of a run on Flower nodes that can be resumed there (it was "
                              "run in-process, or by a privfl without resume on Flower): if it ran in-process, "
                              f"{how_to_continue('inprocess', 'RUN_DIR')}; otherwise start it again")
        if wire.get("run_id") != self.run_id:
            raise InternalError(f"resuming run {wire.get('run_id')!r} with the run id {self.run_id!r}")
        self.strategy.load_state_dict(state["strategy"])
        self.completed_rounds = self._rounds_done = int(state["completed_rounds"])
        self._server_book = LedgerBook.from_state_dict(wire["server_book"])
        self._bytes_down = defaultdict(int, {int(k): int(v) for k, v in wire["bytes_down"]})
        self._bytes_up = defaultdict(int, {int(k): int(v) for k, v in wire["bytes_up"]})
        self._state_of = {int(k): int(v) for k, v in wire["state_of"]}
        self._state_round = -1
        self._committed = self._state(self.completed_rounds)

    def use_journal(self, journal: ReleaseJournal, *, replay: bool) -> None:
        """Append each release's record to ``journal`` (the run directory's ``releases.jsonl``) as its reply arrives
        (:meth:`_arrived`), and the server's own records as it makes them. The nodes keep their ledgers, so a
        resumed run (``replay``) puts back only the server's records made after the checkpoint (the journal's lines
        for several clients)."""
        self._journal = journal
        if replay and journal.path.exists():
            lines = journal.path.read_text(encoding="utf-8").split("\n")[:-1]   # the last: empty, or cut short
            shared = [json.loads(line) for line in lines if '"client_ids"' in line]
            held = {cid: len(self._server_book[cid]) for cid in self._server_book}
            seen: Counter[int] = Counter()
            for entry in (e for e in shared if "client_ids" in e):
                record = ReleaseRecord.from_dict(entry["record"])
                for cid in entry["client_ids"]:
                    seen[cid] += 1
                    if seen[cid] > held.get(cid, 0):
                        self._server_book[cid]._append_history(record)

    def summary(self) -> dict[str, Any]:
        """What the run's ``summary.json`` records about Flower: nodes, timings, and novel clients left out."""
        directory = self.directory
        return {SUMMARY_KEY: {
            "nodes": len(directory.node_clients),
            "clients_per_node_max": max((len(c) for c in directory.node_clients.values()), default=0),
            "connect_s": directory.connect_seconds, "round_seconds": list(self.round_seconds),
            "novel_not_served": directory.novel_not_served.get("clients", []),
            "novel_not_served_reason": directory.novel_not_served.get("reason", ""),
            # this run's epsilons are privacy.epsilon_per_client; a node ledger holds the client's lifetime
            "lifetime": self.lifetime(self.config.delta),
            # data-dependent replies the epsilons do not cover (protocol.OUTSIDE_LEDGER): count and content
            "outside_ledger": {kind: {"replies": count, "carries": p.OUTSIDE_LEDGER[kind]}
                               for kind, count in sorted(self.outside_ledger.items())}}}


def _score(message: Message) -> ClientScore:
    m = message.metrics
    correct = float(m["correct"])       # fractional for an ensemble (expected correct predictions)
    return ClientScore(num_samples=int(m["num_samples"]), correct=int(correct) if correct.is_integer() else correct,
                       loss_sum=float(m["loss_sum"]))

