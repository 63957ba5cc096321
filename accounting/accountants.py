"""Accountants: the (epsilon, delta) guarantee of a composition of privacy events.

Epsilon is in natural-log units, delta is a probability. Three well-kept accountants are wrapped, not re-derived:

- ``"pld"``: dp-accounting's privacy-loss-distribution accountant (tight up to its pessimistic discretisation of
  :data:`PLD_VALUE_DISCRETIZATION_INTERVAL`, a grid made wider where a distribution would not fit in bounded memory,
  :mod:`accounting.pld`; the primary accountant).
- ``"rdp"``: dp-accounting's Renyi-DP accountant over :data:`RDP_ORDERS` (a valid but looser bound; a cross-check,
  and the only one here that prices sampling without replacement).
- ``"prv"``: Opacus' privacy-random-variable accountant (Gopi et al. 2021), Opacus' default for DP-SGD. It prices
  Gaussian releases only, Poisson-sampled or not, and reports an upper bound on epsilon for a given delta.

Composition is adaptive composition: the guarantee holds even when each release depends on earlier outputs.
Before accounting, identical elementary mechanisms are grouped (``k`` equal DP-SGD steps become one k-fold
self-composition), which gives the same guarantee and keeps long ledgers fast.

Every accountant prices releases of noise multiplier at least :data:`~accounting.limits.NOISE_MULTIPLIER_FLOOR`
only: :func:`check_supported` refuses a release below it, and :func:`epsilon` prices one it meets in a history as no
guarantee (infinity), a sound bound found without unbounded memory.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from accounting import limits
from accounting.events import (
    GaussianEvent,
    NonPrivateEvent,
    PrivacyEvent,
    SamplingMethod,
    SubsampledGaussianEvent,
)
from accounting.limits import below_floor
from accounting.pld import PLD_VALUE_DISCRETIZATION_INTERVAL, composed_pld

if TYPE_CHECKING:   # imported where used: importing dp-accounting (and scipy with it) takes about a second
    import dp_accounting

AccountantName = Literal["pld", "rdp", "prv"]
ACCOUNTANTS: tuple[str, ...] = get_args(AccountantName)

#: RDP orders: 1.1 to 10.9 in steps of 0.1, every integer from 11 to 63, and 128, 256, 512, 1024. This is
#: dp-accounting's default grid (Opacus uses the same without 11 and the orders above 63), written out so that results
#: do not move when a library changes its default. It reproduces the reference values; a finer grid near the optimal
#: order gives slightly smaller (still valid) epsilons, e.g. 96.04 instead of 96.12 for 100 composed unit Gaussians.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])


class UnsupportedAccountingError(ValueError):
    """The chosen accountant has no sound analysis for this event: choose another accountant."""


@dataclass(frozen=True)
class PrivacySpent:
    """The guarantee of everything composed so far: (epsilon, delta)-DP under the events' neighbouring relation.

    ``epsilon`` is natural-log (``inf`` if any release was non-private), ``delta`` a probability,
    ``num_releases`` the number of elementary mechanism applications composed, ``accountant`` the accountant's name.
    """

    epsilon: float
    delta: float
    num_releases: int
    accountant: str


def _check_accountant(accountant: object) -> AccountantName:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(map(repr, ACCOUNTANTS))}, got {accountant!r}")
    return accountant  # type: ignore[return-value]  # one of ACCOUNTANTS, checked above


def _check_event(event: object) -> PrivacyEvent:
    if not isinstance(event, PrivacyEvent):
        raise ValueError(f"event must be an accounting PrivacyEvent, got {event!r}")
    return event


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < float(delta) < 1:
        raise ValueError(f"delta must be a probability in (0, 1), got {delta!r}")
    return float(delta)


def _check_epsilon(epsilon: object) -> float:
    if (isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon)
            or epsilon < 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    return float(epsilon)


def _is_without_replacement(leaf: PrivacyEvent) -> bool:
    return isinstance(leaf, SubsampledGaussianEvent) and leaf.sampling_method is SamplingMethod.WITHOUT_REPLACEMENT


def _dp_accounting_backend(leaves: Counter[PrivacyEvent], accountant: str, *, compose: bool = True,
                           ) -> dp_accounting.PrivacyAccountant:
    """A dp-accounting accountant with the grouped composition of ``leaves`` composed into it (or, with
    ``compose=False``, only checked to be supported, which is cheap).

    The backend's relation is add-or-remove-one unless a leaf is sampled without replacement (then replace-one).
    Unsampled leaves carry noise per unit of their own relation's sensitivity, which is exact under both (see
    :meth:`PrivacyEvent.to_dp_event`); PLD is never run under replace-one, where it would double that sensitivity.
    """
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if any(_is_without_replacement(leaf) for leaf in leaves):
        if accountant == "pld":
            raise UnsupportedAccountingError(
                "the 'pld' accountant cannot price SubsampledGaussianEvent(sampling_method='without_replacement'): "
                "dp-accounting's PLD has no analysis of sampling without replacement; use accountant='rdp'"
            )
        relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    dp_event = dp_accounting.ComposedDpEvent(
        events=[dp_accounting.SelfComposedDpEvent(event=leaf.to_dp_event(), count=n) for leaf, n in leaves.items()]
    )
    if accountant == "pld":
        backend = PLDAccountant(relation, value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
    else:
        backend = RdpAccountant(orders=RDP_ORDERS, neighboring_relation=relation)
    if not backend.supports(dp_event):
        raise UnsupportedAccountingError(f"the {accountant!r} accountant cannot price {dp_event}")
    if compose:
        backend.compose(dp_event)
    return backend


def _prv_history(leaves: Counter[PrivacyEvent]) -> list[tuple[float, float, int]]:
    """Opacus' PRV history ``[(noise_multiplier, sampling_probability, steps)]``; unsampled Gaussians have q = 1."""
    history = []
    for leaf, n in leaves.items():
        if isinstance(leaf, GaussianEvent):
            history.append((leaf.noise_multiplier, 1.0, n))
        elif isinstance(leaf, SubsampledGaussianEvent) and leaf.sampling_method is SamplingMethod.POISSON:
            history.append((leaf.noise_multiplier, leaf.sampling_probability, n))
        elif isinstance(leaf, SubsampledGaussianEvent) and leaf.sampling_method is SamplingMethod.NO_AMPLIFICATION:
            history.append((leaf.noise_multiplier, 1.0, n))
        else:
            raise UnsupportedAccountingError(
                f"the 'prv' accountant (Opacus) prices Gaussian releases, Poisson-sampled or not, only; got {leaf!r}. "
                "Use accountant='pld' or 'rdp'"
            )
    return history


