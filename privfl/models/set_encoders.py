"""Set encoders: one client's sample set ``x`` of shape ``[n, ...]`` -> one descriptor vector ``[output_dim]``.

:class:`DeepSetEncoder` (the ODPFL-HN encoder, mean and max pooling) and :class:`DPDeepSetEncoder` (phi clipped to a
ball, mean pooling, psi: the form :func:`privfl.privacy.privatize` accepts) are DeepSets; :class:`DSSEncoder` and
:class:`SetTransformerEncoder` model interactions between samples. Building blocks: :class:`MeanPool`,
:class:`MaxPool`, :class:`MeanMaxPool`, :class:`ClipToBall`, :class:`PrototypeSoftmax`, :class:`DSSLayer`,
:class:`MAB`, :class:`ISAB`, :class:`PMA`.

Each encoder's architecture and why only the DP-ready one can be privatised: docs/methods/hypernetworks.md,
"Set encoders".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

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


class ClipToBall(nn.Module):
    """Per-sample projection onto the L2 ball of radius ``bound``: each row ``v`` of ``[n, d]`` becomes
    ``v * min(1, bound / ||v||)``.

    The same projection :func:`privfl.privacy.privatize` applies to phi's outputs on the client, put inside phi
    so that training sees descriptors of the kind a private release will produce (docs/papers.md, ODPFL-HN, E6).

    With ``sphere=True`` every row is scaled onto the sphere of radius ``bound`` instead (``v * bound / ||v||``, the
    ODPFL-HN paper's unit-sphere normalisation of phi, B_phi = 1, in its DP experiment, section 7): norms cannot shrink,
    so the encoder cannot collapse its outputs towards 0 in training, and the release's clipping is still a no-op.
    """

    def __init__(self, bound: float, *, sphere: bool = False) -> None:
        super().__init__()
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound <= 0:
            raise ConfigError(f"clip bound must be a finite number > 0 (L2 radius), got {bound!r}")
        self.bound = float(bound)
        self.sphere = bool(sphere)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        norms = h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        scale = self.bound / norms
        return h * (scale if self.sphere else torch.clamp(scale, max=1.0))

    def extra_repr(self) -> str:
        return f"bound={self.bound}, sphere={self.sphere}"


class PrototypeSoftmax(nn.Module):
    """Soft assignment of each sample to prototypes: row-wise ``softmax(scores / temperature)`` of ``[n, k]`` scores.

    Each output row lies on the probability simplex (L2 norm at most 1), so the mean over a client's samples is a
    soft histogram of its data over the ``k`` prototypes. A ``temperature`` below 1 makes the assignments sharper
    from the first round on: with scores from a freshly initialised linear layer (of order 0.1) a softmax at
    temperature 1 is nearly uniform, every client's histogram is nearly the same, and the differences the rest of
    the system has to learn from start out tiny.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature > 0):
            raise ConfigError(f"temperature must be a finite number > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.softmax(h / self.temperature, dim=-1)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"


def _input_shape(input_dim: int | None, input_shape: int | Sequence[int] | None) -> tuple[int, ...]:
    if (input_dim is None) == (input_shape is None):
        raise ConfigError(f"give exactly one of input_dim and input_shape, got input_dim={input_dim!r}, "
                          f"input_shape={input_shape!r}")
    shape = (input_dim,) if input_dim is not None else (
        (input_shape,) if isinstance(input_shape, int) else tuple(input_shape or ()))   # None: refused above
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        given = input_dim if input_dim is not None else input_shape
        raise ConfigError(f"input shape must be positive ints, got {given!r}")
    return shape


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


class _Shaped(Protocol):
    input_shape: tuple[int, ...]


class _SetEncoder(nn.Module):
    """Shared shape checks and forward of ``psi(pool(phi(x)))``."""

    input_shape: tuple[int, ...]
    pool: nn.Module
    psi: nn.Module

    def _build(self, input_dim, input_shape, hidden: int, output_dim: int) -> None:
        self.input_shape = _input_shape(input_dim, input_shape)
        hidden = _positive("hidden", hidden)
        self.output_dim = _positive("output_dim", output_dim)
        # phi: FC(F -> hidden) + ReLU per sample; psi: FC(hidden -> hidden) + ReLU + FC(hidden -> output_dim),
        # the feature-dataset DS encoder of the paper (App. C; its layer order as docs/papers.md, ODPFL-HN, U8).
        self.phi = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(self.input_shape), hidden), nn.ReLU())
        self.psi = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, self.output_dim))

    def check_input(self: _Shaped, x: torch.Tensor) -> None:
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


