"""What the defender releases, and how well the attacker's reconstructor recovers the defender's images from it.

Threat model (FedPFT paper, App. E.1): a defender and an attacker share a frozen backbone ``E``. The defender holds
images ``D_d`` and releases, through a **scheme**, a function of ``E(D_d)`` with labels:

- ``"raw"``: the features themselves, one per image (the centralised baseline of feature sharing);
- ``"fedpft"``: per-class Gaussian mixtures fitted by EM (:func:`privfl.methods.fedpft.fit_class_mixtures`, K
  components, K_eff = min(K, n_c)), sent in float16 (:func:`~privfl.methods.fedpft.encode_mixtures`) exactly as the
  FedPFT client sends them; not private;
- ``"dp-fedpft"``: one Gaussian per class released by :func:`privfl.privacy.dp_gmm.release_class_gaussians`
  (features in the unit ball, analytic Gaussian mechanism, public class counts, replace-one within the public class
  histogram, public delta), likewise float16 on the wire.

The attacker owns in-distribution images ``D_a`` disjoint from ``D_d`` and trains a :class:`~attacks.reconstructor.
Reconstructor` on ``(E(x), x)`` for ``x`` in ``D_a``. From a mixture release it draws as many synthetic features as
the released counts say (the paper's server draws n_c per class, so the reconstruction set has the defender set's
size), projects them onto the unit sphere where its training features lie (its own post-processing), and
reconstructs one image per feature: a **set-level** attack, where a defender image is matched to the closest
reconstruction by SSIM (App. E.4). Features are L2-normalised backbone outputs throughout (:func:`unit_features`):
the DP release needs the unit ball, and the same embedding must be used for every scheme to compare them.

:func:`evaluate_release` scores one release under the selections of :mod:`attacks.selection`;
:func:`nearest_image_baseline` scores the attacker that saw nothing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from attacks.metrics import LPIPS, psnr_pairs, ssim_pairs
from attacks.selection import agreement_scores, nearest, top_indices
from privfl.errors import ConfigError

__all__ = ["SCHEMES", "AttackRow", "Release", "ReleaseEvaluation", "evaluate_release", "make_release",
           "nearest_image_baseline", "unit_features"]

SCHEMES = ("raw", "fedpft", "dp-fedpft")


def unit_features(feature_fn: Callable[[Any], Any]) -> Callable[[Any], torch.Tensor]:
    """The embedding ``E``: ``feature_fn`` followed by L2 normalisation of every row (zero rows stay zero)."""
    def embed(images: Any) -> torch.Tensor:
        f = torch.as_tensor(np.asarray(feature_fn(images)), dtype=torch.float32)
        return f / torch.linalg.vector_norm(f, dim=1, keepdim=True).clamp_min(1e-12)
    return embed


@dataclass(frozen=True)
class Release:
    """What the attacker holds after the defender's release, reduced to feature vectors it can reconstruct from.

    Attributes:
        scheme: ``"raw"``, ``"fedpft"`` or ``"dp-fedpft"``.
        features: ``[m, d]`` float32: the raw features, or the synthetic features drawn from the released mixtures.
        labels: ``[m]`` their (released or sampled) labels.
        set_level: True when the features carry no link to individual defender images (mixture releases).
        epsilon: the release's epsilon (``math.inf`` when not private); delta in ``details``.
        details: how it was made (components, covariance, sigmas, ...), JSON-able.
    """

    scheme: str
    features: torch.Tensor
    labels: torch.Tensor
    set_level: bool
    epsilon: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.scheme if math.isinf(self.epsilon) else f"{self.scheme} (eps={self.epsilon:g})"


def _normalise(x: Any) -> torch.Tensor:
    f = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    return f / torch.linalg.vector_norm(f, dim=1, keepdim=True).clamp_min(1e-12)


def make_release(scheme: str, features: Any, labels: Any, *, num_classes: int, epsilon: float | None = None,
                 delta: float = 1e-5, components: int = 10, covariance: str = "diag", seed: int = 0) -> Release:
    """The defender's release of ``(features, labels)`` under ``scheme``, as the attacker receives it.

    Args:
        scheme: one of :data:`SCHEMES`.
        features: ``[n, d]`` defender features ``E(D_d)`` (unit norm: see :func:`unit_features`).
        labels: ``[n]`` integer labels in ``[0, num_classes)``.
        num_classes: C.
        epsilon, delta: the DP-FedPFT budget of the whole message (natural log; delta public); required for
            ``"dp-fedpft"`` only, refused for the others.
        components: K of the FedPFT mixtures (DP-FedPFT always uses 1).
        covariance: ``"full"``, ``"diag"`` or ``"spherical"``.
        seed: EM initialisation, DP noise and the sampling of synthetic features.
    """
    from privfl.methods.fedpft import (ClassMixture, decode_mixtures, encode_mixtures, fit_class_mixtures,
                                       sample_mixtures)

    if scheme not in SCHEMES:
        raise ConfigError(f"unknown release scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    x = torch.as_tensor(np.asarray(features), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(f"features must be [n, d] with one label each, got {tuple(x.shape)} and {tuple(y.shape)}")
    if (scheme == "dp-fedpft") != (epsilon is not None):
        raise ConfigError(f"epsilon is required for scheme 'dp-fedpft' and only for it (scheme {scheme!r}, "
                          f"epsilon {epsilon!r})")
    if scheme == "raw":
        return Release("raw", x.clone(), y.clone(), set_level=False, epsilon=math.inf,
                       details={"floats": int(x.numel())})
    rng = np.random.default_rng(seed)
    if scheme == "fedpft":
        if isinstance(components, bool) or not isinstance(components, numbers.Integral) or components < 1:
            raise ConfigError(f"components must be an integer >= 1, got {components!r}")
        mixtures = fit_class_mixtures(x, y, num_classes=num_classes, components=int(components),
                                      covariance=covariance, seed=seed)
        details = {"components": int(components), "covariance": covariance, "private": False}
        epsilon_out = math.inf
    else:
        from privfl.privacy.dp_gmm import release_class_gaussians

        generator = torch.Generator().manual_seed(seed)
        dp = release_class_gaussians(x.double(), y, num_classes=num_classes, epsilon=epsilon, delta=delta, bound=1.0,
                                     covariance=covariance, components=1, counts="public", relation="replace_one",
                                     generator=generator)
        mixtures = []
        for cls in dp.classes:
            if not cls.released or int(cls.count) == 0:
                continue
            cov = cls.covariance.double().numpy()
            mixtures.append(ClassMixture(label=cls.label, count=int(cls.count), weights=np.ones(1),
                                         means=cls.mean.double().numpy()[None],
                                         covariances=cov[None] if cov.ndim else cov.reshape(1),
                                         covariance_type=covariance))
        details = {"components": 1, "covariance": covariance, "private": True, "delta": float(delta),
                   "counts": "public", "relation": "replace_one within the public class histogram",
                   "sigmas": {k: float(v) for k, v in dp.sigmas.items()}, "calibration": "analytic Gaussian"}
        epsilon_out = float(epsilon)
    wire = decode_mixtures(encode_mixtures(mixtures), covariance=covariance)  # float16, as the server receives it
    synthetic, synthetic_labels = sample_mixtures(wire, rng)
    details["set_size"] = int(len(synthetic))
    return Release(scheme, _normalise(synthetic), torch.as_tensor(synthetic_labels), set_level=True,
                   epsilon=epsilon_out, details=details)


@dataclass(frozen=True)
class AttackRow:
    """One line of the attack table (the paper's Tables 3, 6 and 7: PSNR up, LPIPS down, SSIM up)."""

    source: str
    epsilon: float
    selection: str
    top: str
    n: int
    psnr: float
    lpips: float
    ssim: float
    set_size: int

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["epsilon"] = "inf" if math.isinf(self.epsilon) else self.epsilon
        return out


@dataclass
class ReleaseEvaluation:
    """The rows of one release and what the image grid shows: for each defender image, its reconstruction
    (raw: sample 0 of its own feature; set-level: the closest member of the reconstruction set)."""

    rows: list[AttackRow]
    matched: torch.Tensor
    seconds_sampling: float


def _row(source: str, epsilon: float, selection: str, top: str, targets: torch.Tensor, recons: torch.Tensor,
         lpips: LPIPS, set_size: int) -> AttackRow:
    p = psnr_pairs(targets, recons)
    p = np.where(np.isinf(p), 100.0, p)  # an exact copy is capped at 100 dB so a mean stays finite
    s = ssim_pairs(targets, recons)
    d = lpips(targets, recons).double().numpy()
    return AttackRow(source, epsilon, selection, top, len(targets), float(p.mean()), float(d.mean()), float(s.mean()),
                     set_size)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def evaluate_release(release: Release, reconstructor: Any, targets: Any, *, lpips: LPIPS,
                     samples_per_feature: int = 10, top_fractions: Sequence[float] = (0.01,),
                     guidance_scale: float = 2.0, num_inference_steps: int = 20, seed: int = 0,
                     progress: bool = False) -> ReleaseEvaluation:
    """Reconstruct from ``release`` and score against the defender's evaluated images ``targets``.

    Every released feature is sampled ``samples_per_feature`` times (DDIM from independent starting noise).

    - raw (one feature per target, in the targets' order): **all** scores sample 0 of every target;
      **attacker** keeps the top fraction of features by agreement among their samples and scores their medoids;
      **oracle** keeps the top fraction of targets by the true SSIM of sample 0.
    - set-level: the reconstruction set is sample 0 of every synthetic feature; each target is matched to its
      closest member by SSIM; **all** ("oracle-all" in the paper's Table 7) averages over every target; **oracle**
      keeps the top fraction of targets by matched SSIM; **attacker** keeps the top fraction of synthetic features
      by agreement and scores each medoid against its closest target.

    Args:
        release: from :func:`make_release`.
        reconstructor: a trained :class:`~attacks.reconstructor.Reconstructor`.
        targets: ``[n, C, H, W]`` defender images on [0, 1], at the reconstructor's resolution (after filtering).
        lpips: the LPIPS metric.
        top_fractions: the fractions of the attacker and oracle selections (the paper: 0.01).
    """
    import time

    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    k = int(samples_per_feature)
    if isinstance(samples_per_feature, bool) or k != samples_per_feature or k < 2:
        raise ConfigError(f"samples_per_feature must be an integer >= 2 (the attacker selection compares samples), "
                          f"got {samples_per_feature!r}")
    if not release.set_level and len(release.features) != len(t):
        raise ConfigError(f"a raw release needs one feature per target: {len(release.features)} features, "
                          f"{len(t)} targets")
    m = len(release.features)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    flat = release.features.repeat_interleave(k, dim=0)
    samples = reconstructor.sample(flat, guidance_scale=guidance_scale, num_inference_steps=num_inference_steps,
                                   generator=generator, progress=progress)
    samples = samples.reshape(m, k, *samples.shape[1:])
    seconds = time.perf_counter() - started
    first = samples[:, 0]
    agreement, medoid = agreement_scores(samples.numpy())
    medoids = samples[torch.arange(m), torch.as_tensor(medoid)]
    rows: list[AttackRow] = []
    source, eps = release.scheme, release.epsilon
    if not release.set_level:
        matched = first
        true_ssim = ssim_pairs(t, first)
        rows.append(_row(source, eps, "all", "all", t, first, lpips, m))
        for fraction in top_fractions:
            chosen = torch.as_tensor(top_indices(agreement, fraction))
            rows.append(_row(source, eps, "attacker", _pct(fraction), t[chosen], medoids[chosen], lpips, m))
            chosen = torch.as_tensor(top_indices(true_ssim, fraction))
            rows.append(_row(source, eps, "oracle", _pct(fraction), t[chosen], first[chosen], lpips, m))
    else:
        index, matched_ssim = nearest(t, first)
        matched = first[torch.as_tensor(index)]
        rows.append(_row(source, eps, "all", "all", t, matched, lpips, m))
        for fraction in top_fractions:
            chosen = torch.as_tensor(top_indices(agreement, fraction))
            target_index, _ = nearest(medoids[chosen], t)
            rows.append(_row(source, eps, "attacker", _pct(fraction), t[torch.as_tensor(target_index)],
                             medoids[chosen], lpips, m))
            chosen = torch.as_tensor(top_indices(matched_ssim, fraction))
            rows.append(_row(source, eps, "oracle", _pct(fraction), t[chosen], matched[chosen], lpips, m))
    return ReleaseEvaluation(rows=rows, matched=matched, seconds_sampling=seconds)


def nearest_image_baseline(targets: Any, attacker_images: Any, *, lpips: LPIPS, top_fractions: Sequence[float] = (0.01,),
                           source: str = "nearest attacker image") -> tuple[list[AttackRow], torch.Tensor]:
    """The attacker that saw no release: each target's closest attacker image by SSIM (App. E.4 "train set").

    Returns the rows (all, and oracle at each fraction) and the matched attacker images ``[n, C, H, W]``.
    """
    t = torch.as_tensor(np.asarray(targets), dtype=torch.float32)
    a = torch.as_tensor(np.asarray(attacker_images), dtype=torch.float32)
    index, best = nearest(t, a)
    matched = a[torch.as_tensor(index)]
    rows = [_row(source, math.inf, "all", "all", t, matched, lpips, len(a))]
    for fraction in top_fractions:
        chosen = torch.as_tensor(top_indices(best, fraction))
        rows.append(_row(source, math.inf, "oracle", _pct(fraction), t[chosen], matched[chosen], lpips, len(a)))
    return rows, matched
