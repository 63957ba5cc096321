"""Privacy events: a description of how a release was privatised, precise enough for an accountant to price it.

An event describes a mechanism, never its output. The vocabulary is that of Flower's privacy module
(``NeighboringRelation``, ``SamplingMethod``) and the events map one-to-one onto dp-accounting's ``DpEvent`` tree.

Units: ``sigma`` and ``scale`` are noise parameters in the units of the released value; ``sensitivity`` is the L2
sensitivity of the released value for the Gaussian and its L1 sensitivity for the Laplace mechanism;
``noise_multiplier`` is ``sigma / sensitivity`` (dimensionless); probabilities are plain probabilities.

The neighbouring relation and the sensitivity go together. The sensitivity you pass is the sensitivity *under the
event's relation*: for a sum of records clipped to norm ``C`` it is ``C`` under ``ADD_OR_REMOVE_ONE`` and ``2 C``
under ``REPLACE_ONE``. An unsampled Gaussian (or Laplace) release is then exactly as private as the ratio
``noise / sensitivity`` says, whatever the relation, and that ratio is all :meth:`PrivacyEvent.to_dp_event` hands to
dp-accounting. The relation still matters for two things: a composition is a guarantee under one relation only, so
events under different relations cannot be composed; and subsampling amplification is analysed under a specific
relation (Poisson sampling under add-or-remove-one, sampling without replacement under replace-one).
"""

from __future__ import annotations

import abc
import math
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # imported where used: importing dp-accounting (and scipy with it) takes about a second
    import dp_accounting


class NeighboringRelation(str, Enum):
    """Which datasets are neighbours: the datasets a DP guarantee says an observer cannot tell apart."""

    ADD_OR_REMOVE_ONE = "add_or_remove_one"
    REPLACE_ONE = "replace_one"


class SamplingMethod(str, Enum):
    """How the records that enter a subsampled mechanism are drawn.

    ``POISSON``: each record independently with probability q (analysed under add-or-remove-one).
    ``WITHOUT_REPLACEMENT``: a uniformly random subset of fixed size q * n of a dataset whose size n is public
    (analysed under replace-one).
    ``NO_AMPLIFICATION``: records are drawn somehow, but no privacy amplification is claimed from it.
    """

    POISSON = "poisson"
    WITHOUT_REPLACEMENT = "without_replacement"
    NO_AMPLIFICATION = "no_amplification"


class PrivacyEvent(abc.ABC):
    """Base class of all events.

    Every event has a ``relation`` (a :class:`NeighboringRelation`, or ``None`` for an event that is equally
    (non-)private under every relation), converts to a dp-accounting ``DpEvent`` and round-trips through JSON.
    Events are frozen and hashable, so equal mechanisms can be grouped before accounting.
    """

    @property
    def relation(self) -> NeighboringRelation | None:
        """The neighbouring relation the event's guarantee holds under (``None``: every relation)."""
        raise NotImplementedError

    @abc.abstractmethod
    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event for this mechanism, with noise expressed per unit of sensitivity.

        Unsampled mechanisms become ``GaussianDpEvent(sigma / sensitivity)`` / ``LaplaceDpEvent(scale /
        sensitivity)``, which is exact under dp-accounting's add-or-remove-one accountants and under its RDP
        accountant for either relation. Warning: dp-accounting's ``PLDAccountant(REPLACE_ONE)`` reads a
        ``GaussianDpEvent`` as a per-record bound and doubles the sensitivity; :mod:`accounting.accountants`
        never builds that combination.
        """

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with a ``"type"`` key; :func:`event_from_dict` inverts it."""

    @abc.abstractmethod
    def leaf_counts(self) -> Counter[PrivacyEvent]:
        """Each elementary mechanism in this event and how many times it is applied."""

    @property
    def num_releases(self) -> int:
        """How many elementary mechanism applications the event contains (a self-composition of k counts k)."""
        return sum(self.leaf_counts().values())


# ---------------------------------------------------------------------------------------------------------------------
# Validation helpers: every message names the parameter, what is valid, and the value received.


