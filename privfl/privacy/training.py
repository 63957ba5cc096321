"""How training clients are protected: one setting for every method, and the client-level mechanisms behind it.

:class:`TrainingPrivacy` (``RunConfig.privacy``) chooses one mode for every training client of a run: ``record``
(record-level DP: DP-SGD and per-record clipped releases, calibrated from public quantities only), ``local``
(client-level DP, every client noises its own clipped release), ``distributed`` (client-level DP against an observer
of the secure sum only) or ``central`` (DP-FedAvg with a trusted aggregator). Novel clients are protected by
:class:`NovelPrivacy` (``RunConfig.novel_privacy``).

Entry points: :class:`TrainingPrivacy`, :class:`NovelPrivacy`; the calibrations :func:`record_noise_multiplier`,
:func:`record_sampling_rate`, :func:`client_level_noise`, :func:`central_noise_multiplier`,
:func:`joint_noise_multiplier`, :func:`share_epsilon`, :func:`stage_clips`; the checks :func:`check_epsilon_target`,
:func:`check_delta`, :func:`check_noise_multiplier`.

Each mode's neighbouring relation, mechanism and argument: docs/privacy.md, "The modes: record, local,
distributed, central".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from accounting import (
    ComposedEvent,
    GaussianEvent,
    NeighboringRelation,
    PrivacyEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    limits,
)
from accounting import epsilon as accounting_epsilon
from accounting.calibration import analytic_gaussian_sigma, calibrate_noise_multiplier
from accounting.validation import is_finite
from privfl.errors import ConfigError, check
from privfl.privacy.mechanisms import NOISE_SOURCES, NoiseSource

RECORD, CENTRAL, DISTRIBUTED, LOCAL = "record", "central", "distributed", "local"
#: The modes of :class:`TrainingPrivacy`, record level first.
MODES = (RECORD, CENTRAL, DISTRIBUTED, LOCAL)
CLIENT_LEVEL = (CENTRAL, DISTRIBUTED, LOCAL)
ADAPTIVE = "adaptive"

#: What each mode's epsilons hold under, in words (the ledger's relation records the formal one).
RELATIONS = {
    RECORD: "add or remove one record of a training client's data",
    LOCAL: "replace one training client's whole dataset; nobody is trusted",
    DISTRIBUTED: "replace one training client's whole dataset; against an observer of each round's sum only "
                 "(secure aggregation)",
    CENTRAL: "add or remove one training client; against everyone but the trusted aggregator, which sees each "
             "contribution",
}


def check_epsilon_target(value: Any, name: str) -> float:
    """A target epsilon noise is calibrated for: finite, > 0 and at most
    :data:`~accounting.limits.EPSILON_CEILING` (natural log)."""
    epsilon = check.epsilon(value, name)
    check.require(epsilon <= limits.EPSILON_CEILING, name, epsilon,
                  f"at most {limits.EPSILON_CEILING:g} (the largest target noise is calibrated for: a likelihood "
                  f"ratio of e^{limits.EPSILON_CEILING:g} protects nothing; accounting.limits)")
    return epsilon


def check_delta(value: Any, name: str) -> float:
    """A delta noise is calibrated at: a probability in (0, 1), at least :data:`~accounting.limits.DELTA_FLOOR`."""
    delta = check.delta(value, name)
    check.require(delta >= limits.DELTA_FLOOR, name, delta,
                  f"a probability of at least {limits.DELTA_FLOOR:g} (the least delta the accountants resolve: below "
                  "it the mass they cut from each composition's tails exceeds delta, and epsilon reads infinite)")
    return delta


def check_noise_multiplier(value: Any, name: str) -> float:
    """A noise multiplier (sigma / sensitivity) the accountants price: at least
    :data:`~accounting.limits.NOISE_MULTIPLIER_FLOOR`."""
    floor = limits.NOISE_MULTIPLIER_FLOOR
    check.require(is_finite(value) and value >= floor, name, value,
                  f"a finite number >= {floor:g} (the least noise the accountants price: one release at it is about "
                  "(92, 1e-5)-DP; accounting.limits)")
    return float(value)


@dataclass(frozen=True)
class TrainingPrivacy:
    """How every training client of a run is protected (``RunConfig.privacy``); see the module docstring.

    ``mode``: ``None`` (training clients release without DP; recorded with epsilon = infinity), ``"record"``,
    ``"central"``, ``"distributed"`` or ``"local"``. With a mode, exactly one of ``epsilon`` (the target over the
    run, natural log; the noise is calibrated for it) and ``noise_multiplier`` (sigma / sensitivity) is set.
    ``delta``: the delta of the guarantee. ``clip``: C, the L2 clip (record: of each record's gradient and
    contribution; client level: of a client's whole round); ``"adaptive"`` in central mode.
    ``min_samples``: record level, a public lower bound on a training client's training-split size: means over a
    client's records (ODPFL-HN's descriptor) keep n private and are calibrated at this size; a client with fewer
    records is refused. ``sampling_rate``: record level, the public Poisson rate q of every DP-SGD step (``None``:
    ``min(1, batch_size / min_samples)``, the rate at which a client of ``min_samples`` records draws batches of
    ``batch_size`` on average). ``participations``: local and distributed modes, the most rounds a client may release in
    (``None``: the most the run's public sampling schedule gives any client); each release is calibrated for it and
    the ledger refuses one beyond. ``shares``: distributed mode, M (``None``: the clients one round samples).
    Adaptive clipping (central, ``clip="adaptive"``; Andrew et al. 2021 defaults): ``clip_initial``,
    ``clip_quantile`` (gamma), ``clip_lr`` (eta), ``clip_count_noise`` (sigma_b; ``None``: the expected clients per
    round / 20, as Andrew et al. 2021, or the round's noise multiplier z when that is larger, so that the count
    takes at most a quarter of the round's budget: z_update <= 1.155 z). ``noise``: ``"secure"`` (OS-seeded noise and,
    in central mode, client sampling) or ``"seeded"``
    (from ``noise_seed``: reproducible, for research runs; whoever knows the config can subtract the noise).
    """

    mode: str | None = None
    epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    clip: float | str = 1.0
    min_samples: int = 8
    sampling_rate: float | None = None
    participations: int | None = None
    shares: int | None = None
    clip_initial: float = 0.1
    clip_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_count_noise: float | None = None
    noise: NoiseSource = "secure"
    noise_seed: int = 0

    def __post_init__(self) -> None:
        check.require(self.mode is None or self.mode in MODES, "privacy mode", self.mode,
                      f"None (no DP for training clients) or one of {', '.join(map(repr, MODES))}")
        check_delta(self.delta, "privacy delta")
        check.choice(self.noise, "privacy noise", NOISE_SOURCES)
        check.integer(self.noise_seed, "privacy noise_seed", 0)
        check.integer(self.min_samples, "privacy min_samples", 1)
        if self.clip == ADAPTIVE:
            check.require(self.mode == CENTRAL, "privacy clip", self.clip,
                          f"a finite L2 norm > 0 ('adaptive' follows a quantile of the clients' update norms and is "
                          f"accounted in central mode only; mode is {self.mode!r})")
            check.positive(self.clip_initial, "privacy clip_initial")
            check.require(is_finite(self.clip_quantile) and 0 < self.clip_quantile < 1, "privacy clip_quantile",
                          self.clip_quantile, "in (0, 1)")
            check.positive(self.clip_lr, "privacy clip_lr")
            if self.clip_count_noise is not None:
                check.positive(self.clip_count_noise, "privacy clip_count_noise")
        else:
            check.positive(self.clip, "privacy clip")
        for name in ("participations", "shares"):
            value = getattr(self, name)
            if value is not None:
                check.integer(value, f"privacy {name}", 1)
        if self.sampling_rate is not None:
            check.require(is_finite(self.sampling_rate) and 0 < self.sampling_rate <= 1, "privacy sampling_rate",
                          self.sampling_rate, "a probability in (0, 1] (the Poisson rate of each DP-SGD step)")
        if self.mode is None:
            given = {name: getattr(self, name) for name in ("epsilon", "noise_multiplier", "participations", "shares",
                                                            "sampling_rate")
                     if getattr(self, name) is not None}
            if given:
                raise ConfigError(f"privacy settings {given} need a privacy mode (one of {', '.join(MODES)}); without "
                                  "one, training clients release without DP")
            return
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ConfigError(f"privacy mode {self.mode!r} needs exactly one of epsilon (a target over the run) and "
                              f"noise_multiplier, got epsilon={self.epsilon!r}, "
                              f"noise_multiplier={self.noise_multiplier!r}")
        if self.epsilon is not None:
            check_epsilon_target(self.epsilon, "privacy epsilon")
        if self.noise_multiplier is not None:
            check_noise_multiplier(self.noise_multiplier, "privacy noise_multiplier")
        if self.participations is not None and self.mode not in (LOCAL, DISTRIBUTED):
            raise ConfigError(f"privacy participations is for modes 'local' and 'distributed' (it sets how many "
                              f"releases each noise is calibrated for), got it with mode {self.mode!r}")
        if self.shares is not None and self.mode != DISTRIBUTED:
            raise ConfigError(f"privacy shares is for mode 'distributed', got it with mode {self.mode!r}")
        if self.sampling_rate is not None and self.mode != RECORD:
            raise ConfigError(f"privacy sampling_rate is the Poisson rate of record-level DP-SGD, for mode 'record'; "
                              f"got it with mode {self.mode!r} (central mode samples clients at the client fraction)")

    @property
    def private(self) -> bool:
        return self.mode is not None

    @property
    def client_level(self) -> bool:
        return self.mode in CLIENT_LEVEL

    def describe(self) -> str | None:
        """A short description for messages and summaries (``None`` without a mode)."""
        if self.mode is None:
            return None
        target = f"epsilon={self.epsilon:g}" if self.epsilon is not None else \
            f"noise_multiplier={self.noise_multiplier:g}"
        return f"{self.mode}-level DP ({target}, delta={self.delta:g}, clip={self.clip})" if self.mode == RECORD \
            else f"client-level DP, {self.mode} ({target}, delta={self.delta:g}, clip={self.clip})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> TrainingPrivacy:
        return _from_dict(cls, values or {}, "privacy")


@dataclass(frozen=True)
class NovelPrivacy:
    """How a novel client's release is protected (``RunConfig.novel_privacy``), for every method whose novel clients
    release something (ODPFL-HN's descriptor through ``privatize``, PeFLL's labelled descriptor).

    ``epsilon``: ``None`` (the release is not private, recorded with epsilon = infinity) or a finite epsilon > 0 for
    the one release; ``delta``; ``bound``: the L2 radius each record's contribution is clipped to; ``noise``:
    ``"secure"`` or ``"seeded"`` (from ``noise_seed``, reproducible research runs only).
    """

    epsilon: float | None = None
    delta: float = 1e-5
    bound: float = 1.0
    noise: NoiseSource = "secure"
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if self.epsilon is not None:
            check_epsilon_target(self.epsilon, "novel epsilon")
        check_delta(self.delta, "novel delta")
        check.positive(self.bound, "novel bound")
        check.choice(self.noise, "novel noise", NOISE_SOURCES)
        check.integer(self.noise_seed, "novel noise_seed", 0)

    @property
    def private(self) -> bool:
        return self.epsilon is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> NovelPrivacy:
        return _from_dict(cls, values or {}, "novel_privacy")


_Settings = TypeVar("_Settings", TrainingPrivacy, NovelPrivacy)


def _from_dict(cls: type[_Settings], values: object, what: str) -> _Settings:
    if not isinstance(values, dict):
        raise ConfigError(f"{what} must be a mapping of its settings, got {values!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown {what} setting(s) {', '.join(unknown)}; valid settings: {', '.join(names)}")
    return cls(**values)


def delta_meaning(delta: float, count: int, what: str) -> str | None:
    """What a guarantee at ``delta`` means when it protects one of ``count`` units (``what``: records of a client,
    clients), where ``delta >= 1 / count``: a mechanism that publishes one unit chosen at random, outright, is
    (0, 1/count)-DP, so such a delta admits releases that expose a unit whole. ``None`` for a smaller delta.

    >>> delta_meaning(1e-5, 100, "training clients") is None
    True
    """
    if delta < 1.0 / count:
        return None
    return (f"delta={delta:g} is at least 1/{count} (one over the {count} {what}): at that delta a mechanism that "
            f"publishes one of the {what} chosen at random, outright, is (0, 1/{count})-DP, so an (epsilon, "
            f"{delta:g}) guarantee does not keep any one of them from being exposed whole")


# -- calibration ------------------------------------------------------------------------------------------------------


def _no_noise_error(privacy: TrainingPrivacy) -> ConfigError:
    return ConfigError(f"privacy mode {privacy.mode!r} with neither epsilon nor noise_multiplier has no noise to "
                       "calibrate; set exactly one of them")


def _calibrate(event_at: Callable[[float], PrivacyEvent], privacy: TrainingPrivacy, what: str) -> float:
    """The least noise multiplier for which ``event_at(z)`` meets the privacy target (by PLD); a target that cannot
    be calibrated (:func:`~accounting.calibration.calibrate_noise_multiplier` says why) is a :class:`ConfigError`."""
    if privacy.epsilon is None:
        raise _no_noise_error(privacy)
    try:
        return calibrate_noise_multiplier(event_at, privacy.epsilon, privacy.delta, what=what)
    except ValueError as error:
        raise ConfigError(f"privacy mode {privacy.mode!r}: {error}") from None


def record_sampling_rate(privacy: TrainingPrivacy, batch_size: int) -> float:
    """Record level: q, the public Poisson rate of every DP-SGD step of every training client: ``sampling_rate``
    when set, else ``min(1, batch_size / min_samples)``. Never a function of a client's own record count: under
    add/remove-one n is private, and a rate ``batch_size / n`` would differ between neighbours (n and n + 1).

    >>> record_sampling_rate(TrainingPrivacy(mode="record", epsilon=1.0, min_samples=200), 64)
    0.32
    """
    check.integer(batch_size, "batch_size", 1)
    if privacy.sampling_rate is not None:
        return float(privacy.sampling_rate)
    return min(1.0, batch_size / privacy.min_samples)


def record_steps_for_epochs(epochs: int, sampling_rate: float) -> int:
    """Record level: the DP-SGD steps of ``epochs`` passes at the public rate q, ``ceil(epochs / q)`` (a pass is
    1/q steps in expectation whatever n is; counting a pass as ``ceil(n / batch)`` steps would make the step count,
    and so the event, a function of the private n).

    >>> record_steps_for_epochs(2, 0.32)
    7
    """
    check.integer(epochs, "epochs", 1)
    return math.ceil(epochs / sampling_rate - 1e-9)


def record_noise_multiplier(privacy: TrainingPrivacy, round_event: Callable[[float], PrivacyEvent],
                            participations: int) -> float:
    """Record level: the noise multiplier z of every mechanism of a client's round.

    With ``privacy.noise_multiplier`` it is that value. With ``privacy.epsilon`` it is the least z for which
    ``participations`` rounds of ``round_event(z)`` (the client's every release of one round, as its procedure
    declares it from public quantities only) compose to (epsilon, delta) by PLD. The same z for every client of a
    run: nothing here reads a client's data or size.
    """
    if privacy.noise_multiplier is not None:
        return float(privacy.noise_multiplier)
    check.integer(participations, "participations", 1)
    return _calibrate(lambda z: SelfComposedEvent(round_event(z), participations), privacy,
                      f"{participations} rounds of a training client's releases")


def stage_clips(clip: float, stages: int, shares: tuple[float, ...] | None = None) -> tuple[float, ...]:
    """C_s for each stage of a round, with sum_s C_s^2 = C^2: equal (C / sqrt(S)) unless the method gives the shares
    w_s (summing to 1) of the squared clip, C_s = C sqrt(w_s)."""
    check.positive(clip, "clip")
    check.integer(stages, "stages", 1)
    if shares is None:
        shares = (1.0 / stages,) * stages
    if len(shares) != stages or any(not is_finite(w) or w <= 0 for w in shares) or abs(sum(shares) - 1) > 1e-9:
        raise ConfigError(f"stage clip shares must be {stages} numbers > 0 summing to 1, got {shares!r}")
    return tuple(clip * math.sqrt(w) for w in shares)


@dataclass(frozen=True)
class ClientLevelNoise:
    """The noise of the local and distributed modes: sigma for a round's sum (or a client's own releases), each
    stage's clip, and the events the ledger records, calibrated over ``participations`` rounds.

    The event recorded per stage is the sum's (what the guarantee is about): ``GaussianEvent(sigma, 2 C_s)`` under
    replace-one (one client's whole dataset). In distributed mode each client adds ``sigma / sqrt(shares)``.
    """

    sigma: float
    clips: tuple[float, ...]
    participations: int
    shares: int
    delta: float

    @property
    def share_sigma(self) -> float:
        return self.sigma / math.sqrt(self.shares)

    def stage_event(self, stage: int) -> GaussianEvent:
        return GaussianEvent(sigma=self.sigma, sensitivity=2.0 * self.clips[stage],
                             relation=NeighboringRelation.REPLACE_ONE)

    def round_event(self) -> ComposedEvent:
        return ComposedEvent(tuple(self.stage_event(s) for s in range(len(self.clips))))

    @functools.cached_property
    def lifetime_epsilon(self) -> float:
        """PLD's epsilon of ``participations`` full rounds: what each release is calibrated for."""
        return accounting_epsilon(SelfComposedEvent(self.round_event(), self.participations), self.delta)


def client_level_noise(privacy: TrainingPrivacy, *, stages: int, participations: int, shares: int = 1,
                       stage_shares: tuple[float, ...] | None = None) -> ClientLevelNoise:
    """Local and distributed modes: calibrate sigma for ``participations`` rounds of ``stages`` releases each (see
    the module docstring). With ``privacy.epsilon`` sigma is the analytic Gaussian sigma for sensitivity
    2 C sqrt(participations); with ``privacy.noise_multiplier`` it is z * 2 C."""
    check.integer(participations, "participations", 1)
    check.integer(shares, "shares", 1)
    clip = float(privacy.clip)
    if privacy.epsilon is not None:
        sigma = analytic_gaussian_sigma(privacy.epsilon, privacy.delta, 2.0 * clip * math.sqrt(participations))
    elif privacy.noise_multiplier is not None:
        sigma = float(privacy.noise_multiplier) * 2.0 * clip
    else:
        raise _no_noise_error(privacy)
    return ClientLevelNoise(sigma=sigma, clips=stage_clips(clip, stages, stage_shares),
                            participations=participations, shares=shares, delta=privacy.delta)


def share_epsilon(noise: ClientLevelNoise) -> float:
    """Distributed mode: the epsilon one client's ``participations`` rounds of shares buy against an observer of the
    shares themselves (no secure aggregation), at the noise's delta."""
    share = ComposedEvent(tuple(GaussianEvent(sigma=noise.share_sigma, sensitivity=2.0 * c,
                                              relation=NeighboringRelation.REPLACE_ONE) for c in noise.clips))
    return accounting_epsilon(SelfComposedEvent(share, noise.participations), noise.delta)


def dp_sgd_round_event(noise_multiplier: float, sampling_rate: float, steps: int) -> SelfComposedEvent:
    """Record level: one DP-SGD fit, ``steps`` Poisson-subsampled Gaussian steps at public rate ``sampling_rate``."""
    return SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, sampling_rate), steps)


