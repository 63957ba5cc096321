"""The privfl ClientApp: one node holds one client, runs the method's client procedure, and owns its ledger.

A node finds its client from its node config (``partition-id``, ``num-partitions``) and the run config (the run's
:class:`~privfl.experiment.RunConfig` as JSON: dataset spec, seed, method). Every node builds the same
:class:`~privfl.data.FederatedDataset` with :func:`privfl.data.build_federation` and keeps its own part:
partition ``i < T`` is the ``i``-th training client (by increasing client id), partition ``T + j`` the ``j``-th novel
client, where ``T`` is the number of training clients; ``num-partitions`` must be ``T`` (training clients only) or
``T + N`` (with the ``N`` novel clients).

The release choke point runs here, on the node that owns the data: a release is recorded in the client's
:class:`accounting.PrivacyLedger`, and the ledger written atomically to the node directory, before the reply
leaves the node. The ledger file outlives rounds, runs and restarts of the node, so epsilon only grows.

The client state (control variates, personal models) lives in the node's Flower ``Context.state`` and follows the
in-process runtime's transaction: a round works on a copy, committed once the server has completed the round (the
server says so in the next message it sends).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from flwr.app import ConfigRecord, Context
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from accounting import PrivacyLedger
from privfl.errors import ConfigError
from privfl.federation.context import client_context
from privfl.federation.flower import protocol as p
from privfl.federation.flower.records import from_records, records_to_state, state_to_records, to_records
from privfl.federation.messages import Message, Release
from privfl.federation.rundir import atomic_write_bytes

_PARTS: dict[str, Any] = {}            # per process: (spec, seed, partition) -> this node's client
_FEDERATIONS: dict[str, Any] = {}      # per process: the last federation built (spec, seed)
_PROCEDURES: dict[str, Any] = {}       # per process: run config -> ClientProcedure (shared like in-process)
_THREADS_SET: list[int] = []


class Node:
    """One node's view of the run: its client, its data, the method's client procedure, and where its ledger lives."""

    def __init__(self, run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> None:
        from privfl.experiment import RunConfig

        text = run_config.get(p.RUN_CONFIG) or ""
        if not text:
            raise ConfigError(f"run config {p.RUN_CONFIG!r} is empty: the node needs the run's RunConfig as JSON")
        self.config_text = text
        self.config = RunConfig.from_dict(json.loads(text))
        partition, count = node_config.get(p.PARTITION_ID), node_config.get(p.NUM_PARTITIONS)
        if not isinstance(partition, int) or not isinstance(count, int) or not 0 <= partition < count:
            raise ConfigError(f"node config {p.PARTITION_ID}={partition!r}, {p.NUM_PARTITIONS}={count!r} is "
                              f"invalid: they must be integers with 0 <= {p.PARTITION_ID} < {p.NUM_PARTITIONS}")
        self.partition = partition

        directory = node_config.get(p.NODE_DIR) or ""
        if not directory:
            root = run_config.get(p.NODES_ROOT) or ""
            if not root:
                raise ConfigError(f"node config {p.NODE_DIR!r} is missing: a node needs a directory for its ledger "
                                  f"(e.g. --node-config '{p.NODE_DIR}=\"/var/lib/privfl/node-0\" ...')")
            directory = str(Path(root) / f"partition-{partition}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

        part = _partition(self.config, partition, count, self.directory)
        self.role, self.data, self.labels = part["role"], part["data"], part["labels"]
        self.client_id = self.data.client_id
        if text not in _PROCEDURES:
            _PROCEDURES[text] = _procedure(self.config, part["input_shape"], part["num_classes"])
        self.procedure = _PROCEDURES[text]

        threads = int(run_config.get(p.THREADS) or 0)
        if threads and not _THREADS_SET:
            torch.set_num_threads(threads)
            _THREADS_SET.append(threads)

    # -- the ledger: on disk, read before and written after every release ------------------------------------------

    @property
    def ledger_path(self) -> Path:
        return self.directory / f"ledger-client-{self.client_id}.json"

    def ledger(self) -> PrivacyLedger:
        """The client's ledger as saved on this node (a fresh one before the first release)."""
        if self.ledger_path.exists():
            ledger = PrivacyLedger.load(self.ledger_path)
            if ledger.client_id != self.client_id:
                raise ConfigError(f"{self.ledger_path} holds the ledger of client {ledger.client_id!r}, "
                                  f"not of client {self.client_id!r}")
            return ledger
        return PrivacyLedger(self.client_id)

    def send(self, release: Release, *, round: int | None) -> tuple[Message, dict[str, Any]]:
        """The choke point: record ``release`` and save the ledger, then hand back what may leave the node.

        Raises :class:`accounting.BudgetExceededError` (and sends nothing) when the release would exceed the budget.
        """
        ledger = self.ledger()
        ledger.record(release.event, purpose=release.purpose, round=round, metadata=release.ledger_metadata())
        ledger.save(self.ledger_path)
        return release.message, {"kind": p.RELEASE, "purpose": release.purpose}