def _positive_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _probability_in_unit_interval(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) <= 1:
        raise ValueError(f"{name} must be a probability in (0, 1], got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _enum_member(enum_cls: type[Enum], name: str, value: object) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{name} must be one of {valid}, got {value!r}") from None


def _common_relation(events: Iterable[PrivacyEvent]) -> NeighboringRelation | None:
    """The one relation shared by ``events`` (``None`` if none has one); raises if they mix relations."""
    relations = {e.relation for e in events} - {None}
    if len(relations) > 1:
        found = ", ".join(sorted(repr(r.value) for r in relations if r is not None))
        raise ValueError(
            f"cannot compose events under different neighbouring relations ({found}): a composed guarantee "
            "holds under one relation; describe every release under the same relation"
        )
    return relations.pop() if relations else None


# ---------------------------------------------------------------------------------------------------------------------
# Elementary mechanisms.


@dataclass(frozen=True)
class GaussianEvent(PrivacyEvent):
    """One release of ``value + N(0, sigma^2 I)`` where ``value`` has L2 sensitivity ``sensitivity`` under ``relation``.

    Its privacy depends only on ``sigma / sensitivity``: the exact (epsilon, delta) curve is that of Balle and Wang
    (2018), Theorem 8 (see :func:`accounting.calibration.gaussian_delta`).

    >>> GaussianEvent(sigma=2.0, sensitivity=0.5).to_dp_event()
    GaussianDpEvent(noise_multiplier=4.0)
    """

    sigma: float
    sensitivity: float = 1.0
    relation: NeighboringRelation = NeighboringRelation.REPLACE_ONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", _positive_finite("sigma", self.sigma))
        object.__setattr__(self, "sensitivity", _positive_finite("sensitivity", self.sensitivity))
        object.__setattr__(self, "relation", _enum_member(NeighboringRelation, "relation", self.relation))

    @property
    def noise_multiplier(self) -> float:
        """``sigma / sensitivity``, the only quantity the privacy of this release depends on."""
        return self.sigma / self.sensitivity

    def to_dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.GaussianDpEvent(noise_multiplier=self.noise_multiplier)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "gaussian", "sigma": self.sigma, "sensitivity": self.sensitivity,
                "relation": self.relation.value}

    def leaf_counts(self) -> Counter[PrivacyEvent]:
        return Counter({self: 1})


@dataclass(frozen=True)
class LaplaceEvent(PrivacyEvent):
    """One release of ``value + Laplace(0, scale)`` per coordinate, ``value`` with L1 sensitivity ``sensitivity``.

    Pure ``sensitivity / scale``-DP on its own; accountants compose it tightly with the other events.
    """

    scale: float
    sensitivity: float = 1.0
    relation: NeighboringRelation = NeighboringRelation.REPLACE_ONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _positive_finite("scale", self.scale))
        object.__setattr__(self, "sensitivity", _positive_finite("sensitivity", self.sensitivity))
        object.__setattr__(self, "relation", _enum_member(NeighboringRelation, "relation", self.relation))

    def to_dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.LaplaceDpEvent(noise_multiplier=self.scale / self.sensitivity)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "laplace", "scale": self.scale, "sensitivity": self.sensitivity,
                "relation": self.relation.value}

    def leaf_counts(self) -> Counter[PrivacyEvent]:
        return Counter({self: 1})


# The (sampling method, relation) pairs for which a sound amplification analysis exists in the accountants we wrap.
# Poisson sampling under replace-one is analysed by dp-accounting's PLD only with the per-record norm bound as its
# parameter, which a replace-one sensitivity does not determine; it is refused rather than guessed.
_SUPPORTED_SAMPLING = {
    SamplingMethod.POISSON: {NeighboringRelation.ADD_OR_REMOVE_ONE},
    SamplingMethod.WITHOUT_REPLACEMENT: {NeighboringRelation.REPLACE_ONE},
    SamplingMethod.NO_AMPLIFICATION: set(NeighboringRelation),
}