#: What phi ends with in :class:`DPDeepSetEncoder`.
PHI_HEADS = ("relu", "softmax")
#: What psi is in :class:`DPDeepSetEncoder`.
PSI_KINDS = ("mlp", "linear", "identity")


class DPDeepSetEncoder(_SetEncoder):
    """The DP-ready DeepSet: ``phi`` per sample -> mean over samples (``pool``, a :class:`MeanPool`) -> ``psi``.

    On its own it adds no noise; :func:`privfl.privacy.privatize` wraps it into a module whose output is a DP release
    (per-sample clipping of phi, Gaussian noise on the mean, psi as post-processing).

    Args: as :class:`DeepSetEncoder` (``hidden`` may be odd here), plus
        clip: if given, phi ends with a :class:`ClipToBall` of this radius, so the encoder is *trained* with the
            per-sample clipping that ``privatize(..., bound=clip)`` applies to a release (the projection is then a
            no-op there). ``None`` (default) leaves phi unclipped in training.
        phi_hidden: if given, phi is ``FC(F -> phi_hidden), ReLU, FC(phi_hidden -> hidden)`` (a deeper per-sample
            network ending linearly, so its clipped outputs can point anywhere on the ball); by default phi is
            ``FC(F -> hidden), ReLU``.
        sphere: with ``clip``, scale phi's outputs onto the sphere of radius ``clip`` rather than into the ball
            (the paper's normalisation; keeps the encoder from collapsing its outputs towards 0).
        phi_head: ``"relu"`` (default: phi as above) or ``"softmax"``: phi's last linear layer scores ``hidden``
            learned *prototypes* and a softmax turns the scores into a soft assignment of the sample to them
            (``FC(F -> hidden)`` or ``FC(F -> phi_hidden), ReLU, FC(phi_hidden -> hidden)``, then softmax). Every
            output lies on the probability simplex, whose L2 norm is at most 1, so with ``clip >= 1`` the clipping
            is a no-op, and the pooled mean is a soft histogram of the client's data over the prototypes: for
            label-shifted clients it spreads out with their label mix instead of averaging towards one point.
        temperature: the softmax temperature of ``phi_head="softmax"`` (:class:`PrototypeSoftmax`).
        psi: ``"mlp"`` (default: ``FC(hidden -> hidden), ReLU, FC(hidden -> output_dim)``), ``"linear"``
            (``FC(hidden -> output_dim)``) or ``"identity"`` (the descriptor *is* the pooled mean; ``output_dim``
            must equal ``hidden``). psi is post-processing of the (noisy) mean either way; a learned MLP psi can
            contract the differences between clients' means until the hypernetwork no longer sees them, which
            identity cannot.

    >>> enc = DPDeepSetEncoder(input_shape=(1, 4, 4), hidden=8, output_dim=3)
    >>> enc(torch.randn(5, 1, 4, 4)).shape
    torch.Size([3])
    >>> clipped = DPDeepSetEncoder(input_dim=4, hidden=8, output_dim=3, clip=1.0)
    >>> bool(clipped.phi(100 * torch.randn(6, 4)).norm(dim=1).max() <= 1.0 + 1e-6)
    True
    >>> histogram = DPDeepSetEncoder(input_dim=4, hidden=6, output_dim=6, clip=1.0, phi_head="softmax", psi="identity")
    >>> round(float(histogram(torch.randn(9, 4)).detach().sum()), 5)   # a mean of soft assignments: a histogram
    1.0
    """

    def __init__(self, input_dim: int | None = None, *, input_shape: int | Sequence[int] | None = None,
                 hidden: int = 500, output_dim: int = 64, clip: float | None = None,
                 phi_hidden: int | None = None, sphere: bool = False, phi_head: str = "relu",
                 psi: str = "mlp", temperature: float = 1.0) -> None:
        super().__init__()
        if phi_head not in PHI_HEADS:
            raise ConfigError(f"phi_head must be one of {', '.join(PHI_HEADS)}, got {phi_head!r}")
        if psi not in PSI_KINDS:
            raise ConfigError(f"psi must be one of {', '.join(PSI_KINDS)}, got {psi!r}")
        if psi == "identity" and output_dim != hidden:
            raise ConfigError(f"psi='identity' releases the pooled mean itself, so output_dim must equal hidden; "
                              f"got output_dim={output_dim!r}, hidden={hidden!r}")
        if phi_head == "softmax" and sphere:
            raise ConfigError("phi_head='softmax' already puts phi's outputs on the probability simplex; "
                              "sphere=True would rescale them off it (use sphere=False)")
        self._build(input_dim, input_shape, hidden, output_dim)
        if phi_hidden is not None:
            phi_hidden = _positive("phi_hidden", phi_hidden)
            self.phi = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(self.input_shape), phi_hidden), nn.ReLU(),
                                     nn.Linear(phi_hidden, hidden))
        if phi_head == "softmax":
            if phi_hidden is None:           # drop the ReLU: the prototype scores may be negative
                self.phi = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(self.input_shape), hidden))
            self.phi.append(PrototypeSoftmax(temperature))
        elif temperature != 1.0:
            raise ConfigError(f"temperature={temperature!r} applies only to phi_head='softmax'")
        if clip is not None:
            self.phi.append(ClipToBall(clip, sphere=sphere))
        if psi == "linear":
            self.psi = nn.Linear(hidden, output_dim)
        elif psi == "identity":
            self.psi = nn.Identity()
        self.clip = None if clip is None else float(clip)
        self.phi_head, self.psi_kind = phi_head, psi
        self.pool = MeanPool()


