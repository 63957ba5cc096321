"""The privfl ServerApp: the method's strategy drives the rounds through Flower's Grid.

:class:`FlowerRuntime` has the interface of :class:`~privfl.federation.runtime.InProcessRuntime` that
:func:`privfl.experiment.train` uses (``run_round``, ``evaluate_training_clients``, ``snapshot``/``restore``, the
wire's byte counts and ledgers, novel-client serving), so a Flower run goes through the same training loop,
evaluation, model selection, checkpoints and run directory as an in-process run, and ends with the same numbers:

* the same clients are sampled (:func:`~privfl.federation.runtime.sample_clients`), the strategy configures the
  same messages, each stage of a round is one ``push_messages``/``pull_messages`` exchange with the nodes of the
  sampled clients (one Flower message per node, packing the messages of the clients it holds), and the replies are
  aggregated in increasing client id, as in-process;
* each node computes with the same per-client context and torch seed (:func:`privfl.federation.context.client_context`).

The server never sees a ledger entry being made: the nodes record their releases. The summary's epsilons come from
the ledgers the nodes report at the end (``query.ledger``); the originals stay on the nodes.

Two modes (run config): training (the default), and serving (``serve-from``: a finished training run directory),
which loads that run's selected server state and serves novel clients whose nodes connect later, in a run of their
own (:func:`serve_novel_clients`).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid, ServerApp

from accounting import LedgerBook, PrivacyLedger
from privfl.errors import ConfigError
from privfl.evaluation.metrics import ClientScore
from privfl.federation.flower import protocol as p
from privfl.federation.flower.records import pack, unpack
from privfl.federation.messages import Message
from privfl.federation.runtime import sample_clients

logger = logging.getLogger(__name__)

#: The summary section a Flower run adds (``summary.json``): nodes, timings, and clients left out.
SUMMARY_KEY = "flower"


class FlowerClientError(RuntimeError):
    """A node answered with an error (its ClientApp raised, e.g. a release over budget) or did not answer."""


class FlowerWire:
    """The server's end of the wire: bytes each way per client, and the ledgers the nodes report."""

    def __init__(self, fetch_ledgers: Callable[[], LedgerBook]) -> None:
        self._fetch = fetch_ledgers
        self.bytes_down: dict[int, int] = defaultdict(int)
        self.bytes_up: dict[int, int] = defaultdict(int)

    @property
    def ledgers(self) -> LedgerBook:
        """The clients' ledgers as their nodes last reported them (asking the nodes whose report is out of date)."""
        return self._fetch()

    def state_dict(self) -> dict:
        return {"ledgers_on_nodes": True,
                "bytes_down": [[k, v] for k, v in self.bytes_down.items()],
                "bytes_up": [[k, v] for k, v in self.bytes_up.items()]}


