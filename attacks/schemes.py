"""What the defender releases, and how well an attacker recovers the defender's images from it.

Threat model (FedPFT paper, App. E.1): a defender and an attacker share a frozen backbone ``E``; the defender releases
a function of ``E(D_d)`` through a scheme (raw features, FedPFT mixtures, DP-FedPFT releases), made by the method's
own client procedure and recorded by the wire (:func:`make_release`). The attacker reconstructs from every feature it
holds (:func:`evaluate_release`, :func:`evaluate_decoder`, :func:`nearest_image_baseline`); every attack is scored per
image (:class:`ScoredSet`, :func:`score_reconstructions`) and summarised in rows (:func:`rows_from_scores`).

The schemes, the attacker's post-processing and the row definitions: docs/attacks.md, "Release schemes and
scoring".
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from accounting.validation import is_int_at_least
from attacks.metrics import LPIPS, psnr_pairs, ssim_matrix, ssim_pairs
from attacks.selection import agreement_scores, nearest, top_count
from privfl.errors import ConfigError

__all__ = ["GROUND_TRUTH", "SCHEMES", "SELECTIONS", "AttackRow", "AttackerPrior", "Release", "ReleaseEvaluation",
           "ScoredSet", "evaluate_decoder", "evaluate_release", "feature_diagnostics", "make_release",
           "nearest_image_baseline", "postprocess_release", "prior_only_release", "rows_from_scores",
           "score_reconstructions", "unit_features"]

SCHEMES = ("raw", "fedpft", "dp-fedpft")
#: What a row's ground-truth use means: ``none`` (the attacker alone), ``matching`` (defender images only pair
#: reconstructions with targets), ``selection`` (true similarity picks which pairs count), or both.
GROUND_TRUTH = ("none", "matching", "selection", "matching+selection")


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
    from privfl.data import TrainingClient
    from privfl.federation import Message, Wire
    from privfl.federation import Release as WireRelease
    from privfl.federation.context import client_context
    from privfl.methods.base import ModelFactory
    from privfl.methods.fedpft import FedPFTClient, FedPFTConfig, decode_mixtures, sample_mixtures
    from privfl.privacy.mechanisms import NOISE_SOURCES
    from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

    if scheme not in SCHEMES:
        raise ConfigError(f"unknown release scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    x, y = _check_pairs(features, labels)
    if (scheme == "dp-fedpft") != (epsilon is not None):
        raise ConfigError(f"epsilon is required for scheme 'dp-fedpft' and only for it (scheme {scheme!r}, "
                          f"epsilon {epsilon!r})")
    if not is_int_at_least(components, 1):
        raise ConfigError(f"components must be an integer >= 1, got {components!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ConfigError(f"delta must be a probability in (0, 1), got {delta!r}")
    if dp_noise not in NOISE_SOURCES:
        raise ConfigError(f"dp_noise must be one of {', '.join(NOISE_SOURCES)}, got {dp_noise!r}")
    client_id = 0
    wire = Wire()
    mixtures: list[Any] = []
    if scheme == "raw":
        sent = WireRelease.non_private(Message(arrays={"features": x.clone(), "labels": y.clone()}),
                                       purpose="raw_features")
        delivered = wire.client_to_server(client_id, sent, round=0)
        out_x, out_y = delivered.arrays["features"].float(), delivered.arrays["labels"].long()
        details: dict[str, Any] = {}
    else:
        private = scheme == "dp-fedpft"
        config = FedPFTConfig(components=1 if private else int(components), covariance=covariance)
        privacy = TrainingPrivacy(mode="record", epsilon=float(epsilon), delta=float(delta), noise=dp_noise,
                                  noise_seed=int(seed)) if private else TrainingPrivacy()
        config.check_privacy(privacy, NovelPrivacy())
        client = FedPFTClient(model_factory=ModelFactory("feature_mlp", (x.shape[1],), num_classes), config=config,
                              privacy=privacy)
        data = TrainingClient(client_id=client_id, x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])
        with torch.random.fork_rng(devices=[]):  # client_context seeds torch's generator for the client
            ctx = client_context(seed, client_id, round=0)
            sent = client.train(data, Message(config={"round": 0}), {}, ctx)
        delivered = wire.client_to_server(client_id, sent, round=0)
        mixtures = decode_mixtures(delivered.arrays, covariance=covariance, floor=config.reg_covar)
        synthetic, synthetic_labels = sample_mixtures(mixtures, np.random.default_rng(seed), floor=config.reg_covar)
        out_x, out_y = _normalise(synthetic), torch.as_tensor(synthetic_labels)
        details = {"components": config.components, "covariance": covariance, "reg_covar": config.reg_covar}
        if private:
            details["requested_epsilon"] = float(epsilon)
    ledger = wire.ledgers[client_id]
    (record,) = ledger.records
    spent = ledger.spent(delta)
    details["ledger"] = {"epsilon": "inf" if math.isinf(spent.epsilon) else spent.epsilon, "delta": spent.delta,
                         "accountant": spent.accountant, "purpose": record.purpose, "round": record.round,
                         "metadata": record.metadata, "event": record.event.to_dict()}
    details["bytes"] = int(wire.bytes_up[client_id])
    details["set_size"] = int(len(out_x))
    return Release(scheme, out_x, out_y, set_level=scheme != "raw", epsilon=float(spent.epsilon), details=details,
                   mixtures=tuple(mixtures))


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


# -- scoring --------------------------------------------------------------------------------------------------------

#: The rows of each level and the ground truth each uses (module docstring).
SELECTIONS = {"per-feature": (("all", "none"), ("attacker", "none"), ("oracle", "selection")),
              "set-level": (("all", "matching"), ("attacker", "matching"), ("oracle", "matching+selection"))}


@dataclass
class ScoredSet:
    """Per-image scores of one attack on one release for one evaluation seed (the lines of ``per_image_scores.csv``).

    ``unit`` says what was scored: ``"target"`` (one entry per defender image: its own reconstruction, per-feature,
    or its most similar one by SSIM, set-level) or ``"reconstruction"`` (set-level: one entry per reconstruction,
    paired with its most similar defender image; for the attacker selection). ``index`` is the scored item's position
    (in the seed's evaluated defender images, or in the reconstruction set), ``matched`` its partner's; ``confidence``
    the attacker's confidence in the reconstruction involved (no ground truth).
    """

    seed: int
    source: str
    epsilon: float
    attack: str
    estimate: str
    level: str
    unit: str
    set_size: int
    index: np.ndarray
    matched: np.ndarray
    psnr: np.ndarray
    lpips: np.ndarray
    ssim: np.ndarray
    confidence: np.ndarray

    @property
    def key(self) -> tuple[str, float, str, str, str]:
        return self.source, self.epsilon, self.attack, self.estimate, self.level

    def values(self) -> np.ndarray:
        """``[n, 3]``: PSNR (an exact copy capped at 100 dB so a mean stays finite), LPIPS, SSIM."""
        return np.stack([np.where(np.isinf(self.psnr), 100.0, self.psnr), self.lpips, self.ssim], axis=1)

    def records(self) -> list[dict[str, Any]]:
        eps = "inf" if math.isinf(self.epsilon) else self.epsilon
        return [{"seed": self.seed, "source": self.source, "epsilon": eps, "attack": self.attack,
                 "estimate": self.estimate, "level": self.level, "unit": self.unit, "index": int(i),
                 "matched": int(m), "psnr": float(p), "lpips": float(lp), "ssim": float(s), "confidence": float(c)}
                for i, m, p, lp, s, c in zip(self.index, self.matched, self.psnr, self.lpips, self.ssim,
                                             self.confidence)]


@dataclass(frozen=True)
class AttackRow:
    """One line of the attack table (the paper's Tables 3, 6 and 7: PSNR up, LPIPS down, SSIM up), with the
    percentile-bootstrap interval of every metric (:func:`attacks.statistics.bootstrap_cell`).

    ``source`` is the release (or ``"no release"``), ``attack`` what turns it into images, ``estimate`` which of a
    generator's samples is scored (``"medoid of k"``, ``"mean of k"``, ``"one-step mean of d"``; ``"-"`` for
    decoders), ``level`` and ``selection`` as in the module docstring, ``seed`` the evaluation seed (``"all"``: the
    seeds pooled), ``ground_truth`` one of :data:`GROUND_TRUTH`, ``n`` the scored pairs (summed over seeds),
    ``set_size`` the reconstructions (or candidate images) the attacker holds per seed.
    """

    source: str
    attack: str
    estimate: str
    epsilon: float
    level: str
    selection: str
    top: str
    seed: str
    n: int
    ground_truth: str
    psnr: float
    psnr_low: float
    psnr_high: float
    lpips: float
    lpips_low: float
    lpips_high: float
    ssim: float
    ssim_low: float
    ssim_high: float
    set_size: int

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["epsilon"] = "inf" if math.isinf(self.epsilon) else self.epsilon
        return out

    def interval(self, metric: str) -> tuple[float, float]:
        return getattr(self, f"{metric}_low"), getattr(self, f"{metric}_high")


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def score_reconstructions(targets: Any, reconstructions: Any, confidence: Any, *, linked: Any, lpips: LPIPS,
                          seed: int, source: str, epsilon: float, attack: str,
                          estimate: str = "-") -> tuple[list[ScoredSet], torch.Tensor]:
    """Per-image scores of one attacker's reconstructions (the sets every row of the module docstring is made from).

    Args:
        targets: ``[N, C, H, W]`` evaluated defender images on [0, 1].
        reconstructions: ``[m, C, H, W]``, one per released feature.
        confidence: ``[m]`` the attacker's own confidence in each reconstruction (higher = surer; no ground truth).
        linked: ``False`` for a set-level release; ``True`` when reconstruction i is made from target i's own
            feature (``m = N``); or ``[N]`` indices: target i's own reconstruction is ``reconstructions[linked[i]]``
            (a raw release of every defender image, of which only the near-duplicate-filtered ones are scored).

    Returns:
        ``(sets, shown)``: per-feature targets (when linked), set-level targets and set-level reconstructions; and
        per target the reconstruction the image grid shows (its own when linked, else its SSIM match: oracle-matched).
    """
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    r = torch.as_tensor(np.asarray(reconstructions), dtype=torch.float32)
    conf = np.asarray(confidence, dtype=np.float64)
    n, m = len(t), len(r)
    if conf.shape != (m,):
        raise ConfigError(f"need one confidence per reconstruction: {conf.shape} for {m}")
    own = None
    if isinstance(linked, (bool, np.bool_)):
        if linked and m != n:
            raise ConfigError(f"linked reconstructions need one per target: {m} reconstructions, {n} targets")
        own = np.arange(n) if linked else None
    else:
        own = np.asarray(linked, dtype=np.int64)
        if own.shape != (n,) or (n and (own.min() < 0 or own.max() >= m)):
            raise ConfigError(f"linked must hold one reconstruction index in [0, {m}) per target ({n}), got shape "
                              f"{own.shape}")

    def scored(level: str, unit: str, index: np.ndarray, matched: np.ndarray, tt: torch.Tensor,
               rr: torch.Tensor, c: np.ndarray) -> ScoredSet:
        return ScoredSet(seed, source, epsilon, attack, estimate, level, unit, m, index, matched,
                         psnr_pairs(tt, rr), lpips(tt, rr).double().numpy(), ssim_pairs(tt, rr), c)

    sets = []
    if own is not None:
        sets.append(scored("per-feature", "target", np.arange(n), own, t, r[torch.as_tensor(own)], conf[own]))
    similarity = ssim_matrix(t, r)    # SSIM is symmetric: one matrix matches both ways
    index, paired = similarity.argmax(axis=1), similarity.argmax(axis=0)
    matched = r[torch.as_tensor(index)]
    sets.append(scored("set-level", "target", np.arange(n), index, t, matched, conf[index]))
    sets.append(scored("set-level", "reconstruction", np.arange(m), paired, t[torch.as_tensor(paired)], r, conf))
    return sets, (r[torch.as_tensor(own)] if own is not None else matched)


def rows_from_scores(sets: Sequence[ScoredSet], *, top_fractions: Sequence[float] = (0.05,), n_boot: int = 1000,
                     boot_seed: int = 0) -> list[AttackRow]:
    """The table rows of per-image scores: for each (source, attack, estimate, level), per seed and (with several
    seeds) pooled, the rows of :data:`SELECTIONS` with bootstrap intervals.

    *all* and *oracle* rows score targets (the oracle ranks them by their SSIM); the set-level *attacker* row scores
    the top fraction of the reconstruction set by the attacker's confidence, the per-feature one the top fraction of
    targets by it. Selections are made within each seed.
    """
    from attacks.statistics import bootstrap_cell

    grouped: dict[tuple, dict[tuple[str, int], ScoredSet]] = {}
    for s in sets:
        grouped.setdefault(s.key, {})[(s.unit, s.seed)] = s
    rows = []
    for key, by_unit in grouped.items():
        source, epsilon, attack, estimate, level = key
        seeds = sorted({seed for _, seed in by_unit})
        scopes = [[seed] for seed in seeds] + ([seeds] if len(seeds) > 1 else [])
        for scope in scopes:
            label = str(scope[0]) if len(scope) == 1 else "all"
            for selection, ground_truth in SELECTIONS[level]:
                unit = "reconstruction" if (level, selection) == ("set-level", "attacker") else "target"
                chosen = [by_unit[(unit, seed)] for seed in scope if (unit, seed) in by_unit]
                if not chosen:
                    continue
                fractions = [None] if selection == "all" else list(top_fractions)
                for fraction in fractions:
                    groups = [(c.values(), None if fraction is None else
                               (c.ssim if selection == "oracle" else c.confidence)) for c in chosen]
                    estimate_, low, high = bootstrap_cell(groups, fraction=fraction, n_boot=n_boot, seed=boot_seed)
                    n = sum(len(c.index) if fraction is None else top_count(len(c.index), fraction) for c in chosen)
                    rows.append(AttackRow(source, attack, estimate, epsilon, level, selection,
                                          "all" if fraction is None else _pct(fraction), label, n, ground_truth,
                                          float(estimate_[0]), float(low[0]), float(high[0]),
                                          float(estimate_[1]), float(low[1]), float(high[1]),
                                          float(estimate_[2]), float(low[2]), float(high[2]), chosen[0].set_size))
    return rows


@dataclass
class ReleaseEvaluation:
    """The per-image scores of one attack on one release, what the image grid shows for each defender image (per
    estimate), and the reconstructions (one per released feature, per estimate)."""

    scored: list[ScoredSet]
    shown: dict[str, torch.Tensor]
    reconstructions: dict[str, torch.Tensor]
    seconds: float


def evaluate_release(release: Release, reconstructor: Any, targets: Any, *, lpips: LPIPS, seed: int = 0,
                     samples_per_feature: int = 8, one_step_draws: int = 8, one_step_guidance: float = 1.0,
                     sampling: Any = None, init_decoder: Any = None, guide_decoder: Any = None,
                     target_index: Any = None, progress: bool = False) -> ReleaseEvaluation:
    """Reconstruct from ``release`` with the diffusion reconstructor and score against ``targets``.

    Every released feature is sampled ``samples_per_feature`` times (DDIM from independent starting noise). Three
    estimates are scored: the **medoid** of its samples (a sample: sharp, for LPIPS and SSIM), their **mean** (the
    Monte-Carlo posterior mean ``E[x | feature]``, which minimises the expected squared error, hence PSNR's
    estimate; its expected squared error is ``V (1 + 1/k)`` for posterior variance V), and the **one-step mean**
    (:meth:`~attacks.reconstructor.Reconstructor.posterior_mean`: the network's x_0 prediction from pure noise at
    t = T - 1, averaged over ``one_step_draws`` noise draws; an estimate of ``E[x | feature]`` without the
    ``1 + 1/k`` factor, at guidance scale ``one_step_guidance`` (named in the estimate when it is not 1), from its
    own noise stream so the samples do not change). The attacker's confidence in a feature is the mean pairwise SSIM
    among its samples (:func:`attacks.selection.agreement_scores`; the paper's attacker selection), for all three.

    Args:
        release: from :func:`make_release`, :func:`postprocess_release` or :func:`prior_only_release`.
        reconstructor: a trained :class:`~attacks.reconstructor.Reconstructor` (anything with its ``sample`` and
            ``posterior_mean``).
        targets: ``[N, C, H, W]`` defender images on [0, 1] (after filtering).
        target_index: for a raw release, ``[N]`` the position of each target's feature in the release (default:
            target i is feature i).
        one_step_draws: noise draws averaged by the one-step posterior mean (0: not scored).
        one_step_guidance: its guidance scale w
            (:func:`~attacks.reconstructor.select_one_step_guidance` chooses it on held-out attacker pairs).
        sampling: :class:`~attacks.reconstructor.SamplingSettings` (default: w = 1, 20 DDIM steps).
        init_decoder: the decoder whose estimates start the draws when ``sampling.init_strength`` is set.
        guide_decoder: the decoder whose estimates a ``guide_image`` reconstructor reads.
    """
    from attacks.reconstructor import SamplingSettings

    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    k = samples_per_feature
    if not is_int_at_least(k, 2):
        raise ConfigError(f"samples_per_feature must be an integer >= 2 (the attacker selection compares samples), "
                          f"got {samples_per_feature!r}")
    draws = one_step_draws
    if isinstance(draws, bool) or not isinstance(draws, numbers.Integral) or draws < 0:
        raise ConfigError(f"one_step_draws must be an integer >= 0 (noise draws averaged by the one-step posterior "
                          f"mean; 0: not scored), got {one_step_draws!r}")
    linked = _linked(release, t, target_index)
    sampling = SamplingSettings() if sampling is None else sampling
    extra, one_step_extra = {}, {}
    if guide_decoder is not None:
        one_step_extra["guide"] = guide_decoder.decode(release.features, release.labels)
        extra["guide"] = one_step_extra["guide"].repeat_interleave(int(k), dim=0)
    init = None
    if sampling.init_strength is not None:
        if init_decoder is None:
            raise ConfigError("sampling with init_strength needs the init_decoder whose estimates start the draws")
        # the guide's estimates when the same decoder starts the draws (decoded once)
        init = extra["guide"] if init_decoder is guide_decoder else \
            init_decoder.decode(release.features, release.labels).repeat_interleave(int(k), dim=0)
    m = len(release.features)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    samples = reconstructor.sample(release.features.repeat_interleave(int(k), dim=0), settings=sampling,
                                   generator=generator, progress=progress, init=init, **extra)
    samples = samples.reshape(m, int(k), *samples.shape[1:])
    agreement, medoid = agreement_scores(samples.numpy())
    estimates = {f"medoid of {k}": samples[torch.arange(m), torch.as_tensor(medoid)], f"mean of {k}": samples.mean(1)}
    if draws:
        name = f"one-step mean of {draws}" + ("" if one_step_guidance == 1.0 else f", w {one_step_guidance:g}")
        estimates[name] = reconstructor.posterior_mean(
            release.features, draws=int(draws), guidance_scale=one_step_guidance,
            generator=torch.Generator().manual_seed(seed), **one_step_extra)
    scored, shown = [], {}
    for name, images in estimates.items():
        sets, shown[name] = score_reconstructions(t, images, agreement, linked=linked, lpips=lpips,
                                                  seed=seed, source=release.label, epsilon=release.epsilon,
                                                  attack="diffusion", estimate=name)
        scored += sets
    return ReleaseEvaluation(scored=scored, shown=shown, reconstructions=estimates,
                             seconds=time.perf_counter() - started)


def _linked(release: Release, targets: torch.Tensor, target_index: Any) -> Any:
    if release.set_level:
        return False
    if target_index is None:
        if len(release.features) != len(targets):
            raise ConfigError(f"a raw release needs one feature per target (or target_index): "
                              f"{len(release.features)} features, {len(targets)} targets")
        return True
    return np.asarray(target_index, dtype=np.int64)


def evaluate_decoder(release: Release, decoder: Any, targets: Any, *, lpips: LPIPS, attacker_features: Any,
                     seed: int = 0, target_index: Any = None) -> ReleaseEvaluation:
    """Reconstruct from ``release`` with a decoder baseline (:mod:`attacks.decoders`) and score the same sets.

    The attacker's confidence in a released feature is its highest cosine similarity to an attacker feature (how
    typical the feature is of the attacker's data; no ground truth), the same for every decoder.
    """
    from attacks.decoders import feature_similarity

    started = time.perf_counter()
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    linked = _linked(release, t, target_index)
    images = decoder.decode(release.features, release.labels)
    confidence = feature_similarity(release.features, attacker_features).max(dim=1).values.double().numpy()
    sets, shown = score_reconstructions(t, images, confidence, linked=linked, lpips=lpips,
                                        seed=seed, source=release.label, epsilon=release.epsilon,
                                        attack=decoder.name)
    return ReleaseEvaluation(scored=sets, shown={"-": shown}, reconstructions={"-": images},
                             seconds=time.perf_counter() - started)


def nearest_image_baseline(targets: Any, attacker_images: Any, *, lpips: LPIPS, seed: int = 0,
                           nearest_index: Any = None, source: str = "no release") -> tuple[list[ScoredSet],
                                                                                           torch.Tensor]:
    """The attacker that saw no release, given an oracle: each target's most similar attacker image by true SSIM
    (App. E.4 "train set"); set-level targets only (its *all* and *oracle* rows; both use ground truth to match).

    ``nearest_index``: each target's most similar attacker image when already known (the near-duplicate filter
    computes it); else it is computed here.

    Returns the scored set and the matched attacker images ``[N, C, H, W]``.
    """
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    a = torch.as_tensor(np.asarray(attacker_images), dtype=torch.float32)
    index = nearest(t, a)[0] if nearest_index is None else np.asarray(nearest_index)
    matched = a[torch.as_tensor(index)]
    scored = ScoredSet(seed, source, math.inf, "nearest image by SSIM", "-", "set-level", "target", len(a),
                       np.arange(len(t)), index, psnr_pairs(t, matched), lpips(t, matched).double().numpy(),
                       ssim_pairs(t, matched), np.full(len(t), np.nan))
    return [scored], matched
