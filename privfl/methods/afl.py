"""AFL, Agnostic Federated Learning (Mohri, Sivek and Suresh, ICML 2019), in its stochastic form run over rounds.

The objective is the minimax min_w max_{lambda in simplex} sum_k lambda_k L_k(w), solved by alternating projected
gradient steps (Stochastic-AFL, Algorithm 1): each sampled client releases its weight change and its loss, the
server steps w by the lambda-weighted changes and lambda up the losses (:func:`project_to_simplex`).

Entry points: :class:`AFLConfig`, :class:`AFLStrategy`, :class:`AFLClient` (registered as ``afl``) and
:func:`record_losses`.

The round step by step, the FedTTA paper's settings and each privacy mode (the loss release's Gaussian mechanism;
cited below as "the module docstring"): docs/methods/baselines.md, "AFL".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accounting import PrivacyEvent
from accounting.validation import is_finite
from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE, device_of
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release
from privfl.methods.base import ClientContext, ClientState, compose, register_method, supported_modes
from privfl.methods.fedavg import FedAvgClient, FedAvgStrategy, ServerStepConfig, weighted_mean
from privfl.methods.fedsr import update_release
from privfl.methods.local_training import difference, sgd_settings, weights_of
from privfl.privacy.record import ClippedMean, RecordRelease
from privfl.privacy.training import RECORD, NovelPrivacy, TrainingPrivacy

#: The privacy modes this method runs, and why it refuses the others.
AFL_PRIVACY = supported_modes(
    central="its server step weights each client's update by that client's own mixture weight lambda_k and moves "
            "lambda_k by that client's own loss, not a function of a noisy mean of contributions (a per-client "
            "loss slot would need the training clients' ids, which the server learns only from who is sampled)",
    distributed="its lambda step needs each client's own loss and its server step each client's own lambda_k, "
                "which secure aggregation hides (only the sum is seen)")

#: The name of the loss L_k(w_t) in a client's release (a 0-d tensor beside the weight change).
LOSS = "afl.loss"


@dataclass(frozen=True)
class AFLConfig(ServerStepConfig):
    """Local SGD (``lr`` = gamma_w) plus the mixture-weight learning rate ``lambda_lr`` = gamma_lambda (>= 0), and
    ``loss_bound`` B (nats, > 0): under record-level DP each record's cross-entropy is clipped to [0, B] before the
    client's loss is released (module docstring; the noise grows with B)."""

    lambda_lr: float = 0.001
    loss_bound: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(is_finite(self.lambda_lr) and self.lambda_lr >= 0, "lambda_lr", self.lambda_lr,
                      "a finite number >= 0")
        check.require(is_finite(self.loss_bound) and self.loss_bound > 0, "loss_bound", self.loss_bound,
                      "a finite number > 0 (nats)")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run, a record-level loss release without a sound size bound: the mean's smaller
        neighbour must be non-empty, so ``privacy.min_samples`` >= 2 (module docstring)."""
        if privacy.mode == RECORD and privacy.min_samples < 2:
            raise ConfigError(f"AFL's record-level loss release is a mean over a client's records with n private, "
                              f"calibrated for the public lower bound privacy min_samples, which must be >= 2 (the "
                              f"smaller neighbour's mean must exist), got min_samples={privacy.min_samples}")


def project_to_simplex(v: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of the vector ``v`` on the probability simplex (Duchi et al. 2008, Fig. 1)."""
    u, _ = torch.sort(v, descending=True)
    cumulative = torch.cumsum(u, dim=0) - 1.0
    index = torch.arange(1, len(v) + 1, dtype=v.dtype)
    rho = int(torch.nonzero(u - cumulative / index > 0).max())
    theta = cumulative[rho] / (rho + 1)
    return torch.clamp(v - theta, min=0.0)


