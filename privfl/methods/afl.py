"""AFL, Agnostic Federated Learning (Mohri, Sivek and Suresh, ICML 2019), in its stochastic form run over rounds.

The objective is the minimax  min_w max_{lambda in simplex} L_lambda(w) = sum_k lambda_k L_k(w)        (Eq. 2),
solved by alternating projected gradient steps (the paper's Stochastic-AFL, Algorithm 1). Round t, sampled clients S:

1. the server sends w_t;
2. client k evaluates its loss L_k(w_t) on its training split (the gradient of L_lambda with respect to lambda_k),
   then runs ``local_steps`` SGD steps from w_t (learning rate gamma_w = ``lr``) and sends Delta_k and L_k(w_t);
3. descent on w with the mixture weights: w_{t+1} = w_t + server_lr * sum_{k in S} lambda_k Delta_k / sum_{k in S}
   lambda_k  (with every client sampled, sum_k lambda_k = 1 and this is the lambda-weighted gradient step);
4. ascent on lambda, projected on the simplex: lambda_{t+1} = Proj(lambda_t + gamma_lambda * g), g_k = L_k(w_t) for
   k in S and 0 otherwise; Proj is the Euclidean projection (Duchi et al. 2008).

lambda starts uniform over the ``num_training_clients`` clients. The FedTTA paper's MNIST settings (Table 4) are
gamma_w = 0.3 and gamma_lambda = ``lambda_lr`` = 0.001 (CIFAR-10: 0.1 and 0.3). Simplification: novel clients receive
the last iterate w_T (the round chosen by validation), not the average of the iterates that the paper's convergence
guarantee is about; they send nothing. A client sends its loss as the 0-d tensor ``"afl.loss"`` beside its weight
change.

Privacy (the run's privacy layer, ``RunConfig.privacy``; :mod:`privfl.privacy.training`).

``record`` (add or remove one record): the weight change comes from DP-SGD
(:meth:`~privfl.methods.base.ClientProcedure.fit`). The loss L_k(w_t) is a mean over the client's records, released
by its own Gaussian mechanism (:meth:`AFLClient.private_loss`): each record's cross-entropy (>= 0) is clipped to
[0, ``loss_bound``] and centred, v_i = min(l_i, B) - B/2 in [-B/2, B/2]; under add/remove-one the mean of such values
moves by at most 2 (B/2) / m = B / m for neighbours of sizes m and m - 1
(:func:`~privfl.privacy.sensitivity.certify_mean_of_clipped`, n private), and the noise is calibrated for the public
lower bound m >= ``privacy.min_samples`` (a client with fewer records is refused before it releases), so sensitivity
B / min_samples; N(0, (z B / min_samples)^2) with the round's noise multiplier z, and B/2 added back
(post-processing). The release carries both events, composed (:meth:`AFLClient.round_event`, which the calibration
of a target epsilon composes over the client's rounds); the sample count is not sent.

``local``: the layer clips the whole release (weight change and loss, jointly) to C and adds the noise; the server's
lambda step then reads each client's noised loss, post-processing. ``central`` and ``distributed`` are refused: the
server step weights each sampled client's change by that client's own lambda_k and moves lambda_k by that client's
own loss. That is not a function of a noisy mean of the clients' contributions: a loss would need a coordinate of its
own per client in the summed vector, a slot the server cannot fix in advance (it learns the training clients' ids only
from who is sampled, which central DP keeps secret and secure aggregation hides), and slots assigned by first sight
would make every later contribution depend on who was sampled, outside the noise. Under secure aggregation the server
sees the sum alone, so it could not tell whose loss is whose at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accounting import ComposedEvent, NeighboringRelation, PrivacyEvent
from accounting.validation import is_finite
from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE, device_of
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release
from privfl.methods.base import ClientContext, ClientState, register_method
from privfl.methods.fedavg import FedAvgClient, FedAvgStrategy, ServerStepConfig, weighted_mean
from privfl.methods.fedsr import update_release
from privfl.methods.local_training import difference, sgd_settings, weights_of
from privfl.privacy.mechanisms import GaussianMechanism
from privfl.privacy.sensitivity import certify_mean_of_clipped
from privfl.privacy.training import RECORD, NovelPrivacy, TrainingPrivacy

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
        events = None if fit_event is None else ComposedEvent((fit_event, loss_event))
        return update_release(self, arrays, events, {"num_examples": float(data.num_train)})

    def loss_mechanism(self, noise_multiplier: float, **noise: Any) -> GaussianMechanism:
        """Record level: the Gaussian mechanism of the loss release at ``noise_multiplier`` (module docstring: the
        mean of per-record losses clipped to [0, B], sensitivity B / min_samples under add/remove-one with n
        private). Public quantities only: the client's size is checked by :meth:`private_loss`."""
        bound, floor = float(self.config.loss_bound), int(self.privacy.min_samples)
        certificate = certify_mean_of_clipped(bound / 2, floor, NeighboringRelation.ADD_OR_REMOVE_ONE, n_public=False)
        return GaussianMechanism(sensitivity=certificate.value, noise_multiplier=noise_multiplier,
                                 relation=NeighboringRelation.ADD_OR_REMOVE_ONE, **noise)

    def private_loss(self, model: nn.Module, data: TrainingClient, ctx: ClientContext
                     ) -> tuple[torch.Tensor, PrivacyEvent]:
        """Record level: L_k(w_t) released by :meth:`loss_mechanism` (clip, centre, noise, un-centre), and its
        event."""
        if data.num_train < self.privacy.min_samples:
            # n stays out of the message: it is private under add/remove-one
            raise ConfigError(f"the client has fewer training records than the public lower bound privacy "
                              f"min_samples={self.privacy.min_samples} its loss release is calibrated for; nothing "
                              "released")
        mechanism = self.loss_mechanism(self.noise_multiplier(), **self.noise_source(ctx, "afl_loss"))
        half = float(self.config.loss_bound) / 2
        centred = (record_losses(model, data).clamp(max=2 * half) - half).double().mean()
        return mechanism.add_noise(centred) + half, mechanism.event

    def round_event(self, noise_multiplier: float) -> PrivacyEvent:
        """Record level: the DP-SGD fit and the loss release, composed (what :meth:`train` records)."""
        return ComposedEvent((super().round_event(noise_multiplier), self.loss_mechanism(noise_multiplier).event))


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
    privacy={"record": None, "local": None,
             "central": "its server step weights each client's update by that client's own mixture weight lambda_k "
                        "and moves lambda_k by that client's own loss, not a function of a noisy mean of "
                        "contributions (a per-client loss slot would need the training clients' ids, which the "
                        "server learns only from who is sampled)",
             "distributed": "its lambda step needs each client's own loss and its server step each client's own "
                            "lambda_k, which secure aggregation hides (only the sum is seen)"},
    devices=ANY_DEVICE,
    central_eval=None,
)
