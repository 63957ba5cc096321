"""DP-FedPFT: a differentially private release of one Gaussian per class of a client's (feature, label) data.

The client releases, for every class c, a mean, a covariance (``"full"``, ``"diag"`` or ``"spherical"``) and a count;
the server draws synthetic features from the released Gaussians (:func:`sample_features`) and trains a head on them.
The sensitivities are derived from the per-class counts, one analytic Gaussian is calibrated jointly over the
released blocks, delta is a public input, counts are noised or declared public, and mixtures (K > 1) are refused
(fixing Beitollahi et al., Theorem 4.1; docs/papers.md, FedPFT, E1-E9).

Entry points: :func:`release_class_gaussians` (returns a :class:`DPGaussianRelease`), :func:`sample_features`,
:func:`release_event` (the event a release records, from its settings alone); the pieces
:func:`block_sensitivities`, :func:`calibrate_blocks`, :func:`clipped_class_sums`, :func:`check_data`.

The privacy argument (per-record bounds, neighbouring relations, joint calibration, post-processing, empty classes,
order of operations): docs/privacy.md, "DP-GMM: the DP-FedPFT release".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from accounting import GaussianEvent, NeighboringRelation, PrivacyLedger
from accounting.validation import is_finite
from privfl.errors import ConfigError
from privfl.privacy.mechanisms import GaussianMechanism, NoiseSource, check_epsilon_delta, check_noise
from privfl.privacy.sensitivity import check_bound, check_relation

PURPOSE = "dp_gmm"
CovarianceType = Literal["full", "diag", "spherical"]
CountsMode = Literal["noisy", "public"]
Projection = Literal["ball", "sphere"]
COVARIANCE_TYPES = ("full", "diag", "spherical")
COUNTS_MODES = ("noisy", "public")
PROJECTIONS = ("ball", "sphere")
_SQRT2 = math.sqrt(2.0)


# ---------------------------------------------------------------------------------------------------------------------
# Sensitivities.


@dataclass(frozen=True)
class BlockSensitivities:
    """L2 sensitivities of the three released per-client blocks (over all classes at once), and why they hold.

    Attributes:
        sum: of ``(S1_c)_c``, the per-class sums of clipped features.
        second_moment_sum: of ``(S2_c)_c`` (Frobenius for ``"full"``); ``None`` when S2 is a function of the counts
            (spherical covariance on the sphere: ``S2_c = n_c B^2``) and is not released.
        count: of ``(n_c)_c``; ``None`` when counts are public (not noised).
        argument: the written argument (see the module docstring).
    """

    sum: float
    second_moment_sum: float | None
    count: float | None
    argument: str

    def blocks(self) -> dict[str, float]:
        """The released blocks and their sensitivities, in release order (``sum``, ``second_moment_sum``, ``count``)."""
        named = {"sum": self.sum, "second_moment_sum": self.second_moment_sum, "count": self.count}
        return {name: value for name, value in named.items() if value is not None}

    def per_class(self, n_c: int) -> tuple[float, float | None]:
        """(mean, second moment) sensitivities for a class of public size ``n_c``: the sum sensitivities / n_c."""
        n_c = _check_positive_int("n_c", n_c)
        return self.sum / n_c, None if self.second_moment_sum is None else self.second_moment_sum / n_c


def block_sensitivities(*, bound: float, covariance: CovarianceType = "full",
                        relation: NeighboringRelation | str = "replace_one",
                        counts: CountsMode = "noisy", project: Projection = "ball") -> BlockSensitivities:
    """The L2 sensitivities of the per-class sums of clipped features, of second moments and of counts.

    See the module docstring for the argument. ``counts="public"`` requires ``relation="replace_one"`` and means
    replace-one within the public class histogram. ``project="sphere"`` with spherical covariance has no second-moment
    block (``S2_c = n_c B^2`` follows from the counts).

    >>> s = block_sensitivities(bound=1.0, covariance="full", relation="replace_one", counts="public")
    >>> s.per_class(50)[0]
    0.04
    >>> block_sensitivities(bound=1.0, covariance="spherical", counts="public", project="sphere").blocks()
    {'sum': 2.0}
    """
    bound = check_bound(bound)
    covariance = _check_choice("covariance", covariance, COVARIANCE_TYPES)
    counts = _check_choice("counts", counts, COUNTS_MODES)
    project = _check_choice("project", project, PROJECTIONS)
    relation = check_relation(relation)
    sens = _block_sensitivities(bound, covariance, relation, counts)
    if covariance == "spherical" and project == "sphere":
        sens = BlockSensitivities(
            sum=sens.sum, second_moment_sum=None, count=sens.count,
            argument=sens.argument + "; spherical on the sphere: ||v||^2 = B^2 for every record, so S2_c = n_c B^2 "
                                     "is a function of the (public or noisy) counts and is not released")
    return sens


def _block_sensitivities(bound: float, covariance: str, relation: NeighboringRelation,
                         counts: str) -> BlockSensitivities:
    b2 = bound * bound
    if counts == "public":
        if relation is not NeighboringRelation.REPLACE_ONE:
            raise ConfigError("counts='public' needs relation='replace_one': under add_or_remove_one the class counts "
                              "n_c are private (adding a record changes one), so they cannot be sent in the clear nor "
                              "set the noise scale; use counts='noisy'")
        second = b2 if covariance == "spherical" else _SQRT2 * b2
        return BlockSensitivities(
            sum=2.0 * bound, second_moment_sum=second, count=None,
            argument=("replace-one within the public class histogram (the replaced record keeps its label, one class "
                      f"changes): ||v - w|| <= 2B; second moment ({covariance}) "
                      + ("|  ||v||^2 - ||w||^2 | <= B^2" if covariance == "spherical"
                         else "||vv^T - ww^T||_F^2 <= ||v||^4 + ||w||^4 <= 2B^4") + "; counts public, not noised"))
    if relation is NeighboringRelation.ADD_OR_REMOVE_ONE:
        return BlockSensitivities(
            sum=bound, second_moment_sum=b2, count=1.0,
            argument=("add/remove-one: one record is in one class; ||v|| <= B, ||second moment of v|| <= ||v||^2 <= "
                      "B^2, count moves by 1; other classes unchanged (parallel composition across classes)"))
    return BlockSensitivities(
        sum=2.0 * bound, second_moment_sum=_SQRT2 * b2, count=_SQRT2,
        argument=("replace-one, label may change: same label -> one class moves by (2B, sqrt2 B^2 [spherical B^2], 0); "
                  "label change -> class y loses v, class y' gains w: (sqrt(||v||^2+||w||^2) <= sqrt2 B, "
                  "sqrt(||v||^4+||w||^4) <= sqrt2 B^2, sqrt2); per-block maxima (2B, sqrt2 B^2, sqrt2)"))


# ---------------------------------------------------------------------------------------------------------------------
# Joint calibration.


class BlockCalibration:
    """One Gaussian mechanism over several released blocks, each scaled to unit sensitivity (see the module docstring).

    Block b (sensitivity ``Delta_b``) is released as ``Delta_b * (value_b / Delta_b + N(0, sigma^2 I))`` where sigma is
    the analytic-Gaussian sigma of ``(epsilon, delta)`` at the joint sensitivity ``sqrt(k)``: the k blocks together are
    one ``(epsilon, delta)``-DP Gaussian release, recorded as the single :attr:`event`.

    >>> cal = calibrate_blocks(epsilon=1.0, delta=1e-5, sensitivities={"sum": 2.0, "second_moment_sum": 2 ** 0.5})
    >>> round(cal.joint_sensitivity ** 2, 12), round(cal.sigmas["sum"] / cal.sigmas["second_moment_sum"], 12)
    (2.0, 1.414213562373)
    """

    def __init__(self, mechanism: GaussianMechanism, sensitivities: dict[str, float]) -> None:
        self.mechanism = mechanism
        self.sensitivities = dict(sensitivities)

    @property
    def joint_sensitivity(self) -> float:
        """``sqrt(k)``: the L2 sensitivity of the concatenated unit-scaled blocks."""
        return self.mechanism.sensitivity

    @property
    def sigmas(self) -> dict[str, float]:
        """The noise standard deviation each block carries in its own units, ``Delta_b * sigma``."""
        return {name: value * self.mechanism.sigma for name, value in self.sensitivities.items()}

    @property
    def event(self) -> GaussianEvent:
        """The accounting event of the whole release (one Gaussian, sensitivity ``sqrt(k)``)."""
        return self.mechanism.event

    def add_noise(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Block ``name`` plus its share of the joint Gaussian: ``Delta_b * (value / Delta_b + N(0, sigma^2 I))``."""
        scale = self.sensitivities[name]
        return scale * self.mechanism.add_noise(value / scale)


