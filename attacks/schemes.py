"""What the defender releases, and how the attacker reads it.

Threat model (FedPFT paper, App. E.1): a defender and an attacker share a frozen backbone ``E``; the defender releases
a function of ``E(D_d)`` through a scheme (raw features, FedPFT mixtures, DP-FedPFT releases), made by the method's
own client procedure and recorded by the wire (:func:`make_release`). The attacker may post-process a mixture release
with its own data (:class:`AttackerPrior`, :func:`postprocess_release`) or read it with the release ignored
(:func:`prior_only_release`); how well it then recovers the images is scored in :mod:`attacks.scoring`.

The schemes, the attacker's post-processing and the row definitions: docs/attacks.md, "Release schemes and
scoring".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from accounting.validation import is_int_at_least
from privfl.errors import ConfigError

if TYPE_CHECKING:
    from privfl.privacy.mechanisms import NoiseSource

__all__ = ["SCHEMES", "AttackerPrior", "Release", "feature_diagnostics", "make_release", "postprocess_release",
           "prior_only_release", "unit_features"]

SCHEMES = ("raw", "fedpft", "dp-fedpft")
#: The defender's client id on the wire (the ledger a release is recorded in).
_DEFENDER = 0


def unit_features(feature_fn: Callable[[Any], Any]) -> Callable[[Any], torch.Tensor]:
    """The embedding ``E``: ``feature_fn`` followed by L2 normalisation of every row (zero rows stay zero)."""
    def embed(images: Any) -> torch.Tensor:
        return _normalise(feature_fn(images))
    return embed


def _normalise(x: Any) -> torch.Tensor:
    f = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    return f / torch.linalg.vector_norm(f, dim=1, keepdim=True).clamp_min(1e-12)


@dataclass(frozen=True)
class Release:
    """What the attacker holds after the defender's release, reduced to feature vectors it can reconstruct from.

    Attributes:
        scheme: ``"raw"``, ``"fedpft"`` or ``"dp-fedpft"``.
        features: ``[m, d]`` float32: the raw features, or the features drawn from the released mixtures.
        labels: ``[m]`` their (released or sampled) labels.
        set_level: True when the features carry no link to individual defender images (mixture releases).
        epsilon: the ledger's epsilon for the recorded release at ``details["ledger"]["delta"]`` (``math.inf``
            when not private).
        postprocessing: ``"none"`` (as delivered, L2-normalised) or the attacker's post-processing
            (:func:`postprocess_release`: ``"lmmse"`` for DP-FedPFT, ``"clip"`` for FedPFT), or ``"prior-only"``
            (:func:`prior_only_release`: the release ignored but for its counts).
        details: how it was made: the ledger record (purpose, metadata, event), the requested epsilon, bytes, set
            size; JSON-able.
        mixtures: the decoded mixtures as the server holds them (empty for raw).
    """

    scheme: str
    features: torch.Tensor
    labels: torch.Tensor
    set_level: bool
    epsilon: float
    postprocessing: str = "none"
    details: dict[str, Any] = field(default_factory=dict)
    mixtures: tuple[Any, ...] = ()

    @property
    def label(self) -> str:
        if self.postprocessing == "prior-only":
            return "prior only (release ignored)"
        if not self.set_level:
            return self.scheme
        return self.scheme + (", post-processed" if self.postprocessing != "none" else ", naive")


def _check_pairs(features: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.as_tensor(np.asarray(features), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"features must be [n, d] (n >= 1) with one label each, got {tuple(x.shape)} and "
                          f"{tuple(y.shape)}")
    if not torch.isfinite(x).all():
        raise ConfigError("features contain NaN or inf")
    return x, y


def make_release(scheme: str, features: Any, labels: Any, *, num_classes: int, epsilon: float | None = None,
                 delta: float = 1e-5, components: int = 10, covariance: str = "diag", seed: int = 0,
                 dp_noise: str = "seeded") -> Release:
    """The defender's release of ``(features, labels)`` under ``scheme``, as the server (and attacker) receives it.

    The release is made by the method's client procedure (FedPFT's :meth:`~privfl.methods.fedpft.FedPFTClient.train`
    for the mixture schemes) and passed through a :class:`~privfl.federation.Wire`, which records it in client 0's
    ledger; the returned :class:`Release` carries the ledger's epsilon and record.

    Args:
        scheme: one of :data:`SCHEMES`.
        features: ``[n, d]`` defender features ``E(D_d)`` (unit norm: see :func:`unit_features`).
        labels: ``[n]`` integer labels in ``[0, num_classes)``.
        num_classes: C.
        epsilon, delta: the DP-FedPFT budget requested for the whole message (natural log; delta public); required
            for ``"dp-fedpft"`` only, refused for the others. ``delta`` is also where the ledger is read.
        components: K of the FedPFT mixtures (DP-FedPFT always uses 1).
        covariance: ``"full"``, ``"diag"`` or ``"spherical"``.
        seed: the run seed of the client's context (EM initialisation), the DP noise seed (with ``dp_noise=
            "seeded"``) and the server-side sampling of synthetic features.
        dp_noise: the DP noise source, :data:`privfl.privacy.mechanisms.NOISE_SOURCES`: ``"seeded"`` (reproducible;
            the defender is simulated), ``"secure"`` (the library default) or ``"hardened"``.
    """
    from privfl.federation import Wire

    if scheme not in SCHEMES:
        raise ConfigError(f"unknown release scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    x, y = _check_pairs(features, labels)
    _check_release_options(scheme, epsilon=epsilon, delta=delta, components=components, dp_noise=dp_noise)
    wire = Wire()
    mixtures: list[Any] = []
    if scheme == "raw":
        out_x, out_y = _send_raw(wire, x, y)
        details: dict[str, Any] = {}
    else:
        out_x, out_y, mixtures, details = _send_mixtures(wire, scheme, x, y, num_classes=num_classes, epsilon=epsilon,
                                                         delta=delta, components=components, covariance=covariance,
                                                         seed=seed, dp_noise=dp_noise)
    ledger = wire.ledgers[_DEFENDER]
    (record,) = ledger.records
    spent = ledger.spent(delta)
    details["ledger"] = {"epsilon": "inf" if math.isinf(spent.epsilon) else spent.epsilon, "delta": spent.delta,
                         "accountant": spent.accountant, "purpose": record.purpose, "round": record.round,
                         "metadata": record.metadata, "event": record.event.to_dict()}
    details["bytes"] = int(wire.bytes_up[_DEFENDER])
    details["set_size"] = int(len(out_x))
    return Release(scheme, out_x, out_y, set_level=scheme != "raw", epsilon=float(spent.epsilon), details=details,
                   mixtures=tuple(mixtures))


def _check_release_options(scheme: str, *, epsilon: float | None, delta: float, components: int,
                           dp_noise: str) -> None:
    """Refuse the options of :func:`make_release` that ``scheme`` cannot take, naming the option."""
    from privfl.privacy.mechanisms import NOISE_SOURCES

    if (scheme == "dp-fedpft") != (epsilon is not None):
        raise ConfigError(f"epsilon is required for scheme 'dp-fedpft' and only for it (scheme {scheme!r}, "
                          f"epsilon {epsilon!r})")
    if not is_int_at_least(components, 1):
        raise ConfigError(f"components must be an integer >= 1, got {components!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ConfigError(f"delta must be a probability in (0, 1), got {delta!r}")
    if dp_noise not in NOISE_SOURCES:
        raise ConfigError(f"dp_noise must be one of {', '.join(NOISE_SOURCES)}, got {dp_noise!r}")


def _send_raw(wire: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw features and labels through ``wire`` as a non-private release; what the server receives."""
    from privfl.federation import Message
    from privfl.federation import Release as WireRelease

    sent = WireRelease.non_private(Message(arrays={"features": x.clone(), "labels": y.clone()}),
                                   purpose="raw_features")
    delivered = wire.client_to_server(_DEFENDER, sent, round=0)
    return delivered.arrays["features"].float(), delivered.arrays["labels"].long()


