"""The privfl ServerApp: the method's strategy drives the rounds through Flower's Grid.

:class:`FlowerRuntime` has the interface of :class:`~privfl.federation.runtime.InProcessRuntime` that
:func:`privfl.experiment.train` uses (``run_round``, ``evaluate_training_clients``, ``snapshot``/``restore``, the
wire's byte counts and ledgers, novel-client serving), so a Flower run goes through the same training loop,
evaluation, model selection, checkpoints and run directory as an in-process run, and ends with the same numbers:

* the same clients are sampled (:func:`~privfl.federation.runtime.sample_clients`), the strategy configures the
  same messages, each stage of a round is one ``push_messages``/``pull_messages`` exchange with the sampled nodes,
  and the replies are aggregated in increasing client id, as in-process;
* each node computes with the same per-client context and torch seed (:func:`privfl.federation.context.client_context`).

The server never sees a ledger entry being made: the nodes record their releases. The summary's epsilons come from
the ledgers the nodes report at the end (``query.ledger``); the originals stay on the nodes.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid, ServerApp

from accounting import LedgerBook, PrivacyLedger
from privfl.errors import ConfigError
from privfl.evaluation.metrics import ClientScore
from privfl.federation.flower import protocol as p
from privfl.federation.flower.records import HEADER, from_records, to_records
from privfl.federation.messages import Message
from privfl.federation.runtime import sample_clients


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
    """Runs a method's rounds on Flower nodes; a drop-in for the in-process runtime inside :func:`experiment.train`."""

    def __init__(self, grid: Grid, *, strategy, client, federation, seed: int, client_fraction: float,
                 config_text: str, options: p.FlowerOptions | None = None) -> None:
        self.grid = grid
        self.strategy = strategy
        self.client = client                       # the procedure class's flags only (serves_novel_clients)
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
        self._committed = self._state(0)
        self.nodes: dict[int, int] = {}            # client id -> Flower node id
        self._connect(config_text)

    # -- connecting: which node holds which client -----------------------------------------------------------------

    def _connect(self, config_text: str) -> None:
        expected = len(self.training_ids) + len(self.novel_ids)
        deadline = time.monotonic() + self.options.node_wait_s
        node_ids = list(self.grid.get_node_ids())
        while len(node_ids) < expected and time.monotonic() < deadline:
            time.sleep(0.5)
            node_ids = list(self.grid.get_node_ids())
        if len(node_ids) < len(self.training_ids):
            raise FlowerClientError(
                f"{len(node_ids)} Flower nodes connected within {self.options.node_wait_s:g} s, but the run has "
                f"{len(self.training_ids)} training clients (one node each); start the missing SuperNodes")
        header = {"op": "hello", "config": config_text}
        replies = self._send({("node", nid): (Message(), header) for nid in node_ids}, "hello", count=False)
        holders: dict[int, list[int]] = defaultdict(list)
        for (_, nid), (_, reply) in replies.items():
            if not reply.get("config_matches"):
                raise ConfigError(f"Flower node {nid} runs with a different privfl-config than the server; "
                                  "start every node of a run with the same run config")
            holders[int(reply["client_id"])].append(nid)
        duplicated = {cid: nids for cid, nids in holders.items() if len(nids) > 1}
        if duplicated:
            raise ConfigError(f"several nodes hold the same client (client id: node ids) {duplicated}; "
                              "give every SuperNode its own partition-id")
        missing = [cid for cid in self.training_ids if cid not in holders]
        if missing:
            raise FlowerClientError(f"no connected node holds training clients {missing}")
        self.nodes = {cid: nids[0] for cid, nids in holders.items()}

    # -- one exchange: a message down to each node, the replies up -------------------------------------------------

    def _send(self, outgoing: Mapping[Any, tuple[Message, dict[str, Any]]], op: str, *, group: str = "",
              count: bool = True) -> dict[Any, tuple[Message, dict[str, Any]]]:
        """Push one message per destination (a client id, or ``("node", node_id)``), pull every reply, in key order.

        Identical privfl messages (FedAvg sends one to all) are converted to records once and shared.
        """
        converted: dict[int, RecordDict] = {}
        flower_messages, destination = [], {}
        for key in sorted(outgoing):      # keys are all client ids, or all ("node", node id)
            message, header = outgoing[key]
            node_id = key[1] if isinstance(key, tuple) else self.nodes[key]
            if count and not isinstance(key, tuple):
                self.wire.bytes_down[key] += message.num_bytes()
            if id(message) not in converted:
                converted[id(message)] = to_records(message)
            body = converted[id(message)]
            content = RecordDict({**{k: v for k, v in body.items() if k != HEADER},
                                  HEADER: ConfigRecord(dict(header))})
            flower_messages.append(FlowerMessage(content, node_id, p.MESSAGE_TYPES[op], group_id=group))
            destination[node_id] = key
        if not flower_messages:
            return {}
        pending = set(self.grid.push_messages(flower_messages))
        replies: dict[Any, tuple[Message, dict[str, Any]]] = {}
        deadline = None if self.options.timeout_s is None else time.monotonic() + self.options.timeout_s
        while pending:
            for reply in self.grid.pull_messages(pending):
                pending.discard(reply.metadata.reply_to_message_id)
                key = destination[reply.metadata.src_node_id]
                if reply.has_error():
                    raise FlowerClientError(f"{_who(key)} failed in {op!r}: {reply.error.reason}")
                replies[key] = message, header = from_records(reply.content)
                if isinstance(key, int) and "ledger" in header:
                    self._ledgers[key] = header["ledger"]          # the node's ledger as of this reply
                elif isinstance(key, int) and header.get("kind") == p.RELEASE:
                    self._ledgers.pop(key, None)                   # a release since the last report
            if pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise FlowerClientError(f"{len(pending)} of {len(flower_messages)} nodes did not answer {op!r} "
                                            f"within {self.options.timeout_s:g} s")
                time.sleep(self.options.poll_interval_s)
        return {key: replies[key] for key in sorted(replies)}

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
        """One round: configure, one exchange per stage with the sampled nodes, aggregate."""
        if round != self.completed_rounds:
            raise RuntimeError(f"round {round} requested but {self.completed_rounds} rounds are completed")
        sampled = sample_clients(self.training_ids, self.client_fraction, seed=self.seed, round=round)
        replies = self._train(round, 0, self.strategy.configure_train(round, sampled))
        for stage in range(1, self.strategy.train_stages):
            replies = self._train(round, stage, self.strategy.configure_stage(round, stage, replies))
        metrics = self.strategy.aggregate_train(round, replies)
        self.completed_rounds = self._rounds_done = round + 1
        self._state_round = -1
        self._committed = self._state(self.completed_rounds)
        return {"clients": float(len(sampled)), **metrics}

    def _train(self, round: int, stage: int, messages: dict[int, Message]) -> dict[int, Message]:
        header = {"op": "train" if stage == 0 else "train_stage", "round": round, "stage": stage,
                  "completed_rounds": self._rounds_done}
        replies = self._send({cid: (m, header) for cid, m in messages.items()}, header["op"], group=str(round))
        return self._delivered(replies)

    def evaluate_training_clients(self, score, *, report_to_server: bool, round: int | None) -> dict[int, Any]:
        """Every training node scores its evaluation model on its validation split (with ``score_model``).

        With ``report_to_server`` each score is a release the node records; otherwise it comes back as telemetry
        for the experimenter, outside the ledger, as the in-process runtime reads it directly.
        """
        header = {"op": "evaluate", "completed_rounds": self._rounds_done, "report": bool(report_to_server),
                  "round": -1 if round is None else round, "pin": round is not None,
                  "keep_pins": "" if self._snapshot_round is None else str(self._snapshot_round),
                  "state_round": self._state_round, "send_ledger": round is None}
        outgoing = {cid: (self.strategy.configure_evaluate(cid), header) for cid in self.training_ids}
        replies = self._send(outgoing, "evaluate")
        self._delivered(replies)
        return {cid: _score(message) for cid, (message, _) in replies.items()}

    def score_novel_clients(self, federation) -> dict[int, ClientScore]:
        """Serve every novel client whose node is connected through the two-down, one-up protocol; the node builds
        its model, scores it with the hidden labels it holds, and sends back the score (telemetry)."""
        ids = [c.client_id for c in federation.novel_clients if c.client_id in self.nodes]
        if not ids:
            return {}
        header = {"op": "novel_request"}
        queries = self._delivered(self._send({cid: (self.strategy.novel_request(cid), header) for cid in ids},
                                             "novel_request"))
        header = {"op": "novel_model", "send_ledger": True}
        replies = self._send({cid: (self.strategy.novel_reply(cid, queries.get(cid)), header) for cid in ids},
                             "novel_model")
        return {cid: _score(message) for cid, (message, _) in replies.items()}

    def _fetch_ledgers(self) -> LedgerBook:
        """A book of the ledgers the nodes reported; nodes whose last report predates a release are asked again."""
        stale = [cid for cid in self.nodes if cid not in self._ledgers]
        self._send({cid: (Message(), {"op": "ledger"}) for cid in stale}, "ledger", count=False)
        book = LedgerBook()
        for cid in sorted(self._ledgers):
            if self._ledgers[cid]:
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


