"""Bootstrap confidence intervals for the attack tables (Efron and Tibshirani 1993, ch. 13, percentile interval).

A table cell is a mean of per-image scores, possibly over a top-k selection (the attacker's or the oracle's) and
possibly over several evaluation seeds. :func:`bootstrap_cell` resamples the scored images with replacement **within
each seed** (stratified: every seed keeps its size), redoes the top-k selection inside every resample (so the
interval includes the selection's own variability), averages over seeds, and returns the statistic on the data with
the 2.5 % and 97.5 % quantiles of its resampled values. The intervals describe the defender images and the sampling;
they do not include the variability of training the attacker's models again.

Two cells are called separated only when their intervals do not overlap (:func:`separated`); a paired interval on
the per-image differences (the same images scored by two attacks) is sharper, and is what :func:`bootstrap_cell`
gives when handed the differences.

Example:
    >>> import numpy as np
    >>> values = np.arange(10.0)[:, None]
    >>> estimate, low, high = bootstrap_cell([(values, None)], n_boot=200, seed=0)
    >>> float(estimate[0]), bool(low[0] < 4.5 < high[0])
    (4.5, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from accounting.validation import is_int_at_least
from attacks.selection import top_count
from privfl.errors import ConfigError

__all__ = ["bootstrap_cell", "separated"]


def _top_mean(values: np.ndarray, rank: np.ndarray | None, k: int | None) -> np.ndarray:
    """Mean of ``values`` ``[..., n, m]`` over the top ``k`` by ``rank`` ``[..., n]`` (ties: lower index first)."""
    if rank is None or k is None:
        return values.mean(axis=-2)
    order = np.argsort(-rank, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(values, order[..., None], axis=-2).mean(axis=-2)


def bootstrap_cell(groups: Sequence[tuple[Any, Any]], *, fraction: float | None = None, n_boot: int = 1000,
                   confidence: float = 0.95, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mean over seeds of (top-k) means, with its percentile-bootstrap interval.

    Args:
        groups: one ``(values [n, m], rank [n] or None)`` per seed: m metrics of n scored images, and the score that
            ranks them for a top selection (higher first; ``None``: every image counts).
        fraction: the top fraction kept in each seed (``ceil(fraction * n)``, at least 1); ``None``: all images.
        n_boot: bootstrap resamples.
        confidence: the interval's coverage.
        seed: the resampling's random stream.

    Returns:
        ``(estimate [m], low [m], high [m])``.
    """
    if not is_int_at_least(n_boot, 1):
        raise ConfigError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence!r}")
    if not groups:
        raise ConfigError("bootstrap_cell needs at least one group of scores")
    rng = np.random.default_rng(seed)
    estimates, resampled = [], []
    for values, rank in groups:
        v = np.asarray(values, dtype=np.float64)
        v = v[:, None] if v.ndim == 1 else v
        if v.ndim != 2 or len(v) == 0:
            raise ConfigError(f"each group's values must be [n >= 1, m], got shape {v.shape}")
        r = None if rank is None else np.asarray(rank, dtype=np.float64)
        if r is not None and r.shape != (len(v),):
            raise ConfigError(f"rank must have one score per image: {r.shape} for {len(v)} images")
        k = None if fraction is None or r is None else top_count(len(v), fraction)
        estimates.append(_top_mean(v, r, k))
        index = rng.integers(0, len(v), size=(n_boot, len(v)))
        resampled.append(_top_mean(v[index], None if r is None else r[index], k))
    estimate = np.mean(estimates, axis=0)
    boot = np.mean(resampled, axis=0)   # [n_boot, m]
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail], axis=0)
    return estimate, low, high


def separated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals ``(low, high)`` do not overlap."""
    return a[1] < b[0] or b[1] < a[0]