def _send_mixtures(wire: Any, scheme: str, x: torch.Tensor, y: torch.Tensor, *, num_classes: int,
                   epsilon: float | None, delta: float, components: int, covariance: str, seed: int,
                   dp_noise: str) -> tuple[torch.Tensor, torch.Tensor, list[Any], dict[str, Any]]:
    """FedPFT's client procedure (under record-level DP for ``"dp-fedpft"``) through ``wire``; returns the features
    and labels the server draws from the delivered mixtures, the mixtures and how they were made."""
    from privfl.data import TrainingClient
    from privfl.federation import Message
    from privfl.federation.context import client_context
    from privfl.methods.base import ModelFactory
    from privfl.methods.fedpft import FedPFTClient, FedPFTConfig, decode_mixtures, sample_mixtures
    from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

    private = scheme == "dp-fedpft"
    config = FedPFTConfig(components=1 if private else int(components), covariance=covariance)
    requested = None if epsilon is None else float(epsilon)   # not None exactly when private (make_release checks)
    privacy = TrainingPrivacy(mode="record", epsilon=requested, delta=float(delta),
                              noise=cast("NoiseSource", dp_noise),   # one of NOISE_SOURCES (make_release checks)
                              noise_seed=int(seed)) if private else TrainingPrivacy()
    config.check_privacy(privacy, NovelPrivacy())
    client = FedPFTClient(model_factory=ModelFactory("feature_mlp", (x.shape[1],), num_classes), config=config,
                          privacy=privacy)
    data = TrainingClient(client_id=_DEFENDER, x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])
    with torch.random.fork_rng(devices=[]):  # client_context seeds torch's generator for the client
        ctx = client_context(seed, _DEFENDER, round=0)
        sent = client.train(data, Message(config={"round": 0}), {}, ctx)
    delivered = wire.client_to_server(_DEFENDER, sent, round=0)
    mixtures = decode_mixtures(delivered.arrays, covariance=covariance, floor=config.reg_covar)
    synthetic, synthetic_labels = sample_mixtures(mixtures, np.random.default_rng(seed), floor=config.reg_covar)
    details = {"components": config.components, "covariance": covariance, "reg_covar": config.reg_covar}
    if private:
        details["requested_epsilon"] = requested
    return _normalise(synthetic), torch.as_tensor(synthetic_labels), mixtures, details


