"""Multi-stage rounds: a round that is a dialogue, every message up recorded, client state committed at the end."""

import numpy as np
import pytest
import torch

from privfl.data import TrainingClient
from privfl.federation import InProcessRuntime, Message, Release
from privfl.methods.base import ClientProcedure, ModelFactory, Strategy


class SumStrategy(Strategy):
    """Stage 0: clients send a value; stage 1: the server sends the sum back; clients answer sum * id."""

    train_stages = 2

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.total = torch.zeros(())
        self.seen_stage1 = {}

    def configure_train(self, round, client_ids):
        return {cid: Message(config={"round": round}) for cid in client_ids}

    def configure_stage(self, round, stage, replies):
        assert stage == 1
        total = sum(float(m.metrics["value"]) for m in replies.values())
        return {cid: Message(metrics={"sum": total}) for cid in replies if cid != 2}   # client 2 drops out

    def aggregate_train(self, round, replies):
        self.seen_stage1 = {cid: m.metrics["answer"] for cid, m in replies.items()}
        self.total = self.total + sum(self.seen_stage1.values())
        return {"answers": float(len(replies))}

    def novel_request(self, client_id):
        return Message()

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"].clone()


class SumClient(ClientProcedure):
    def train(self, data, message, state, ctx):
        state["calls"] = state.get("calls", 0) + 1
        return Release.non_private(Message(metrics={"value": float(data.client_id + 1)}), "value")

    def train_stage(self, stage, data, message, state, ctx):
        state["calls"] += 1
        if stage == 1 and data.client_id == 3:
            raise KeyboardInterrupt               # interrupted mid-dialogue in the second round (see below)
        return Release.non_private(Message(metrics={"answer": message.metrics["sum"] * data.client_id}), "answer")


def _clients(n):
    x = np.zeros((4, 1, 2, 2), dtype=np.float32)
    y = np.zeros(4, dtype=np.int64)
    return [TrainingClient(client_id=i, x_train=x, y_train=y, x_val=x, y_val=y) for i in range(n)]


def test_a_two_stage_round_is_a_recorded_dialogue_and_commits_only_when_complete():
    factory = ModelFactory("mlp2nn", (1, 2, 2), 2)
    strategy = SumStrategy(model_factory=factory, config=None, seed=0, num_training_clients=3)
    runtime = InProcessRuntime(strategy=strategy, client=SumClient(model_factory=factory, config=None),
                               training_clients=_clients(3), seed=0)
    metrics = runtime.run_round(0)
    # stage-0 values are 1, 2, 3 (sum 6); client 2 gets no stage-1 message, so clients 0 and 1 answer 0 and 6.
    assert metrics["answers"] == 2.0 and strategy.seen_stage1 == {0: 0.0, 1: 6.0}
    ledgers = runtime.wire.ledgers
    assert [r.purpose for r in ledgers[1].records] == ["value", "answer"]
    assert [r.purpose for r in ledgers[2].records] == ["value"]
    assert runtime.client_states[1]["calls"] == 2 and runtime.client_states[2]["calls"] == 1

    # A round interrupted at stage 1 commits nothing: client states and server state stay as after round 0.
    more = _clients(4)
    strategy = SumStrategy(model_factory=factory, config=None, seed=0, num_training_clients=4)
    runtime = InProcessRuntime(strategy=strategy, client=SumClient(model_factory=factory, config=None),
                               training_clients=more, seed=0)
    with pytest.raises(KeyboardInterrupt):
        runtime.run_round(0)
    assert runtime.completed_rounds == 0 and all(state == {} for state in runtime.client_states.values())
    assert len(runtime.wire.ledgers[0]) == 2       # the releases made before the interruption stay recorded