def calibrate_blocks(*, epsilon: float, delta: float, sensitivities: Mapping[str, float],
                     relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
                     noise: NoiseSource | None = None, generator: torch.Generator | None = None) -> BlockCalibration:
    """Calibrate one Gaussian for blocks released together so that the whole release is ``(epsilon, delta)``-DP.

    Args (keyword-only):
        epsilon, delta: the budget of the whole release (natural log; a probability).
        sensitivities: each block's own L2 sensitivity under ``relation`` (derived from the structure, e.g. by
            :func:`block_sensitivities`), all > 0.
        relation, noise, generator: as for :class:`~privfl.privacy.mechanisms.GaussianMechanism`.
    """
    if not sensitivities:
        raise ConfigError("calibrate_blocks needs at least one block")
    for name, value in sensitivities.items():
        if not is_finite(value) or value <= 0:
            raise ConfigError(f"sensitivity of block {name!r} must be a finite number > 0, got {value!r}")
    mechanism = GaussianMechanism(epsilon=epsilon, delta=delta, sensitivity=math.sqrt(len(sensitivities)),
                                  relation=relation, noise=noise, generator=generator)
    return BlockCalibration(mechanism, {name: float(value) for name, value in sensitivities.items()})


# ---------------------------------------------------------------------------------------------------------------------
# The release.


