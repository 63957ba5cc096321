"""MR-MTL: mean-regularised multi-task learning, as Liu, Hu, Wu and Smith run it in "On Privacy and Personalization in
Cross-Silo Federated Learning" (NeurIPS 2022; public code: github kenziyuliu/private-cross-silo-fl,
``trainers/mrmtl.py``).

Each training client (a silo) keeps its own model w_i, trained locally with a pull (lambda / 2) ||w_i - w_bar||^2
toward the server's mean w_bar, and releases u_i = w_i - w_bar; the server moves w_bar by the mean of the u_i.
lambda = 0 is local training; large lambda tends to FedAvg. Every privacy mode runs.

Entry points: :class:`MRMTLConfig`, :class:`MRMTLStrategy`, :class:`MRMTLClient` (registered as ``mrmtl``) and
:func:`mean_regulariser`.

The round, why u_i is released rather than w_i, and each privacy mode: docs/methods/baselines.md, "MR-MTL".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE
from privfl.errors import check
from privfl.federation.messages import Message, Release
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    LocalTrainingConfig,
    private_release,
    register_method,
    supported_modes,
)
from privfl.methods.fedavg import FedAvgStrategy
from privfl.methods.local_training import ExtraLoss, difference, sgd_settings, weights_of


@dataclass(frozen=True)
class MRMTLConfig(LocalTrainingConfig):
    """MR-MTL's settings: local SGD (:class:`~privfl.methods.base.LocalTrainingConfig`: ``lr``, ``local_steps``,
    ``batch_size``, ...), the regularisation strength ``lam`` (lambda >= 0; Liu et al. take 0.001 on Rotated MNIST),
    and ``local_epochs``: when set, each round is that many passes over the silo's records in place of
    ``local_steps`` (``epochs * ceil(n / batch_size)`` steps without DP; under record-level DP ``ceil(epochs / q)``
    steps at the public rate q, since n is private there).

    ``lr * lam`` must stay below 2: a gradient step on (lambda / 2) ||w - w_bar||^2 multiplies w - w_bar by
    1 - lr * lambda, which overshoots w_bar further each step beyond that."""

    lam: float = 0.001
    local_epochs: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check.non_negative(self.lam, "lam")
        check.require(self.lr * self.lam < 2.0, "lam", self.lam,
                      f"below 2 / lr = {2.0 / self.lr:g} (lr={self.lr!r}): a step on the regulariser scales "
                      "w - w_bar by 1 - lr * lam, which diverges once lr * lam >= 2")
        if self.local_epochs is not None:
            check.integer(self.local_epochs, "local_epochs", 1)

    def round_config(self, round: int) -> dict:
        return {**super().round_config(round), "local_epochs": self.local_epochs or 0}


def mean_regulariser(lam: float, mean: dict[str, torch.Tensor], device: str | torch.device) -> ExtraLoss:
    """(lambda / 2) sum over parameters ||w - w_bar||^2 as an ``extra_loss``: its gradient, lambda (w - w_bar),
    depends on the current iterate and the server's mean ``mean`` only, never on the records."""
    anchor = {name: value.detach().to(device) for name, value in mean.items()}

    def regulariser(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return 0.5 * lam * cast(torch.Tensor, sum(((p - anchor[name]) ** 2).sum() for name, p in params.items()))

    return regulariser


class MRMTLStrategy(FedAvgStrategy):
    """Holds the mean w_bar only; moves it by the (noisy, under client-level DP) mean of the releases w_i - w_bar,
    which makes it the mean of the round's silo models (no server learning rate, no momentum)."""

    def server_step(self, change: dict[str, torch.Tensor]) -> None:
        self.weights = {k: v + change[k].to(v.dtype) for k, v in self.weights.items()}


class MRMTLClient(ClientProcedure):
    """Keeps its own model w_i in the client state, trains it towards the received mean, releases w_i - w_bar."""

    def local_settings(self, data: TrainingClient, config: dict[str, Any]) -> dict[str, Any]:
        """The :func:`local_sgd` settings of the server's round message: ``local_steps`` steps, or ``local_epochs``
        passes (record level: ``ceil(epochs / q)`` steps at the public rate q, :meth:`record_steps`; ``fit`` refuses
        a message whose steps differ from the client's own plan)."""
        settings = sgd_settings(config)
        settings["steps"] = self.round_steps(data, config)
        return settings

    def own_weights(self, state: ClientState, mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """w_i: the client state, or the received mean the first time this client takes part."""
        return dict(state) if state else {k: v.clone() for k, v in mean.items()}

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        mean = message.arrays
        model = self.model_from(self.own_weights(state, mean))
        regulariser = mean_regulariser(float(self.config.lam), mean, self.model_factory.device)
        loss, event = self.fit(model, data, self.local_settings(data, message.config), ctx.rng,
                               extra_loss=regulariser)
        trained = weights_of(model)
        for name, value in trained.items():      # replace entries: the runtime keeps the last round's by reference
            state[name] = value
        metrics = {} if event is not None else {"num_examples": float(data.num_train), "loss": loss}
        return private_release(Message(arrays=difference(trained, mean), metrics=metrics), "model_update", event,
                               metadata={"noise": self.privacy.noise, "max_grad_norm": self.privacy.clip})

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState):
        """A training client is scored with its own w_i (w_bar, the message, if it never took part)."""
        return self.model_from(dict(state) if state else message.arrays)


register_method(
    "mrmtl", strategy=MRMTLStrategy, client=MRMTLClient, config=MRMTLConfig,
    description="MR-MTL: each silo keeps its own model, trained with (lam/2)||w_i - w_bar||^2 towards the mean w_bar "
                "of the silos' models, the server's only state; novel clients get w_bar",
    privacy=supported_modes(),
    smoke_settings={"lam": 0.5},
    devices=ANY_DEVICE,
    central_eval=None,
)
