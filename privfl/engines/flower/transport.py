"""The server's transport on Flower: one privfl exchange as Flower messages through a Grid, one per node.

:class:`GridTransport` pushes one Flower message per node (packing the privfl messages of the clients the node holds,
:func:`~privfl.engines.flower.records.pack`), pulls every reply with exponential backoff between asks, and gives
each client's reply back. It knows nothing of rounds, strategies or ledgers: the runtime
(:mod:`privfl.engines.flower.runtime`) says what to send, and the node directory
(:mod:`privfl.engines.flower.nodes`) which node holds which client.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Message as FlowerMessage
from flwr.app import RecordDict
from flwr.serverapp import Grid

from privfl.engines.flower import protocol as p
from privfl.engines.flower.records import pack, unpack
from privfl.federation.messages import Message


class FlowerClientError(RuntimeError):
    """A node answered with an error (its ClientApp raised, e.g. a release over budget) or did not answer."""


def ids_text(ids: list[int], limit: int = 20) -> str:
    """``[1, 2, 3, ...]``: at most ``limit`` ids, for error messages."""
    shown = ", ".join(str(i) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


class GridTransport:
    """Exchanges with Flower nodes through ``grid``, within the waiting limits of ``options``.

    ``node_clients`` (node id -> the client ids it holds) is filled by the node directory as nodes say hello; it is
    used to pack messages per node and to name the clients of a node that failed.
    """

    def __init__(self, grid: Grid, options: p.FlowerOptions) -> None:
        self.grid = grid
        self.options = options
        self.node_clients: dict[int, list[int]] = {}
        self.node_partitions: dict[int, list[int]] = {}   # node id -> the partitions it holds
        self.node_index: dict[int, int] = {}      # node id -> its key pair index (privfl flower supernode --node)
        self.node_of: dict[int, int] = {}          # client id -> node id
        self.run_id = ""                           # the privfl run every message names (protocol.RUN_KEY)
        self.on_reply: Callable[[int, RecordDict], None] | None = None   # each reply's content as it arrives

    def who(self, node_ids: list[int]) -> str:
        """``SuperNode --node 1 (partition 1, clients [5])``, ...: the nodes as their operator started them (or, for
        a node started otherwise, a simulated one say, by the partitions it holds), for error messages. Flower's node
        id names only a node that has not said hello."""
        parts = []
        for nid in node_ids:
            held, partitions = self.node_clients.get(nid), self.node_partitions.get(nid)
            where = ""
            if partitions:
                where = (f"partition {partitions[0]}" if len(partitions) == 1 else
                         f"partitions {partitions[0]}-{partitions[-1]}")
            clients = f"clients {ids_text(held)}" if held else ""
            inside = ", ".join(part for part in (where, clients) if part)
            if nid in self.node_index:
                parts.append(f"SuperNode --node {self.node_index[nid]}" + (f" ({inside})" if inside else ""))
            elif partitions:
                parts.append(f"the node holding {inside}")
            else:
                parts.append(f"Flower node {nid}" + (f" ({inside})" if inside else ""))
        return ", ".join(parts)

    def exchange(self, contents: Mapping[int, RecordDict], op: str, group: str = "") -> dict[int, RecordDict]:
        """Push one Flower message per node, pull every reply (backing off exponentially between asks), and give
        the replies' contents by node id. Raises :class:`FlowerClientError` naming the nodes (and their clients)
        that failed, or that did not answer within ``timeout_s``."""
        messages = [FlowerMessage(content, nid, p.MESSAGE_TYPES[op], group_id=group)
                    for nid, content in sorted(contents.items())]
        return {nid: reply.content for nid, reply in self.deliver(messages, op).items()}

    def deliver(self, messages: list[FlowerMessage], op: str) -> dict[int, FlowerMessage]:
        """Push ``messages`` (one per node), pull every reply as :meth:`exchange` does, and give the replies by node
        id; ``op`` names the exchange in errors. Any node that fails or does not answer in time stops the exchange
        with :class:`FlowerClientError`: nothing that came back is used."""
        if not messages:
            return {}
        pushed = {str(i) for i in self.grid.push_messages(messages) if i}
        node_of = {str(m.metadata.message_id): m.metadata.dst_node_id for m in messages}
        refused = [nid for mid, nid in node_of.items() if mid not in pushed]
        if refused:
            raise FlowerClientError(f"the SuperLink did not accept the {op!r} messages for {self.who(refused)}")
        pending = set(node_of)
        replies: dict[int, FlowerMessage] = {}
        timeout = self.options.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.options.poll_min_s
        while pending:
            arrived = False
            failed: list[str] = []
            for reply in self.grid.pull_messages(pending):
                message_id = reply.metadata.reply_to_message_id
                arrived = True
                if message_id not in node_of:
                    # an error the SuperLink made without naming the message it answers: the node is one of those
                    # still silent (the reply's source is the SuperLink itself, never the node)
                    silent = sorted(node_of[mid] for mid in pending)
                    failed.append(f"one of {self.who(silent)} failed in {op!r}: "
                                  f"{reply.error.reason if reply.has_error() else 'an unexpected reply'}")
                    continue
                pending.discard(message_id)
                nid = node_of[message_id]
                if reply.has_error():
                    failed.append(f"{self.who([nid])} failed in {op!r}: {reply.error.reason}")
                    continue
                replies[nid] = reply
                if self.on_reply is not None:          # even when another node's failure stops the exchange
                    self.on_reply(nid, reply.content)
            if failed:
                raise FlowerClientError("; ".join(failed))
            if pending:
                if deadline is not None and time.monotonic() > deadline:
                    silent = sorted(node_of[mid] for mid in pending)
                    raise FlowerClientError(
                        f"{len(silent)} of {len(messages)} nodes did not answer {op!r} within {timeout:g} s "
                        f"(timeout-s): {self.who(silent)}; is a SuperNode down?")
                delay = self.options.poll_min_s if arrived else min(2 * delay, self.options.poll_max_s)
                time.sleep(delay)
        return replies

    def pack(self, outgoing: Mapping[int, tuple[Message, dict[str, Any]]], op: str,
             header: dict[str, Any]) -> dict[int, RecordDict]:
        """Each node's Flower content for ``outgoing`` (client id -> its message and its own header): the messages
        of the clients it holds, packed with the common ``header``. A message object several clients get is
        converted once."""
        converted: dict[int, dict[str, Any]] = {}
        common = {"op": op, **header, **({p.RUN_KEY: self.run_id} if self.run_id else {})}
        return {nid: pack(items, common, converted=converted)
                for nid, items in self.by_node(outgoing).items()}

    def by_node(self, outgoing: Mapping[int, Any]) -> dict[int, dict[int, Any]]:
        """``outgoing`` (by client id) grouped by the node that holds each client, in increasing client id."""
        grouped: dict[int, dict[int, Any]] = defaultdict(dict)
        for cid in sorted(outgoing):
            grouped[self.node_of[cid]][cid] = outgoing[cid]
        return dict(grouped)

    def send(self, outgoing: Mapping[int, tuple[Message, dict[str, Any]]], op: str, header: dict[str, Any], *,
             group: str = "") -> dict[int, tuple[Message, dict[str, Any]]]:
        """Send each client its message (with its own header beside the common ``header``), packed per node; return
        each client's reply and reply header, in increasing client id. A message object several clients get is
        converted once."""
        asked = self.by_node(outgoing)
        replies: dict[int, tuple[Message, dict[str, Any]]] = {}
        for nid, content in self.exchange(self.pack(outgoing, op, header), op, group).items():
            _, items = unpack(content)
            if set(items) != set(asked[nid]):
                raise FlowerClientError(f"{self.who([nid])} answered {op!r} for clients {ids_text(sorted(items))}, "
                                        f"but was asked for clients {ids_text(sorted(asked[nid]))}")
            replies.update(items)
        return {cid: replies[cid] for cid in sorted(replies)}