class FlowerRuntime:
    """Runs a method's rounds on Flower nodes; a drop-in for the in-process runtime inside :func:`experiment.train`.

    ``serve`` (novel client ids) makes a serving runtime: it connects to the nodes of those novel clients only, and
    :meth:`serve` serves them; training nodes may be absent.
    """

    def __init__(self, grid: Grid, *, strategy, client, federation, seed: int, client_fraction: float,
                 config, options: p.FlowerOptions | None = None, serve: list[int] | None = None) -> None:
        self.grid = grid
        self.strategy = strategy
        self.client = client                       # the procedure class's flags only (serves_novel_clients)
        self.config = config
        self.seed = seed
        self.client_fraction = client_fraction
        self.options = options or p.FlowerOptions()
        self.training_ids = sorted(c.client_id for c in federation.training_clients)
        self.novel_ids = sorted(c.client_id for c in federation.novel_clients)
        self.wire = FlowerWire(self._fetch_ledgers)
        self._ledgers: dict[int, str] = {}        # client id -> its ledger (JSON) as its node last reported it
        self.completed_rounds = 0
        self._rounds_done = 0                      # rounds ever completed (restore() may go back to an earlier one)
        self._snapshot_round: int | None = None    # the round of the last snapshot handed out (nodes keep its state)
        self._state_round = -1                     # evaluate with the client states of this round (-1: latest)
        self._state_of: dict[int, int] = {}        # client id -> last completed round it trained in (its state's)
        self._committed = self._state(0)
        self.nodes: dict[int, int] = {}            # client id -> Flower node id
        self.node_clients: dict[int, list[int]] = {}   # Flower node id -> the client ids it holds
        self.round_seconds: list[float] = []
        self.novel_not_served: dict[str, Any] = {}
        self.outside_ledger: Counter[str] = Counter()   # replies that reached the server without a ledger record
        started = time.perf_counter()
        self._connect(serve)
        self.connect_seconds = time.perf_counter() - started

    # -- connecting: which node holds which clients ----------------------------------------------------------------

    def _connect(self, serve: list[int] | None) -> None:
        """Say hello to nodes as they connect, until every client the run needs is held or ``node_wait_s`` passed.

        Training needs every training client, and every novel client when the method serves them and the nodes
        declare novel partitions (``num-partitions`` = training + novel clients); nodes started with
        ``num-partitions`` = training clients leave the novel clients out of this run, which the summary records.
        Serving needs the ``serve`` novel clients only.
        """
        num_training, num_all = len(self.training_ids), len(self.training_ids) + len(self.novel_ids)
        deadline = time.monotonic() + self.options.node_wait_s
        declared: dict[int, int] = {}              # node id -> its num-partitions
        partitions: dict[int, int] = {}            # client id -> partition
        while True:
            new = self._new_nodes(declared)
            if new:
                for nid, header in self._hello(new).items():
                    declared[nid] = int(header["num_partitions"])
                    for cid, partition in zip(header["holds"], header["partitions"]):
                        if cid in self.nodes:
                            raise ConfigError(f"client {cid} is held by node {self.nodes[cid]} and by node {nid}; "
                                              "give every SuperNode its own partitions")
                        self.nodes[int(cid)], partitions[int(cid)] = nid, int(partition)
                    self.node_clients[nid] = sorted(int(c) for c in header["holds"])
                counts = sorted(set(declared.values()))
                if len(counts) > 1:
                    raise ConfigError(f"the nodes were started with different num-partitions {counts}; start every "
                                      f"SuperNode of a run with the same num-partitions ({num_training} or {num_all})")
            novel_declared = bool(declared) and next(iter(declared.values())) == num_all and num_all > num_training
            if serve is not None and declared and not novel_declared:
                raise ConfigError(f"serving novel clients needs nodes started with num-partitions={num_all} "
                                  f"(training and novel partitions), got {next(iter(declared.values()))}")
            if serve is not None:
                needed = list(serve)
            else:
                needed = self.training_ids + (self.novel_ids if self.client.serves_novel_clients and novel_declared
                                              else [])
            missing = [cid for cid in needed if cid not in self.nodes]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if missing:
            index = {cid: i for i, cid in enumerate(self.training_ids + self.novel_ids)}
            raise FlowerClientError(
                f"{len(missing)} clients the run needs have no connected node after {self.options.node_wait_s:g} s "
                f"(node-wait-s): clients {_ids(missing)} (partitions {_ids([index[c] for c in missing])} of "
                f"{num_all}); {len(declared)} nodes connected. Start SuperNodes for those partitions")
        if serve is None and self.client.serves_novel_clients and self.novel_ids and not novel_declared:
            reason = (f"the nodes were started with num-partitions={num_training} (training clients only), so no "
                      f"node holds a novel client; start them with num-partitions={num_all} to serve novel clients "
                      "in this run, or serve them later in a run of their own (serve-from)")
            self.novel_not_served = {"clients": list(self.novel_ids), "reason": reason}
            warnings.warn(f"{len(self.novel_ids)} novel clients will not be served: {reason}", stacklevel=2)
            logger.warning("%d novel clients will not be served: %s", len(self.novel_ids), reason)

    def _new_nodes(self, known: Mapping[int, Any], settle_s: float = 1.0, most_s: float = 5.0) -> list[int]:
        """Nodes not in ``known``; once some appear, wait until no more appear for ``settle_s`` (at most ``most_s``),
        so that nodes connecting together get one hello exchange."""
        new = {nid for nid in self.grid.get_node_ids() if nid not in known}
        until = time.monotonic() + most_s
        while new and time.monotonic() < until:
            time.sleep(settle_s)
            more = {nid for nid in self.grid.get_node_ids() if nid not in known} - new
            if not more:
                break
            new |= more
        return sorted(new)

    def _hello(self, node_ids: list[int]) -> dict[int, dict[str, Any]]:
        """Ask ``node_ids`` which clients they hold and with which run config; refuse a node whose config differs."""
        from privfl.experiment import RunConfig

        ours = RunConfig.from_dict(json.loads(json.dumps(self.config.to_dict()))).to_dict()   # as a node parses it
        replies = self._exchange({nid: pack({}, {"op": "hello"}) for nid in node_ids}, "hello")
        headers = {}
        for nid, content in replies.items():
            header, _ = unpack(content)
            theirs = RunConfig.from_dict(json.loads(header["config"])).to_dict()
            if theirs != ours:
                raise ConfigError(f"Flower node {nid} runs with a different privfl-config than the server "
                                  f"({_differences(ours, theirs)}); start every node of a run with the same run "
                                  "config")
            headers[nid] = header
        return headers

    # -- one exchange: a message down to each node, the replies up -------------------------------------------------

    def _exchange(self, contents: Mapping[int, RecordDict], op: str, group: str = "") -> dict[int, RecordDict]:
        """Push one Flower message per node, pull every reply (backing off exponentially between asks), and give
        the replies' contents by node id. Raises :class:`FlowerClientError` naming the nodes (and their clients)
        that failed, or that did not answer within ``timeout_s``."""
        messages = [FlowerMessage(content, nid, p.MESSAGE_TYPES[op], group_id=group)
                    for nid, content in sorted(contents.items())]
        if not messages:
            return {}
        pushed = {str(i) for i in self.grid.push_messages(messages) if i}
        node_of = {str(m.metadata.message_id): m.metadata.dst_node_id for m in messages}
        refused = [nid for mid, nid in node_of.items() if mid not in pushed]
        if refused:
            raise FlowerClientError(f"the SuperLink did not accept the {op!r} messages for {self._who(refused)}")
        pending = set(node_of)
        replies: dict[int, RecordDict] = {}
        timeout = self.options.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.options.poll_min_s
        while pending:
            arrived = False
            for reply in self.grid.pull_messages(pending):
                pending.discard(reply.metadata.reply_to_message_id)
                nid = reply.metadata.src_node_id
                arrived = True
                if reply.has_error():
                    raise FlowerClientError(f"{self._who([nid])} failed in {op!r}: {reply.error.reason}")
                replies[nid] = reply.content
            if pending:
                if deadline is not None and time.monotonic() > deadline:
                    silent = sorted(node_of[mid] for mid in pending)
                    raise FlowerClientError(
                        f"{len(silent)} of {len(messages)} nodes did not answer {op!r} within {timeout:g} s "
                        f"(timeout-s): {self._who(silent)}; is a SuperNode down?")
                delay = self.options.poll_min_s if arrived else min(2 * delay, self.options.poll_max_s)
                time.sleep(delay)
        return replies

    def _who(self, node_ids: list[int]) -> str:
        parts = []
        for nid in node_ids:
            held = self.node_clients.get(nid)
            parts.append(f"node {nid}" + (f" (clients {_ids(held)})" if held else ""))
        return ", ".join(parts)

    def _send(self, outgoing: Mapping[int, tuple[Message, dict[str, Any]]], op: str, header: dict[str, Any], *,
              group: str = "", count: bool = True) -> dict[int, tuple[Message, dict[str, Any]]]:
        """Send each client its message (with its own header beside the common ``header``), packed per node; return
        each client's reply, in increasing client id. A message object several clients get is converted once."""
        by_node: dict[int, dict[int, tuple[Message, dict[str, Any]]]] = defaultdict(dict)
        for cid in sorted(outgoing):
            message, own = outgoing[cid]
            by_node[self.nodes[cid]][cid] = (message, own)
            if count:
                self.wire.bytes_down[cid] += message.num_bytes()
        converted: dict[int, dict[str, Any]] = {}
        contents = {nid: pack(items, {"op": op, **header}, converted=converted) for nid, items in by_node.items()}
        replies: dict[int, tuple[Message, dict[str, Any]]] = {}
        for nid, content in self._exchange(contents, op, group).items():
            _, items = unpack(content)
            if set(items) != set(by_node[nid]):
                raise FlowerClientError(f"node {nid} answered {op!r} for clients {_ids(sorted(items))}, but was asked "
                                        f"for clients {_ids(sorted(by_node[nid]))}")
            for cid, (message, reply_header) in items.items():
                replies[cid] = (message, reply_header)
                if reply_header.get("kind") == p.TELEMETRY and (message.metrics or message.arrays):
                    self.outside_ledger[op] += 1                       # a score (the ledger op's reply is empty)
                if "ledger" in reply_header:
                    self.outside_ledger["ledger"] += 1
                    self._ledgers[cid] = reply_header["ledger"]        # the node's ledger as of this reply
                elif reply_header.get("kind") == p.RELEASE:
                    self._ledgers.pop(cid, None)                       # a release since the last report
        return {cid: replies[cid] for cid in sorted(replies)}

    def _delivered(self, replies: dict[int, tuple[Message, dict[str, Any]]]) -> dict[int, Message]:
        """The releases among ``replies`` (what the server may use), counted as bytes up."""
        delivered = {}
        for cid, (message, header) in replies.items():
            if header.get("kind") == p.RELEASE:
                self.wire.bytes_up[cid] += message.num_bytes()
                delivered[cid] = message
        return delivered

    # -- the runtime interface of experiment.train ------------------------------------------------------------------

    def run_round(self, round: int) -> dict[str, float]:
        """One round: configure, one exchange per stage with the sampled clients' nodes, aggregate."""
        if round != self.completed_rounds:
            raise RuntimeError(f"round {round} requested but {self.completed_rounds} rounds are completed")
        started = time.perf_counter()
        sampled = sample_clients(self.training_ids, self.client_fraction, seed=self.seed, round=round)
        replies = self._train(round, 0, self.strategy.configure_train(round, sampled))
        for stage in range(1, self.strategy.train_stages):
            replies = self._train(round, stage, self.strategy.configure_stage(round, stage, replies))
        metrics = self.strategy.aggregate_train(round, replies)
        self.completed_rounds = self._rounds_done = round + 1
        self._state_of.update({cid: round for cid in sampled})   # the nodes commit these clients' states of this round
        self._state_round = -1
        self._committed = self._state(self.completed_rounds)
        self.round_seconds.append(time.perf_counter() - started)
        return {"clients": float(len(sampled)), **metrics}

    def _train(self, round: int, stage: int, messages: dict[int, Message]) -> dict[int, Message]:
        op = "train" if stage == 0 else "train_stage"
        header = {"round": round, "stage": stage, "completed_rounds": self._rounds_done}
        outgoing = {cid: (m, {"state_of": self._state_of.get(cid, -1)}) for cid, m in messages.items()}
        return self._delivered(self._send(outgoing, op, header, group=str(round)))

    def evaluate_training_clients(self, score, *, report_to_server: bool, round: int | None) -> dict[int, Any]:
        """Every training node scores its evaluation model on its validation split (with ``score_model``).

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

    def score_novel_clients(self, federation) -> dict[int, ClientScore]:
        """Serve every novel client the run holds (see :meth:`_connect`) through the two-down, one-up protocol;
        the node builds its model, scores it with the hidden labels it holds, and sends back the score (telemetry)."""
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

    def _fetch_ledgers(self, ids: list[int] | None = None) -> LedgerBook:
        """A book of the ledgers the nodes reported; nodes whose last report predates a release are asked again."""
        ids = sorted(self.nodes) if ids is None else ids
        stale = [cid for cid in ids if cid not in self._ledgers]
        self._send({cid: (Message(), {}) for cid in stale}, "ledger", {}, count=False)
        book = LedgerBook()
        for cid in ids:
            if self._ledgers.get(cid):
                ledger = PrivacyLedger.from_state_dict(json.loads(self._ledgers[cid]))
                if ledger.client_id != cid:
                    raise FlowerClientError(f"the node of client {cid} reported the ledger of client "
                                            f"{ledger.client_id!r}")
                book.add(ledger)
        return book

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
        return {**self._committed, "wire": self.wire.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ConfigError("resuming a run on Flower is not supported yet: resume it with --engine inprocess, "
                          "or start it again")

    def summary(self) -> dict[str, Any]:
        """What the run's ``summary.json`` records about Flower: nodes, timings, and novel clients left out."""
        return {"nodes": len(self.node_clients),
                "clients_per_node_max": max((len(c) for c in self.node_clients.values()), default=0),
                "connect_s": self.connect_seconds, "round_seconds": list(self.round_seconds),
                "novel_not_served": self.novel_not_served.get("clients", []),
                "novel_not_served_reason": self.novel_not_served.get("reason", ""),
                # data-dependent replies the epsilons do not cover (protocol.OUTSIDE_LEDGER): count and content
                "outside_ledger": {kind: {"replies": count, "carries": p.OUTSIDE_LEDGER[kind]}
                                   for kind, count in sorted(self.outside_ledger.items())}}