@dataclass(frozen=True)
class SubsampledGaussianEvent(PrivacyEvent):
    """One step of a subsampled Gaussian mechanism (one DP-SGD step): sample records, sum them, add Gaussian noise.

    ``noise_multiplier`` is ``sigma / sensitivity`` of the sum over the sample, under ``relation`` (for DP-SGD with
    clipping norm C under add-or-remove-one: sigma / C). ``sampling_probability`` is q.

    Supported combinations, each with the analysis that prices it:

    - ``POISSON`` with ``ADD_OR_REMOVE_ONE`` (the default; DP-SGD as in Opacus): PLD, RDP and PRV accountants.
    - ``WITHOUT_REPLACEMENT`` with ``REPLACE_ONE`` and a public ``population_size`` n (the sample has exactly q * n
      records, so q * n must be an integer): RDP accountant only (Wang, Balle, Kasiviswanathan 2019).
    - ``NO_AMPLIFICATION`` with either relation: accounted as an unsampled Gaussian with this noise multiplier.

    Any other combination raises ``ValueError`` at construction.
    """

    noise_multiplier: float
    sampling_probability: float
    sampling_method: SamplingMethod = SamplingMethod.POISSON
    relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE
    _: KW_ONLY
    population_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", _positive_finite("noise_multiplier", self.noise_multiplier))
        object.__setattr__(self, "sampling_probability",
                           _probability_in_unit_interval("sampling_probability", self.sampling_probability))
        method = _enum_member(SamplingMethod, "sampling_method", self.sampling_method)
        relation = _enum_member(NeighboringRelation, "relation", self.relation)
        object.__setattr__(self, "sampling_method", method)
        object.__setattr__(self, "relation", relation)
        if relation not in _SUPPORTED_SAMPLING[method]:
            valid = ", ".join(repr(r.value) for r in _SUPPORTED_SAMPLING[method])
            raise ValueError(
                f"sampling_method={method.value!r} is accounted only under relation {valid}, got {relation.value!r}"
            )
        if method is SamplingMethod.WITHOUT_REPLACEMENT:
            n = _positive_int("population_size", self.population_size)
            object.__setattr__(self, "population_size", n)
            sample_size = self.sampling_probability * n
            if abs(sample_size - round(sample_size)) > 1e-9 * n:
                raise ValueError(
                    "sampling without replacement draws exactly sampling_probability * population_size records, "
                    f"which must be an integer; got {self.sampling_probability!r} * {n} = {sample_size!r}"
                )
        elif self.population_size is not None:
            raise ValueError(
                "population_size is used only with sampling_method='without_replacement', "
                f"got population_size={self.population_size!r} with sampling_method={method.value!r}"
            )

    @property
    def sample_size(self) -> int | None:
        """The fixed sample size q * n for sampling without replacement, else ``None``."""
        if self.population_size is None:
            return None
        return round(self.sampling_probability * self.population_size)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        gaussian = dp_accounting.GaussianDpEvent(noise_multiplier=self.noise_multiplier)
        if self.sampling_method is SamplingMethod.POISSON:
            return dp_accounting.PoissonSampledDpEvent(sampling_probability=self.sampling_probability, event=gaussian)
        if self.sampling_method is SamplingMethod.WITHOUT_REPLACEMENT:
            return dp_accounting.SampledWithoutReplacementDpEvent(
                source_dataset_size=self.population_size, sample_size=self.sample_size, event=gaussian
            )
        return gaussian

    def to_dict(self) -> dict[str, Any]:
        return {"type": "subsampled_gaussian", "noise_multiplier": self.noise_multiplier,
                "sampling_probability": self.sampling_probability, "sampling_method": self.sampling_method.value,
                "relation": self.relation.value, "population_size": self.population_size}

    def leaf_counts(self) -> Counter[PrivacyEvent]:
        return Counter({self: 1})


