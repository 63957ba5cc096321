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
guarantee is about; they send nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accounting.validation import is_finite
from privfl.data import TrainingClient
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release
from privfl.methods.base import ClientContext, ClientState, register_method
from privfl.methods.fedavg import FedAvgClient, FedAvgStrategy, ServerStepConfig, weighted_mean
from privfl.methods.local_training import difference, local_sgd, sgd_settings, weights_of


@dataclass(frozen=True)
class AFLConfig(ServerStepConfig):
    """Local SGD (``lr`` = gamma_w) plus the mixture-weight learning rate ``lambda_lr`` = gamma_lambda (>= 0)."""

    lambda_lr: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(is_finite(self.lambda_lr) and self.lambda_lr >= 0, "lambda_lr", self.lambda_lr, "a finite number >= 0")


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
        bad = {cid: replies[cid].metrics.get("afl_loss") for cid in ids
               if not math.isfinite(replies[cid].metrics.get("afl_loss", float("nan")))}
        if bad:   # before any state changes: lambda's projection has no answer for a NaN or infinite loss
            raise ConfigError(f"round {round}: AFL needs each client's finite loss at the received weights for its "
                              f"lambda step, got {bad}; the model diverged: lower lr (now {self.config.lr!r}), "
                              f"server_lr (now {self.config.server_lr!r}) or lambda_lr (now {self.config.lambda_lr!r})")
        slots = [self.slot(cid) for cid in ids]
        weights = [float(self.lambdas[s]) for s in slots]
        if sum(weights) > 0:      # all sampled clients at lambda = 0: w stays, lambda still moves
            change = weighted_mean([replies[cid].arrays for cid in ids], weights)
            self.weights = {k: v + self.config.server_lr * change[k] for k, v in self.weights.items()}
        gradient = torch.zeros_like(self.lambdas)
        for cid, s in zip(ids, slots):
            gradient[s] = replies[cid].metrics["afl_loss"]
        self.lambdas = project_to_simplex(self.lambdas + self.config.lambda_lr * gradient)
        losses = [replies[cid].metrics["afl_loss"] for cid in ids]
        return {"train_loss": sum(losses) / len(losses), "afl_weighted_loss": sum(
            w * loss for w, loss in zip(weights, losses)) / max(sum(weights), 1e-12),
            "lambda_max": float(self.lambdas.max())}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "lambdas": self.lambdas, "lambda_ids": self.lambda_ids}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.lambdas = state["lambdas"].clone()
        self.lambda_ids = state["lambda_ids"].clone()


class AFLClient(FedAvgClient):
    """Step 2: the loss at the received weights, then FedAvg's local SGD."""

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        start = message.arrays
        model = self.model_from(start)
        with torch.no_grad():
            model.eval()
            loss_at_start = float(nn.functional.cross_entropy(model(data.x_train), data.y_train))
        local_sgd(model, data.x_train, data.y_train, rng=ctx.rng, **sgd_settings(message.config))
        update = Message(arrays=difference(weights_of(model), start),
                         metrics={"num_examples": float(data.num_train), "afl_loss": loss_at_start})
        return Release.non_private(update, purpose="model_update")


register_method(
    "afl", strategy=AFLStrategy, client=AFLClient, config=AFLConfig,
    description="AFL: agnostic FL, minimax over client mixture weights lambda (projected gradient ascent on the "
                "simplex with the clients' losses)",
)
