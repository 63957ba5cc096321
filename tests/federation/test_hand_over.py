"""Messages handed over uncopied (``ClientProcedure.shares_messages``): who may declare it, and the runtime's check that
a procedure declaring it leaves the tensors it received as they were."""

import pytest
import torch

from privfl.config import RunConfig
from privfl.data import build_federation
from privfl.errors import InternalError
from privfl.experiment import build_runtime
from privfl.methods.base import ClientProcedure
from privfl.methods.fedavg import FedAvgClient

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


class _Overrides(FedAvgClient):
    """Overrides ``train`` without declaring anything: it does not inherit FedAvg's declaration."""

    def train(self, data, message, state, ctx):
        return super().train(data, message, state, ctx)


class _Declares(_Overrides):
    shares_messages = True


class _Scribbles(FedAvgClient):
    """Declares shares_messages and breaks it: adds one to every weight it received."""

    shares_messages = True

    def train(self, data, message, state, ctx):
        for tensor in message.arrays.values():
            tensor.add_(1.0)
        return super().train(data, message, state, ctx)


def test_only_a_class_that_declares_it_for_its_own_train_hands_over_messages():
    assert not ClientProcedure.shares_messages
    hands_over = {cls: cls.hands_over_messages(object.__new__(cls))
                  for cls in (FedAvgClient, _Overrides, _Declares, _Scribbles)}
    assert hands_over == {FedAvgClient: True, _Overrides: False, _Declares: True, _Scribbles: True}


def _runtime(make_spec, client_class=None):
    config = RunConfig(federation=make_spec(num_clients=8, novel_fraction=0.25), method="fedavg",
                       method_config={"lr": 0.1, "local_steps": 2, "batch_size": 8}, rounds=1, eval_every=1, seed=3)
    runtime = build_runtime(config, build_federation(config.federation, seed=config.seed))
    if client_class is not None:
        client = runtime.client
        runtime.client = object.__new__(client_class)
        vars(runtime.client).update(vars(client))
    return runtime


def test_handed_over_messages_give_the_numbers_of_copied_ones(make_spec):
    handed, copied = _runtime(make_spec), _runtime(make_spec, _Overrides)
    assert handed.client.hands_over_messages() and not copied.client.hands_over_messages()
    handed.run_round(0)
    copied.run_round(0)
    one, two = handed.strategy.state_dict()["weights"], copied.strategy.state_dict()["weights"]
    weights = [{k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for s in (one, two)]
    assert weights[0] and weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_a_procedure_that_changes_a_handed_over_message_in_place_stops_the_run(make_spec):
    runtime = _runtime(make_spec, _Scribbles)
    with pytest.raises(InternalError, match=r"client 0 modified the tensors of the message it received in place at "
                                            r"stage 0 of round 0, although its procedure \(_Scribbles\) declares "
                                            r"shares_messages"):
        runtime.run_round(0)
