"""The server's directory of Flower nodes: which node holds which clients, found by saying hello as nodes connect.

:func:`connect` waits for the nodes a run needs, asks each new node which clients it holds and with which run config
(the ``hello`` operation; no data), refuses a node whose config differs from the server's or that holds a client
another node holds, and fills the transport's node map. Training needs every training client, and every novel client
when the method serves them and the nodes declare novel partitions (``num-partitions`` = training + novel clients);
nodes started with ``num-partitions`` = training clients leave the novel clients out of this run, which the summary
records. Serving needs the novel clients it serves only.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from privfl.config import RunConfig
from privfl.engines.flower.records import pack, unpack
from privfl.engines.flower.transport import FlowerClientError, GridTransport, ids_text
from privfl.errors import ConfigError, StorageError

logger = logging.getLogger(__name__)


@dataclass
class NodeDirectory:
    """What :func:`connect` found: the node of each client (also in the transport), novel clients no node holds for
    this run (and why), and how long connecting took."""

    nodes: dict[int, int] = field(default_factory=dict)                 # client id -> Flower node id
    node_clients: dict[int, list[int]] = field(default_factory=dict)    # node id -> the client ids it holds
    novel_not_served: dict[str, Any] = field(default_factory=dict)
    connect_seconds: float = 0.0


def connect(transport: GridTransport, config: RunConfig, *, training_ids: list[int], novel_ids: list[int],
            serves_novel_clients: bool, serve: list[int] | None = None) -> NodeDirectory:
    """Say hello to nodes as they connect, until every client the run needs is held or ``node_wait_s`` passed.

    ``serve`` (novel client ids) connects a serving run: it needs the nodes of those novel clients only.
    """
    started = time.perf_counter()
    directory = NodeDirectory()
    num_training, num_all = len(training_ids), len(training_ids) + len(novel_ids)
    deadline = time.monotonic() + transport.options.node_wait_s
    declared: dict[int, int] = {}              # node id -> its num-partitions
    partitions: dict[int, int] = {}            # client id -> partition
    while True:
        new = _new_nodes(transport, declared)
        if new:
            for nid, header in _hello(transport, config, new).items():
                declared[nid] = int(header["num_partitions"])
                for cid, partition in zip(header["holds"], header["partitions"], strict=True):
                    if cid in directory.nodes:
                        raise ConfigError(f"client {cid} is held by {transport.who([directory.nodes[cid]])} and by "
                                          f"{transport.who([nid])}; give every SuperNode its own partitions")
                    directory.nodes[int(cid)], partitions[int(cid)] = nid, int(partition)
                directory.node_clients[nid] = sorted(int(c) for c in header["holds"])
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
            needed = training_ids + (novel_ids if serves_novel_clients and novel_declared else [])
        missing = [cid for cid in needed if cid not in directory.nodes]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if missing:
        index = {cid: i for i, cid in enumerate(training_ids + novel_ids)}
        raise FlowerClientError(
            f"{len(missing)} clients the run needs have no connected node after {transport.options.node_wait_s:g} s "
            f"(node-wait-s): clients {ids_text(missing)} (partitions {ids_text([index[c] for c in missing])} of "
            f"{num_all}); {len(declared)} nodes connected. Start SuperNodes for those partitions")
    if serve is None and serves_novel_clients and novel_ids and not novel_declared:
        reason = (f"the nodes were started with num-partitions={num_training} (training clients only), so no "
                  f"node holds a novel client; start them with num-partitions={num_all} to serve novel clients "
                  "in this run, or serve them later in a run of their own (serve-from)")
        directory.novel_not_served = {"clients": list(novel_ids), "reason": reason}
        warnings.warn(f"{len(novel_ids)} novel clients will not be served: {reason}", stacklevel=2)
        logger.warning("%d novel clients will not be served: %s", len(novel_ids), reason)
    directory.connect_seconds = time.perf_counter() - started
    return directory


def _new_nodes(transport: GridTransport, known: Mapping[int, Any], settle_s: float = 1.0,
               most_s: float = 5.0) -> list[int]:
    """Nodes not in ``known``; once some appear, wait until no more appear for ``settle_s`` (at most ``most_s``),
    so that nodes connecting together get one hello exchange."""
    grid = transport.grid
    new = {nid for nid in grid.get_node_ids() if nid not in known}
    until = time.monotonic() + most_s
    while new and time.monotonic() < until:
        time.sleep(settle_s)
        more = {nid for nid in grid.get_node_ids() if nid not in known} - new
        if not more:
            break
        new |= more
    return sorted(new)


def _hello(transport: GridTransport, config: RunConfig, node_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Ask ``node_ids`` which clients they hold and with which run config; refuse a node whose config differs.
    Each node's clients go into the transport's node map."""
    ours = RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))).to_dict()   # as a node parses it
    replies = transport.exchange({nid: pack({}, {"op": "hello"}) for nid in node_ids}, "hello")
    headers = {}
    for nid, content in replies.items():
        header, _ = unpack(content)
        transport.node_partitions[nid] = sorted(int(part) for part in header["partitions"])
        if isinstance(header.get("node"), int):
            transport.node_index[nid] = int(header["node"])
        theirs = RunConfig.from_dict(json.loads(header["config"])).to_dict()
        if theirs != ours:
            raise ConfigError(f"{transport.who([nid])} runs with a different privfl-config than the server "
                              f"({differences(ours, theirs)}); start every node of a run with the same run config")
        headers[nid] = header
        transport.node_clients[nid] = sorted(int(c) for c in header["holds"])
        transport.node_of.update({int(c): nid for c in header["holds"]})
        check_disk(transport.who([nid]), json.loads(header["disk"]) if header.get("disk") else None)
    return headers


#: Room a node needs beyond what its clients' ledgers and states take now, for a round's new records.
DISK_MARGIN = 2**20


def check_disk(who: str, disk: Mapping[str, Any] | None) -> None:
    """Refuse, before any round, a node whose directory cannot take its clients' next ledgers and states
    (:func:`privfl.engines.flower.client_app.node_disk`): not writable, or with less free than those files take now
    plus :data:`DISK_MARGIN` (each is written whole beside the one it replaces). A node that stopped mid-round for want
    of space would have refused its own release, but the other nodes' releases of that round would be made again on
    resume. ``disk`` None: a node that does not report it."""
    if not disk:
        return
    where = disk.get("directory") or "its node directory"
    if not disk.get("writable", True):
        raise StorageError(f"{who} cannot write its node directory {where} ({disk.get('error')}): make it "
                           "writable (or restart the node with another --node-dir holding its files), then start "
                           "the run again (or resume it); this attempt released nothing")
    free, need = int(disk.get("free") or 0), int(disk.get("held") or 0) + DISK_MARGIN
    if free < need:
        raise StorageError(f"{who} has {free / 2**20:.1f} MiB free in its node directory {where}, but its clients' "
                           f"ledgers and states take {int(disk.get('held') or 0) / 2**20:.1f} MiB and each is "
                           f"written whole beside the one it replaces (it needs {need / 2**20:.1f} MiB): free space "
                           "there, then start the run again (or resume it); this attempt released nothing")


def differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> str:
    """The settings that differ between two run configs, as ``key: server X, node Y``."""
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = differences(a, b, f"{prefix}{key}.")
            if inner:
                diffs.append(inner)
        elif a != b:
            diffs.append(f"{prefix}{key}: server {a!r}, node {b!r}")
    return "; ".join(diffs)