def _prv_epsilon(leaves: Counter[PrivacyEvent], delta: float) -> float:
    history = _prv_history(leaves)
    # Imported here: importing opacus imports torch, and the rest of this package must stay torch-free.
    import numpy as np
    from opacus.accountants import PRVAccountant

    prv = PRVAccountant()
    prv.history = history
    # q = 1 makes Opacus take log(0) on a branch it then discards; silence that, not real errors.
    with np.errstate(divide="ignore"):
        return float(prv.get_epsilon(delta))


def check_supported(event: PrivacyEvent, *, accountant: AccountantName = "pld") -> None:
    """Raise :class:`UnsupportedAccountingError` if ``accountant`` cannot price ``event``. Cheap: composes nothing.

    A :class:`NonPrivateEvent` is supported by every accountant (its price is epsilon = inf); a release of noise
    multiplier below :data:`~accounting.limits.NOISE_MULTIPLIER_FLOOR` by none.
    """
    event = _check_event(event)
    accountant = _check_accountant(accountant)
    try:
        hash(event)
    except TypeError:   # an event that cannot be remembered is checked each time
        _check_supported(event, accountant)
        return
    _supported(event, accountant, limits.NOISE_MULTIPLIER_FLOOR)


@functools.lru_cache(maxsize=1024)
def _supported(event: PrivacyEvent, accountant: AccountantName, floor: float) -> None:
    """:func:`_check_supported`, remembered per (event, accountant, noise floor) when it passes: every client of a
    round records the same event, and the answer depends on nothing else."""
    _check_supported(event, accountant)


def _check_supported(event: PrivacyEvent, accountant: AccountantName) -> None:
    leaves = event.leaf_counts()
    reason = below_floor(event)
    if reason is not None:
        raise UnsupportedAccountingError(f"the {accountant!r} accountant cannot price it: {reason}")
    priced = Counter({leaf: n for leaf, n in leaves.items() if not isinstance(leaf, NonPrivateEvent)})
    if accountant == "prv":
        _prv_history(priced)
    else:
        _dp_accounting_backend(priced, accountant, compose=False)


