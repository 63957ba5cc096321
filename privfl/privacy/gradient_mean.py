"""A DP release of the gradient of a mean over a client's records: per-record gradients clipped, averaged, noised.

Some training clients send, besides their DP-SGD weight change, the gradient of a mean over their records with
respect to a network's parameters (PeFLL's embedding-network gradient, IT-PFL-HN's encoder regression). Each record's
gradient is clipped to C, the mean is noised for ``2C/min_samples`` under add/remove-one with n private (DP-SGD's
relation, so both compose in one ledger). Entry points: :func:`certify_gradient_mean`,
:func:`release_gradient_mean`.

The argument step by step and the bias of the clipped estimate: docs/privacy.md, "Gradients of a mean over
records".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from accounting import GaussianEvent, NeighboringRelation
from accounting.validation import is_finite, is_int_at_least
from privfl.devices import device_of
from privfl.errors import ConfigError
from privfl.privacy.dp_sgd import check_dp_compatible
from privfl.privacy.mechanisms import GaussianMechanism, NoiseSource, check_noise
from privfl.privacy.per_sample import ClippedGradientSum, PerSampleLoss, flat_views, trained_parameters
from privfl.privacy.sensitivity import SensitivityCertificate, certify_mean_of_clipped

#: Records per call of the clipped-sum engine (bounds the memory of one call's per-record pieces).
CHUNK = 256


def certify_gradient_mean(clip: float, min_samples: int) -> SensitivityCertificate:
    """The L2 sensitivity ``2C / min_samples`` of the mean of per-record gradients clipped to ``clip`` (C), under
    add/remove-one with n private and at least ``min_samples`` (module docstring, steps 2-3).

    >>> certify_gradient_mean(1.0, 8).value
    0.25
    """
    return certify_mean_of_clipped(clip, min_samples, NeighboringRelation.ADD_OR_REMOVE_ONE, n_public=False)


@torch.no_grad()
def release_gradient_mean(model: nn.Module, per_sample_loss: PerSampleLoss, x: torch.Tensor, y: torch.Tensor, *,
                          clip: float, min_samples: int, noise_multiplier: float,
                          params: Iterable[str | nn.Parameter] | None = None, noise: NoiseSource | None = None,
                          generator: torch.Generator | None = None
                          ) -> tuple[dict[str, torch.Tensor], GaussianEvent, SensitivityCertificate]:
    """One DP release of ``(1/n) sum_j clip_C(grad l_j)`` over the client's n records, ``l_j = per_sample_loss(model,
    x[j:j+1], y[j:j+1])``: ``(noisy gradient by parameter name, event, certificate)`` (module docstring).

    Steps: 1. validate (``x`` finite, ``n >= min_samples``, the model free of layers that mix records); 2. certify
    ``2C / min_samples``; 3. the clipped per-record gradients summed (:class:`ClippedGradientSum`, ``CHUNK`` records
    a call), divided by n in float64 (nothing leaves); 4. Gaussian noise of ``noise_multiplier`` times the
    sensitivity. The model's parameters are left as they were (no ``.grad`` is set).

    Args:
        model: the network whose parameters the gradient is taken with respect to.
        per_sample_loss: ``(model, x_batch, y_batch) -> losses (B,)``, record i's loss from record i alone.
        x, y: the client's records (``y`` is handed to the loss as is; pass zeros where it has no labels).
        clip: C, the per-record L2 clip (> 0).
        min_samples: the public lower bound on n the sensitivity is calibrated for (an int >= 2).
        noise_multiplier: sigma / sensitivity (> 0).
        params: the parameters (names or the model's own), by default every parameter with ``requires_grad``.
        noise, generator: the noise source, as :class:`GaussianMechanism` takes them.
    """
    if not is_finite(clip) or clip <= 0:
        raise ConfigError(f"clip (the per-record L2 clip of the gradient) must be a finite number > 0, got {clip!r}")
    if not is_int_at_least(min_samples, 2):
        raise ConfigError("the add/remove-one gradient mean keeps n private and is calibrated to a public lower bound "
                          f"on it: min_samples must be an int >= 2, got {min_samples!r}")
    noise = check_noise(noise, generator)
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or not x.is_floating_point():
        raise ConfigError(f"x must be a floating-point tensor of one client's records, got "
                          f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if not isinstance(y, torch.Tensor) or len(y) != len(x):
        raise ConfigError("y must be a tensor with one entry per record of x")
    if not bool(torch.isfinite(x).all()):
        raise ConfigError("x contains NaN/inf values; nothing was released")
    n = len(x)
    if n < min_samples:
        # n stays out of the message: it is private under add/remove-one (that a client is refused is public)
        raise ConfigError(f"the client has fewer records than the public lower bound min_samples={min_samples} the "
                          "add/remove-one guarantee is calibrated for; nothing was released")
    certificate = certify_gradient_mean(float(clip), int(min_samples))
    mechanism = GaussianMechanism(sensitivity=certificate.value, noise_multiplier=noise_multiplier,
                                  relation=NeighboringRelation.ADD_OR_REMOVE_ONE, noise=noise, generator=generator)
    was_training = model.training
    model.train()    # the validator inspects the layers as they train; the gradients run in the caller's mode
    try:
        check_dp_compatible(model)
    finally:
        model.train(was_training)
    trained = trained_parameters(model, params)
    dtype = next(iter(trained.values())).dtype if trained else torch.get_default_dtype()
    device = device_of(model)   # the sum is kept, and the records are moved, where the model computes
    flat = torch.zeros(sum(p.numel() for p in trained.values()), dtype=dtype, device=device)
    views = flat_views(trained, flat)
    engine = ClippedGradientSum(model, trained, per_sample_loss)
    with torch.enable_grad():
        for start in range(0, n, CHUNK):
            engine(x[start:start + CHUNK].to(device), y[start:start + CHUNK].to(device), float(clip), views)
    noisy = mechanism.add_noise(flat.double() / n)
    out, offset = {}, 0
    for name, p in trained.items():
        out[name] = noisy[offset:offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()
    return out, mechanism.event, certificate


__all__ = ["CHUNK", "certify_gradient_mean", "release_gradient_mean"]
