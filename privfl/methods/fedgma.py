"""FedGMA (Tenison, Sreeramadas, Mugunthan, Oyallon, Rish and Belilovsky, TMLR 2023, "Gradient Masked Averaging for
Federated Learning"): FedAvg whose server step is damped coordinate-wise where the clients disagree in sign.

Round t, sampled clients S (the paper's Algorithm 1):

1. the server sends w_t; client k runs ``local_steps`` SGD steps (client lr eta_c) and sends Delta_k = w_k - w_t;
2. agreement score per coordinate j: A_j = | (1/|S|) sum_k sign(Delta_k,j) |, in [0, 1];
3. soft mask: m_j = 1 where A_j >= tau, else m_j = A_j;
4. w_{t+1} = w_t + eta_g * m (.) Delta_bar, with Delta_bar FedAvg's sample-size weighted mean of the changes.

Settings as the FedTTA paper chose them for MNIST (Table 4): eta_c = ``lr`` = 0.3, eta_g = ``server_lr`` = 1,
tau = ``threshold`` = 0.1 (its grid: eta_g in {0.01, 0.1, 1, 1.5, 2}, tau in {0.1, ..., 0.9}). The sign agreement is
unweighted (one vote per client), as in the paper; a coordinate that a client left unchanged votes 0.
Novel clients receive w and send nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accounting.validation import is_finite
from privfl.devices import ANY_DEVICE
from privfl.errors import check
from privfl.federation.messages import Message
from privfl.methods.base import register_method, supported_modes
from privfl.methods.fedavg import (
    FedAvgClient,
    FedAvgConfig,
    FedAvgStrategy,
    sample_weights,
    weighted_mean,
    weighted_mean_scalar,
)

#: The privacy modes this method runs, and why it refuses the others.
FEDGMA_PRIVACY = supported_modes(
    central="its server step masks coordinates by the agreement of each client's own update signs, not a function "
            "of the clients' noisy mean",
    distributed="its server step needs each client's update signs, which secure aggregation hides (only the sum "
                "is seen)")


@dataclass(frozen=True)
class FedGMAConfig(FedAvgConfig):
    """FedAvg's settings (``lr`` = eta_c, ``server_lr`` = eta_g; under record-level or local DP the mask is
    post-processing of the released changes) plus the agreement threshold ``threshold`` = tau."""

    threshold: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(is_finite(self.threshold) and 0 <= self.threshold <= 1, "threshold", self.threshold, "in [0, 1]")


def sign_agreement(updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A = |mean_k sign(Delta_k)| per coordinate (step 2), tensor by tensor. An integer tensor (a buffer such as
    batch norm's ``num_batches_tracked``, a counter, not a gradient) gets full agreement: FedAvg's step."""
    return {name: torch.stack([torch.sign(u[name]) for u in updates]).mean(dim=0).abs()
            if updates[0][name].is_floating_point() else torch.ones(updates[0][name].shape)
            for name in updates[0]}


def gradient_mask(updates: list[dict[str, torch.Tensor]], threshold: float) -> dict[str, torch.Tensor]:
    """The soft mask of step 3: 1 where the agreement reaches ``threshold``, the agreement itself elsewhere."""
    return {name: torch.where(a >= threshold, torch.ones_like(a), a) for name, a in sign_agreement(updates).items()}


class FedGMAStrategy(FedAvgStrategy):
    """FedAvg's server with the masked step 4."""

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        ids = sorted(replies)
        updates = [replies[cid].arrays for cid in ids]
        counts = sample_weights(replies, ids)
        change = weighted_mean(updates, counts)
        mask = gradient_mask(updates, self.config.threshold)
        self.weights = {k: v + self.config.server_lr * mask[k] * change[k] for k, v in self.weights.items()}
        kept = sum(float((m == 1).sum()) for m in mask.values()) / sum(m.numel() for m in mask.values())
        losses = [replies[cid].metrics.get("loss", float("nan")) for cid in ids]
        return {"train_loss": weighted_mean_scalar(losses, counts), "mask_full_fraction": kept}


register_method(
    "fedgma", strategy=FedGMAStrategy, client=FedAvgClient, config=FedGMAConfig,
    description="FedGMA: FedAvg with a sign-agreement soft mask (threshold tau) on the server step",
    privacy=FEDGMA_PRIVACY,
    devices=ANY_DEVICE,
    central_eval=None,
)