# -- the attacker's post-processing ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttackerPrior:
    """What the attacker knows about in-distribution features from its own labelled data (float64).

    Attributes:
        class_counts: ``[C]`` its features per class; a class with fewer than two has no moments (NaN) and a
            release of that class cannot be post-processed.
        class_means: ``[C, d]`` per-class mean feature.
        class_variances: ``[C, d]`` per-class per-dimension variance (population).
        mean, std: ``[d]`` mean and per-dimension standard deviation over all its features (std floored at 1 % of
            its average, as the reconstructor's standardisation does), for :func:`feature_diagnostics`.
        class_eigenvalues, class_eigenvectors: ``[C, d]`` and ``[C, d, d]`` the eigendecomposition of each class's
            full covariance (population), when fitted with ``full_covariance=True``; else ``None``.
    """

    class_counts: torch.Tensor
    class_means: torch.Tensor
    class_variances: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    class_eigenvalues: torch.Tensor | None = None
    class_eigenvectors: torch.Tensor | None = None

    @classmethod
    def fit(cls, features: Any, labels: Any, *, num_classes: int, full_covariance: bool = False) -> AttackerPrior:
        """The moments of the attacker's labelled features; ``full_covariance`` adds each class's covariance
        eigendecomposition (d x d per class), which the post-processing then uses (:func:`postprocess_release`)."""
        x, y = _check_pairs(features, labels)
        x = x.double()
        if int(y.min()) < 0 or int(y.max()) >= num_classes:
            raise ConfigError(f"labels must lie in [0, {num_classes}), got {int(y.min())}..{int(y.max())}")
        counts = torch.bincount(y, minlength=num_classes)
        nan = torch.full((x.shape[1],), math.nan, dtype=torch.float64)
        means = torch.stack([x[y == c].mean(0) if counts[c] >= 2 else nan for c in range(num_classes)])
        variances = torch.stack([x[y == c].var(0, unbiased=False) if counts[c] >= 2 else nan
                                 for c in range(num_classes)])
        std = x.std(0, unbiased=False)
        values = vectors = None
        if full_covariance:
            pairs = []
            for c in range(num_classes):
                if counts[c] >= 2:
                    centred = x[y == c] - means[c]
                    pairs.append(torch.linalg.eigh(centred.T @ centred / int(counts[c])))
                else:
                    pairs.append((nan, torch.full((x.shape[1], x.shape[1]), math.nan, dtype=torch.float64)))
            values = torch.stack([v.clamp_min(0) for v, _ in pairs])
            vectors = torch.stack([u for _, u in pairs])
        return cls(counts, means, variances, x.mean(0), std.clamp_min(max(float(std.mean()) * 1e-2, 1e-12)),
                   values, vectors)


