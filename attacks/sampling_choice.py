"""How the attacker chooses the reconstructor's sampling settings on its own held-out pairs (no defender data).

:func:`select_sampling` compares :class:`~attacks.reconstructor_config.SamplingSettings` candidates by the mean SSIM
of their reconstructions; :func:`select_one_step_guidance` chooses the guidance scale of the one-step posterior mean
(:meth:`~attacks.reconstructor.Reconstructor.posterior_mean`) by mean PSNR. Where they enter the attack:
docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attacks.reconstructor_config import SamplingSettings, checked_real
from privfl.errors import ConfigError

__all__ = ["select_one_step_guidance", "select_sampling"]


def select_sampling(reconstructor: Any, features: Any, images: Any, candidates: Any, *, init: Any = None,
                    guide: Any = None, seed: int = 0,
                    progress: bool = False) -> tuple[SamplingSettings, list[dict[str, Any]]]:
    """The sampling settings whose reconstructions of held-out attacker pairs have the highest mean SSIM.

    The attacker holds these pairs out of training, so the choice uses no defender data. Every candidate starts from
    the same noise (one sample per feature), so the scores differ only by the settings; ties go to the earlier
    candidate. Mean PSNR is recorded beside SSIM for the report.

    Args:
        reconstructor: a trained reconstructor (anything with its ``sample`` method).
        features, images: ``[n, d]`` held-out attacker features and their images ``[n, C, H, W]`` on [0, 1].
        candidates: :class:`SamplingSettings` to compare.
        init: ``[n, C, H, W]`` decoder estimates for the candidates with ``init_strength`` (required if any has).
        guide: ``[n, C, H, W]`` the estimates a ``guide_image`` reconstructor reads.

    Returns:
        ``(best settings, [{"settings": ..., "label": ..., "ssim": ..., "psnr": ...} per candidate])``.
    """
    candidates = list(candidates)
    if not candidates or not all(isinstance(c, SamplingSettings) for c in candidates):
        raise ConfigError("select_sampling needs one or more SamplingSettings candidates")
    f, x = _held_out_pairs(features, images)
    if init is None and any(c.init_strength is not None for c in candidates):
        raise ConfigError("a candidate with init_strength needs the decoder's estimates (init)")
    scores = []
    for candidate in candidates:
        generator = torch.Generator().manual_seed(seed)
        extra = {} if guide is None else {"guide": guide}
        recon = reconstructor.sample(f, settings=candidate, generator=generator, progress=progress,
                                     init=init if candidate.init_strength is not None else None, **extra)
        scores.append({"settings": candidate.to_dict(), "label": candidate.label, **_held_out_scores(x, recon)})
    best = max(range(len(candidates)), key=lambda i: (scores[i]["ssim"], -i))
    return candidates[best], scores


def select_one_step_guidance(reconstructor: Any, features: Any, images: Any, scales: Any, *, draws: int,
                             guide: Any = None, seed: int = 0) -> tuple[float, list[dict[str, Any]]]:
    """The guidance scale w of the one-step estimate (:meth:`~attacks.reconstructor.Reconstructor.posterior_mean`)
    whose estimates of held-out attacker pairs have the highest mean PSNR.

    The one-step estimate stands for the posterior mean, the estimate of least squared error, so w is chosen on
    squared error (PSNR); SSIM is recorded beside it. At w = 1 it is the conditional network's estimate; a w a
    little above 1 moves it away from the unconditional one (the attacker's data mean), which lowers the held-out
    squared error when the conditional estimate is shrunk towards that mean more than the true posterior mean is
    (MNIST, the 28 px benchmark reconstructor, 8 draws on 400 held-out pairs: PSNR 17.46 / 17.48 / 17.32 and SSIM
    0.708 / 0.723 / 0.734 at w = 1 / 1.05 / 1.25). The pairs are held out of training, so the choice uses no
    defender data; every scale reads the same noise draws; ties go to the earlier scale.

    Returns:
        ``(best w, [{"guidance_scale": w, "ssim": ..., "psnr": ...} per scale])``.
    """
    scales = [checked_real("guidance scale", w, 0.0, 1e3) for w in scales]
    if not scales:
        raise ConfigError("select_one_step_guidance needs one or more guidance scales")
    f, x = _held_out_pairs(features, images)
    extra = {} if guide is None else {"guide": guide}
    scores = [{"guidance_scale": w, **_held_out_scores(x, reconstructor.posterior_mean(
        f, draws=draws, guidance_scale=w, generator=torch.Generator().manual_seed(seed), **extra))}
        for w in scales]
    best = max(range(len(scales)), key=lambda i: (scores[i]["psnr"], -i))
    return scales[best], scores


def _held_out_pairs(features: Any, images: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out attacker features and their images as float32 tensors; a ConfigError unless they pair up."""
    f, x = (torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v, dtype=torch.float32)
            for v in (features, images))
    if len(f) == 0 or len(f) != len(x):
        raise ConfigError(f"need as many held-out features as images (and at least one), got {len(f)} and {len(x)}")
    return f, x


def _held_out_scores(x: torch.Tensor, recon: torch.Tensor) -> dict[str, float]:
    """Mean SSIM and mean PSNR (an exact copy counted at 100 dB) of reconstructions of held-out images."""
    from attacks.metrics import psnr_pairs, ssim_pairs

    p = psnr_pairs(x, recon)
    return {"ssim": float(ssim_pairs(x, recon).mean()), "psnr": float(np.where(np.isinf(p), 100.0, p).mean())}