class AFLStrategy(FedAvgStrategy):
    """Holds w and lambda. Client ids take lambda's slots in the order they are first seen; the slots of clients not
    yet seen are interchangeable (they start equal and get the same zero gradient), so the order does not matter."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        n = self.num_training_clients
        self.lambdas = torch.full((n,), 1.0 / n, dtype=torch.float64)
        self.lambda_ids = torch.full((n,), -1, dtype=torch.int64)

    def slot(self, client_id: int) -> int:
        """lambda's index for ``client_id`` (assigning the next free slot on first sight)."""
        hits = torch.nonzero(self.lambda_ids == client_id)
        if len(hits):
            return int(hits[0])
        free = torch.nonzero(self.lambda_ids == -1)
        if not len(free):
            raise ValueError(f"client {client_id} is one more than the {self.num_training_clients} training clients")
        index = int(free[0])
        self.lambda_ids = self.lambda_ids.clone()
        self.lambda_ids[index] = client_id
        return index

    def mixture_weights(self) -> dict[int, float]:
        """lambda by client id, for the clients seen so far."""
        return {int(cid): float(lam) for cid, lam in zip(self.lambda_ids, self.lambdas) if cid >= 0}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        ids = sorted(replies)
        losses = {cid: float(replies[cid].arrays[LOSS]) if LOSS in replies[cid].arrays else math.nan for cid in ids}
        bad = {cid: loss for cid, loss in losses.items() if not math.isfinite(loss)}
        if bad:   # before any state changes: lambda's projection has no answer for a NaN or infinite loss
            raise ConfigError(f"round {round}: AFL needs each client's finite loss at the received weights for its "
                              f"lambda step, got {bad}; the model diverged: lower lr (now {self.config.lr!r}), "
                              f"server_lr (now {self.config.server_lr!r}) or lambda_lr (now {self.config.lambda_lr!r})")
        slots = [self.slot(cid) for cid in ids]
        weights = [float(self.lambdas[s]) for s in slots]
        if sum(weights) > 0:      # all sampled clients at lambda = 0: w stays, lambda still moves
            change = weighted_mean([{k: v for k, v in replies[cid].arrays.items() if k != LOSS} for cid in ids],
                                   weights)
            self.weights = {k: v + self.config.server_lr * change[k] for k, v in self.weights.items()}
        gradient = torch.zeros_like(self.lambdas)
        for cid, s in zip(ids, slots):
            gradient[s] = losses[cid]
        self.lambdas = project_to_simplex(self.lambdas + self.config.lambda_lr * gradient)
        values = [losses[cid] for cid in ids]
        return {"train_loss": sum(values) / len(values), "afl_weighted_loss": sum(
            w * loss for w, loss in zip(weights, values)) / max(sum(weights), 1e-12),
            "lambda_max": float(self.lambdas.max())}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "lambdas": self.lambdas, "lambda_ids": self.lambda_ids}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.lambdas = state["lambdas"].clone()
        self.lambda_ids = state["lambda_ids"].clone()


class AFLClient(FedAvgClient):
    """Step 2: the loss at the received weights, then FedAvg's local SGD (DP-SGD and a private loss at record
    level)."""

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        start = message.arrays
        model = self.model_from(start)
        loss_event = None
        if self.record_level:
            loss_at_start, loss_event = self.private_loss(model, data, ctx)
        else:
            loss_at_start = torch.tensor(float(record_losses(model, data).mean()))
        _, fit_event = self.fit(model, data, sgd_settings(message.config), ctx.rng)
        arrays = {**difference(weights_of(model), start), LOSS: loss_at_start.to("cpu", torch.float32)}
        events = compose(fit_event, loss_event)
        return update_release(self, arrays, events, {"num_examples": float(data.num_train)})

    def loss_release(self) -> ClippedMean:
        """Record level: the loss release (module docstring): the mean of per-record losses clipped to [0, B] and
        centred, so each lies in the L2 ball of radius B / 2 (sensitivity B / min_samples under add/remove-one with
        n private). Public quantities only: the client's size is checked by :meth:`private_loss`."""
        return self.clipped_mean(float(self.config.loss_bound) / 2)

    def private_loss(self, model: nn.Module, data: TrainingClient, ctx: ClientContext
                     ) -> tuple[torch.Tensor, PrivacyEvent]:
        """Record level: L_k(w_t) released by :meth:`loss_release` (clip, centre, noise, un-centre), and its
        event."""
        if data.num_train < self.privacy.min_samples:
            # n stays out of the message: it is private under add/remove-one
            raise ConfigError(f"the client has fewer training records than the public lower bound privacy "
                              f"min_samples={self.privacy.min_samples} its loss release is calibrated for; nothing "
                              "released")
        mechanism = self.loss_release().mechanism(self.noise_multiplier(), **self.noise_source(ctx, "afl_loss"))
        half = float(self.config.loss_bound) / 2
        centred = (record_losses(model, data).clamp(max=2 * half) - half).double().mean()
        return mechanism.add_noise(centred) + half, mechanism.event

    def record_releases(self) -> tuple[RecordRelease, ...]:
        """Record level: the DP-SGD fit and the loss release (what :meth:`train` records)."""
        return (self.dp_sgd_fit(), self.loss_release())


def record_losses(model: nn.Module, data: TrainingClient) -> torch.Tensor:
    """Each training record's cross-entropy (nats) under ``model`` in eval mode, shape (n,) (the model's mode is
    restored)."""
    training = model.training
    model.eval()
    device = device_of(model)
    try:
        with torch.no_grad():
            return nn.functional.cross_entropy(model(data.x_train.to(device)), data.y_train.to(device),
                                               reduction="none")
    finally:
        model.train(training)


register_method(
    "afl", strategy=AFLStrategy, client=AFLClient, config=AFLConfig,
    description="AFL: agnostic FL, minimax over client mixture weights lambda (projected gradient ascent on the "
                "simplex with the clients' losses)",
    privacy=AFL_PRIVACY,
    devices=ANY_DEVICE,
    central_eval=None,
)
