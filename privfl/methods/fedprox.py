"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds (mu / 2) * ||w - w_global||^2.

The server side is FedAvg's; only the client's local objective changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privfl.methods.base import ClientState, _require, register_method
from privfl.methods.fedavg import FedAvgClient, FedAvgConfig, FedAvgStrategy


@dataclass(frozen=True)
class FedProxConfig(FedAvgConfig):
    """FedAvg's settings plus the proximal coefficient ``mu`` (>= 0; 0 gives FedAvg)."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.mu >= 0 and self.mu != float("inf"), "mu", self.mu, "a finite number >= 0")
        _require(self.dp_noise_multiplier is None, "dp_noise_multiplier", self.dp_noise_multiplier,
                 "None for fedprox (DP-SGD has no proximal term here; use fedavg)")


class FedProxClient(FedAvgClient):
    """FedAvg's client with the proximal term anchored at the received global weights."""

    def local_objective(self, global_weights: dict[str, torch.Tensor], state: ClientState):
        mu = self.config.mu
        anchor = {k: v.detach() for k, v in global_weights.items()}

        def proximal(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return 0.5 * mu * sum(((p - anchor[name]) ** 2).sum() for name, p in params.items())

        return proximal


register_method(
    "fedprox", strategy=FedAvgStrategy, client=FedProxClient, config=FedProxConfig,
    description="FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in the local objective",
)