@dataclass(frozen=True)
class DPClassGaussian:
    """What the server receives for one class.

    Attributes:
        label: the class index.
        count: the public count (an int) or the noisy count (a float, possibly <= 0).
        mean: ``[d]`` float64, or ``None`` for a class with public count 0.
        covariance: PSD, in the ``covariance_type``'s form: ``[d, d]`` (full), ``[d]`` variances (diag), a 0-d
            tensor (spherical, one variance for all coordinates); ``None`` with ``mean``.
    """

    label: int
    count: float
    mean: torch.Tensor | None
    covariance: torch.Tensor | None

    @property
    def released(self) -> bool:
        return self.mean is not None


@dataclass(frozen=True)
class DPGaussianRelease:
    """A client's DP-FedPFT message: one Gaussian per class, how it was privatised, and its accounting event.

    ``sigmas``: the noise standard deviation of each block in its own units (``"second_moment_sum"`` is 0.0 when that
    block follows from the counts and is not released); ``event``: the one Gaussian event of the whole message (what
    the ledger records).
    """

    classes: tuple[DPClassGaussian, ...]
    covariance_type: CovarianceType
    counts: CountsMode
    relation: NeighboringRelation
    epsilon: float
    delta: float
    bound: float
    dim: int
    sensitivities: BlockSensitivities
    sigmas: dict[str, float]
    event: GaussianEvent
    project: Projection = "ball"

    def covariance_matrix(self, label: int) -> torch.Tensor:
        """The full ``[d, d]`` covariance of class ``label`` (diag / spherical expanded)."""
        return _as_matrix(self.classes[label].covariance, self.covariance_type, self.dim)

    def metadata(self) -> dict[str, Any]:
        """The JSON-able description recorded with the ledger entry."""
        return _metadata(self.covariance_type, self.counts, self.relation, self.epsilon, self.delta, self.bound,
                         self.dim, len(self.classes), self.sensitivities, self.sigmas, self.project,
                         self.event.sensitivity, self.event.sigma)