@dataclass(frozen=True)
class NonPrivateEvent(PrivacyEvent):
    """A release made without any privacy mechanism: every composition that contains it has epsilon = +inf.

    Its ``relation`` is ``None``: it is equally non-private under every relation, so it composes with anything.
    """

    @property
    def relation(self) -> None:
        return None

    def to_dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.NonPrivateDpEvent()

    def to_dict(self) -> dict[str, Any]:
        return {"type": "non_private"}

    def leaf_counts(self) -> Counter[PrivacyEvent]:
        return Counter({self: 1})


# ---------------------------------------------------------------------------------------------------------------------
# Compositions. Composition may be adaptive: each release may depend on the outputs of earlier ones.


@dataclass(frozen=True)
class SelfComposedEvent(PrivacyEvent):
    """``event`` applied ``count`` times (for example ``count`` DP-SGD steps of one round)."""

    event: PrivacyEvent
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.event, PrivacyEvent):
            raise ValueError(f"event must be a PrivacyEvent, got {self.event!r}")
        object.__setattr__(self, "count", _positive_int("count", self.count))

    @property
    def relation(self) -> NeighboringRelation | None:
        return self.event.relation

    def to_dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.SelfComposedDpEvent(event=self.event.to_dp_event(), count=self.count)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "self_composed", "event": self.event.to_dict(), "count": self.count}

    def leaf_counts(self) -> Counter[PrivacyEvent]:
        return Counter({leaf: n * self.count for leaf, n in self.event.leaf_counts().items()})


@dataclass(frozen=True)
class ComposedEvent(PrivacyEvent):
    """The releases ``events`` made one after another; all must be described under the same relation."""

    events: tuple[PrivacyEvent, ...]

    def __post_init__(self) -> None:
        if isinstance(self.events, (PrivacyEvent, str, bytes, Mapping)) or not isinstance(self.events, Iterable):
            raise ValueError(f"events must be a sequence of PrivacyEvent, got {self.events!r}")
        events = tuple(self.events)
        for e in events:
            if not isinstance(e, PrivacyEvent):
                raise ValueError(f"events must contain only PrivacyEvent instances, got {e!r}")
        _common_relation(events)
        object.__setattr__(self, "events", events)

    @property
    def relation(self) -> NeighboringRelation | None:
        return _common_relation(self.events)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.ComposedDpEvent(events=[e.to_dp_event() for e in self.events])

    def to_dict(self) -> dict[str, Any]:
        return {"type": "composed", "events": [e.to_dict() for e in self.events]}

    def leaf_counts(self) -> Counter[PrivacyEvent]:
        counts: Counter[PrivacyEvent] = Counter()
        for e in self.events:
            counts.update(e.leaf_counts())
        return counts


# ---------------------------------------------------------------------------------------------------------------------
# JSON.


def event_from_dict(d: Mapping[str, Any]) -> PrivacyEvent:
    """Rebuild an event from :meth:`PrivacyEvent.to_dict` output (validated like a freshly constructed event).

    >>> e = SelfComposedEvent(GaussianEvent(sigma=1.0), count=3)
    >>> event_from_dict(e.to_dict()) == e
    True
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"an event dict must be a mapping, got {d!r}")
    kind = d.get("type")
    fields = {k: v for k, v in d.items() if k != "type"}
    try:
        if kind == "gaussian":
            return GaussianEvent(**fields)
        if kind == "laplace":
            return LaplaceEvent(**fields)
        if kind == "subsampled_gaussian":
            return SubsampledGaussianEvent(**fields)
        if kind == "non_private":
            return NonPrivateEvent(**fields)
        if kind == "self_composed":
            return SelfComposedEvent(event=event_from_dict(fields["event"]), count=fields["count"])
        if kind == "composed":
            return ComposedEvent(events=tuple(event_from_dict(e) for e in fields["events"]))
    except (TypeError, KeyError) as exc:
        raise ValueError(f"malformed {kind!r} event dict {dict(d)!r}: {exc}") from None
    valid = "'gaussian', 'laplace', 'subsampled_gaussian', 'non_private', 'self_composed', 'composed'"
    raise ValueError(f"event type must be one of {valid}, got {kind!r}")
