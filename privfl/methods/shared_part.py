"""The shared part of a hypernetwork method's target: the tensors the hypernetwork does not generate.

With ``generated="head"`` or ``"head_bias"`` (:data:`~privfl.models.hypernetwork.GENERATED_PARTS`) a hypernetwork
emits only the target's last layer (or its bias); the rest is one copy that every client trains locally, as part of
the whole target it receives, and that the server moves by the mean of the clients' weight changes, FedAvg's server
step with heavy-ball momentum::

    b = mu b + m   (b = m at first),   shared -= shared_lr * b

where ``m`` is the mean over the round's clients of ``w_before - w_after`` restricted to the shared tensors (the sign
of pFedHN's code, so ``shared_lr = 1`` is FedAvg). ODPFL-HN, pFedHN, IT-PFL-HN and PeFLL hold one
:class:`SharedPart` each; with ``generated="all"`` it is empty (or holds only frozen tensors, see the methods) and
every method is the paper's.

**Privacy.** Nothing here reads a client's data: the step is post-processing of the weight changes the clients
released (record level: each change is a DP-SGD iterate's difference; local: the layer clipped and noised each change
as a whole), or of the privacy layer's noisy mean of the contributions under central DP, where each method adds the
shared tensors of a client's change to its contribution (prefix :data:`SHARED_PREFIX`), clipped jointly with the rest.
Only the hypernetwork reads the generated coordinates of each change; the noise on the shared coordinates is averaged
over the round's clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from accounting.validation import is_finite
from privfl.errors import check
from privfl.models.hypernetwork import GENERATED_PARTS

#: The prefix of the shared tensors in a central-DP contribution.
SHARED_PREFIX = "shared."

def check_shared_settings(generated: Any, shared_lr: Any, shared_momentum: Any) -> None:
    """Refuse a bad ``generated``, ``shared_lr`` or ``shared_momentum`` with a message naming the value and the valid
    ones (the same messages in every method)."""
    check.require(generated in GENERATED_PARTS, "generated", generated, f"one of {', '.join(GENERATED_PARTS)}")
    check.require(is_finite(shared_momentum) and 0 <= shared_momentum < 1, "shared_momentum", shared_momentum,
                  "in [0, 1)")
    check.require(is_finite(shared_lr) and shared_lr > 0, "shared_lr", shared_lr, "a finite number > 0")


def mean_of(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensor-by-tensor mean of ``dicts`` (summed in place into one copy, in the order given; no stacking)."""
    total = {k: v.clone() for k, v in dicts[0].items()}
    for other in dicts[1:]:
        for k, v in total.items():
            v.add_(other[k])
    return {k: v.div_(len(dicts)) for k, v in total.items()}


def norm_of(tensors: dict[str, torch.Tensor]) -> float:
    """The joint L2 norm of ``tensors`` (0 for none)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors.values()]))) \
        if tensors else 0.0


class SharedPart:
    """The shared tensors of a target, their momentum buffers and FedAvg's server step.

    Args:
        target: the target network at its seeded initialisation (the shared part starts from its values).
        names: the target tensors that are shared (each method says which: the tensors not generated).
        lr: ``shared_lr``; momentum: ``shared_momentum``; device: where the tensors live (messages and saved state
            are on the CPU).
    """

    def __init__(self, target: nn.Module, names: Sequence[str], *, lr: float, momentum: float,
                 device: torch.device | str = "cpu") -> None:
        wanted = set(names)
        #: Every tensor of the target, in ``named_parameters()`` order (the order of a completed message).
        self.target_names = [name for name, _ in target.named_parameters()]
        self.values: dict[str, torch.Tensor] = {name: p.detach().clone().to(device)
                                                for name, p in target.named_parameters() if name in wanted}
        self.momentum: dict[str, torch.Tensor] = {}
        self.lr, self.mu = float(lr), float(momentum)
        self.device = torch.device(device)

    def __bool__(self) -> bool:
        return bool(self.values)

    def __iter__(self):
        return iter(self.values)

    def of(self, change: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shared tensors of a client's weight change (what FedAvg's step averages), on the part's device."""
        return {name: change[name].to(self.device) for name in self.values}

    def mean_change(self, changes: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The mean of the shared tensors of ``changes`` (in the order given); ``{}`` with no shared part."""
        return mean_of([self.of(change) for change in changes]) if self.values else {}

    def complete(self, generated: dict[str, torch.Tensor], shared: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
        """The target's weights: ``generated`` for the tensors the hypernetwork emits, the shared part (as it stands,
        or ``shared``) for the rest; in the target's order, detached copies. Generated tensors are kept where they
        are; shared ones are put on ``generated``'s device."""
        shared = self.values if shared is None else shared
        if not shared:
            return generated
        device = next(iter(generated.values())).device if generated else torch.device("cpu")
        return {name: generated[name] if name in generated else shared[name].detach().to(device, copy=True)
                for name in self.target_names if name in generated or name in shared}

    def contribution(self, change: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Central DP: the shared tensors of a client's change, prefixed :data:`SHARED_PREFIX`, on the CPU."""
        return {SHARED_PREFIX + name: change[name].detach().cpu() for name in self.values}

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """Zeros shaped like :meth:`contribution`, on the CPU."""
        return {SHARED_PREFIX + k: torch.zeros(v.shape, dtype=v.dtype) for k, v in self.values.items()}

    def from_mean(self, mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shared tensors of a noisy mean of contributions, unprefixed, on the part's device."""
        return {name: mean[SHARED_PREFIX + name].to(self.device) for name in self.values}

    def step(self, change: dict[str, torch.Tensor]) -> None:
        """FedAvg's server step from the mean weight change (before minus after): ``b = mu b + m`` (``b = m`` at
        first), ``shared -= shared_lr * b``."""
        buffers, mu = self.momentum, self.mu
        new_buffers, new_shared = {}, {}
        for name, value in self.values.items():
            g = change[name].to(value.device, value.dtype)
            if mu > 0:
                g = g if name not in buffers else mu * buffers[name] + g
                new_buffers[name] = g
            new_shared[name] = value - self.lr * g
        self.values, self.momentum = new_shared, new_buffers

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the shared tensors."""
        return {k: v.detach().clone() for k, v in self.values.items()}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{"shared": ..., "shared_momentum": ...}``, copies on the CPU (the momentum is training-only)."""
        return {"shared": {k: v.detach().to("cpu", copy=True) for k, v in self.values.items()},
                "shared_momentum": {k: v.detach().to("cpu", copy=True) for k, v in self.momentum.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved; a state saved before the shared part existed (no ``"shared"``)
        generated everything and leaves the part as it is."""
        self.momentum = {k: v.to(self.device, copy=True) for k, v in state.get("shared_momentum", {}).items()}
        if "shared" in state:
            self.values = {k: v.to(self.device, copy=True) for k, v in state["shared"].items()}


__all__ = ["SHARED_PREFIX", "SharedPart", "check_shared_settings", "mean_of", "norm_of"]
