"""The privfl ClientApp: a node holds one client (or several), runs the method's client procedure, owns the ledgers.

A node finds its clients from its node config (``partition-id``, or ``partition-range="FIRST-LAST"`` for several,
and ``num-partitions``) and the run config (the run's :class:`~privfl.config.RunConfig` as JSON: dataset spec,
seed, method). Every node builds the same :class:`~privfl.data.FederatedDataset` with
:func:`privfl.data.build_federation` and keeps its own part: partition ``i < T`` is the ``i``-th training client (by
increasing client id), partition ``T + j`` the ``j``-th novel client, where ``T`` is the number of training clients;
``num-partitions`` must be ``T`` (training clients only) or ``T + N`` (with the ``N`` novel clients).

The release choke point runs here, on the node that owns the data: a release is recorded in the client's
:class:`accounting.PrivacyLedger`, and the ledger written atomically to the node directory, before the reply
leaves the node. The ledger file outlives rounds, runs and restarts of the node, so epsilon only grows.

A training client's state (control variates, personal models) is kept in the node directory too
(:class:`ClientStateFile`, tensors and plain scalars, loaded with ``weights_only=True``), not in Flower's in-memory
``Context``, so a SuperNode that restarts carries on with it. It follows the in-process runtime's transaction: a
round works on a copy, committed once the server has completed the round (the server says so in the next message it
sends). The server also says which round's state it expects each client to hold; a node whose state does not match
(its directory was replaced, or the state file is from another run) refuses to compute, naming the client.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from flwr.app import Context
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from accounting import PrivacyLedger
from accounting.files import atomic_write
from privfl.config import RunConfig, build_client, run_federation
from privfl.engines.flower import protocol as p
from privfl.engines.flower import secagg
from privfl.engines.flower.records import pack, unpack
from privfl.errors import DataFreeError, ProtocolStateError, PublicConfigError
from privfl.federation.context import client_context
from privfl.federation.messages import Message, Release
from privfl.federation.rundir import atomic_write_bytes

_PARTS: dict[str, Any] = {}            # per process: (spec, seed, partition) -> that partition's client
_NODES: dict[str, Any] = {}            # per process: (run config, node config) -> Node
_FEDERATIONS: dict[str, Any] = {}      # per process: the last federation built (spec, seed)
_PROCEDURES: dict[str, Any] = {}       # per process: run config -> ClientProcedure (shared like in-process)
_THREADS_SET: list[int] = []


class NodeClient:
    """One client a node holds: its data (a novel client's hidden labels too, for scoring only) and its ledger."""

    def __init__(self, partition: int, part: dict[str, Any], directory: Path) -> None:
        self.partition = partition
        self.role, self.data, self.labels = part["role"], part["data"], part["labels"]
        self.client_id = self.data.client_id
        self.directory = directory

    # -- the ledger: on disk, read before and written after every release ------------------------------------------

    @property
    def ledger_path(self) -> Path:
        return self.directory / f"ledger-client-{self.client_id}.json"

    def ledger(self) -> PrivacyLedger:
        """The client's ledger as saved on this node (a fresh one before the first release)."""
        if self.ledger_path.exists():
            ledger = PrivacyLedger.load(self.ledger_path)
            if ledger.client_id != self.client_id:
                raise PublicConfigError(f"{self.ledger_path} holds the ledger of client {ledger.client_id!r}, "
                                        f"not of client {self.client_id!r}")
            return ledger
        return PrivacyLedger(self.client_id)

    def send(self, release: Release, *, round: int | None, run: str = "") -> tuple[Message, dict[str, Any]]:
        """The choke point: record ``release`` and save the ledger, then hand back what may leave the node.

        The record names the privfl run ``run`` (metadata ``"run"``, when the server gives one): the ledger keeps the
        client's lifetime across runs, and the server tells this run's releases from earlier runs' by it. The reply
        header carries the record itself, for the run directory's release journal. Raises
        :class:`accounting.BudgetExceededError` (and sends nothing) when the release would exceed the budget.
        """
        ledger = self.ledger()
        metadata = release.ledger_metadata()
        if run:
            metadata = {**metadata, p.RUN_KEY: run}
        record = ledger.record(release.event, purpose=release.purpose, round=round, metadata=metadata,
                               calibrated_for=release.calibrated_for, audience=release.audience)
        ledger.save(self.ledger_path)
        return release.message, {"kind": p.RELEASE, "purpose": release.purpose,
                                 "record": json.dumps(record.to_dict(), allow_nan=False)}

    @property
    def state_path(self) -> Path:
        return self.directory / f"state-client-{self.client_id}.pt"

    def expect(self, role: str, op: str) -> None:
        if self.role != role:
            raise PublicConfigError(f"operation {op!r} sent to partition {self.partition}, which holds {self.role} "
                                    f"client {self.client_id}, not a {role} client")


class Node:
    """One node's view of the run: its clients, the method's client procedure, and the directory that keeps the
    clients' ledgers and states."""

    def __init__(self, run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> None:
        text = run_config.get(p.RUN_CONFIG) or ""
        if not text:
            raise PublicConfigError(f"run config {p.RUN_CONFIG!r} is empty: the node needs the run's RunConfig as JSON")
        self.config = RunConfig.from_dict(json.loads(text))
        self.config_key = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.partitions, self.num_partitions = p.node_partitions(node_config, run_config)

        # An explicit node directory holds all the node's clients; without one, each client gets its own
        # NODES_ROOT/partition-<i>, so a client's ledger is found again whatever grouping a later run uses (a
        # simulation with another clients-per-node, a serving run): epsilon never resets.
        explicit = node_config.get(p.NODE_DIR) or ""
        root = run_config.get(p.NODES_ROOT) or ""
        if not explicit and not root:
            raise PublicConfigError(f"node config {p.NODE_DIR!r} is missing: a node needs a directory for its ledgers "
                                    f"(e.g. --node-config '{p.NODE_DIR}=\"/var/lib/privfl/node-0\" ...')")

        self.clients: dict[int, NodeClient] = {}
        part = None
        for partition in self.partitions:
            directory = Path(explicit) if explicit else Path(root) / f"partition-{partition}"
            directory.mkdir(parents=True, exist_ok=True)
            part = _partition(self.config, partition, self.num_partitions, directory)
            client = NodeClient(partition, part, directory)
            self.clients[client.client_id] = client
        if part is None:
            raise PublicConfigError("the node config names no partition for this node to hold")
        if text not in _PROCEDURES:
            _PROCEDURES[text] = _procedure(self.config, part["input_shape"], part["num_classes"],
                                           part["num_training"])
        self.procedure = _PROCEDURES[text]

        threads = int(run_config.get(p.THREADS) or 0)
        if threads and not _THREADS_SET:
            torch.set_num_threads(threads)
            _THREADS_SET.append(threads)

    def client(self, client_id: int) -> NodeClient:
        if client_id not in self.clients:
            raise PublicConfigError(f"a message for client {client_id} arrived at the node holding partitions "
                                    f"{_span(self.partitions)} (clients {sorted(self.clients)})")
        return self.clients[client_id]


def node_disk(clients: list[NodeClient]) -> dict[str, Any]:
    """What the server checks before a round (:func:`privfl.engines.flower.nodes.check_disk`): whether each directory
    that keeps these clients' ledgers and states takes a new file (one is made and removed), the free bytes of the
    fullest, and the bytes those files take now (each is written whole beside the one it replaces). Configuration
    and sizes only: nothing of a client's data."""
    import os
    import shutil
    import tempfile

    disk: dict[str, Any] = {"writable": True, "free": None, "held": 0, "directory": "", "error": ""}
    for directory in sorted({c.directory for c in clients}):
        try:
            descriptor, probe = tempfile.mkstemp(dir=directory, prefix=".privfl-probe-")
            os.close(descriptor)
            os.unlink(probe)
            free = shutil.disk_usage(directory).free
        except OSError as error:
            return {**disk, "writable": False, "directory": str(directory), "error": error.strerror or str(error)}
        if disk["free"] is None or free < disk["free"]:
            disk["free"], disk["directory"] = free, str(directory)
    for client in clients:
        for path in (client.ledger_path, client.state_path):
            if path.exists():
                disk["held"] += path.stat().st_size
    return disk


def _span(partitions: list[int]) -> str:
    return str(partitions[0]) if len(partitions) == 1 else f"{partitions[0]}-{partitions[-1]}"


def _node(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> Node:
    """The node for these configs (built once per process: a simulation process serves many virtual nodes)."""
    key = json.dumps([run_config.get(p.RUN_CONFIG) or "", run_config.get(p.NODES_ROOT) or "",
                      run_config.get(p.THREADS) or 0, run_config.get(p.CLIENTS_PER_NODE) or 1,
                      run_config.get(p.NUM_CLIENTS) or 0, dict(node_config)], sort_keys=True, default=str)
    if key not in _NODES:
        _NODES[key] = Node(run_config, node_config)
    return _NODES[key]


def _partition(config, partition: int, count: int, directory: Path) -> dict[str, Any]:
    """This node's client: its data (and, for a novel client, the hidden labels used only to score its model).

    The first time, the node builds the whole federation and keeps its part in ``directory`` (tensors only, loaded
    with ``weights_only=True``); later messages, which Flower's deployment engine handles in fresh processes, read
    that file instead of building the federation again.
    """
    from privfl.data import NovelClient, TrainingClient

    key = json.dumps([config.federation.to_dict(), config.seed, partition, count], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    if digest in _PARTS:
        return _PARTS[digest]
    path = directory / f"partition-{digest}.pt"
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
    else:
        built = json.dumps([config.federation.to_dict(), config.seed], sort_keys=True)
        if built not in _FEDERATIONS:                  # a simulation process serves many nodes: build once
            _FEDERATIONS.clear()
            _FEDERATIONS[built] = run_federation(config)
        federation = _FEDERATIONS[built]
        training, novel = federation.training_clients, federation.novel_clients
        valid = (len(training), len(training) + len(novel))
        if count not in valid:
            raise PublicConfigError(f"node config {p.NUM_PARTITIONS}={count!r} is invalid: this federation has "
                                    f"{len(training)} training and {len(novel)} novel clients, so it must be "
                                    f"{valid[0]} (training clients only) or {valid[1]} (training and novel)")
        saved = {"input_shape": list(federation.input_shape), "num_classes": federation.num_classes,
                 "num_training": len(training)}
        if partition < len(training):
            c = training[partition]
            saved.update(role="training", client_id=c.client_id, x_train=c.x_train, y_train=c.y_train,
                         x_val=c.x_val, y_val=c.y_val)
        else:
            c = novel[partition - len(training)]
            saved.update(role="novel", client_id=c.client_id, x=c.x,
                         labels=federation.novel_labels.labels(c.client_id))
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        atomic_write_bytes(path, buffer.getvalue())
    data: TrainingClient | NovelClient
    if saved["role"] == "training":
        data = TrainingClient(client_id=int(saved["client_id"]), x_train=saved["x_train"], y_train=saved["y_train"],
                              x_val=saved["x_val"], y_val=saved["y_val"])
        labels = None
    else:
        data, labels = NovelClient(int(saved["client_id"]), saved["x"]), saved["labels"]   # labels: scoring only
    part = {"role": saved["role"], "data": data, "labels": labels, "input_shape": tuple(saved["input_shape"]),
            "num_classes": int(saved["num_classes"]), "num_training": int(saved["num_training"])}
    _PARTS[digest] = part
    return part


def _procedure(config: RunConfig, input_shape: tuple[int, ...], num_classes: int, num_training: int):
    """The method's client procedure under the run's privacy layer, as the in-process runtime builds it
    (:func:`privfl.config.build_client`)."""
    procedure = build_client(config, input_shape, num_classes, num_training)
    with torch.random.fork_rng(devices=[]):
        procedure.workspace_model()   # built outside any client's seeded stream
    return procedure


class ClientStateFile:
    """A training client's state on its node, in ``state-client-<id>.pt`` beside its ledger.

    It holds the committed state (of the last round the server completed with this client, ``committed_round``), the
    pending state (the round in progress, ``pending_round``), and states pinned per round (to evaluate with an
    earlier round's state after the server rolls back to it). Tensors and plain scalars only: it loads with
    ``weights_only=True``. Every change is written atomically (a temporary file renamed over the old one). The state
    is per run: the file names the run (Flower's run id and the run config's digest) and a file of another run is
    not used.
    """

    def __init__(self, path: Path, run: str) -> None:
        self.path, self.run = path, run
        self.committed: dict[str, Any] = {}
        self.committed_round = -1
        self.pending: dict[str, Any] | None = None
        self.pending_round = -1
        self.pins: dict[int, dict[str, Any]] = {}
        self.found = "no state file"
        if path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("run") == run:
                self.committed, self.committed_round = saved["committed"], int(saved["committed_round"])
                self.pending, self.pending_round = saved["pending"], int(saved["pending_round"])
                self.pins = {int(r): s for r, s in saved["pins"].items()}
                self.found = f"its state of round {self.committed_round}" if self.committed_round >= 0 else \
                    "no committed state"
            else:
                self.found = f"a state file of another run ({saved.get('run')!r}, this run is {run!r})"

    def save(self) -> None:
        _check_state(self.committed, self.path)
        buffer = io.BytesIO()
        torch.save({"run": self.run, "committed": self.committed, "committed_round": self.committed_round,
                    "pending": self.pending, "pending_round": self.pending_round,
                    "pins": {str(r): s for r, s in self.pins.items()}}, buffer)
        _replace(self.path, buffer.getvalue())

    def settle(self, completed_rounds: int) -> bool:
        """Commit the pending state if the server has completed its round since; True if something changed."""
        if 0 <= self.pending_round < completed_rounds:
            self.committed, self.committed_round = self.pending or {}, self.pending_round
            self.pending, self.pending_round = None, -1
            return True
        return False

    def check(self, client_id: int, expected_round: int) -> None:
        """Refuse to go on when this is not the state of ``expected_round`` (the last round the server completed
        with this client; -1: it never trained), so a lost state never passes for a fresh one."""
        if self.committed_round != expected_round:
            expected = "no state (it has not trained yet)" if expected_round < 0 else \
                f"its state of round {expected_round}"
            raise ProtocolStateError(f"client {client_id}: the server expects it to hold {expected}, but its node "
                                     f"has {self.found} in {self.path}; the client state (control variates, personal "
                                     "models) was lost or belongs to another run, and this run cannot go on with it: "
                                     "start the run again")


def _check_state(state: Mapping[str, Any], path: Path) -> None:
    for key, value in state.items():
        if not isinstance(value, (torch.Tensor, bool, int, float, str)):
            raise PublicConfigError(f"client state value {key}={type(value).__name__} cannot be kept in {path}: a "
                                    "client state holds tensors and int, float, str or bool values only")


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, without fsync: after a power loss the previous state may come back,
    which :meth:`ClientStateFile.check` refuses (:func:`accounting.files.atomic_write`)."""
    atomic_write(path, data, durable=False)


def _optional_round(value: Any) -> int | None:
    value = int(value)
    return None if value < 0 else value


#: The file, in a node directory, that keeps the texts of the errors a node does not forward to the server.
ERROR_LOG = "errors.log"

_log = logging.getLogger(__name__)


class NodeFailure(DataFreeError, RuntimeError):
    """What the server hears of a node error whose text may describe a client's data: which clients failed, in
    which operation, and the node file that keeps the text (see :func:`handle`)."""


def handle(message: FlowerMessage, context: Context, defaults: Mapping[str, Any] | None = None) -> FlowerMessage:
    """Run one operation of the privfl protocol for each client the message names, and return the packed replies;
    a stage of SecAgg+ (distributed DP's secure train exchange) goes through Flower's ``secaggplus_mod``, whose
    masked-vector stage runs the train operation here (:func:`privfl.engines.flower.secagg.node_stage`).

    Errors. Flower sends the text of an exception the ClientApp raises to the server, in its error reply, outside any
    ledger. A text can describe a client's data (a count of NaN rows, a label outside the range, a value a method
    refused), so only the text of a :class:`~privfl.errors.DataFreeError` (configuration and protocol state) leaves
    the node. Any other error is logged on the node and appended to ``errors.log`` in the client's node directory
    (or the node's), and the node raises :class:`NodeFailure` instead, naming the clients, the operation and that
    file. That the node failed still reaches the server: it is data-dependent, the epsilons do not cover it, and the
    run stops on it.
    """
    if secagg.carries_secagg(message):
        try:
            return secagg.node_stage(message, context, lambda m, c: _protocol(m, c, defaults))
        except Exception as error:
            _withhold(error, "train (SecAgg+)", "the node", _node_dir(context, _run_config(context, defaults)))
    return _protocol(message, context, defaults)


def _run_config(context: Context, defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    run_config = dict(defaults or {})
    run_config.update({k: v for k, v in context.run_config.items() if v not in ("", None)})
    return run_config


def _node_dir(context: Context, run_config: Mapping[str, Any]) -> str | None:
    directory = context.node_config.get(p.NODE_DIR) or run_config.get(p.NODES_ROOT) or None
    return None if directory is None else str(directory)


def _protocol(message: FlowerMessage, context: Context, defaults: Mapping[str, Any] | None) -> FlowerMessage:
    """:func:`handle` of one privfl operation."""
    run_config = _run_config(context, defaults)
    node_dir = _node_dir(context, run_config)
    header: dict[str, Any] = {}
    try:
        node = _node(run_config, context.node_config)
        header, items = unpack(message.content)
    except Exception as error:
        _withhold(error, str(header.get("op", message.metadata.message_type)), "the node", node_dir)
    op = header.get("op")
    if op == "hello":
        clients = [node.clients[cid] for cid in sorted(node.clients)]
        reply_header = {"kind": p.TELEMETRY, "holds": [c.client_id for c in clients],
                        "roles": [c.role for c in clients], "partitions": [c.partition for c in clients],
                        "num_partitions": node.num_partitions, "config": json.dumps(node.config.to_dict())}
        reply_header["disk"] = json.dumps(node_disk(clients))        # a ConfigRecord holds no dict
        index = context.node_config.get(p.NODE_INDEX)
        if isinstance(index, int) and not isinstance(index, bool):
            reply_header["node"] = index            # its --node, for the server's messages about it
        return FlowerMessage(pack({}, reply_header), reply_to=message)
    if op not in _OPERATIONS:
        raise PublicConfigError(f"unknown privfl operation {op!r}; valid: {', '.join(p.MESSAGE_TYPES)}")
    run = f"{header.get(p.RUN_KEY) or context.run_id}-{node.config_key}"
    replies = {}
    for cid, (body, own_header) in items.items():
        client = node.client(cid)
        try:
            client_header = {**header, **own_header}
            reply, reply_header = _OPERATIONS[op](node, client, body, client_header, run)
            if op == "ledger" or client_header.get("send_ledger"):
                ledger = client.ledger()     # after this message's release, if any: what the node has recorded so far
                reply_header["ledger"] = json.dumps(ledger.state_dict()) if len(ledger) else ""
        except Exception as error:
            _withhold(error, op, f"client {cid}", client.directory)
        replies[cid] = (reply, reply_header)
    return FlowerMessage(pack(replies, {"kind": "replies"}), reply_to=message)


def _withhold(error: Exception, op: str, who: str, directory: str | Path | None) -> NoReturn:
    """Re-raise ``error`` if its text is data-free; otherwise keep its text on the node and raise NodeFailure."""
    if isinstance(error, DataFreeError):
        raise error
    text = "".join(traceback.format_exception(error))
    _log.error("%s failed in %r; this text stays on the node:\n%s", who, op, text)
    where = "the node's log (it has no node directory)"
    if directory is not None:
        path = Path(directory) / ERROR_LOG
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as log:
                log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {who} failed in {op!r}\n{text}")
            where = str(path)
        except OSError as write_error:
            _log.error("could not append to %s: %s", path, write_error)
    raise NodeFailure(f"{who} failed in {op!r}; the error text stays on the node, since it may describe the "
                      f"client's data: see {where}") from None


def _train(node: Node, client: NodeClient, body: Message, header: dict[str, Any], run: str):
    client.expect("training", header["op"])
    round, stage = int(header["round"]), int(header["stage"])
    store = ClientStateFile(client.state_path, run)
    store.settle(int(header["completed_rounds"]))
    if stage == 0:
        store.check(client.client_id, int(header["state_of"]))
        working = dict(store.committed)            # a pending round interrupted earlier is being run again
        ctx = client_context(node.config.seed, client.client_id, round, 0)
        release = node.procedure.train(client.data, body, working, ctx)
    else:
        if store.pending_round != round or store.pending is None:
            raise ProtocolStateError(f"client {client.client_id}: stage {stage} of round {round} arrived, but the node "
                                     f"holds no stage-0 work of that round (pending round {store.pending_round}, "
                                     f"{store.found})")
        working = store.pending
        ctx = client_context(node.config.seed, client.client_id, round, stage)
        release = node.procedure.train_stage(stage, client.data, body, working, ctx)
    _check_state(working, client.state_path)
    store.pending, store.pending_round = working, round
    store.save()
    if release is None:
        return Message(), {"kind": p.NOTHING}
    return client.send(release, round=round, run=header.get(p.RUN_KEY, ""))


def _evaluate(node: Node, client: NodeClient, body: Message, header: dict[str, Any], run: str):
    from privfl.metrics import score_model

    client.expect("training", "evaluate")
    completed = int(header["completed_rounds"])
    store = ClientStateFile(client.state_path, run)
    changed = store.settle(completed)
    store.check(client.client_id, int(header["state_of"]))
    state_round = int(header.get("state_round", -1))
    if state_round >= 0:
        if state_round not in store.pins:
            raise ProtocolStateError(f"client {client.client_id}: asked to evaluate with its state of round "
                                     f"{state_round}, but it pinned only rounds {sorted(store.pins)}")
        state = store.pins[state_round]
    else:
        state = store.committed
    if header.get("pin"):
        keep = {int(r) for r in str(header.get("keep_pins", "")).split(",") if r}
        store.pins = {r: s for r, s in store.pins.items() if r in keep}
        store.pins[completed] = state
        changed = True
    if changed:
        store.save()
    data = client.data
    score = score_model(node.procedure.evaluation_model(data, body, dict(state)), data.x_val, data.y_val)
    if header.get("report"):
        report = Message(metrics={"num_samples": float(score.num_samples), "correct": float(score.correct),
                                  "loss_sum": float(score.loss_sum)})
        return client.send(Release.non_private(report, "validation_metrics"), round=_optional_round(header["round"]),
                           run=header.get(p.RUN_KEY, ""))
    return _score_reply(score)


def _novel_request(node: Node, client: NodeClient, body: Message, header: dict[str, Any], run: str):
    client.expect("novel", "novel_request")
    release = node.procedure.novel_query(client.data, body)
    return (Message(), {"kind": p.NOTHING}) if release is None else \
        client.send(release, round=None, run=header.get(p.RUN_KEY, ""))


def _novel_model(node: Node, client: NodeClient, body: Message, header: dict[str, Any], run: str):
    from privfl.metrics import score_model

    client.expect("novel", "novel_model")
    model = node.procedure.novel_model(client.data, body)
    return _score_reply(score_model(model, client.data.x, client.labels))


def _ledger(node: Node, client: NodeClient, body: Message, header: dict[str, Any], run: str):
    return Message(), {"kind": p.TELEMETRY}


_OPERATIONS = {"train": _train, "train_stage": _train, "evaluate": _evaluate, "novel_request": _novel_request,
               "novel_model": _novel_model, "ledger": _ledger}


def _score_reply(score) -> tuple[Message, dict[str, Any]]:
    return (Message(metrics={"num_samples": float(score.num_samples), "correct": float(score.correct),
                             "loss_sum": float(score.loss_sum)}), {"kind": p.TELEMETRY})


def make_client_app(defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """A ClientApp running the privfl protocol; ``defaults`` fill run-config keys the run does not set (the
    simulation passes the run's config this way, since ``run_simulation`` has no run config)."""
    defaults = dict(defaults or {})
    app = ClientApp()

    def run(message: FlowerMessage, context: Context) -> FlowerMessage:
        return handle(message, context, defaults)

    for message_type in set(p.MESSAGE_TYPES.values()):
        category, _, action = message_type.partition(".")
        register = getattr(app, category)
        register(action)(run) if action else register()(run)
    return app


#: The ClientApp that ``flwr run`` loads (``privfl.engines.flower.client_app:app``).
app = make_client_app()
