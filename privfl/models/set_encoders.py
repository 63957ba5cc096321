"""Set encoders: one client's sample set ``x`` of shape ``[n, ...]`` -> one descriptor vector ``[output_dim]``.

Two DeepSets (Zaheer et al. 2017), both of the form ``psi(pool(phi(x_1), ..., phi(x_n)))``:

- :class:`DeepSetEncoder` is the ODPFL-HN encoder (Amosy et al., App. C; digest ``papers/odpfl-hn.md`` section 2.1):
  a per-sample network ``phi``, then **mean** pooling over the samples on the first half of the units and **max**
  pooling on the other half, then a set-level network ``psi``. Its max half moves by O(1) when one sample is replaced,
  whatever n, so it cannot be made differentially private by noise that shrinks with n (digest section 5.7 item 2);
  :func:`privfl.privacy.privatize` refuses it.
- :class:`DPDeepSetEncoder` is the DP-ready form ``phi -> mean over samples -> psi`` with the attributes ``phi``,
  ``pool`` (a :class:`MeanPool`) and ``psi`` that :func:`privfl.privacy.privatize` inspects. Train it with the same
  structure it will be privatised with, so the hypernetwork sees descriptors of the kind it will receive.

Image inputs are flattened inside ``phi`` (``input_shape`` like ``(1, 28, 28)``); feature inputs give ``input_dim``.
Pooling modules reduce over dimension 0, the sample dimension.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from privfl.errors import ConfigError


class MeanPool(nn.Module):
    """Mean over the samples: ``[n, d] -> [d]``. Replacing one of n samples moves it by ``||phi(x) - phi(x')|| / n``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(dim=0)


class MaxPool(nn.Module):
    """Coordinate-wise max over the samples: ``[n, d] -> [d]``. One sample can move it by O(1) whatever n."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.amax(dim=0)


class MeanMaxPool(nn.Module):
    """Mean over the samples on units ``[:split]`` and max on units ``[split:]`` (the ODPFL-HN DeepSet pooling)."""

    def __init__(self, split: int) -> None:
        super().__init__()
        self.split = split
        self.mean = MeanPool()
        self.max = MaxPool()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.mean(h[:, : self.split]), self.max(h[:, self.split:])])

    def extra_repr(self) -> str:
        return f"split={self.split}"


def _input_shape(input_dim: int | None, input_shape: int | Sequence[int] | None) -> tuple[int, ...]:
    if (input_dim is None) == (input_shape is None):
        raise ConfigError(f"give exactly one of input_dim and input_shape, got input_dim={input_dim!r}, "
                          f"input_shape={input_shape!r}")
    shape = (input_dim,) if input_dim is not None else (
        (input_shape,) if isinstance(input_shape, int) else tuple(input_shape))
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        given = input_dim if input_dim is not None else input_shape
        raise ConfigError(f"input shape must be positive ints, got {given!r}")
    return shape


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


class _SetEncoder(nn.Module):
    """Shared shape checks and forward of ``psi(pool(phi(x)))``."""

    input_shape: tuple[int, ...]

    def _build(self, input_dim, input_shape, hidden: int, output_dim: int) -> None:
        self.input_shape = _input_shape(input_dim, input_shape)
        hidden = _positive("hidden", hidden)
        self.output_dim = _positive("output_dim", output_dim)
        # phi: FC(F -> hidden) + ReLU per sample; psi: FC(hidden -> hidden) + ReLU + FC(hidden -> output_dim),
        # the feature-dataset DS encoder of the paper (digest section 2.1, "[G] resolution").
        self.phi = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(self.input_shape), hidden), nn.ReLU())
        self.psi = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, self.output_dim))

    def check_input(self, x: torch.Tensor) -> None:
        """Raise :class:`ConfigError` unless ``x`` is a non-empty sample set of shape ``[n, *input_shape]``."""
        if not isinstance(x, torch.Tensor) or tuple(x.shape[1:]) != self.input_shape or x.ndim < 2 or x.shape[0] < 1:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"a sample set must have shape [n >= 1, *{self.input_shape}], got {got}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One client's sample set ``x`` ``[n, *input_shape]`` -> descriptor ``[output_dim]``."""
        self.check_input(x)
        return self.psi(self.pool(self.phi(x)))


class DeepSetEncoder(_SetEncoder):
    """The ODPFL-HN DeepSet: ``phi`` per sample, mean pooling on half the units and max on the other half, ``psi``.

    Not differentially privatisable (the max half); use :class:`DPDeepSetEncoder` for a DP release.

    Args:
        input_dim: feature dimension for vector inputs (give this or ``input_shape``).
        input_shape: shape of one sample (an int or a tuple such as ``(1, 28, 28)``; images are flattened in phi).
        hidden: width of phi's output; units ``[:hidden // 2]`` are mean-pooled, the rest max-pooled (even, >= 2).
        output_dim: descriptor dimension.

    >>> enc = DeepSetEncoder(input_dim=10, hidden=8, output_dim=3)
    >>> enc(torch.randn(5, 10)).shape
    torch.Size([3])
    """

    def __init__(self, input_dim: int | None = None, *, input_shape: int | Sequence[int] | None = None,
                 hidden: int = 500, output_dim: int = 64) -> None:
        super().__init__()
        if isinstance(hidden, int) and not isinstance(hidden, bool) and (hidden < 2 or hidden % 2):
            raise ConfigError(f"hidden must be an even int >= 2 (half mean, half max pooled), got {hidden!r}")
        self._build(input_dim, input_shape, hidden, output_dim)
        self.pool = MeanMaxPool(hidden // 2)


class DPDeepSetEncoder(_SetEncoder):
    """The DP-ready DeepSet: ``phi`` per sample -> mean over samples (``pool``, a :class:`MeanPool`) -> ``psi``.

    On its own it adds no noise; :func:`privfl.privacy.privatize` wraps it into a module whose output is a DP release
    (per-sample clipping of phi, Gaussian noise on the mean, psi as post-processing).

    Args: as :class:`DeepSetEncoder` (``hidden`` may be odd here).

    >>> enc = DPDeepSetEncoder(input_shape=(1, 4, 4), hidden=8, output_dim=3)
    >>> enc(torch.randn(5, 1, 4, 4)).shape
    torch.Size([3])
    """

    def __init__(self, input_dim: int | None = None, *, input_shape: int | Sequence[int] | None = None,
                 hidden: int = 500, output_dim: int = 64) -> None:
        super().__init__()
        self._build(input_dim, input_shape, hidden, output_dim)
        self.pool = MeanPool()


__all__ = ["DPDeepSetEncoder", "DeepSetEncoder", "MaxPool", "MeanMaxPool", "MeanPool"]
