"""The joint clip of client-level DP: a client's whole release (every tensor of it) projected onto an L2 ball.

Client-level DP (one client's whole dataset is the unit of privacy; McMahan et al. 2018) bounds what one client can
move by clipping everything it contributes in a round, jointly, to L2 norm C: two datasets of the client then give two
releases in the ball of radius C, so the clipped release moves by at most 2 C (replace one client) or C (add or
remove one). The mechanisms built on it, their calibration and their accounting are the privacy layer's
(:mod:`privfl.privacy.training`, :mod:`privfl.modes.wrappers`).

Units: L2 norms in the units of the update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from accounting.validation import is_finite
from privfl.errors import ConfigError, TrainingDivergedError


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all tensors of ``update`` taken together (as one flattened vector)."""
    squared = sum(_squares(t).sum() for t in update.values())
    if not isinstance(squared, torch.Tensor):   # sum() over no tensors is the int 0
        raise ConfigError("the update must hold at least one tensor, got an empty mapping")
    return float(torch.sqrt(squared))


def _squares(t: torch.Tensor) -> torch.Tensor:
    """``t.double() ** 2`` (the same numbers: the square of a double is x * x either way), squared in place where the
    conversion made a copy."""
    d = t.detach().double()
    if d.data_ptr() == t.data_ptr():    # t is float64 already: do not touch the caller's tensor
        return d * d
    return d.mul_(d)


def _clip_scale(update: Mapping[str, torch.Tensor], max_norm: float) -> tuple[float, float]:
    """``min(1, max_norm / ||update||_2)`` and the norm; refuses a bad ``max_norm`` and an update that is not finite."""
    if not is_finite(max_norm) or max_norm <= 0:
        raise ConfigError(f"max_norm must be a finite number > 0 (L2), got {max_norm!r}")
    norm = update_norm(update)
    if not math.isfinite(norm):
        raise TrainingDivergedError("the update to clip contains NaN or inf: local training diverged (lower the local "
                                    "or server learning rate or momentum); its norm, and so its sensitivity, is "
                                    "unbounded, so it is not released")
    scale = min(1.0, float(max_norm) / norm) if norm > 0 else 1.0
    return scale, norm


def clip_update(update: Mapping[str, torch.Tensor], max_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """``update * min(1, max_norm / ||update||_2)`` (joint L2 norm over every tensor) and the norm before clipping.

    >>> clipped, norm = clip_update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    >>> norm, [round(float(v), 3) for v in (clipped["a"], clipped["b"])]
    (5.0, [0.6, 0.8])
    """
    scale, norm = _clip_scale(update, max_norm)
    return {k: v.detach() * scale for k, v in update.items()}, norm


def add_clipped(total: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor], max_norm: float) -> float:
    """Add ``clip_update(update, max_norm)``'s tensors, as float64, into ``total``'s (float64, by name) in place, and
    return the norm before clipping: the numbers of ``total[k] + clipped[k].double()``, without the clipped copy
    (an update within the ball is added as it is: times 1.0 it is itself) or the float64 one."""
    scale, norm = _clip_scale(update, max_norm)
    for name, sum_ in total.items():
        value = update[name].detach()
        sum_.add_(value if scale == 1.0 else value * scale)
    return norm


__all__ = ["add_clipped", "clip_update", "update_norm"]