def central_round_event(noise_multiplier: float, sampling_probability: float) -> SubsampledGaussianEvent:
    """Central mode: one round as every client's ledger records it (Poisson sampling, add or remove one client)."""
    return SubsampledGaussianEvent(noise_multiplier, sampling_probability)


@functools.lru_cache(maxsize=32)
def central_noise_multiplier(privacy: TrainingPrivacy, *, sampling_probability: float, rounds: int) -> float:
    """Central mode: z of the round's release (count and update together, see the module docstring): the given
    ``noise_multiplier``, or the least z for which ``rounds`` Poisson-subsampled Gaussian rounds at q compose to
    (epsilon, delta). Remembered: the run's plan and its aggregator ask for the same one."""
    if privacy.noise_multiplier is not None:
        return float(privacy.noise_multiplier)
    check.integer(rounds, "rounds", 1)
    return _calibrate(lambda z: SelfComposedEvent(central_round_event(z, sampling_probability), rounds), privacy,
                      f"{rounds} rounds at client sampling rate {sampling_probability!r}")


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """Adaptive clipping: the update sum's noise multiplier z_update for a round of total noise multiplier z whose
    count (sensitivity 1/2) gets noise ``count_noise`` (sigma_b): z_update = (z^-2 - (2 sigma_b)^-2)^-1/2 (Andrew et
    al. 2021, Theorem 1). Refused when the count alone would spend the round's budget (z >= 2 sigma_b)."""
    check.positive(noise_multiplier, "noise_multiplier")
    check.positive(count_noise, "clip_count_noise")
    rest = noise_multiplier ** -2 - (2.0 * count_noise) ** -2
    if rest <= 0:
        raise ConfigError(f"adaptive clipping with clip_count_noise={count_noise:g} spends the whole round's budget "
                          f"on the clip count (it needs clip_count_noise > noise_multiplier / 2 = "
                          f"{noise_multiplier / 2:g}); raise clip_count_noise or use a fixed clip")
    return cast(float, rest ** -0.5)   # float ** float is typed Any (a complex for a base < 0); here rest > 0


def joint_noise_multiplier(update: float, count_noise: float) -> float:
    """The inverse of :func:`update_noise_multiplier`: the round's z from z_update and sigma_b."""
    return cast(float, (update ** -2 + (2.0 * count_noise) ** -2) ** -0.5)   # base: a sum of inverse squares, > 0


__all__ = [
    "ADAPTIVE", "CENTRAL", "CLIENT_LEVEL", "DISTRIBUTED", "LOCAL", "MODES", "RECORD", "RELATIONS",
    "ClientLevelNoise", "NovelPrivacy", "TrainingPrivacy", "central_noise_multiplier", "central_round_event",
    "dp_sgd_round_event",
    "check_delta", "check_epsilon_target", "check_noise_multiplier", "delta_meaning",
    "client_level_noise", "joint_noise_multiplier", "record_noise_multiplier", "record_sampling_rate",
    "record_steps_for_epochs", "share_epsilon",
    "stage_clips", "update_noise_multiplier",
]
