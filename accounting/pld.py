"""Privacy-loss distributions of the PLD accountant, on a grid chosen so that each fits in bounded memory.

dp-accounting's ``PLDAccountant`` discretises privacy losses on a grid of fixed width
(:data:`PLD_VALUE_DISCRETIZATION_INTERVAL`). The grid of one Gaussian release of noise
multiplier z spans about 1 / z^2 + 20 / z, so a small z (or many unsampled Gaussians, which compose to one of noise
multiplier z / sqrt(k)) asks for billions of points. :func:`composed_pld` builds the distributions exactly as
``PLDAccountant`` does (the same constructions, in the same order) on the default grid wherever every distribution
it builds holds at most :data:`~accounting.limits.PLD_MAX_POINTS` points, and on the narrowest coarser grid that
fits otherwise. Every grid is pessimistic (losses are rounded up), so the epsilon read from it is an upper bound
whatever its width. The size of each distribution is known before it is built: a single release's loss range from
its closed-form bounds, a k-fold self-composition's from the Chernoff bounds dp-accounting truncates it at.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

from accounting.events import (
    GaussianEvent,
    LaplaceEvent,
    PrivacyEvent,
    SamplingMethod,
    SubsampledGaussianEvent,
)
from accounting.limits import PLD_MAX_POINTS

#: Width of the privacy-loss grid of the PLD accountant where it fits (dp-accounting's default). It reproduces the
#: exact epsilon of 100 composed unit Gaussians (91.8173 at delta=1e-5) and the DP-SGD reference value 1.8282 to 4
#: decimals; a grid of 1e-3 would be 5x faster but reads 1.8289 on the latter.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4

#: dp-accounting's bounds, as ``PLDAccountant`` uses them: the log of the noise mass cut from one release, and the
#: tail mass a composition may truncate.
_LOG_MASS_TRUNCATION = -50.0
_TAIL_MASS_TRUNCATION = 1e-15


def _part(leaf: PrivacyEvent, count: int) -> tuple[str, float, float, int] | None:
    """``(kind, parameter, sampling probability, self-compositions)`` of ``count`` applications of ``leaf``, as
    ``PLDAccountant`` builds them: unsampled Gaussians as one Gaussian of noise multiplier z / sqrt(count), not
    self-composed (0); a Poisson-subsampled step and a Laplace release self-composed ``count`` times; ``None`` for
    what it does not build here (sampling without replacement)."""
    if isinstance(leaf, GaussianEvent):
        return "gaussian", leaf.noise_multiplier / math.sqrt(count), 1.0, 0
    if isinstance(leaf, SubsampledGaussianEvent):
        if leaf.sampling_method is SamplingMethod.NO_AMPLIFICATION:
            return "gaussian", leaf.noise_multiplier / math.sqrt(count), 1.0, 0
        if leaf.sampling_method is SamplingMethod.POISSON:
            return "gaussian", leaf.noise_multiplier, leaf.sampling_probability, count
        return None
    if isinstance(leaf, LaplaceEvent):
        return "laplace", leaf.scale / leaf.sensitivity, 1.0, count
    return None


def _loss_span(kind: str, parameter: float, sampling_probability: float) -> float:
    """The width of the privacy-loss range of one release (the wider of its two adjacencies), from dp-accounting's
    connect-the-dots bounds: what the grid of that release spans, known before it is built."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    spans = []
    for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
        if kind == "gaussian":
            loss = plm.GaussianPrivacyLoss(parameter, sensitivity=1, pessimistic_estimate=True,
                                           log_mass_truncation_bound=_LOG_MASS_TRUNCATION,
                                           sampling_prob=sampling_probability, adjacency_type=adjacency)
        else:
            loss = plm.LaplacePrivacyLoss(parameter, sensitivity=1, adjacency_type=adjacency)
        bounds = loss.connect_dots_bounds()
        spans.append(float(bounds.epsilon_upper) - float(bounds.epsilon_lower))
    return max(spans)


