"""FedAvg (McMahan et al., AISTATS 2017): local SGD, then the sample-size weighted mean of the weight changes.

Round t, for sampled clients S_t with n_i training samples (numbered steps as in the paper's Algorithm 1):

1. the server sends the global weights w_t;
2. client i runs ``local_steps`` minibatch SGD steps from w_t and sends Delta_i = w_i - w_t and n_i;
3. the server sets w_{t+1} = w_t + server_lr * sum_i (n_i / sum_j n_j) Delta_i.

Novel clients receive w (the model of the best validation round, or the last) and send nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from privfl.data import TrainingClient
from privfl.federation.messages import Message, Release
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    LocalTrainingConfig,
    Strategy,
    _finite,
    _require,
    register_method,
)
from privfl.methods.local_training import difference, local_sgd, sgd_settings, weights_of
from privfl.privacy.dp_sgd import DPSGDConfig, DPSGDTrainer
from privfl.privacy.mechanisms import NOISE_SOURCES


@dataclass(frozen=True)
class ServerStepConfig(LocalTrainingConfig):
    """Local SGD plus the server learning rate applied to the averaged change (1.0 = plain averaging)."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(_finite(self.server_lr) and self.server_lr > 0, "server_lr", self.server_lr,
                 "a finite number > 0")


@dataclass(frozen=True)
class FedAvgConfig(ServerStepConfig):
    """FedAvg's settings. With ``dp_noise_multiplier`` set, clients train with DP-SGD (Opacus, Poisson sampling,
    per-sample clipping at ``dp_max_grad_norm``) and each round's weight change is released with that round's
    DP-SGD event (record-level, add/remove one); the client's ledger composes the rounds for its whole life.
    ``dp_noise`` is ``"secure"`` (default; OS-seeded sampling and noise), ``"hardened"`` (as secure, with the noise
    drawn against floating-point attacks: Opacus' ``secure_mode``, see :class:`~privfl.privacy.dp_sgd.DPSGDConfig`)
    or ``"seeded"`` (from the client's keyed generator: reproducible, for research runs only, since the server knows
    the run seed).
    """

    dp_noise_multiplier: float | None = None
    dp_max_grad_norm: float = 1.0
    dp_noise: str = "secure"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.dp_noise_multiplier is None
                 or (_finite(self.dp_noise_multiplier) and self.dp_noise_multiplier > 0),
                 "dp_noise_multiplier", self.dp_noise_multiplier, "None or a finite number > 0")
        _require(_finite(self.dp_max_grad_norm) and self.dp_max_grad_norm > 0, "dp_max_grad_norm",
                 self.dp_max_grad_norm, "a finite number > 0")
        _require(self.dp_noise in NOISE_SOURCES, "dp_noise", self.dp_noise, f"one of {', '.join(NOISE_SOURCES)}")
        if self.dp_noise_multiplier is None:   # DP settings that would silently do nothing
            for name, default in (("dp_max_grad_norm", 1.0), ("dp_noise", "secure")):
                _require(getattr(self, name) == default, name, getattr(self, name),
                         f"left at {default!r} without dp_noise_multiplier (without it clients train without DP)")

    @property
    def training_dp(self) -> str | None:
        """What protects the training clients' releases (``None``: nothing), read by
        :class:`~privfl.experiment.RunConfig`."""
        return None if self.dp_noise_multiplier is None else f"DP-SGD (dp_noise_multiplier={self.dp_noise_multiplier})"


def weighted_mean(updates: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """sum_i w_i * update_i / sum_i w_i, tensor by tensor."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregation weights must sum to > 0, got {weights}")
    return {
        name: sum(update[name] * (w / total) for update, w in zip(updates, weights, strict=True))
        for name in updates[0]
    }


class FedAvgStrategy(Strategy):
    """Holds the global weights; averages weight changes weighted by the clients' sample counts."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights = weights_of(self.model_factory.init(self.seed))

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        message = Message(arrays=self.weights, config=self.config.round_config(round))
        return {cid: message for cid in client_ids}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        ids = sorted(replies)
        # DP-SGD clients send no sample count (it depends on the data): their changes are averaged uniformly.
        counts = [replies[cid].metrics.get("num_examples", 1.0) for cid in ids]
        change = weighted_mean([replies[cid].arrays for cid in ids], counts)
        self.weights = {k: v + self.config.server_lr * change[k] for k, v in self.weights.items()}
        losses = [replies[cid].metrics.get("loss", float("nan")) for cid in ids]
        return {"train_loss": weighted_mean_scalar(losses, counts)}

    def novel_request(self, client_id: int) -> Message:
        return Message(arrays=self.weights)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = {k: v.clone() for k, v in state["weights"].items()}


def weighted_mean_scalar(values: list[float], weights: list[float]) -> float:
    return float(sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights))


class FedAvgClient(ClientProcedure):
    """Runs local SGD from the received weights and sends the weight change with its sample count."""

    def local_objective(self, global_weights: dict[str, torch.Tensor], state: ClientState):
        """The extra term added to the local loss (none for FedAvg; FedProx overrides this)."""
        return None

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        start = message.arrays
        model = self.model_from(start)
        if self.config.dp_noise_multiplier is not None:
            return self.train_private(data, model, start, message, ctx)
        loss = local_sgd(model, data.x_train, data.y_train, rng=ctx.rng, extra_loss=self.local_objective(start, state),
                         **sgd_settings(message.config))
        update = Message(
            arrays=difference(weights_of(model), start),
            metrics={"num_examples": float(data.num_train), "loss": loss},
        )
        return Release.non_private(update, purpose="model_update")

    def train_private(self, data: TrainingClient, model, start, message: Message, ctx: ClientContext) -> Release:
        """DP-SGD local training; the release carries only the weight change and this round's DP-SGD event.

        The change is post-processing of the DP-SGD iterates, so the round's event covers it. The sample count and
        training loss are not sent: they depend on the data and no mechanism covers them. (The accountant takes n as
        known for the sampling rate q = batch_size / n, which the round's event records: a ledger sent to the server,
        as Flower's summary does, gives n; see ``privfl.federation.flower.protocol.OUTSIDE_LEDGER``.)
        """
        trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=self.config.dp_noise_multiplier,
                                           max_grad_norm=self.config.dp_max_grad_norm, noise=self.config.dp_noise))
        settings = sgd_settings(message.config)
        _, event = trainer.train(model, data.x_train, data.y_train, lr=settings["lr"], steps=settings["steps"],
                                 batch_size=settings["batch_size"], rng=ctx.rng)
        return Release(Message(arrays=difference(weights_of(model), start)), purpose="model_update", event=event,
                       metadata={"noise": self.config.dp_noise, "max_grad_norm": self.config.dp_max_grad_norm})


register_method(
    "fedavg", strategy=FedAvgStrategy, client=FedAvgClient, config=FedAvgConfig,
    description="FedAvg: sample-size weighted average of local SGD updates; novel clients get the global model",
)