def _metadata(covariance: str, counts: str, relation: NeighboringRelation, epsilon: float, delta: float, bound: float,
              dim: int, num_classes: int, sens: BlockSensitivities, sigmas: dict[str, float], project: str,
              joint_sensitivity: float, joint_sigma: float) -> dict[str, Any]:
    public = counts == "public"
    released = list(sens.blocks())
    return {
        "mechanism": "Gaussian on per-class clipped sums (" + ", ".join(
            {"sum": "S1", "second_moment_sum": "S2", "count": "n"}[b] for b in released) + ")",
        "covariance_type": covariance, "components": 1, "num_classes": num_classes, "dim": dim, "bound": bound,
        "project": project, "epsilon": epsilon, "delta": delta,
        "blocks": released, "second_moment_from_counts": sens.second_moment_sum is None,
        "budget_split": ("joint: each block scaled to unit sensitivity, one analytic Gaussian of sensitivity "
                         f"sqrt({len(released)})"),
        "joint_sensitivity": joint_sensitivity, "joint_sigma": joint_sigma,
        "counts_public": public,
        # the neighbours in words (the event carries the relation itself): the run summary lists these
        "relation": ("replace_one within the public class histogram (labels of replaced records unchanged)"
                     if public else relation.value + " (labels may change; all classes released)"),
        "sensitivities": {"sum": sens.sum, "second_moment_sum": sens.second_moment_sum, "count": sens.count},
        "sensitivity_argument": sens.argument,
        "sigmas": dict(sigmas),
        "calibration": "analytic Gaussian (Balle and Wang 2018) on the unit-scaled blocks jointly",
    }