def _single_pld(kind: str, parameter: float, sampling_probability: float, interval: float) -> Any:
    """One release's PLD (add or remove one) as ``PLDAccountant`` builds it."""
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution as PLD

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if kind == "gaussian":
        return PLD.from_gaussian_mechanism(standard_deviation=parameter, value_discretization_interval=interval,
                                           sampling_prob=sampling_probability, neighboring_relation=relation)
    return PLD.from_laplace_mechanism(parameter=parameter, value_discretization_interval=interval)


#: :func:`_single_pld` of a release that is self-composed, remembered: a run prices the same DP-SGD step at a new
#: count every round, and building it is what costs. At most 8 are kept, each of at most ``PLD_MAX_POINTS`` points.
#: (An unsampled Gaussian is built at a new noise multiplier z / sqrt(count) each time, so it is not kept.)
_step_pld = functools.lru_cache(maxsize=8)(_single_pld)


def _pmfs(pld: Any) -> list[Any]:
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    return [pmf if hasattr(pmf, "_probs") else pmf.to_dense_pmf() for pmf in pmfs]


def _self_composed_points(pld: Any, count: int) -> int:
    """How many points ``pld.self_compose(count)`` holds: dp-accounting truncates it at the Chernoff bounds this
    computes first (``common.compute_self_convolve_bounds``), without convolving anything."""
    from dp_accounting.pld import common

    sizes = []
    for pmf in _pmfs(pld):
        if len(pmf._probs) * count <= PLD_MAX_POINTS:
            sizes.append(len(pmf._probs) * count)
            continue
        lower, upper = common.compute_self_convolve_bounds(pmf._probs, count, _TAIL_MASS_TRUNCATION)
        sizes.append(upper - lower + 1)
    return max(sizes)


def composed_pld(leaves: Counter[PrivacyEvent]) -> tuple[Any, float] | None:
    """The PLD of ``leaves`` composed (each elementary release the number of times it counts) and the grid width it
    was built on: :data:`PLD_VALUE_DISCRETIZATION_INTERVAL` where every distribution built fits in
    :data:`~accounting.limits.PLD_MAX_POINTS` points, else the narrowest wider grid that fits. ``None`` for leaves
    this does not build (the caller asks dp-accounting's accountant itself). The leaves must be priceable
    (:func:`accounting.limits.below_floor` is ``None``)."""
    from dp_accounting.pld import privacy_loss_distribution as PLD

    parts = []
    for leaf, count in leaves.items():
        part = _part(leaf, count)
        if part is None:
            return None
        parts.append(part)
    interval = PLD_VALUE_DISCRETIZATION_INTERVAL
    # 1. the grid every single release fits on
    for kind, parameter, q, _ in parts:
        points = _loss_span(kind, parameter, q) / interval + 2
        if points > PLD_MAX_POINTS:
            interval *= points / PLD_MAX_POINTS * 1.01
    # 2. the self-compositions and their composition fit on it too; a grid that does not is widened (the sizes
    #    shrink in proportion) and the releases built again
    for _ in range(8):
        built, total, widen = [], 0, 1.0
        for kind, parameter, q, count in parts:
            single = (_step_pld if count else _single_pld)(kind, parameter, q, interval)
            points = _self_composed_points(single, count) if count else max(len(p._probs) for p in _pmfs(single))
            widen = max(widen, points / PLD_MAX_POINTS)
            total += points
            built.append((single, count))
        widen = max(widen, total / (2 * PLD_MAX_POINTS))
        if widen <= 1.0:
            break
        interval *= widen * 1.01
    else:   # pragma: no cover  (sizes shrink in proportion to the grid's width)
        raise RuntimeError(f"no grid up to {interval:g} fits the privacy-loss distribution of {dict(leaves)!r}")
    pld = PLD.identity(value_discretization_interval=interval)
    for single, count in built:
        pld = pld.compose(single.self_compose(count) if count else single)
    return pld, interval


__all__ = ["PLD_VALUE_DISCRETIZATION_INTERVAL", "composed_pld"]