def _ids(ids: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(i) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


def _differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> str:
    """The settings that differ between two run configs, as ``key: server X, node Y``."""
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _differences(a, b, f"{prefix}{key}.")
            if inner:
                diffs.append(inner)
        elif a != b:
            diffs.append(f"{prefix}{key}: server {a!r}, node {b!r}")
    return "; ".join(diffs)


def _score(message: Message) -> ClientScore:
    m = message.metrics
    correct = float(m["correct"])       # fractional for an ensemble (expected correct predictions)
    return ClientScore(num_samples=int(m["num_samples"]), correct=int(correct) if correct.is_integer() else correct,
                       loss_sum=float(m["loss_sum"]))


def flower_runtime_factory(grid: Grid, options: p.FlowerOptions | None = None, *, on_build=None):
    """A ``runtime_factory`` for :func:`privfl.experiment.train` that runs on ``grid`` (``on_build(runtime)`` is
    called with the runtime it builds)."""
    from privfl.experiment import build_runtime

    def factory(config, federation) -> FlowerRuntime:
        base = build_runtime(config, federation)     # the same strategy and procedure objects as in-process
        runtime = FlowerRuntime(grid, strategy=base.strategy, client=base.client, federation=federation,
                                seed=config.seed, client_fraction=config.client_fraction, config=config,
                                options=options)
        if on_build is not None:
            on_build(runtime)
        return runtime

    return factory


def options_from_run_config(run_config: Mapping[str, Any]) -> p.FlowerOptions:
    """The waiting limits a run config sets (``timeout-s`` > 0, ``node-wait-s`` >= 0; unset: the defaults)."""
    values = {}
    for key, name in ((p.TIMEOUT, "timeout_s"), (p.NODE_WAIT, "node_wait_s")):
        raw = run_config.get(key)
        if raw in (None, ""):
            continue
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"run config {key}={raw!r} must be a number")
        if key == p.TIMEOUT and raw <= 0:
            raise ConfigError(f"run config {key}={raw!r} must be > 0 seconds (a limit for one exchange's replies; "
                              f"the default is {p.DEFAULT_TIMEOUT_S:g}): without one a dead node hangs the run")
        values[name] = float(raw)
    return p.FlowerOptions(**values)