def clipped_class_sums(features: Any, labels: Any, *, num_classes: int, bound: float,
                       covariance: CovarianceType = "full",
                       project: Projection = "ball") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact (noise-free, never sent) per-class sums of projected features: ``(S1 [C, d], S2, counts [C])``.

    ``S2`` is ``[C, d, d]`` (full), ``[C, d]`` (diag) or ``[C]`` (spherical). Raises :class:`ConfigError` on NaN/inf
    features, labels outside ``[0, num_classes)`` or mismatched shapes.
    """
    x, y = check_data(features, labels, num_classes)
    bound = check_bound(bound)
    covariance = _check_choice("covariance", covariance, COVARIANCE_TYPES)
    project = _check_choice("project", project, PROJECTIONS)
    return _class_sums(_project(x, bound, project), y, num_classes, covariance)


def release_event(*, epsilon: float, delta: float, bound: float, covariance: CovarianceType = "full",
                  relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE, counts: CountsMode = "noisy",
                  project: Projection = "ball") -> GaussianEvent:
    """The one Gaussian event :func:`release_class_gaussians` records with these settings, from the settings alone
    (the blocks' sensitivities follow from the structure; no record enters): what a plan prices before the release."""
    relation = check_relation(relation)
    sens = block_sensitivities(bound=bound, covariance=covariance, relation=relation, counts=counts, project=project)
    return calibrate_blocks(epsilon=epsilon, delta=delta, sensitivities=sens.blocks(), relation=relation).event


def release_class_gaussians(features: Any, labels: Any, *, num_classes: int, epsilon: float, delta: float,
                            bound: float, covariance: CovarianceType = "full", components: int = 1,
                            counts: CountsMode = "noisy", relation: NeighboringRelation | str = "replace_one",
                            ledger: PrivacyLedger | None = None, generator: torch.Generator | None = None,
                            noise: NoiseSource | None = None, eigenvalue_floor: float | None = None,
                            round: int | None = None, project: Projection = "ball") -> DPGaussianRelease:
    """One (epsilon, delta)-DP release of a Gaussian per class (DP-FedPFT, K = 1; docs/privacy.md, "DP-GMM").

    Args:
        features: ``[n, d]`` real array or tensor; every entry finite.
        labels: ``[n]`` integers in ``[0, num_classes)``.
        num_classes: C, public.
        epsilon, delta: the client's budget for this whole message (natural log; delta a probability, public,
            ``<< 1/n`` — never ``1/n_c``).
        bound: L2 radius B of each feature (see ``project``).
        covariance: ``"full"``, ``"diag"`` or ``"spherical"``.
        components: must be 1. EM-fitted mixtures (K > 1) are refused: EM iterations, initialisation and component
            assignment all touch the data and none of it is covered by this mechanism (the paper's Theorem 4.1 only
            covers K = 1).
        counts: ``"noisy"`` (counts get Gaussian noise and are used downstream) or ``"public"`` (sent in the clear;
            only with ``relation="replace_one"``, meaning replace-one within the public class histogram).
        relation: the neighbouring relation of the guarantee.
        ledger: the client's ledger; the composed event is recorded (purpose ``"dp_gmm"``) before any noise is drawn.
        generator, noise: the noise source (see :class:`~privfl.privacy.mechanisms.GaussianMechanism`).
        eigenvalue_floor: smallest eigenvalue (variance) kept by the PSD projection; default ``1e-6 * bound^2``.
        round: the round recorded in the ledger.
        project: ``"ball"`` (clip each feature to norm <= B) or ``"sphere"`` (scale each to norm exactly B; for
            features that are already L2-normalised, as FedPFT's are, this changes nothing, and spherical covariance
            then releases no second-moment block).

    Raises:
        ConfigError: bad configuration, NaN/inf features, ``components != 1``; nothing recorded.
        accounting.BudgetExceededError: the ledger's budget would be exceeded; nothing recorded or released.

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(100, 3, generator=g); y = torch.arange(100) % 2
    >>> r = release_class_gaussians(x, y, num_classes=2, epsilon=1.0, delta=1e-5, bound=1.0, generator=g)
    >>> [c.label for c in r.classes], r.classes[0].covariance.shape
    ([0, 1], torch.Size([3, 3]))
    """
    # 1. Validate everything; nothing is recorded on failure.
    _check_one_component(components)
    epsilon, delta = check_epsilon_delta(epsilon, delta)
    noise = check_noise(noise, generator)
    relation = check_relation(relation)
    sens = block_sensitivities(bound=bound, covariance=covariance, relation=relation, counts=counts, project=project)
    bound = float(bound)
    x, y = check_data(features, labels, num_classes)
    floor = _eigenvalue_floor(eigenvalue_floor, bound)
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise ConfigError(f"ledger must be an accounting.PrivacyLedger or None, got {ledger!r}")

    # 2. One analytic Gaussian over the unit-scaled released blocks, at the whole (epsilon, delta).
    calibration = calibrate_blocks(epsilon=epsilon, delta=delta, sensitivities=sens.blocks(), relation=relation,
                                   noise=noise, generator=generator)
    sigmas = _released_sigmas(calibration)

    # 3. Exact sums of the projected features (nothing leaves the client yet).
    s1, s2, n = _class_sums(_project(x, bound, project), y, num_classes, covariance)

    # 4. Record before any noise exists; a budget refusal raises here and nothing is released.
    if ledger is not None:
        ledger.record(calibration.event, purpose=PURPOSE, round=round,
                      metadata=_metadata(covariance, counts, relation, epsilon, delta, bound, x.shape[1], num_classes,
                                         sens, sigmas, project, calibration.joint_sensitivity,
                                         calibration.mechanism.sigma))

    # 5. Noise on every released block of every class.
    noisy_s1 = calibration.add_noise("sum", s1)
    noisy_n = calibration.add_noise("count", n) if counts == "noisy" else n
    # spherical on the sphere: S2_c = n_c B^2, so S2_c / n_c = B^2 exactly, and no block is released
    noisy_s2 = None if sens.second_moment_sum is None else calibration.add_noise("second_moment_sum", s2)

    # 6. Post-processing.
    classes = _class_gaussians(noisy_s1, noisy_s2, noisy_n, n, counts=counts, covariance=covariance, bound=bound,
                               floor=floor, dim=x.shape[1])
    return DPGaussianRelease(classes=classes, covariance_type=covariance, counts=counts, relation=relation,
                             epsilon=epsilon, delta=delta, bound=bound, dim=x.shape[1], sensitivities=sens,
                             sigmas=sigmas, event=calibration.event, project=project)



def _check_one_component(components: int) -> None:
    """Refuse EM-fitted mixtures (K > 1): nothing in this mechanism covers EM."""
    components = _check_positive_int("components", components)
    if components != 1:
        raise ConfigError(f"components={components}: EM-fitted Gaussian mixtures (K > 1) are not differentially "
                          "private (EM iterations, k-means initialisation and component assignment all use the data; "
                          "the DP-FedPFT theorem covers K = 1 only). Use components=1, or a DP-EM with its own "
                          "per-iteration accounting")


def _eigenvalue_floor(eigenvalue_floor: float | None, bound: float) -> float:
    """The PSD projection's smallest variance: ``eigenvalue_floor``, by default ``1e-6 * bound^2``; checked > 0."""
    floor = 1e-6 * bound * bound if eigenvalue_floor is None else eigenvalue_floor
    if not is_finite(floor) or floor <= 0:
        raise ConfigError(f"eigenvalue_floor must be a finite number > 0, got {eigenvalue_floor!r}")
    return floor


def _released_sigmas(calibration: BlockCalibration) -> dict[str, float]:
    """The noise standard deviation of each block (0 for a second moment that follows from the counts)."""
    return {"sum": calibration.sigmas["sum"],
            "second_moment_sum": calibration.sigmas.get("second_moment_sum", 0.0),  # 0: follows from the counts
            **({"count": calibration.sigmas["count"]} if "count" in calibration.sigmas else {})}


def _class_gaussians(noisy_s1: torch.Tensor, noisy_s2: torch.Tensor | None, noisy_n: torch.Tensor, n: torch.Tensor,
                     *, counts: CountsMode, covariance: CovarianceType, bound: float, floor: float,
                     dim: int) -> tuple[DPClassGaussian, ...]:
    """Post-processing of the noisy blocks (no privacy cost): each class's mean (projected back into the B-ball)
    and PSD covariance; with public counts a class with no records has neither."""
    classes = []
    for c in range(len(n)):
        if counts == "public" and int(n[c]) == 0:
            classes.append(DPClassGaussian(label=c, count=0, mean=None, covariance=None))
            continue
        divisor = float(n[c]) if counts == "public" else max(float(noisy_n[c]), 1.0)
        mean = noisy_s1[c] / divisor
        norm = float(torch.linalg.vector_norm(mean))
        if norm > bound:
            mean = mean * (bound / norm)
        second = torch.tensor(bound * bound, dtype=torch.float64) if noisy_s2 is None else noisy_s2[c] / divisor
        cov = _covariance_from_moments(second, mean, covariance, dim, floor)
        count = int(n[c]) if counts == "public" else float(noisy_n[c])
        classes.append(DPClassGaussian(label=c, count=count, mean=mean, covariance=cov))
    return tuple(classes)

def sample_features(release: DPGaussianRelease, num_per_class: int | Sequence[int] | Mapping[int, int] | None = None,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic ``(features [m, d], labels [m])`` drawn from the released Gaussians (the server's side).

    ``num_per_class``: an int for every class, a sequence / mapping per class, or ``None`` for the released counts
    (public counts as they are; noisy counts as ``max(0, round(n~_c))``). Classes that were not released (public
    count 0) give no samples. Pure post-processing of the release: no privacy cost.
    """
    if not isinstance(release, DPGaussianRelease):
        raise ConfigError(f"release must be a DPGaussianRelease, got {type(release).__name__}")
    num_classes = len(release.classes)
    if num_per_class is None:
        wanted = [max(0, int(round(float(c.count)))) for c in release.classes]
    elif isinstance(num_per_class, bool):
        raise ConfigError(f"num_per_class must be an int, a sequence or mapping of ints per class, or None, got "
                          f"{num_per_class!r}")
    elif isinstance(num_per_class, (int, numbers.Integral)):   # int too: typeshed does not make int an Integral
        wanted = [int(num_per_class)] * num_classes
    elif isinstance(num_per_class, Mapping):
        wanted = [int(num_per_class.get(c, 0)) for c in range(num_classes)]
    else:
        wanted = [int(v) for v in num_per_class]
        if len(wanted) != num_classes:
            raise ConfigError(f"num_per_class has {len(wanted)} entries for {num_classes} classes")
    if any(w < 0 for w in wanted):
        raise ConfigError(f"num_per_class must be >= 0, got {wanted}")
    xs, ys = [], []
    for cls, m in zip(release.classes, wanted):
        if m == 0 or not cls.released:
            continue
        cov = _as_matrix(cls.covariance, release.covariance_type, release.dim)
        eigenvalues, eigenvectors = torch.linalg.eigh(cov)
        root = eigenvectors * eigenvalues.clamp_min(0.0).sqrt()
        z = torch.randn(m, release.dim, generator=generator, dtype=torch.float64)
        xs.append(cls.mean + z @ root.T)
        ys.append(torch.full((m,), cls.label, dtype=torch.long))
    if not xs:
        return torch.zeros(0, release.dim, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.cat(xs), torch.cat(ys)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers.


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> Any:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_data(features: Any, labels: Any, num_classes: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [n, d] float64, labels [n] int64)``, or a ConfigError naming what is wrong: not finite, not
    integer labels, labels outside [0, num_classes), mismatched shapes."""
    num_classes = _check_positive_int("num_classes", num_classes)
    try:
        x = torch.as_tensor(np.asarray(features.detach().cpu() if isinstance(features, torch.Tensor) else features,
                                       dtype=np.float64))
        y_np = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"features must be a real [n, d] array and labels an [n] integer array: {exc}") from None
    if x.ndim != 2 or x.shape[1] < 1:
        raise ConfigError(f"features must have shape [n, d] with d >= 1, got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ConfigError("features contain NaN or inf: their clipped norm, and so the sensitivity, is undefined")
    if y_np.ndim != 1 or y_np.shape[0] != x.shape[0]:
        raise ConfigError(f"labels must have shape [{x.shape[0]}], got {tuple(y_np.shape)}")
    if y_np.size and not (np.issubdtype(y_np.dtype, np.integer)
                          or (np.issubdtype(y_np.dtype, np.floating) and np.all(np.mod(y_np, 1) == 0))):
        raise ConfigError(f"labels must be integers, got dtype {y_np.dtype}")
    y = torch.as_tensor(y_np.astype(np.int64))
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ConfigError(f"labels must lie in [0, {num_classes}), got values in [{int(y.min())}, {int(y.max())}]")
    return x, y


def _project(x: torch.Tensor, bound: float, project: str) -> torch.Tensor:
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    if project == "ball":
        return x * torch.clamp(bound / norms.clamp_min(1e-300), max=1.0)
    v = x * (bound / norms.clamp_min(1e-300))
    zero = norms[:, 0] == 0
    if bool(zero.any()):  # no direction: a fixed point of the sphere that does not depend on the data
        v[zero] = 0.0
        v[zero, 0] = bound
    # rounding can leave ||v|| a few ulps above B; rescale those so the bound holds exactly
    over = torch.linalg.vector_norm(v, dim=1, keepdim=True)
    return torch.where(over > bound, v * (bound / over), v)


def _class_sums(v: torch.Tensor, y: torch.Tensor, num_classes: int,
                covariance: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = v.shape[1]
    onehot = torch.nn.functional.one_hot(y, num_classes).to(torch.float64)  # [n, C]
    s1 = onehot.T @ v
    if covariance == "full":  # V_c^T V_c class by class: [C, d, d], never the [n, d, d] outer products
        s2 = torch.zeros(num_classes, d, d, dtype=torch.float64)
        for c in torch.unique(y).tolist():
            vc = v[y == c]
            s2[c] = vc.T @ vc
    elif covariance == "diag":
        s2 = onehot.T @ (v * v)
    else:
        s2 = onehot.T @ (v * v).sum(dim=1)
    n = onehot.sum(dim=0)
    assert s1.shape == (num_classes, d)
    return s1, s2, n


def _covariance_from_moments(second: torch.Tensor, mean: torch.Tensor, covariance: str, d: int,
                             floor: float) -> torch.Tensor:
    if covariance == "full":
        cov: torch.Tensor = second - torch.outer(mean, mean)   # declared: torch.linalg.eigh's results are untyped
        cov = (cov + cov.T) / 2
        eigenvalues, eigenvectors = torch.linalg.eigh(cov)
        cov = (eigenvectors * eigenvalues.clamp_min(floor)) @ eigenvectors.T
        return (cov + cov.T) / 2
    if covariance == "diag":
        return (second - mean * mean).clamp_min(floor)
    return ((second - mean.dot(mean)) / d).clamp_min(floor)


def _as_matrix(cov: torch.Tensor | None, covariance: str, d: int) -> torch.Tensor:
    if cov is None:
        raise ConfigError("this class was not released (public count 0): it has no covariance")
    if covariance == "full":
        return cov
    if covariance == "diag":
        return torch.diag(cov)
    return cov * torch.eye(d, dtype=cov.dtype)


__all__ = ["COUNTS_MODES", "COVARIANCE_TYPES", "PROJECTIONS", "PURPOSE", "BlockCalibration", "BlockSensitivities",
           "DPClassGaussian", "DPGaussianRelease", "block_sensitivities", "calibrate_blocks", "clipped_class_sums",
           "release_class_gaussians", "release_event", "sample_features"]
