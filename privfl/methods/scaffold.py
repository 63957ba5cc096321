"""SCAFFOLD (Karimireddy et al., ICML 2020), Algorithm 1 with option II for the client control variate.

Server state: global weights x and server control variate c. Client i keeps its control variate c_i (zeros at first).
Round t, sampled clients S:

1. the server sends (x, c);
2. client i starts from y = x and takes K steps  y <- y - lr_l * (g_i(y) - c_i + c)          (Alg. 1, line 10);
3. it sets c_i+ = c_i - c + (x - y) / (K * lr_l)                                              (option II, line 12);
   and sends Delta_y = y - x and Delta_c = c_i+ - c_i, keeping c_i <- c_i+;
4. the server sets x <- x + lr_g * mean(Delta_y) and c <- c + (|S| / N) * mean(Delta_c)        (lines 16 to 17),
   where N is the number of training clients and the means are uniform over S, as in the paper.

The correction in step 2 is added as a linear term <c - c_i, y> in the local loss, whose gradient is exactly c - c_i.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE
from privfl.federation.messages import Message, Release, prefixed
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    Strategy,
    private_release,
    register_method,
    supported_modes,
)
from privfl.methods.fedavg import ServerStepConfig, weighted_mean
from privfl.methods.local_training import difference, sgd_settings, weights_of


@dataclass(frozen=True)
class ScaffoldConfig(ServerStepConfig):
    """FedAvg's settings, read as SCAFFOLD's: ``lr`` is the local rate lr_l, ``server_lr`` the global rate lr_g."""


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


class ScaffoldStrategy(Strategy):
    """Holds x and c; applies steps 4 of the algorithm."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights = weights_of(self.model_factory.init(self.seed))
        self.control = zeros_like(self.weights)

    def round_message(self, round: int) -> Message:
        return Message(arrays={**prefixed("x.", self.weights), **prefixed("c.", self.control)},
                       config=self.config.round_config(round))

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        ids = sorted(replies)
        uniform = [1.0] * len(ids)
        delta_y = weighted_mean([replies[cid].subset("dy.") for cid in ids], uniform)
        delta_c = weighted_mean([replies[cid].subset("dc.") for cid in ids], uniform)
        share = len(ids) / self.num_training_clients
        self.weights = {k: v + self.config.server_lr * delta_y[k] for k, v in self.weights.items()}
        self.control = {k: v + share * delta_c[k] for k, v in self.control.items()}
        return {"train_loss": sum(replies[cid].metrics.get("loss", float("nan")) for cid in ids) / len(ids)}

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        zeros = zeros_like(self.weights)
        return {**prefixed("dy.", zeros), **prefixed("dc.", zeros)}

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """Step 4 from the noisy mean of (Delta y_i, Delta c_i): x += lr_g * mean Delta y; c += (sum Delta c_i) / N,
        the sum being the noisy mean times the expected count q N (or the round's count, distributed)."""
        message = Message(arrays=mean)
        delta_y, delta_c = message.subset("dy."), message.subset("dc.")
        share = count / self.num_training_clients
        self.weights = {k: v + self.config.server_lr * delta_y[k].to(v.dtype) for k, v in self.weights.items()}
        self.control = {k: v + share * delta_c[k].to(v.dtype) for k, v in self.control.items()}
        return {}

    def novel_request(self, client_id: int) -> Message:
        return Message(arrays=self.weights)

    training_only = ("control",)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "control": self.control}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = {k: v.clone() for k, v in state["weights"].items()}
        self.control = ({k: v.clone() for k, v in state["control"].items()} if "control" in state
                        else zeros_like(self.weights))


class ScaffoldClient(ClientProcedure):
    """Steps 2 and 3 of the algorithm; keeps c_i in the client state (key prefix ``"c_i."``)."""

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        x, c = message.subset("x."), message.subset("c.")
        c_i = {k[len("c_i."):]: v for k, v in state.items() if k.startswith("c_i.")} or zeros_like(c)
        lr, steps = float(message.config["lr"]), int(message.config["local_steps"])
        correction = {k: (c[k] - c_i[k]).detach().to(self.model_factory.device) for k in c}

        def control_term(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return cast(torch.Tensor, sum((correction[name] * p).sum() for name, p in params.items()))

        model = self.model_from(x)
        loss, event = self.fit(model, data, sgd_settings(message.config), ctx.rng, extra_loss=control_term)
        y = weights_of(model)
        # c_i+ (option II) is a function of y and the server's c only: under record-level DP it is post-processing
        c_i_new = {k: c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in c}
        state.update(prefixed("c_i.", c_i_new))
        update = Message(
            arrays={**prefixed("dy.", difference(y, x)), **prefixed("dc.", difference(c_i_new, c_i))},
            metrics={} if event is not None else {"num_examples": float(data.num_train), "loss": loss},
        )
        return private_release(update, "model_update", event, metadata={"noise": self.privacy.noise})


register_method(
    "scaffold", strategy=ScaffoldStrategy, client=ScaffoldClient, config=ScaffoldConfig,
    description="SCAFFOLD: control variates correct client drift; local lr and global (server) lr",
    privacy=supported_modes(), devices=ANY_DEVICE,
    central_eval=None,
)