# -- encoders that couple the samples (not privatisable) ---------------------------------------------------------


class _SetLayerBase(nn.Module):
    """Shared input handling of the DSS and Set Transformer encoders."""

    def _shape(self, input_dim, input_shape, output_dim) -> None:
        self.input_shape = _input_shape(input_dim, input_shape)
        self.output_dim = _positive("output_dim", output_dim)

    check_input = _SetEncoder.check_input


class DSSLayer(nn.Module):
    """One layer of Deep Sets for Symmetric elements (Maron et al. 2020, eq. 5): ``L1(x_i) + L2(mean_j x_j)``.

    ``L1`` (the Siamese part, shared by all elements) and ``L2`` (the aggregate part) are convolutions for images
    ``[n, C, H, W]`` (equivariant to translations) or linear maps for vectors ``[n, F]``. The aggregate is the mean
    rather than the sum, so its scale does not grow with n. The output is equivariant to permutations of the set.
    """

    def __init__(self, in_channels: int, out_channels: int, *, image: bool, kernel_size: int = 3) -> None:
        super().__init__()
        if image:
            self.siamese: nn.Module = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
            self.aggregate: nn.Module = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2,
                                                  bias=False)
        else:
            self.siamese = nn.Linear(in_channels, out_channels)
            self.aggregate = nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.siamese(x) + self.aggregate(x.mean(dim=0, keepdim=True))