def _who(key: Any) -> str:
    return f"node {key[1]}" if isinstance(key, tuple) else f"the node of client {key}"


def _score(message: Message) -> ClientScore:
    m = message.metrics
    return ClientScore(num_samples=int(m["num_samples"]), correct=int(m["correct"]), loss_sum=float(m["loss_sum"]))


def flower_runtime_factory(grid: Grid, options: p.FlowerOptions | None = None):
    """A ``runtime_factory`` for :func:`privfl.experiment.train` that runs on ``grid``."""
    from privfl.experiment import build_runtime

    def factory(config, federation) -> FlowerRuntime:
        base = build_runtime(config, federation)     # the same strategy and procedure objects as in-process
        return FlowerRuntime(grid, strategy=base.strategy, client=base.client, federation=federation,
                             seed=config.seed, client_fraction=config.client_fraction,
                             config_text=json.dumps(config.to_dict()), options=options)

    return factory


def run_server(grid: Grid, run_config: Mapping[str, Any], *, options: p.FlowerOptions | None = None,
               progress: bool = False, stop_after_round: int | None = None) -> dict[str, Any]:
    """Train the run that ``run_config`` describes (``privfl-config``, ``out``, ``overwrite``) on ``grid``."""
    from privfl.experiment import RunConfig, train

    text, out = run_config.get(p.RUN_CONFIG) or "", run_config.get(p.OUT) or ""
    if not text or not out:
        raise ConfigError(f"run config needs {p.RUN_CONFIG!r} (the RunConfig as JSON) and {p.OUT!r} (the run "
                          f"directory on the SuperLink's machine); got {sorted(k for k, v in run_config.items() if v)}")
    config = RunConfig.from_dict(json.loads(text))
    if options is None:
        timeout = float(run_config.get(p.TIMEOUT) or 0)
        options = p.FlowerOptions(timeout_s=timeout or None,
                                  node_wait_s=float(run_config.get(p.NODE_WAIT) or p.FlowerOptions.node_wait_s))
    return train(config, out, overwrite=bool(run_config.get(p.OVERWRITE)), progress=progress,
                 stop_after_round=stop_after_round, runtime_factory=flower_runtime_factory(grid, options))


def make_server_app(run_config: Mapping[str, Any] | None = None, *, options: p.FlowerOptions | None = None,
                    progress: bool = False, stop_after_round: int | None = None,
                    result: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp that trains ``run_config`` (or the run config Flower gives it); the summary, or the exception,
    goes to ``result["summary"]`` / ``result["error"]``."""
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