def feature_diagnostics(features: Any, prior: AttackerPrior) -> dict[str, float]:
    """How far ``features`` are from the attacker's own: the RMS of their per-dimension z-scores (about 1 in
    distribution) and the share of negative entries (0 for MobileNetV2 features, which are averaged ReLU6s)."""
    f = torch.as_tensor(np.asarray(features), dtype=torch.float64)
    z = (f - prior.mean) / prior.std
    return {"standardised_rms": float(z.pow(2).mean().sqrt()), "negative_fraction": float((f < 0).double().mean())}


def postprocess_release(release: Release, prior: AttackerPrior, *, seed: int = 0) -> Release:
    """The attacker's post-processing of a mixture release: Bayes (LMMSE) estimates of each class's moments.

    Computed from the release (its means, variances, public counts and the mechanism's public noise scales, which
    the ledger record carries) and the attacker's own data only, so it costs no privacy (post-processing theorem).
    The prior is the threat model's: the defender's data come from the attacker's distribution, so a class's mean
    over n_c defender features is the attacker's class mean plus sampling noise of variance ``var_c / n_c`` per
    dimension. For a DP-FedPFT release, per class c with released mean m, variance v and count n_c:

    1. Undo the release's clipping of the mean to the unit ball: a mean of norm ``bound`` is rescaled to the
       expected norm of the noisy mean, ``sqrt(||mu_c||^2 + d s^2)``, with ``s = sigma_sum / n_c`` its noise std.
    2. Mean: ``mu_c + w (m - mu_c)``, ``w = t / (t + s^2)`` per dimension, ``t = var_c / n_c`` (the LMMSE weight).
       With a full-covariance prior (``AttackerPrior.fit(..., full_covariance=True)``) the same estimate is taken
       along the principal directions of the class instead: ``mu_c + V diag(w_k) V^T (m - mu_c)``,
       ``w_k = (lambda_k / n_c) / (lambda_k / n_c + s^2)`` for the eigenpairs ``(lambda_k, V_k)`` of the class
       covariance (the Gaussian posterior mean of the defender's class mean given the noisy release; Kay 1993,
       Fundamentals of Statistical Signal Processing I, eq. 12.20). The class's variance concentrates in a few
       directions, where the release weighs far more than in any single coordinate.
    3. Variance: ``var_c + u (v - var_c)``, ``u = q / (q + r)``, with ``q = 2 var_c^2 / n_c`` (a sample variance's
       spread) and ``r`` the variance of the release's noise on it: ``(sigma_second / n_c)^2`` (diag) or
       ``(sigma_second / (n_c d))^2`` (spherical). Floored at the release's ``reg_covar``. Spherical covariance on
       the sphere releases no second moment (``sigma_second = 0``): its variance ``(B^2 - ||m||^2) / d`` is a function
       of the noisy, clipped mean m, not a noiseless estimate (at small epsilon m is clipped to norm B and the
       released variance is the floor). Every feature has norm B, so the class's variance is that same function of
       the class mean: it is computed from the estimate of step 2, ``(B^2 - ||mean||^2) / d`` (``u = 0``: the
       released variance is not used).

    A FedPFT release has no noise (``w = u = 1``): its mixtures are kept as they are. Then, for both:

    4. Draw n_c features per class as the server does (same seed as the naive reading), clip at 0 (the backbone's
       features are non-negative; Gaussian draws are not) and L2-normalise.

    The mean weights ``w`` (their average over the d directions, and the largest) and variance weights ``u`` (how
    much of the release survives) go to ``details``.
    """
    from privfl.methods.fedpft import sample_mixtures

    if release.scheme not in ("fedpft", "dp-fedpft"):
        raise ConfigError(f"post-processing is for mixture releases (fedpft, dp-fedpft), got scheme {release.scheme!r}")
    floor = float(release.details.get("reg_covar", 1e-6))
    info: dict[str, Any] = {"method": "samples clipped at 0 and L2-normalised"}
    if release.scheme == "fedpft":
        posterior = list(release.mixtures)
    else:
        posterior, mean_weights, variance_weights, top_weights = _lmmse_moments(release, prior, floor)
        full = prior.class_eigenvectors is not None
        info = {"method": f"LMMSE class moments under the attacker's in-distribution prior "
                          f"({'full covariance' if full else 'per dimension'}); samples clipped at 0 and "
                          "L2-normalised",
                "mean_release_weight": float(np.mean(mean_weights)),
                "top_direction_mean_weight": float(np.mean(top_weights)),
                "variance_release_weight": float(np.mean(variance_weights)),
                "per_class_mean_weight": mean_weights}
    synthetic, labels = sample_mixtures(posterior, np.random.default_rng(seed), floor=floor)
    features = _normalise(torch.as_tensor(synthetic).clamp_min(0))
    return replace(release, features=features, labels=torch.as_tensor(labels), postprocessing="clip" if
                   release.scheme == "fedpft" else "lmmse", details={**release.details, "postprocessing": info},
                   mixtures=tuple(posterior))


