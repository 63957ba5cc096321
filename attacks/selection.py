"""Which reconstructions an attack is scored on (FedPFT paper, App. E.4, Tables 6 and 7; `docs/papers.md`, FedPFT).

The building blocks of the rows that :mod:`attacks.schemes` defines (per-feature and set-level; which rows use the
defender's images to match or to select is stated there and in every table):

- **top fraction**: :func:`top_count` keeps ``ceil(fraction * n)`` items (at least 1), :func:`top_indices` the best
  scored ones; every row counts n in defender images.
- **attacker confidence**: draw k reconstructions per feature and score the feature by the mean pairwise SSIM among
  its k samples (agreement = confident sampling; no ground truth); the attacker's reconstruction of the feature is
  the medoid sample, the one with the highest mean SSIM to the other k - 1 (App. E.4 leaves unstated which of the
  10 samples is scored; `docs/papers.md`, the reconstruction attack) (:func:`agreement_scores`).
- **matching**: :func:`nearest` pairs each image with its most similar candidate by SSIM (set-level rows; with the
  attacker's own images as candidates, the oracle "nearest attacker image" baseline of App. E.4).
- **near-duplicate filter**: defender images whose maximum SSIM to any attacker image is among the top ``fraction``
  (10 % in the paper), or at least ``threshold``, are removed before scoring: a memorised near-copy is not a
  reconstruction.

All functions take image batches ``[N, C, H, W]`` on [0, 1] and return indices into them.

Example:
    >>> import numpy as np
    >>> top_count(450, 0.01), top_indices(np.array([0.2, 0.9, 0.5]), 0.34).tolist()
    (5, [1, 2])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from accounting.validation import is_real
from attacks.metrics import ssim_matrix
from privfl.errors import ConfigError

__all__ = ["agreement_scores", "near_duplicate_filter", "nearest", "top_count", "top_indices"]


def _fraction(name: str, value: object, *, allow_zero: bool = False) -> float:
    if not is_real(value) or not math.isfinite(value) or value > 1 \
            or value < 0 or (value == 0 and not allow_zero):
        low = "[0" if allow_zero else "(0"
        raise ConfigError(f"{name} must be a fraction in {low}, 1], got {value!r}")
    return float(value)


def top_count(n: int, fraction: float) -> int:
    """How many of ``n`` items the top ``fraction`` keeps: ``ceil(fraction * n)``, at least 1 (0 when n = 0)."""
    fraction = _fraction("fraction", fraction)
    if n <= 0:
        return 0
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def top_indices(scores: Any, fraction: float) -> np.ndarray:
    """Indices of the ``top_count`` highest scores, best first (ties: the lower index first)."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1:
        raise ConfigError(f"scores must be one-dimensional, got shape {scores.shape}")
    order = np.argsort(-scores, kind="stable")
    return order[:top_count(len(scores), fraction)]


def agreement_scores(samples: Any, *, data_range: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per feature, the mean pairwise SSIM among its k samples and the index of the medoid sample.

    Args:
        samples: ``[n, k, C, H, W]`` (k >= 2 reconstructions of each of n features).

    Returns:
        ``(agreement [n], medoid [n])``: the mean SSIM over the k(k-1)/2 pairs, and for each feature the sample with
        the highest mean SSIM to the other k - 1 (the lowest index on ties).
    """
    samples = np.asarray(samples)
    if samples.ndim != 5 or samples.shape[1] < 2:
        raise ConfigError(f"samples must be [n, k >= 2, C, H, W], got shape {samples.shape}")
    n, k = samples.shape[:2]
    agreement, medoid = np.empty(n), np.empty(n, dtype=np.int64)
    off_diagonal = ~np.eye(k, dtype=bool)
    for i in range(n):
        s = ssim_matrix(samples[i], samples[i], data_range=data_range)
        s = (s + s.T) / 2  # symmetric up to rounding
        agreement[i] = s[off_diagonal].mean()
        medoid[i] = int(np.argmax(np.where(off_diagonal, s, 0.0).sum(1) / (k - 1)))
    return agreement, medoid


def nearest(targets: Any, candidates: Any, *, data_range: float = 1.0,
            fast: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """For each target, the candidate with the highest SSIM: ``(index [n], ssim [n])``.

    ``fast``: search in float32 (:func:`~attacks.metrics.ssim_matrix`), then rescore each winner in float64; for
    large candidate sets (a defender image against every attacker image).
    """
    import torch

    s = ssim_matrix(targets, candidates, data_range=data_range, dtype=torch.float32 if fast else torch.float64)
    if s.shape[1] == 0:
        raise ConfigError("nearest needs at least one candidate image")
    index = np.argmax(s, axis=1)
    if fast:
        from attacks.metrics import ssim_pairs

        t = torch.as_tensor(np.asarray(targets.detach().cpu() if isinstance(targets, torch.Tensor) else targets))
        c = torch.as_tensor(np.asarray(candidates.detach().cpu() if isinstance(candidates, torch.Tensor)
                                       else candidates))
        return index, ssim_pairs(t, c[torch.as_tensor(index)], data_range=data_range)
    return index, s[np.arange(len(s)), index]


def near_duplicate_filter(defender: Any, attacker: Any, *, fraction: float = 0.1, threshold: float | None = 0.95,
                          data_range: float = 1.0, max_ssim: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Drop defender images too similar to an attacker image (the paper drops the top 10 % by maximum SSIM).

    Args:
        defender, attacker: image batches.
        fraction: the share of defender images with the highest maximum SSIM to the attacker set that is dropped
            (0 drops none by rank).
        threshold: also drop every defender image whose maximum SSIM reaches it (``None``: rank only). An exact
            copy (SSIM 1) is always dropped.
        max_ssim: every defender image's maximum SSIM to the attacker set when already computed (the second output
            of :func:`nearest`); ``None`` computes it.

    Returns:
        ``(kept, max_ssim)``: the kept defender indices (ascending) and every defender image's maximum SSIM.
    """
    fraction = _fraction("fraction", fraction, allow_zero=True)
    if threshold is not None:
        threshold = _fraction("threshold", threshold)
    best = nearest(defender, attacker, data_range=data_range)[1] if max_ssim is None else \
        np.asarray(max_ssim, dtype=np.float64)
    n = len(best)
    dropped = np.zeros(n, dtype=bool)
    if fraction > 0 and n:
        dropped[top_indices(best, fraction)] = True
    dropped |= best >= (1.0 - 1e-9 if threshold is None else min(threshold, 1.0 - 1e-9))
    return np.flatnonzero(~dropped), best