def epsilon(event: PrivacyEvent, delta: float, *, accountant: AccountantName = "pld") -> float:
    """The epsilon at which ``event`` (any composition of releases) is (epsilon, delta)-DP.

    Args:
        event: the releases; all under one neighbouring relation.
        delta: target delta, in (0, 1).
        accountant: "pld", "rdp" or "prv" (see the module docstring).

    Returns:
        epsilon (natural log): 0.0 for an empty composition, ``inf`` if any release is a :class:`NonPrivateEvent` or
        has noise below :data:`~accounting.limits.NOISE_MULTIPLIER_FLOOR` (no bound is computed for it).

    Raises:
        UnsupportedAccountingError: the accountant has no analysis for some release in ``event``.

    >>> from accounting.events import SelfComposedEvent, SubsampledGaussianEvent
    >>> dp_sgd = SelfComposedEvent(SubsampledGaussianEvent(1.0, sampling_probability=0.01), count=1000)
    >>> round(epsilon(dp_sgd, 1e-5), 4), round(epsilon(dp_sgd, 1e-5, accountant="rdp"), 4)
    (1.8282, 2.1014)
    """
    leaves = _check_event(event).leaf_counts()
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    if any(isinstance(leaf, NonPrivateEvent) for leaf in leaves) or below_floor(event) is not None:
        return math.inf
    if not leaves:
        return 0.0
    return _epsilon_of_leaves(frozenset(leaves.items()), delta, accountant)


def in_canonical_order(leaves: Iterable[tuple[PrivacyEvent, int]]) -> Counter[PrivacyEvent]:
    """``leaves`` as a Counter in one order that depends on the events alone (their reprs), so that the same multiset
    is always composed in the same order: composition is exact up to floating-point rounding, whose last bits follow
    the order (about 1e-13 relative), and an order taken from a set would follow the process's hash seed."""
    return Counter(dict(sorted(leaves, key=lambda item: (repr(item[0]), item[1]))))


@functools.lru_cache(maxsize=4096)
def _epsilon_of_leaves(leaves: frozenset[tuple[PrivacyEvent, int]], delta: float, accountant: str) -> float:
    """:func:`epsilon` of a multiset of elementary releases, remembered: the clients of a run often hold identical
    ledgers (the same mechanisms, as many times), and one PLD composition of subsampled Gaussians takes about a
    second. Events are frozen, so equal keys mean equal compositions and the cached value is exact."""
    counts = in_canonical_order(leaves)
    if accountant == "prv":
        return _prv_epsilon(counts, delta)
    if accountant == "pld":
        built = composed_pld(counts)
        if built is not None:
            return float(built[0].get_epsilon_for_delta(delta))
    return float(_dp_accounting_backend(counts, accountant).get_epsilon(delta))


def delta_for_epsilon(event: PrivacyEvent, epsilon: float, *, accountant: AccountantName = "pld") -> float:
    """The smallest delta at which ``event`` is (epsilon, delta)-DP, by the accountant's bound.

    Args:
        event: the releases; all under one neighbouring relation.
        epsilon: target epsilon (natural log), finite and >= 0.
        accountant: "pld" or "rdp". Opacus' PRV accountant reports epsilon for a delta only, so "prv" raises.

    Returns:
        delta in [0, 1]: 0.0 for an empty composition, 1.0 if any release is a :class:`NonPrivateEvent` or has noise
        below :data:`~accounting.limits.NOISE_MULTIPLIER_FLOOR`.
    """
    leaves = _check_event(event).leaf_counts()
    epsilon = _check_epsilon(epsilon)
    accountant = _check_accountant(accountant)
    if accountant == "prv":
        raise UnsupportedAccountingError(
            "the 'prv' accountant (Opacus) reports epsilon for a given delta only; use accountant='pld' or 'rdp'"
        )
    if any(isinstance(leaf, NonPrivateEvent) for leaf in leaves) or below_floor(event) is not None:
        return 1.0
    if not leaves:
        return 0.0
    built = composed_pld(leaves) if accountant == "pld" else None
    if built is not None:
        return float(min(1.0, built[0].get_delta_for_epsilon(epsilon)))
    return float(min(1.0, _dp_accounting_backend(leaves, accountant).get_delta(epsilon)))


def privacy_spent(event: PrivacyEvent, delta: float, *, accountant: AccountantName = "pld") -> PrivacySpent:
    """:func:`epsilon` of ``event`` at ``delta``, with the number of releases and the accountant named."""
    return PrivacySpent(
        epsilon=epsilon(event, delta, accountant=accountant),
        delta=_check_delta(delta),
        num_releases=event.num_releases,
        accountant=accountant,
    )
