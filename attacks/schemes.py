"""What the defender releases, and how well an attacker recovers the defender's images from it.

Threat model (FedPFT paper, App. E.1): a defender and an attacker share a frozen backbone ``E``. The defender holds
images ``D_d`` and releases, through a **scheme**, a function of ``E(D_d)`` with labels. Every release is made by
the method's own client procedure and crosses a :class:`privfl.federation.Wire`, which records it in the defender's
ledger before delivering it; the attacker gets the delivered message, exactly what the server would see:

- ``"raw"``: the features themselves, one per image, recorded as a non-private release (epsilon = infinity);
- ``"fedpft"``: :meth:`privfl.methods.fedpft.FedPFTClient.train` without privacy: per-class Gaussian
  mixtures (K components, EM), float16 on the wire; not private;
- ``"dp-fedpft"``: the same client under record-level privacy at ``epsilon``: one Gaussian per class from the
  DP-GMM release (unit
  ball, analytic Gaussian mechanism, public counts). Its epsilon is what the ledger's accountant says the recorded
  event costs, which can differ from the requested one; both are kept.

From a mixture release the attacker decodes the mixtures as the server does (:func:`~privfl.methods.fedpft.
decode_mixtures`) and draws as many features per class as the released counts say
(:func:`~privfl.methods.fedpft.sample_mixtures`), then L2-normalises them as FedPFT's head does: the **naive**
reading. DP noise puts these features far outside the distribution the attacker's reconstructor was trained on, so
the attacker may also **post-process** (:func:`postprocess_release`): anything computed from the release and its own
data is free under DP's post-processing theorem.

The attacker reconstructs from every feature it holds and is scored by :func:`evaluate_release` (diffusion
reconstructor) and :func:`feature_retrieval` (the attacker image whose feature is closest: the like-for-like
baseline of a generator), beside :func:`nearest_image_baseline` (the attacker image most similar to each defender
image by true SSIM: an oracle, since it needs the defender's images to choose).

**Row definitions** (the same for every release and attack; ``n`` always counts scored defender images, and a top
fraction p scores ``ceil(p * N)`` of the N evaluated defender images):

- ``per-feature`` rows exist only where a feature belongs to one defender image (raw). The attacker's
  reconstruction of target i is the medoid of the samples of feature i (diffusion) or its retrieved image.
  *all*: every target (no ground truth); *attacker*: the top p by the attacker's confidence (agreement among its
  samples, or feature similarity; no ground truth); *oracle*: the top p by the true SSIM (ground truth selects).
- ``set-level`` rows: the attacker's reconstruction set holds one image per released feature (the medoid of its
  samples). *all*: each target matched to its most similar member by SSIM (ground truth matches; the paper's
  "Oracle-all"); *attacker*: the attacker's ``ceil(p * N)`` most confident reconstructions, each paired with its most
  similar target (ground truth only pairs); *oracle*: the top p targets by matched SSIM (the paper's "Oracle").
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

from attacks.metrics import LPIPS, psnr_pairs, ssim_pairs
from attacks.selection import agreement_scores, nearest, top_count, top_indices
from privfl.errors import ConfigError

__all__ = ["GROUND_TRUTH", "SCHEMES", "AttackRow", "AttackerPrior", "Release", "ReleaseEvaluation",
           "evaluate_release", "feature_diagnostics", "feature_retrieval", "make_release", "nearest_image_baseline",
           "postprocess_release", "score_reconstructions", "unit_features"]

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
            (:func:`postprocess_release`: ``"lmmse"`` for DP-FedPFT, ``"clip"`` for FedPFT).
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
        dp_noise: ``"seeded"`` (reproducible; the defender is simulated) or ``"secure"`` (the library default).
    """
    from privfl.data import TrainingClient
    from privfl.federation import Message, Wire
    from privfl.federation import Release as WireRelease
    from privfl.federation.context import client_context
    from privfl.methods.base import ModelFactory
    from privfl.methods.fedpft import FedPFTClient, FedPFTConfig, decode_mixtures, sample_mixtures
    from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

    if scheme not in SCHEMES:
        raise ConfigError(f"unknown release scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    x, y = _check_pairs(features, labels)
    if (scheme == "dp-fedpft") != (epsilon is not None):
        raise ConfigError(f"epsilon is required for scheme 'dp-fedpft' and only for it (scheme {scheme!r}, "
                          f"epsilon {epsilon!r})")
    if isinstance(components, bool) or not isinstance(components, numbers.Integral) or components < 1:
        raise ConfigError(f"components must be an integer >= 1, got {components!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ConfigError(f"delta must be a probability in (0, 1), got {delta!r}")
    if dp_noise not in ("seeded", "secure", "hardened"):
        raise ConfigError(f"dp_noise must be 'seeded', 'secure' or 'hardened', got {dp_noise!r}")
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
    """

    class_counts: torch.Tensor
    class_means: torch.Tensor
    class_variances: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    @classmethod
    def fit(cls, features: Any, labels: Any, *, num_classes: int) -> AttackerPrior:
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
        return cls(counts, means, variances, x.mean(0), std.clamp_min(max(float(std.mean()) * 1e-2, 1e-12)))


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

    The mean weights ``w`` and variance weights ``u`` (how much of the release survives) go to ``details``.
    """
    from privfl.methods.fedpft import sample_mixtures

    if release.scheme not in ("fedpft", "dp-fedpft"):
        raise ConfigError(f"post-processing is for mixture releases (fedpft, dp-fedpft), got scheme {release.scheme!r}")
    floor = float(release.details.get("reg_covar", 1e-6))
    info: dict[str, Any] = {"method": "samples clipped at 0 and L2-normalised"}
    if release.scheme == "fedpft":
        posterior = list(release.mixtures)
    else:
        posterior, mean_weights, variance_weights = _lmmse_moments(release, prior, floor)
        info = {"method": "LMMSE class moments under the attacker's in-distribution prior; samples clipped at 0 and "
                          "L2-normalised",
                "mean_release_weight": float(np.mean(mean_weights)),
                "variance_release_weight": float(np.mean(variance_weights)),
                "per_class_mean_weight": mean_weights}
    synthetic, labels = sample_mixtures(posterior, np.random.default_rng(seed), floor=floor)
    features = _normalise(torch.as_tensor(synthetic).clamp_min(0))
    return replace(release, features=features, labels=torch.as_tensor(labels), postprocessing="clip" if
                   release.scheme == "fedpft" else "lmmse", details={**release.details, "postprocessing": info},
                   mixtures=tuple(posterior))


def _lmmse_moments(release: Release, prior: AttackerPrior, floor: float) -> tuple[list[Any], list[float], list[float]]:
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
    posterior, mean_weights, variance_weights = [], [], []
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
        t = var / n_c
        w = t / (t + s2)
        mean = mu + w * (m - mu)
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
        variance_weights.append(float(u.mean()))
    return posterior, mean_weights, variance_weights


# -- scoring --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttackRow:
    """One line of the attack table (the paper's Tables 3, 6 and 7: PSNR up, LPIPS down, SSIM up).

    ``source`` is the release (or ``"no release"``), ``attack`` what turns it into images, ``level`` and
    ``selection`` as in the module docstring, ``ground_truth`` one of :data:`GROUND_TRUTH`, ``n`` the scored pairs,
    ``set_size`` the reconstructions (or candidate images) the attacker holds.
    """

    source: str
    attack: str
    epsilon: float
    level: str
    selection: str
    top: str
    n: int
    ground_truth: str
    psnr: float
    lpips: float
    ssim: float
    set_size: int

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["epsilon"] = "inf" if math.isinf(self.epsilon) else self.epsilon
        return out


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def _metrics(targets: torch.Tensor, recons: torch.Tensor, lpips: LPIPS) -> tuple[float, float, float]:
    p = psnr_pairs(targets, recons)
    p = np.where(np.isinf(p), 100.0, p)  # an exact copy is capped at 100 dB so a mean stays finite
    return float(p.mean()), float(lpips(targets, recons).double().mean()), float(ssim_pairs(targets, recons).mean())


def score_reconstructions(targets: Any, reconstructions: Any, confidence: Any, *, linked: bool, source: str,
                          attack: str, epsilon: float, lpips: LPIPS,
                          top_fractions: Sequence[float] = (0.01,)) -> tuple[list[AttackRow], torch.Tensor]:
    """The rows of the module docstring for one attacker's reconstructions.

    Args:
        targets: ``[N, C, H, W]`` evaluated defender images on [0, 1].
        reconstructions: ``[m, C, H, W]``, one per released feature (``m = N``, in the targets' order, when
            ``linked``).
        confidence: ``[m]`` the attacker's own confidence in each reconstruction (higher = surer; no ground truth).
        linked: the features belong to the targets one to one (adds the per-feature rows).

    Returns:
        ``(rows, shown)``: the rows, and per target the reconstruction the image grid shows (its own when linked,
        else its set-level match).
    """
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    r = torch.as_tensor(np.asarray(reconstructions), dtype=torch.float32)
    conf = np.asarray(confidence, dtype=np.float64)
    n, m = len(t), len(r)
    if conf.shape != (m,):
        raise ConfigError(f"need one confidence per reconstruction: {conf.shape} for {m}")
    if linked and m != n:
        raise ConfigError(f"linked reconstructions need one per target: {m} reconstructions, {n} targets")
    rows: list[AttackRow] = []

    def add(level: str, selection: str, top: str, ground_truth: str, tt: torch.Tensor, rr: torch.Tensor) -> None:
        rows.append(AttackRow(source, attack, epsilon, level, selection, top, len(tt), ground_truth,
                              *_metrics(tt, rr, lpips), m))

    if linked:
        true = ssim_pairs(t, r)
        add("per-feature", "all", "all", "none", t, r)
        for fraction in top_fractions:
            chosen = torch.as_tensor(top_indices(conf, fraction))
            add("per-feature", "attacker", _pct(fraction), "none", t[chosen], r[chosen])
            chosen = torch.as_tensor(top_indices(true, fraction))
            add("per-feature", "oracle", _pct(fraction), "selection", t[chosen], r[chosen])
    index, best = nearest(t, r)
    matched = r[torch.as_tensor(index)]
    add("set-level", "all", "all", "matching", t, matched)
    for fraction in top_fractions:
        k = min(top_count(n, fraction), m)
        chosen = torch.as_tensor(np.argsort(-conf, kind="stable")[:k])
        paired, _ = nearest(r[chosen], t)
        add("set-level", "attacker", _pct(fraction), "matching", t[torch.as_tensor(paired)], r[chosen])
        chosen = torch.as_tensor(top_indices(best, fraction))
        add("set-level", "oracle", _pct(fraction), "matching+selection", t[chosen], matched[chosen])
    return rows, (r if linked else matched)


@dataclass
class ReleaseEvaluation:
    """The rows of one release and what the image grid shows for each defender image (see
    :func:`score_reconstructions`), with the attacker's reconstructions (one per released feature)."""

    rows: list[AttackRow]
    shown: torch.Tensor
    reconstructions: torch.Tensor
    seconds: float


def evaluate_release(release: Release, reconstructor: Any, targets: Any, *, lpips: LPIPS,
                     samples_per_feature: int = 10, top_fractions: Sequence[float] = (0.01,),
                     guidance_scale: float = 2.0, num_inference_steps: int = 20, seed: int = 0,
                     progress: bool = False) -> ReleaseEvaluation:
    """Reconstruct from ``release`` with the diffusion reconstructor and score against ``targets``.

    Every released feature is sampled ``samples_per_feature`` times (DDIM from independent starting noise); the
    attacker's reconstruction of the feature is the medoid of its samples, and its confidence the mean pairwise SSIM
    among them (:func:`attacks.selection.agreement_scores`; the paper's attacker selection). Rows as in the module
    docstring (:func:`score_reconstructions`).

    Args:
        release: from :func:`make_release` or :func:`postprocess_release`.
        reconstructor: a trained :class:`~attacks.reconstructor.Reconstructor` (anything with its ``sample``).
        targets: ``[N, C, H, W]`` defender images on [0, 1], at the reconstructor's resolution (after filtering);
            for a raw release, in the order of its features.
        lpips: the LPIPS metric.
        top_fractions: the fractions of the attacker and oracle selections (the paper: 0.01).
    """
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    k = samples_per_feature
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 2:
        raise ConfigError(f"samples_per_feature must be an integer >= 2 (the attacker selection compares samples), "
                          f"got {samples_per_feature!r}")
    if not release.set_level and len(release.features) != len(t):
        raise ConfigError(f"a raw release needs one feature per target: {len(release.features)} features, "
                          f"{len(t)} targets")
    m = len(release.features)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    samples = reconstructor.sample(release.features.repeat_interleave(int(k), dim=0), guidance_scale=guidance_scale,
                                   num_inference_steps=num_inference_steps, generator=generator, progress=progress)
    samples = samples.reshape(m, int(k), *samples.shape[1:])
    agreement, medoid = agreement_scores(samples.numpy())
    medoids = samples[torch.arange(m), torch.as_tensor(medoid)]
    rows, shown = score_reconstructions(t, medoids, agreement, linked=not release.set_level, source=release.label,
                                        attack="diffusion", epsilon=release.epsilon, lpips=lpips,
                                        top_fractions=top_fractions)
    return ReleaseEvaluation(rows=rows, shown=shown, reconstructions=medoids, seconds=time.perf_counter() - started)


def feature_retrieval(release: Release, attacker_features: Any, attacker_images: Any, targets: Any, *,
                      lpips: LPIPS, top_fractions: Sequence[float] = (0.01,)) -> ReleaseEvaluation:
    """The like-for-like baseline of the diffusion attack: for each released feature, the attacker image whose
    feature is closest (highest cosine similarity), that similarity as the attacker's confidence; the same rows.

    Needs no defender data to choose (unlike :func:`nearest_image_baseline`).
    """
    started = time.perf_counter()
    a = _normalise(attacker_features)
    images = torch.as_tensor(np.asarray(attacker_images), dtype=torch.float32)
    if len(a) != len(images) or len(a) == 0:
        raise ConfigError(f"need one attacker image per attacker feature (and at least one), got {len(a)} features "
                          f"and {len(images)} images")
    similarity = _normalise(release.features) @ a.T
    best, index = similarity.max(dim=1)
    retrieved = images[index]
    rows, shown = score_reconstructions(targets, retrieved, best.double().numpy(), linked=not release.set_level,
                                        source=release.label, attack="feature NN", epsilon=release.epsilon,
                                        lpips=lpips, top_fractions=top_fractions)
    return ReleaseEvaluation(rows=rows, shown=shown, reconstructions=retrieved, seconds=time.perf_counter() - started)


def nearest_image_baseline(targets: Any, attacker_images: Any, *, lpips: LPIPS,
                           top_fractions: Sequence[float] = (0.01,),
                           source: str = "no release") -> tuple[list[AttackRow], torch.Tensor]:
    """The attacker that saw no release, given an oracle: each target's most similar attacker image by true SSIM
    (App. E.4 "train set"). Set-level rows *all* and *oracle*; both use ground truth to match.

    Returns the rows and the matched attacker images ``[N, C, H, W]``.
    """
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    a = torch.as_tensor(np.asarray(attacker_images), dtype=torch.float32)
    index, best = nearest(t, a)
    matched = a[torch.as_tensor(index)]
    attack = "nearest image by SSIM"
    rows = [AttackRow(source, attack, math.inf, "set-level", "all", "all", len(t), "matching",
                      *_metrics(t, matched, lpips), len(a))]
    for fraction in top_fractions:
        chosen = torch.as_tensor(top_indices(best, fraction))
        rows.append(AttackRow(source, attack, math.inf, "set-level", "oracle", _pct(fraction), len(chosen),
                              "matching+selection", *_metrics(t[chosen], matched[chosen], lpips), len(a)))
    return rows, matched
