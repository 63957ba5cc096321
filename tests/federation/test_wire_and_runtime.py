import math

import pytest
import torch

from accounting import BudgetExceededError, GaussianEvent, LedgerBook, PrivacyBudget
from privfl.federation import Message, Release, Wire, sample_clients


def test_every_client_release_is_recorded_before_delivery():
    wire = Wire()
    message = Message(arrays={"w": torch.ones(10)}, metrics={"num_examples": 3.0})
    delivered = wire.client_to_server(7, Release.non_private(message, "model_update"), round=4)
    ledger = wire.ledgers[7]
    assert len(ledger) == 1
    record = ledger.records[0]
    assert record.purpose == "model_update" and record.round == 4 and record.metadata["bytes"] == 40
    assert math.isinf(ledger.spent(1e-5).epsilon)          # a non-private release is epsilon = infinity
    assert wire.bytes_up[7] == 40
    delivered.arrays["w"] += 1                               # the server's copy is not the client's tensor
    assert torch.equal(message.arrays["w"], torch.ones(10))


def test_a_release_over_budget_is_refused_and_nothing_is_delivered():
    wire = Wire(LedgerBook(default_budget=PrivacyBudget(epsilon=1.0, delta=1e-5)))
    release = Release(Message(arrays={"d": torch.zeros(4)}), purpose="descriptor", event=GaussianEvent(sigma=0.5))
    with pytest.raises(BudgetExceededError):
        wire.client_to_server(3, release, round=0)
    assert len(wire.ledgers[3]) == 0 and wire.bytes_up.get(3, 0) == 0


def test_client_sampling_is_seeded_and_sized():
    ids = list(range(50))
    first = sample_clients(ids, 0.2, seed=1, round=3)
    assert len(first) == 10 and first == sample_clients(ids, 0.2, seed=1, round=3)
    assert first != sample_clients(ids, 0.2, seed=1, round=4)
    assert sample_clients(ids, 1.0, seed=1, round=0) == ids
    assert len(sample_clients(ids, 0.001, seed=0, round=0)) == 1
