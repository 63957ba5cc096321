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


def test_fedavg_clients_get_the_servers_tensors_uncopied_with_the_same_numbers(tiny_config):
    """A procedure that declares ``shares_messages`` (FedAvg's, and its subclasses that keep its ``train``) receives
    the server's tensors and hands its release over without a copy; the run's numbers are those of copied
    messages, and the wire copies again once the exchange is over."""
    from privfl.config import run_federation
    from privfl.experiment import build_runtime
    from privfl.methods.afl import AFLClient
    from privfl.methods.fedadg import FedADGClient
    from privfl.methods.fedavg import FedAvgClient
    from privfl.methods.fedprox import FedProxClient
    from privfl.methods.fedsr import FedSRClient
    from privfl.methods.tent import TentClient

    def handing_over(cls):
        return cls.hands_over_messages(object.__new__(cls))

    assert all(handing_over(c) for c in (FedAvgClient, FedProxClient, TentClient))
    assert not any(handing_over(c) for c in (AFLClient, FedADGClient, FedSRClient))   # their own train
    config = tiny_config()
    runs = {}
    for hand_over in (True, False):
        runtime = build_runtime(config, run_federation(config))
        inner, seen = runtime.client.inner, []
        train = inner.train

        def spy(data, message, state, ctx, train=train, runtime=runtime, seen=seen):
            weights = runtime.strategy.weights
            seen.append(all(message.arrays[k] is weights[k] for k in weights))
            return train(data, message, state, ctx)

        inner.train = spy
        if not hand_over:
            runtime.client.hands_over_messages = lambda: False
        for round in range(2):
            runtime.run_round(round)
        assert seen and set(seen) == {hand_over}
        assert runtime.wire.hand_over is False
        runs[hand_over] = runtime
    for name, tensor in runs[True].strategy.weights.items():
        assert torch.equal(tensor, runs[False].strategy.weights[name]), name
    assert [r.event for r in runs[True].ledgers()[0].records] == [r.event for r in runs[False].ledgers()[0].records]


def test_a_procedure_that_changes_a_shared_message_in_place_is_stopped(tiny_config):
    from privfl.config import run_federation
    from privfl.errors import InternalError
    from privfl.experiment import build_runtime

    config = tiny_config()
    runtime = build_runtime(config, run_federation(config))
    train = runtime.client.inner.train

    def scribble(data, message, state, ctx):
        next(iter(message.arrays.values())).mul_(1.0)          # in place, on the server's own tensor
        return train(data, message, state, ctx)

    runtime.client.inner.train = scribble
    with pytest.raises(InternalError, match="modified the tensors of the message it received in place"):
        runtime.run_round(0)
    assert runtime.wire.hand_over is False


def test_central_dp_sums_the_contributions_as_they_arrive_with_the_numbers_of_summing_them_at_the_end(tiny_config):
    """The central aggregator folds each contribution into the round's sum as it reaches the server (the round then
    holds one sum, not every client's update): the same noisy means, clips and ledgers as adding them afterwards."""
    from privfl.config import run_federation
    from privfl.experiment import build_runtime
    from privfl.federation.messages import Message
    from privfl.privacy.training import TrainingPrivacy

    config = tiny_config(client_fraction=0.6, privacy=TrainingPrivacy(mode="central", noise_multiplier=1.0,
                                                                      clip="adaptive", noise="seeded", noise_seed=4))
    runs, kept = {}, {}
    for folding in (True, False):
        runtime = build_runtime(config, run_federation(config))
        strategy = runtime.strategy
        if not folding:
            strategy.fold = lambda round, stage, cid, message: message
        aggregate = strategy.aggregate_train

        def spy(round, replies, aggregate=aggregate, folding=folding):
            kept.setdefault(folding, []).append(sum(len(m.arrays) for m in replies.values()))
            assert all(isinstance(m, Message) for m in replies.values())
            return aggregate(round, replies)

        strategy.aggregate_train = spy
        for round in range(3):
            runtime.run_round(round)
        runs[folding] = runtime
    assert kept[True] == [0, 0, 0] and all(n > 0 for n in kept[False])       # folded: no update kept
    assert runs[True].strategy.clip == runs[False].strategy.clip
    for name, tensor in runs[True].strategy.inner.weights.items():
        assert torch.equal(tensor, runs[False].strategy.inner.weights[name]), name
    epsilons = [r.ledgers().epsilons(1e-5) for r in (runs[True], runs[False])]
    assert epsilons[0] == epsilons[1]