def _lmmse_moments(release: Release, prior: AttackerPrior,
                   floor: float) -> tuple[list[Any], list[float], list[float], list[float]]:
    from privfl.methods.fedpft import ClassMixture

    covariance = release.details.get("covariance")
    if covariance not in ("diag", "spherical"):
        raise ConfigError(f"DP post-processing supports diag and spherical covariance, got {covariance!r}")
    metadata = release.details["ledger"]["metadata"]
    sigmas = metadata.get("sigmas", {})
    missing = [k for k in ("sum", "second_moment_sum") if k not in sigmas] + (["bound"] if "bound" not in metadata
                                                                              else [])
    if missing:
        raise ConfigError(f"the release's ledger record lacks {missing}, which post-processing needs; its metadata "
                          f"has {sorted(metadata)}")
    sigma_sum, sigma_second = float(sigmas["sum"]), float(sigmas["second_moment_sum"])
    bound = float(metadata["bound"])
    posterior, mean_weights, variance_weights, top_weights = [], [], [], []
    for mixture in release.mixtures:
        c, n_c = mixture.label, max(int(mixture.count), 1)
        if c >= len(prior.class_means) or int(prior.class_counts[c]) < 2:
            have = int(prior.class_counts[c]) if c < len(prior.class_counts) else 0
            raise ConfigError(f"the release has class {c}, of which the attacker's prior holds {have} features; "
                              f"post-processing needs at least two")
        mu, var = prior.class_means[c], prior.class_variances[c]
        d = len(mu)
        m = torch.as_tensor(mixture.means[0], dtype=torch.float64)
        s2 = (sigma_sum / n_c) ** 2
        norm = float(torch.linalg.vector_norm(m))
        if norm >= bound * (1 - 2e-3):  # clipped (float16 on the wire rounds the norm)
            m = m * (math.sqrt(float(mu @ mu) + d * s2) / norm)
        if prior.class_eigenvectors is None or prior.class_eigenvalues is None:   # both or neither
            t = var / n_c
            w = t / (t + s2)
            mean = mu + w * (m - mu)
        else:
            values, vectors = prior.class_eigenvalues[c], prior.class_eigenvectors[c]
            t = values / n_c
            w = t / (t + s2)
            mean = mu + vectors @ (w * (vectors.T @ (m - mu)))
        v = torch.as_tensor(mixture.covariances[0], dtype=torch.float64)
        if covariance == "diag":
            p, r = var, (sigma_second / n_c) ** 2
            q = 2 * p * p / n_c
        else:
            p, r = var.mean(), (sigma_second / (n_c * d)) ** 2
            q = 2 * p * p / (n_c * d)
        if covariance == "spherical" and sigma_second == 0:   # on the sphere: the variance follows from the mean
            u = torch.zeros(())
            variance = torch.as_tensor((bound * bound - float(mean @ mean)) / d, dtype=torch.float64).clamp_min(floor)
        else:
            u = q / (q + r)
            variance = (p + u * (v - p)).clamp_min(floor)
        posterior.append(ClassMixture(label=c, count=mixture.count, weights=np.ones(1), means=mean.numpy()[None],
                                      covariances=variance.numpy().reshape(1, *variance.shape),
                                      covariance_type=covariance))
        mean_weights.append(float(w.mean()))
        top_weights.append(float(w.max()))
        variance_weights.append(float(u.mean()))
    return posterior, mean_weights, variance_weights, top_weights