def run_server(grid: Grid, run_config: Mapping[str, Any], *, options: p.FlowerOptions | None = None,
               progress: bool = False, stop_after_round: int | None = None) -> dict[str, Any]:
    """Train the run that ``run_config`` describes (``privfl-config``, ``out``, ``overwrite``) on ``grid``, or, with
    ``serve-from``, serve novel clients of that finished run (:func:`serve_novel_clients`)."""
    from privfl.experiment import RunConfig, train
    from privfl.federation.rundir import RunDirectory

    options = options or options_from_run_config(run_config)
    out = run_config.get(p.OUT) or ""
    if run_config.get(p.SERVE_FROM):
        if not out:
            raise ConfigError(f"run config {p.OUT!r} is empty: serving needs a directory for its results")
        return serve_novel_clients(grid, run_config[p.SERVE_FROM], out, clients=_serve_clients(run_config),
                                   options=options, overwrite=bool(run_config.get(p.OVERWRITE)))
    text = run_config.get(p.RUN_CONFIG) or ""
    if not text or not out:
        raise ConfigError(f"run config needs {p.RUN_CONFIG!r} (the RunConfig as JSON) and {p.OUT!r} (the run "
                          f"directory on the SuperLink's machine); got {sorted(k for k, v in run_config.items() if v)}")
    config = RunConfig.from_dict(json.loads(text))
    built: list[FlowerRuntime] = []
    summary = train(config, out, overwrite=bool(run_config.get(p.OVERWRITE)), progress=progress,
                    stop_after_round=stop_after_round,
                    runtime_factory=flower_runtime_factory(grid, options, on_build=built.append))
    summary[SUMMARY_KEY] = built[0].summary()
    RunDirectory(out).write_json(RunDirectory.SUMMARY, summary)
    return summary


