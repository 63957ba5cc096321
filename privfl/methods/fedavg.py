"""FedAvg (McMahan et al., AISTATS 2017): local SGD, then the sample-size weighted mean of the weight changes.

Round t, for sampled clients S_t with n_i training samples (numbered steps as in the paper's Algorithm 1):

1. the server sends the global weights w_t;
2. client i runs ``local_steps`` minibatch SGD steps from w_t and sends Delta_i = w_i - w_t and n_i;
3. the server sets w_{t+1} = w_t + server_lr * sum_i (n_i / sum_j n_j) Delta_i.

``server_momentum`` beta > 0 makes step 3 FedAvgM (Hsu, Qi and Brown 2019, "Measuring the effects of non-identical
data distribution"): v_{t+1} = beta v_t + Delta_t, w_{t+1} = w_t + server_lr v_{t+1}, where Delta_t is the round's
(noisy, under client-level DP) mean change. It is post-processing of the released means, so it changes no epsilon;
DP-FedAvg with server momentum is the setting of McMahan et al. (ICLR 2018) and Andrew et al. (NeurIPS 2021).

Novel clients receive w (the model of the best validation round, or the last) and send nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from accounting.validation import is_real
from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    LocalTrainingConfig,
    Strategy,
    private_release,
    register_method,
    supported_modes,
)
from privfl.methods.local_training import change_of, sgd_settings, weights_of


@dataclass(frozen=True)
class ServerStepConfig(LocalTrainingConfig):
    """Local SGD plus the server learning rate applied to the averaged change (1.0 = plain averaging)."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check.positive(self.server_lr, "server_lr")


@dataclass(frozen=True)
class FedAvgConfig(ServerStepConfig):
    """FedAvg's settings: local SGD (:class:`~privfl.methods.base.LocalTrainingConfig`), the server learning rate and
    server momentum (0: plain FedAvg; in [0, 1)). Its training clients are protected by the run's privacy layer
    (``RunConfig.privacy``): record level trains with DP-SGD, each round's weight change released with that round's
    event."""

    server_momentum: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(is_real(self.server_momentum) and 0.0 <= self.server_momentum < 1.0, "server_momentum",
                      self.server_momentum, "a number in [0, 1) (0: plain FedAvg)")


def weighted_mean(updates: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """sum_i w_i * update_i / sum_i w_i, tensor by tensor."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregation weights must sum to > 0, got {weights}")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    return {name: _weighted_sum([update[name] for update in updates], [w / total for w in weights])
            for name in updates[0]}


def _weighted_sum(tensors: list[torch.Tensor], factors: list[float]) -> torch.Tensor:
    """``sum(t * f for t, f in zip(tensors, factors))``, the same numbers (Python's sum starts from 0 and adds each
    product in turn), in one accumulator and one scratch tensor where every tensor has the same shape, dtype and
    device; otherwise that very sum."""
    first = tensors[0]
    if not all(isinstance(t, torch.Tensor) and t.shape == first.shape and t.dtype == first.dtype
               and t.device == first.device and first.is_floating_point() for t in tensors):
        return cast(torch.Tensor, sum(t * f for t, f in zip(tensors, factors, strict=True)))
    total = torch.zeros_like(first)
    scratch = torch.empty_like(first)
    for t, f in zip(tensors, factors, strict=True):
        total.add_(torch.mul(t, f, out=scratch))
    return total


class FedAvgStrategy(Strategy):
    """Holds the global weights; averages weight changes weighted by the clients' sample counts."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights = weights_of(self.model_factory.init(self.seed))
        self.momentum: dict[str, torch.Tensor] | None = None
        momentum = getattr(self.config, "server_momentum", 0.0)
        if momentum and (type(self).aggregate_train is not FedAvgStrategy.aggregate_train
                         or type(self).apply_mean is not FedAvgStrategy.apply_mean):
            raise ConfigError(f"server_momentum={momentum!r} is applied by FedAvg's own server step, which "
                              f"{type(self).__name__} replaces; use server_momentum=0 with this method")

    def server_step(self, change: dict[str, torch.Tensor]) -> None:
        """w <- w + server_lr * change, through the momentum buffer when ``server_momentum`` > 0."""
        beta = getattr(self.config, "server_momentum", 0.0)
        if beta:
            self.momentum = ({k: v.clone() for k, v in change.items()} if self.momentum is None
                             else {k: beta * self.momentum[k] + change[k] for k in change})
            change = self.momentum
        self.weights = {k: v + self.config.server_lr * change[k].to(v.dtype) for k, v in self.weights.items()}

    def round_message(self, round: int) -> Message:
        return Message(arrays=self.weights, config=self.config.round_config(round))

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        ids = sorted(replies)
        counts = sample_weights(replies, ids)
        self.server_step(weighted_mean([replies[cid].arrays for cid in ids], counts))
        losses = [replies[cid].metrics.get("loss", float("nan")) for cid in ids]
        return {"train_loss": weighted_mean_scalar(losses, counts)}

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(v) for k, v in self.weights.items()}

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """w <- w + server_lr * (noisy mean weight change): step 3 with uniform weights (the sample counts are
        private)."""
        self.server_step(mean)
        return {}

    def novel_request(self, client_id: int) -> Message:
        return Message(arrays=self.weights)

    training_only = ("momentum",)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights} if self.momentum is None else {"weights": self.weights,
                                                                       "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = {k: v.clone() for k, v in state["weights"].items()}
        self.momentum = {k: v.clone() for k, v in state["momentum"].items()} if "momentum" in state else None


def sample_weights(replies: Mapping[int, Message], ids: Sequence[int], weighted: bool = True) -> list[float]:
    """Each reply's weight in a mean, in the order of ``ids``: its sample count (``num_examples``), or 1 where it
    sends none (a private client does not: its count depends on its data, and no mechanism covers it), or 1 for
    every reply when ``weighted`` is False."""
    return [float(replies[cid].metrics.get("num_examples", 1.0)) if weighted else 1.0 for cid in ids]


def weighted_mean_scalar(values: list[float], weights: list[float]) -> float:
    return float(sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights))


class FedAvgClient(ClientProcedure):
    """Runs local SGD from the received weights and sends the weight change with its sample count."""

    # train reads the received weights (into the workspace model, and to subtract them) and releases fresh tensors
    shares_messages = True

    def local_objective(self, global_weights: dict[str, torch.Tensor], state: ClientState):
        """The extra term added to the local loss (none for FedAvg; FedProx overrides this)."""
        return None

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        """Local SGD from the received weights (DP-SGD under record-level DP, where the sample count and loss, which
        no mechanism covers, are not sent); the release is the weight change."""
        start = message.arrays
        model = self.model_from(start)
        loss, event = self.fit(model, data, sgd_settings(message.config), ctx.rng,
                               extra_loss=self.local_objective(start, state))
        metrics = {} if event is not None else {"num_examples": float(data.num_train), "loss": loss}
        return private_release(Message(arrays=change_of(model, start), metrics=metrics), "model_update",
                               event, metadata={"noise": self.privacy.noise, "max_grad_norm": self.privacy.clip})


#: What the FedAvg family's registrations declare: every mode runs (the server step is a mean of the clients' weight
#: changes, so central and distributed DP step from their noisy mean).
FEDAVG_PRIVACY = supported_modes()


register_method(
    "fedavg", strategy=FedAvgStrategy, client=FedAvgClient, config=FedAvgConfig,
    description="FedAvg: sample-size weighted average of local SGD updates; novel clients get the global model",
    privacy=FEDAVG_PRIVACY, devices=ANY_DEVICE,
    central_eval=None,
)