def prior_only_release(release: Release, prior: AttackerPrior, *, seed: int = 0) -> Release:
    """The attacker's reading of a DP-FedPFT release with the release ignored: the same public class counts, the
    attacker's own class moments (its prior), draws clipped at 0 and L2-normalised as in :func:`postprocess_release`.

    What reconstructions from it achieve is what the attacker's in-distribution data gives without the release
    (the LMMSE post-processing with release weights ``w = u = 0``); a DP row is informative only where it differs
    from this one. Drawn with the same ``seed`` as the post-processed reading, so the two differ only by the moments.
    """
    from privfl.methods.fedpft import ClassMixture, sample_mixtures

    if release.scheme != "dp-fedpft":
        raise ConfigError(f"the prior-only reading is for dp-fedpft releases, got scheme {release.scheme!r}")
    floor = float(release.details.get("reg_covar", 1e-6))
    covariance = release.details.get("covariance")
    if covariance is None:
        raise ConfigError("the dp-fedpft release does not name its covariance type (details['covariance'])")
    mixtures = []
    for mixture in release.mixtures:
        c = mixture.label
        if c >= len(prior.class_means) or int(prior.class_counts[c]) < 2:
            raise ConfigError(f"the release has class {c}, of which the attacker's prior holds too few features")
        variance = prior.class_variances[c] if covariance == "diag" else prior.class_variances[c].mean()
        mixtures.append(ClassMixture(label=c, count=mixture.count, weights=np.ones(1),
                                     means=prior.class_means[c].numpy()[None],
                                     covariances=variance.clamp_min(floor).numpy().reshape(1, *variance.shape),
                                     covariance_type=covariance))
    synthetic, labels = sample_mixtures(mixtures, np.random.default_rng(seed), floor=floor)
    features = _normalise(torch.as_tensor(synthetic).clamp_min(0))
    info = {"method": "the attacker's prior class moments with the release's public counts; the release's moments "
                      "are not used"}
    return replace(release, features=features, labels=torch.as_tensor(labels), postprocessing="prior-only",
                   epsilon=0.0, details={**release.details, "postprocessing": info}, mixtures=tuple(mixtures))