def _serve_clients(run_config: Mapping[str, Any]) -> list[int] | None:
    raw = run_config.get(p.SERVE_CLIENTS)
    if raw in (None, ""):
        return None
    try:
        return [int(v) for v in str(raw).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"run config {p.SERVE_CLIENTS}={raw!r} must be comma-separated novel client ids, "
                          "e.g. \"9,10\"") from None


SERVE_SUMMARY, SERVE_LEDGER = "serve.json", "ledger.json"


def serve_novel_clients(grid: Grid, train_dir: str | Path, out: str | Path, *, clients: list[int] | None = None,
                        options: p.FlowerOptions | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Serve novel clients of the finished training run in ``train_dir``, in a run of their own.

    The server loads the run's config and its selected server state from ``checkpoint.pt`` (``weights_only=True``):
    the best-validation snapshot for ``select="best_val"``, the final state otherwise. Each novel client's node
    (``num-partitions`` = training + novel clients) gets the method's request, sends its query (ODPFL-HN: a
    descriptor, recorded in that node's ledger first; FedAvg: nothing), and gets its model, which it scores with
    the labels it holds. ``clients``: the novel client ids to serve (default: all). Writes ``serve.json`` (scores,
    epsilons, bytes) and ``ledger.json`` (the served clients' ledgers as their nodes report them) into ``out``.
    """
    from privfl.data import build_federation
    from privfl.evaluation.metrics import summarize_scores
    from privfl.experiment import RunConfig, build_runtime
    from privfl.federation.rundir import RunDirectory, atomic_write_bytes, dumps

    run = RunDirectory(train_dir)
    config = RunConfig.from_dict(run.read_json(RunDirectory.CONFIG))
    checkpoint = run.load_checkpoint()
    if checkpoint is None:
        raise ConfigError(f"{run.path(RunDirectory.CHECKPOINT)} does not exist: serve-from needs a training run "
                          "directory with its checkpoint")
    state = checkpoint["runtime"]
    if int(state["completed_rounds"]) != config.rounds:
        raise ConfigError(f"the run in {run.root} completed {state['completed_rounds']} of {config.rounds} rounds: "
                          "finish it (privfl train --resume) before serving its novel clients")
    best = checkpoint.get("best") or {}
    if config.select == "best_val" and best.get("snapshot") is not None:
        selected, selected_round = best["snapshot"], int(best["round"])
    else:
        selected, selected_round = state, int(state["completed_rounds"])
    target = RunDirectory(out)
    if target.path(SERVE_SUMMARY).exists() and not overwrite:
        raise ConfigError(f"{target.path(SERVE_SUMMARY)} exists; choose another out directory or set overwrite")
    federation = build_federation(config.federation, seed=config.seed)
    base = build_runtime(config, federation)
    if not base.client.serves_novel_clients:
        raise ConfigError(f"method {config.method!r} does not serve novel clients (its novel clients need labels "
                          "or training), so there is nothing to serve")
    base.strategy.load_state_dict(selected["strategy"])
    novel = sorted(c.client_id for c in federation.novel_clients)
    ids = novel if clients is None else sorted(set(clients))
    unknown = [cid for cid in ids if cid not in novel]
    if unknown or not ids:
        raise ConfigError(f"serve-clients {clients!r} must name novel clients of the run in {run.root}; valid: "
                          f"{_ids(novel, 50)}")
    started = time.perf_counter()
    runtime = FlowerRuntime(grid, strategy=base.strategy, client=base.client, federation=federation,
                            seed=config.seed, client_fraction=config.client_fraction, config=config,
                            options=options, serve=ids)
    scores = runtime.serve(ids)
    ledgers = runtime._fetch_ledgers(ids)
    epsilons = ledgers.epsilons(config.delta)
    rows = [{"client_id": cid, "num_samples": scores[cid].num_samples, "accuracy": 100.0 * scores[cid].accuracy,
             "loss": scores[cid].loss, "epsilon": float(epsilons.get(cid, 0.0)),
             "releases": len(ledgers[cid]) if cid in ledgers else 0,
             "bytes_up": runtime.wire.bytes_up.get(cid, 0), "bytes_down": runtime.wire.bytes_down.get(cid, 0)}
            for cid in ids]
    summary = {"mode": "serve", "train_dir": str(run.root), "method": config.method, "seed": config.seed,
               "select": config.select, "selected_round": selected_round,
               "novel": summarize_scores([scores[cid] for cid in ids]),
               "privacy": {"delta": config.delta, "epsilon_max_novel": max(r["epsilon"] for r in rows),
                           "epsilon_per_client": {str(r["client_id"]): r["epsilon"] for r in rows}},
               "clients": rows, "wall_time_s": time.perf_counter() - started, SUMMARY_KEY: runtime.summary()}
    target.root.mkdir(parents=True, exist_ok=True)
    ledgers.save(target.path(SERVE_LEDGER))
    atomic_write_bytes(target.path(SERVE_SUMMARY), (dumps(summary) + "\n").encode())
    return summary


def make_server_app(run_config: Mapping[str, Any] | None = None, *, options: p.FlowerOptions | None = None,
                    progress: bool = False, stop_after_round: int | None = None,
                    result: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp that trains ``run_config`` (or the run config Flower gives it), or serves with ``serve-from``;
    the summary, or the exception, goes to ``result["summary"]`` / ``result["error"]``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        values = {**(run_config or {}), **{k: v for k, v in context.run_config.items() if v not in ("", None)}}
        try:
            summary = run_server(grid, values, options=options, progress=progress, stop_after_round=stop_after_round)
        except BaseException as error:          # handed to the caller, who re-raises it outside Flower's thread
            if result is None:
                raise
            result["error"] = error
            return
        if result is not None:
            result["summary"] = summary

    return app


#: The ServerApp that ``flwr run`` loads (``privfl.federation.flower.server_app:app``).
app = make_server_app()
