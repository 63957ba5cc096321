"""MR-MTL: mean-regularised multi-task learning, as Liu, Hu, Wu and Smith run it in "On Privacy and Personalization in
Cross-Silo Federated Learning" (NeurIPS 2022; public code: github kenziyuliu/private-cross-silo-fl,
``trainers/mrmtl.py``).

Each training client (a silo) i keeps its own model w_i; together they minimise

    sum_i F_i(w_i) + (lambda / 2) sum_i ||w_i - w_bar||^2,    w_bar = the mean of the w_i,

by alternating rounds (numbered as the code runs them):

1. the server sends the mean w_bar (its only state);
2. silo i takes w_i from its client state (the first time it takes part, w_bar), runs local SGD on
   F_i(w) + (lambda / 2) ||w - w_bar||^2, keeps the result as its new w_i and releases u_i = w_i - w_bar;
3. the server sets w_bar <- w_bar + mean_i u_i, the mean of the round's w_i (weighted by the silos' sample counts
   without DP, as the authors' code does, uniformly under DP, where the counts are private).

lambda = 0 is local training (the release does not feed back into w_i); as lambda grows every w_i is pulled to w_bar
and the method tends to FedAvg. A training client is scored with its own w_i; novel clients (and a training client
never sampled) receive w_bar.

**What is released.** u_i = w_i - w_bar, not w_i: the server knows w_bar, so the two carry the same information, but
the difference is what client-level clipping bounds well (a whole model's norm is far larger than its distance to the
mean) and what the server steps by (``apply_mean``: the noisy mean of the u_i is the move of the mean, so central and
distributed DP step from it as they step FedAvg). Without DP and with every client in every round, releasing the
round's change w_i^new - w_i^old instead (as the authors' code does) gives the same w_bar, since w_bar stays the mean of
the w_i; with partial participation or clipping it does not, and u_i is what makes w_bar the mean of the models.
How this and the code's other choices are settled: docs/papers.md, MR-MTL, U1-U5.

**Privacy.** Record level: w_i is trained by DP-SGD (:meth:`~privfl.methods.base.ClientProcedure.fit`), so every
iterate of a silo's model is post-processing of noisy clipped gradient sums, each round's recorded with the round's
release; the regulariser's gradient lambda (w - w_bar) reads the current iterate and the server's mean only, never the
records, and is added outside the clipped, noised sum (``extra_loss``), as FedProx's proximal term is. Local and
distributed: the layer clips u_i and adds the noise (or a share); w_i stays on the client. Central: the aggregator
clips each u_i, noises the sum and moves w_bar by it; it keeps nothing per client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
)
from privfl.methods.fedavg import FedAvgStrategy
from privfl.methods.local_training import ExtraLoss, difference, sgd_settings, weights_of
from privfl.privacy.training import record_steps_for_epochs


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

    def regulariser(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return 0.5 * lam * sum(((p - anchor[name]) ** 2).sum() for name, p in params.items())

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
        epochs = int(config.get("local_epochs", 0))
        if epochs:
            batch_size = int(config["batch_size"])
            settings["steps"] = (record_steps_for_epochs(epochs, self.record_sampling_rate()) if self.record_level
                                 else epochs * math.ceil(data.num_train / min(batch_size, data.num_train)))
        return settings

    def record_steps(self) -> int:
        """Record level: ``local_steps``, or ``local_epochs`` passes at the public rate q (``ceil(epochs / q)``)."""
        epochs = self.config.local_epochs or 0
        return record_steps_for_epochs(epochs, self.record_sampling_rate()) if epochs else int(self.config.local_steps)

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
    privacy={"record": None, "local": None, "distributed": None, "central": None},
    smoke_settings={"lam": 0.5},
    devices=ANY_DEVICE,
    central_eval=None,
)
