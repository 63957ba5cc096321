"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds (mu / 2) * ||w - w_global||^2.

The server side is FedAvg's; only the client's local objective changes. Under record-level DP the proximal term's
gradient mu (w - w_global) depends on the current iterate and the server's weights only, not on the data: DP-SGD adds
it outside the clipped, noised per-sample sum (``extra_loss`` of :meth:`~privfl.methods.base.ClientProcedure.fit`),
so it costs no privacy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from privfl.devices import ANY_DEVICE
from privfl.errors import check
from privfl.methods.base import ClientState, register_method
from privfl.methods.fedavg import FEDAVG_PRIVACY, FedAvgClient, FedAvgConfig, FedAvgStrategy


@dataclass(frozen=True)
class FedProxConfig(FedAvgConfig):
    """FedAvg's settings plus the proximal coefficient ``mu`` (>= 0; 0 gives FedAvg)."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        check.non_negative(self.mu, "mu")


class FedProxClient(FedAvgClient):
    """FedAvg's client with the proximal term anchored at the received global weights."""

    def local_objective(self, global_weights: dict[str, torch.Tensor], state: ClientState):
        mu = self.config.mu
        anchor = {k: v.detach().to(self.model_factory.device) for k, v in global_weights.items()}

        def proximal(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return 0.5 * mu * sum(((p - anchor[name]) ** 2).sum() for name, p in params.items())

        return proximal


register_method(
    "fedprox", strategy=FedAvgStrategy, client=FedProxClient, config=FedProxConfig,
    description="FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in the local objective",
    privacy=FEDAVG_PRIVACY, devices=ANY_DEVICE,
    central_eval=None,
)