def _partition(config, partition: int, count: int, directory: Path) -> dict[str, Any]:
    """This node's client: its data (and, for a novel client, the hidden labels used only to score its model).

    The first time, the node builds the whole federation and keeps its part in ``directory`` (tensors only, loaded
    with ``weights_only=True``); later messages, which Flower's deployment engine handles in fresh processes, read
    that file instead of building the federation again.
    """
    from privfl.data import NovelClient, TrainingClient, build_federation

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
            _FEDERATIONS[built] = build_federation(config.federation, seed=config.seed)
        federation = _FEDERATIONS[built]
        training, novel = federation.training_clients, federation.novel_clients
        valid = (len(training), len(training) + len(novel))
        if count not in valid:
            raise ConfigError(f"node config {p.NUM_PARTITIONS}={count!r} is invalid: this federation has "
                              f"{len(training)} training and {len(novel)} novel clients, so it must be {valid[0]} "
                              f"(training clients only) or {valid[1]} (training and novel)")
        saved = {"input_shape": list(federation.input_shape), "num_classes": federation.num_classes}
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
    if saved["role"] == "training":
        data = TrainingClient(client_id=int(saved["client_id"]), x_train=saved["x_train"], y_train=saved["y_train"],
                              x_val=saved["x_val"], y_val=saved["y_val"])
        labels = None
    else:
        data, labels = NovelClient(int(saved["client_id"]), saved["x"]), saved["labels"]   # labels: scoring only
    part = {"role": saved["role"], "data": data, "labels": labels, "input_shape": tuple(saved["input_shape"]),
            "num_classes": int(saved["num_classes"])}
    _PARTS[digest] = part
    return part


def _procedure(config, input_shape: tuple[int, ...], num_classes: int):
    """The method's client procedure, as :func:`privfl.experiment.build_runtime` builds it."""
    from privfl.experiment import model_name_for
    from privfl.methods import ModelFactory, get_method

    spec = get_method(config.method)
    shape = SimpleNamespace(input_shape=input_shape)
    factory = ModelFactory(model_name_for(config, shape), tuple(input_shape), num_classes)
    procedure = spec.client(model_factory=factory, config=spec.make_config(**config.method_config))
    with torch.random.fork_rng(devices=[]):
        procedure.workspace_model()   # built outside any client's seeded stream
    return procedure


class _StateStore:
    """Client states in the node's ``Context.state``: committed, pending (the round in progress), pinned per round."""

    TAGS = "privfl.tags"

    def __init__(self, state) -> None:
        self.records = state
        if self.TAGS not in state:
            state[self.TAGS] = ConfigRecord({"pending_round": -1})
        self.tags = state[self.TAGS]

    def get(self, name: str) -> dict[str, Any] | None:
        if f"{name}.t" not in self.records:
            return None
        return records_to_state(self.records[f"{name}.t"], self.records[f"{name}.s"])

    def put(self, name: str, state: Mapping[str, Any]) -> None:
        self.records[f"{name}.t"], self.records[f"{name}.s"] = state_to_records(state)

    def drop(self, name: str) -> None:
        for suffix in (".t", ".s"):
            self.records.pop(f"{name}{suffix}", None)

    @property
    def pending_round(self) -> int:
        return int(self.tags["pending_round"])

    def settle(self, completed_rounds: int) -> None:
        """Commit the pending state if the server has completed its round since."""
        pending = self.pending_round
        if 0 <= pending < completed_rounds:
            self.put("privfl.committed", self.get("privfl.pending") or {})
            self.drop("privfl.pending")
            self.tags["pending_round"] = -1

    def pins(self) -> list[int]:
        return sorted(int(k.split(".")[2]) for k in self.records if k.startswith("privfl.pin.") and k.endswith(".t"))


def _optional_round(value: Any) -> int | None:
    value = int(value)
    return None if value < 0 else value


