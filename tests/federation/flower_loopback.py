"""A Flower Grid whose nodes run the privfl ClientApp in this process: what the ServerApp tests of the Flower engine
and of SecAgg+ drive their runs with (with the ``task_identity`` fixture of tests/conftest.py)."""

from __future__ import annotations

import copy
import uuid

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Error, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402

from privfl.engines.flower import client_app  # noqa: E402


class LoopbackGrid:
    """Nodes running the privfl ClientApp in this process, each message as it is pushed; each node gets its own copy
    of a message, as over a network.

    ``nodes``: node id -> node config. ``silent``: node ids that answer the hello but nothing after (a SuperNode that
    died). ``drop(message)``: the node handles the message, but its reply is lost. ``sent`` lists (node id, message
    type) of every message pushed.
    """

    def __init__(self, nodes, run_config, *, silent=(), drop=lambda message: False) -> None:
        self.contexts = {nid: Context(run_id=1, node_id=nid, node_config=dict(config), state=RecordDict(),
                                      run_config=dict(run_config)) for nid, config in nodes.items()}
        self.silent = set(silent)
        self.drop = drop
        self.replies: list[FlowerMessage] = []
        self.sent: list[tuple[int, str]] = []

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            nid, kind = message.metadata.dst_node_id, message.metadata.message_type
            self.sent.append((nid, kind))
            ids.append(message.metadata.message_id)
            if nid in self.silent and kind != "query.hello":
                continue
            try:
                reply = client_app.handle(copy.deepcopy(message), self.contexts[nid])
            except Exception as error:        # as Flower does: the ClientApp's exception becomes an error reply
                reply = FlowerMessage(Error(code=0, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            if not self.drop(message):
                self.replies.append(reply)
        return ids

    def pull_messages(self, message_ids):
        wanted = set(message_ids)
        out = [r for r in self.replies if r.metadata.reply_to_message_id in wanted]
        self.replies = [r for r in self.replies if r.metadata.reply_to_message_id not in wanted]
        return out