class DSSEncoder(_SetLayerBase):
    """A DSS set encoder (docs/papers.md, ODPFL-HN, U7): DSS layers (convolutional for images, with ReLU and 2x2 max
    pooling over space after each), then per element ``FC -> hidden, ReLU``, pooling over the set, and
    ``FC -> output_dim``.

    Not differentially privatisable: every element's features depend on the set aggregate at every layer.

    Args:
        input_dim / input_shape: as :class:`DeepSetEncoder`; a 3-d ``input_shape`` ``(C, H, W)`` uses convolutions.
        channels: output channels (images) or widths (vectors) of the DSS layers (default ``(16, 32)``).
        hidden: width before pooling (200, the width of the papers' DeepSet before pooling).
        output_dim: descriptor dimension.
        pool: ``"meanmax"`` (mean on half the units, max on the rest, as the ODPFL-HN DeepSet) or ``"mean"``.

    >>> enc = DSSEncoder(input_shape=(1, 8, 8), channels=(4, 8), hidden=16, output_dim=3)
    >>> enc(torch.randn(5, 1, 8, 8)).shape
    torch.Size([3])
    """

    def __init__(self, input_dim: int | None = None, *, input_shape: int | Sequence[int] | None = None,
                 channels: Sequence[int] = (16, 32), hidden: int = 200, output_dim: int = 64,
                 pool: str = "meanmax") -> None:
        super().__init__()
        self._shape(input_dim, input_shape, output_dim)
        hidden = _positive("hidden", hidden)
        channels = tuple(channels)
        if not channels:
            raise ConfigError("channels must list at least one DSS layer width, got ()")
        for c in channels:
            _positive("channels", c)
        if pool not in ("meanmax", "mean"):
            raise ConfigError(f"pool must be 'meanmax' or 'mean', got {pool!r}")
        if pool == "meanmax" and (hidden < 2 or hidden % 2):
            raise ConfigError(f"hidden must be an even int >= 2 with pool='meanmax', got {hidden!r}")
        image = len(self.input_shape) == 3
        layers: list[nn.Module] = []
        width = self.input_shape[0] if image else math.prod(self.input_shape)
        size = list(self.input_shape[1:]) if image else []
        for c in channels:
            layers += [DSSLayer(width, c, image=image), nn.ReLU()]
            if image and min(size) >= 2:
                layers.append(nn.MaxPool2d(2))
                size = [s // 2 for s in size]
            width = c
        self.equivariant = nn.Sequential(*layers)
        flat = width * math.prod(size) if image else width
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU())
        self.pool = MeanMaxPool(hidden // 2) if pool == "meanmax" else MeanPool()
        self.psi = nn.Linear(hidden, self.output_dim)
        self._image = image

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One client's sample set ``x`` ``[n, *input_shape]`` -> descriptor ``[output_dim]``."""
        self.check_input(x)
        h = x if self._image else x.reshape(len(x), -1)
        return self.psi(self.pool(self.head(self.equivariant(h))))


class MAB(nn.Module):
    """Multihead attention block (Lee et al. 2019, eq. 6): ``H = X + MHA(X, Y, Y)``, ``out = H + ReLU(FC(H))``
    (optional LayerNorm after each sum, as the authors' ``ln`` flag)."""

    def __init__(self, dim: int, heads: int, *, ln: bool = False) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Linear(dim, dim)
        self.ln0 = nn.LayerNorm(dim) if ln else nn.Identity()
        self.ln1 = nn.LayerNorm(dim) if ln else nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln0(x + self.attention(x, y, y, need_weights=False)[0])
        return self.ln1(h + torch.relu(self.ff(h)))


class ISAB(nn.Module):
    """Induced set attention block (Lee et al. 2019, eq. 9): ``MAB(X, MAB(I, X))`` with ``m`` learned inducing
    points ``I``; O(n m) instead of O(n^2), permutation equivariant."""

    def __init__(self, dim: int, heads: int, inducing: int, *, ln: bool = False) -> None:
        super().__init__()
        self.inducing = nn.Parameter(torch.randn(1, inducing, dim) / dim ** 0.5)
        self.mab0 = MAB(dim, heads, ln=ln)
        self.mab1 = MAB(dim, heads, ln=ln)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mab0(self.inducing.expand(len(x), -1, -1), x)
        return self.mab1(x, h)


class PMA(nn.Module):
    """Pooling by multihead attention (Lee et al. 2019, eq. 11): ``MAB(S, ReLU(FC(X)))`` with ``k`` learned seeds."""

    def __init__(self, dim: int, heads: int, seeds: int = 1, *, ln: bool = False) -> None:
        super().__init__()
        self.seeds = nn.Parameter(torch.randn(1, seeds, dim) / dim ** 0.5)
        self.ff = nn.Linear(dim, dim)
        self.mab = MAB(dim, heads, ln=ln)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mab(self.seeds.expand(len(x), -1, -1), torch.relu(self.ff(x)))


class SetTransformerEncoder(_SetLayerBase):
    """A Set Transformer encoder (docs/papers.md, ODPFL-HN, U7): a per-element stem (two 3x3 conv + ReLU + 2x2
    max-pool layers of 16 and 32 channels for images, nothing for vectors), ``FC -> dim``, ``blocks`` ISABs, PMA with
    one seed, and ``FC -> output_dim``.

    Not differentially privatisable: softmax attention can let one sample dominate the pooled output.

    Args:
        input_dim / input_shape: as :class:`DeepSetEncoder`.
        dim: attention width (128); heads: attention heads (4, dividing ``dim``); inducing: inducing points per
            ISAB (16); blocks: number of ISABs (2); ln: LayerNorm in the attention blocks (off, as the authors'
            default).
        output_dim: descriptor dimension.

    >>> enc = SetTransformerEncoder(input_dim=6, dim=8, heads=2, inducing=4, output_dim=3)
    >>> enc(torch.randn(5, 6)).shape
    torch.Size([3])
    """

    def __init__(self, input_dim: int | None = None, *, input_shape: int | Sequence[int] | None = None,
                 dim: int = 128, heads: int = 4, inducing: int = 16, blocks: int = 2, output_dim: int = 64,
                 ln: bool = False) -> None:
        super().__init__()
        self._shape(input_dim, input_shape, output_dim)
        dim, heads, inducing = _positive("dim", dim), _positive("heads", heads), _positive("inducing", inducing)
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ConfigError(f"blocks must be an int >= 0, got {blocks!r}")
        if dim % heads:
            raise ConfigError(f"heads must divide dim, got dim={dim}, heads={heads}")
        if len(self.input_shape) == 3:
            stem: list[nn.Module] = []
            width, size = self.input_shape[0], list(self.input_shape[1:])
            for c in (16, 32):
                stem += [nn.Conv2d(width, c, 3, padding=1), nn.ReLU()]
                if min(size) >= 2:
                    stem.append(nn.MaxPool2d(2))
                    size = [s // 2 for s in size]
                width = c
            stem += [nn.Flatten(), nn.Linear(width * math.prod(size), dim)]
        else:
            stem = [nn.Flatten(), nn.Linear(math.prod(self.input_shape), dim)]
        self.stem = nn.Sequential(*stem)
        self.blocks = nn.ModuleList(ISAB(dim, heads, inducing, ln=ln) for _ in range(blocks))
        self.pma = PMA(dim, heads, 1, ln=ln)
        self.out = nn.Linear(dim, self.output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One client's sample set ``x`` ``[n, *input_shape]`` -> descriptor ``[output_dim]``."""
        self.check_input(x)
        h = self.stem(x).unsqueeze(0)                   # [1, n, dim]: the set is one batch element
        for block in self.blocks:
            h = block(h)
        return self.out(self.pma(h).reshape(-1))


__all__ = ["PHI_HEADS", "PSI_KINDS", "ClipToBall", "PrototypeSoftmax", "DPDeepSetEncoder", "DSSEncoder", "DSSLayer",
           "DeepSetEncoder", "ISAB", "MAB", "MaxPool", "MeanMaxPool", "MeanPool", "PMA", "SetTransformerEncoder"]