def handle(message: FlowerMessage, context: Context, defaults: Mapping[str, Any] | None = None) -> FlowerMessage:
    """Run one operation of the privfl protocol on this node and return the reply."""
    run_config = dict(defaults or {})
    run_config.update({k: v for k, v in context.run_config.items() if v not in ("", None)})
    node = Node(run_config, context.node_config)
    body, header = from_records(message.content)
    op = header.get("op")
    if op == "hello":
        reply, reply_header = Message(), {"kind": p.TELEMETRY, "client_id": node.client_id, "role": node.role,
                                          "partition_id": node.partition,
                                          "config_matches": header.get("config") == node.config_text}
    elif op in ("train", "train_stage"):
        reply, reply_header = _train(node, _StateStore(context.state), body, header)
    elif op == "evaluate":
        reply, reply_header = _evaluate(node, _StateStore(context.state), body, header)
    elif op == "novel_request":
        release = node.procedure.novel_query(_novel(node, op), body)
        reply, reply_header = (Message(), {"kind": p.NOTHING}) if release is None else node.send(release, round=None)
    elif op == "novel_model":
        from privfl.evaluation.metrics import score_model

        model = node.procedure.novel_model(_novel(node, op), body)
        reply, reply_header = _score_reply(score_model(model, node.data.x, node.labels))
    elif op == "ledger":
        reply, reply_header = Message(), {"kind": p.TELEMETRY}
    else:
        raise ConfigError(f"unknown privfl operation {op!r}; valid: {', '.join(p.MESSAGE_TYPES)}")
    if op == "ledger" or header.get("send_ledger"):
        ledger = node.ledger()     # after this message's release, if any: what the node has recorded so far
        reply_header["ledger"] = json.dumps(ledger.state_dict()) if len(ledger) else ""
    return FlowerMessage(to_records(reply, reply_header), reply_to=message)


def _novel(node: Node, op: str):
    if node.role != "novel":
        raise ConfigError(f"operation {op!r} sent to partition {node.partition}, which holds training client "
                          f"{node.client_id}, not a novel client")
    return node.data


def _training(node: Node, op: str):
    if node.role != "training":
        raise ConfigError(f"operation {op!r} sent to partition {node.partition}, which holds novel client "
                          f"{node.client_id}, not a training client")
    return node.data


def _train(node: Node, store: _StateStore, body: Message, header: dict[str, Any]):
    data = _training(node, header["op"])
    round, stage = int(header["round"]), int(header["stage"])
    store.settle(int(header["completed_rounds"]))
    if stage == 0:
        store.drop("privfl.pending")                    # a round interrupted earlier is being run again
        working = dict(store.get("privfl.committed") or {})
        ctx = client_context(node.config.seed, node.client_id, round, 0)
        release = node.procedure.train(data, body, working, ctx)
    else:
        if store.pending_round != round:
            raise RuntimeError(f"client {node.client_id}: stage {stage} of round {round} arrived, but the node "
                               f"holds no stage-0 work of that round (pending round {store.pending_round})")
        working = store.get("privfl.pending") or {}
        ctx = client_context(node.config.seed, node.client_id, round, stage)
        release = node.procedure.train_stage(stage, data, body, working, ctx)
    store.put("privfl.pending", working)
    store.tags["pending_round"] = round
    if release is None:
        return Message(), {"kind": p.NOTHING}
    return node.send(release, round=round)


def _evaluate(node: Node, store: _StateStore, body: Message, header: dict[str, Any]):
    from privfl.evaluation.metrics import score_model

    data = _training(node, "evaluate")
    completed = int(header["completed_rounds"])
    store.settle(completed)
    state_round = int(header.get("state_round", -1))
    if state_round >= 0:
        state = store.get(f"privfl.pin.{state_round}")
        if state is None:
            raise RuntimeError(f"client {node.client_id}: asked to evaluate with its state of round {state_round}, "
                               f"but it pinned only rounds {store.pins()}")
    else:
        state = store.get("privfl.committed") or {}
    if header.get("pin"):
        keep = {int(r) for r in str(header.get("keep_pins", "")).split(",") if r}
        for r in store.pins():
            if r not in keep:
                store.drop(f"privfl.pin.{r}")
        store.put(f"privfl.pin.{completed}", state)
    score = score_model(node.procedure.evaluation_model(data, body, state), data.x_val, data.y_val)
    if header.get("report"):
        report = Message(metrics={"num_samples": float(score.num_samples), "correct": float(score.correct),
                                  "loss_sum": float(score.loss_sum)})
        return node.send(Release.non_private(report, "validation_metrics"), round=_optional_round(header["round"]))
    return _score_reply(score)


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


#: The ClientApp that ``flwr run`` loads (``privfl.federation.flower.client_app:app``).
app = make_client_app()
