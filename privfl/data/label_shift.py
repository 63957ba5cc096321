"""How far a novel client's label mix is from the nearest training client's (ODPFL-HN's accuracy-vs-shift axis).

Example:
    >>> round(label_shift_kl([1, 0], [[0, 1], [1, 0]], smoothing=0.0), 6)
    0.0
"""

from __future__ import annotations

from typing import Any

import numpy as np

from privfl.errors import ConfigError

__all__ = ["label_shift_kl"]


def _as_counts(name: str, histogram: Any, ndim: int) -> np.ndarray:
    """Histogram(s) of label counts as float64, checked to be finite, non-negative and of the right rank."""
    counts = np.asarray(histogram.detach().cpu() if hasattr(histogram, "detach") else histogram, dtype=np.float64)
    if counts.ndim != ndim or counts.shape[-1] == 0:
        raise ConfigError(f"{name} must have {ndim} dimension(s) with at least one class, got shape {counts.shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ConfigError(f"{name} must hold finite, non-negative counts")
    return counts


def label_shift_kl(novel_histogram: Any, training_histograms: Any, smoothing: float = 1e-3) -> float:
    """``min_j KL(P_novel || P_train_j)`` in nats, with ``smoothing`` added to every class count before normalising.

    Args:
        novel_histogram: label counts of the novel client, shape ``[K]`` (array-like or tensor).
        training_histograms: label counts of the training clients, shape ``[J, K]`` (or a list of ``[K]``).
        smoothing: pseudo-count added to every class of every histogram (>= 0); it keeps the divergence finite
            when a training client lacks a class the novel client has.

    Returns:
        The KL divergence to the nearest training client (natural log).

    Raises:
        ConfigError: shapes that disagree, negative or non-finite counts, an all-zero histogram with no smoothing.
    """
    if not np.isfinite(smoothing) or smoothing < 0:
        raise ConfigError(f"smoothing={smoothing!r} is invalid: it must be a finite number >= 0")
    novel = _as_counts("novel_histogram", novel_histogram, 1) + smoothing
    training = _as_counts("training_histograms", training_histograms, 2) + smoothing
    if training.shape[1] != novel.shape[0]:
        raise ConfigError(
            f"novel_histogram has {novel.shape[0]} classes but training_histograms have {training.shape[1]}"
        )
    if novel.sum() == 0 or (training.sum(axis=1) == 0).any():
        raise ConfigError("a histogram is all zeros; use smoothing > 0 or drop empty clients")
    p = novel / novel.sum()
    q = training / training.sum(axis=1, keepdims=True)
    support = p > 0  # 0 * log(0 / q) = 0 by convention
    with np.errstate(divide="ignore"):
        divergences = (p[support] * (np.log(p[support]) - np.log(q[:, support]))).sum(axis=1)
    return float(divergences.min())
