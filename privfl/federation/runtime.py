"""The in-process runtime: rounds of a method's strategy and client procedures, with every message on the wire.

It is the embedded default engine; the Flower runtime drives the same strategy and client objects. The runtime does
not know which method it runs: it calls the :class:`~privfl.methods.base.Strategy` and
:class:`~privfl.methods.base.ClientProcedure` interfaces only.

Rounds are transactional. A client procedure works on a copy of its state, and client states are committed only
after the server has aggregated, so if a round is interrupted the runtime still holds the consistent state of the
last completed round (:meth:`committed_state_dict`). The ledger is never rolled back: a release that was made stays
recorded, even if its round is later run again. A process killed between checkpoints takes with it the records of
the releases made since the last one; :func:`privfl.experiment.train` gives the wire a run directory's release
journal (``releases.jsonl``, appended before each delivery) and replays it into the checkpoint's ledgers on resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from privfl.data import NovelClient, TrainingClient
from privfl.federation.context import ClientContext, ClientState, client_context
from privfl.federation.messages import Message, Release
from privfl.federation.seeding import derive_rng
from privfl.federation.wire import Wire


def sample_clients(client_ids: list[int], fraction: float, *, seed: int, round: int) -> list[int]:
    """A seeded uniform sample of ``max(1, round(fraction * len(client_ids)))`` clients for ``round``, sorted."""
    count = max(1, int(round_half_up(fraction * len(client_ids))))
    if count >= len(client_ids):
        return sorted(client_ids)
    chosen = derive_rng(seed, "client_sampling", round).choice(len(client_ids), size=count, replace=False)
    return sorted(client_ids[i] for i in chosen)


def round_half_up(value: float) -> int:
    return int(value + 0.5)


class InProcessRuntime:
    """Runs a method's rounds on the training clients of one federation, all in this process."""

    def __init__(self, *, strategy, client, training_clients: list[TrainingClient], seed: int,
                 client_fraction: float = 1.0, wire: Wire | None = None) -> None:
        self.strategy = strategy
        self.client = client
        self.clients = {c.client_id: c for c in training_clients}
        self.seed = seed
        self.client_fraction = client_fraction
        self.wire = wire if wire is not None else Wire()
        self.client_states: dict[int, ClientState] = {cid: {} for cid in self.clients}
        self.completed_rounds = 0
        self._committed = self.snapshot()
        with torch.random.fork_rng(devices=[]):
            client.workspace_model()   # built outside any client's seeded stream, as on a Flower node

    def _context(self, client_id: int, round: int, stage: int = 0) -> ClientContext:
        return client_context(self.seed, client_id, round, stage)

    def run_round(self, round: int) -> dict[str, float]:
        """One round: configure, train the sampled clients, deliver their releases, aggregate, commit."""
        if round != self.completed_rounds:
            raise RuntimeError(f"round {round} requested but {self.completed_rounds} rounds are completed")
        sampled = sample_clients(sorted(self.clients), self.client_fraction, seed=self.seed, round=round)
        new_states = {cid: dict(self.client_states[cid]) for cid in sampled}
        replies = self._exchange(round, 0, self.strategy.configure_train(round, sampled), new_states)
        for stage in range(1, self.strategy.train_stages):
            replies = self._exchange(round, stage, self.strategy.configure_stage(round, stage, replies), new_states)
        metrics = self.strategy.aggregate_train(round, replies)
        self.client_states.update(new_states)
        self.completed_rounds = round + 1
        self._committed = self.snapshot()
        return {"clients": float(len(sampled)), **metrics}

    def _exchange(self, round: int, stage: int, messages: dict[int, Message],
                  states: dict[int, ClientState]) -> dict[int, Message]:
        """One stage of a round: each message down, the client's work on its working state, its release up."""
        replies = {}
        for cid in sorted(messages):
            delivered = self.wire.server_to_client(cid, messages[cid])
            ctx = self._context(cid, round, stage)
            if stage == 0:
                release = self.client.train(self.clients[cid], delivered, states[cid], ctx)
            else:
                release = self.client.train_stage(stage, self.clients[cid], delivered, states[cid], ctx)
            if release is not None:
                replies[cid] = self.wire.client_to_server(cid, release, round=round)
        return replies

    def training_client_model(self, client_id: int) -> nn.Module:
        """The model training client ``client_id`` is scored with, built on the client from the server's message."""
        message = self.wire.server_to_client(client_id, self.strategy.configure_evaluate(client_id))
        return self.client.evaluation_model(self.clients[client_id], message, self.client_states[client_id])

    def novel_client_model(self, novel: NovelClient) -> nn.Module:
        """Serve one novel client through the two-down, one-up protocol; its query (if any) is a recorded release."""
        cid = novel.client_id
        request = self.wire.server_to_client(cid, self.strategy.novel_request(cid))
        release = self.client.novel_query(novel, request)
        delivered = None if release is None else self.wire.client_to_server(cid, release, round=None)
        reply = self.wire.server_to_client(cid, self.strategy.novel_reply(cid, delivered))
        return self.client.novel_model(novel, reply)

    def evaluate_training_clients(self, score, *, report_to_server: bool, round: int | None) -> dict[int, Any]:
        """Score every training client on its own validation split, on the client, with ``score(model, x, y)``.

        With ``report_to_server`` (model selection on validation needs it) each client sends its score, and that
        message is a recorded release like any other; otherwise the score stays with the experimenter.
        """
        scores = {}
        for cid, data in self.clients.items():
            result = score(self.training_client_model(cid), data.x_val, data.y_val)
            if report_to_server:
                report = Message(metrics={"num_samples": float(result.num_samples), "correct": float(result.correct),
                                          "loss_sum": float(result.loss_sum)})
                self.wire.client_to_server(cid, Release.non_private(report, "validation_metrics"), round=round)
            scores[cid] = result
        return scores

    def snapshot(self) -> dict[str, Any]:
        """The server state and client states now (by reference: they are replaced, never mutated in place)."""
        return {
            "completed_rounds": self.completed_rounds,
            "strategy": self.strategy.state_dict(),
            "client_states": {cid: dict(state) for cid, state in self.client_states.items()},
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return server and client states to ``snapshot``; the wire and its ledgers are untouched."""
        self.strategy.load_state_dict(snapshot["strategy"])
        self.client_states = {int(cid): dict(s) for cid, s in snapshot["client_states"].items()}
        self.completed_rounds = int(snapshot["completed_rounds"])
        self._committed = self.snapshot()

    def committed_state_dict(self) -> dict[str, Any]:
        """The state at the end of the last completed round, plus the wire (whose ledger never rolls back)."""
        return {**self._committed, "wire": self.wire.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restore(state)
        self.wire.load_state_dict(state["wire"])
