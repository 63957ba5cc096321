"""Noise mechanisms: the only code in privfl that adds noise to anything that leaves a client.

:class:`GaussianMechanism` releases ``value + N(0, sigma^2 I)`` with sigma calibrated by the analytic Gaussian
mechanism (Balle and Wang 2018, via :func:`accounting.analytic_gaussian_sigma`), which is exact for every epsilon > 0.
Epsilon is natural-log, delta a probability, sensitivity L2 in the units of the released value.
"""

from __future__ import annotations

import math
import numbers
import secrets
from typing import Literal

import torch

from accounting import GaussianEvent, NeighboringRelation, analytic_gaussian_sigma

from privfl.errors import ConfigError
from privfl.privacy.sensitivity import check_relation

NoiseSource = Literal["seeded", "secure"]
NOISE_SOURCES = ("seeded", "secure")


def check_epsilon_delta(epsilon: object, delta: object) -> tuple[float, float]:
    """Validated ``(epsilon, delta)``; :class:`ConfigError` naming the bad value otherwise."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) \
            or epsilon <= 0:
        raise ConfigError(f"epsilon must be a finite number > 0 (natural log), got {epsilon!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ConfigError(f"delta must be a probability in the open interval (0, 1), got {delta!r}")
    return float(epsilon), float(delta)


def check_noise(noise: object, generator: object) -> NoiseSource:
    """Validated noise source: ``"secure"`` takes no generator, ``"seeded"`` needs one; ``None`` (the default of
    every mechanism) means ``"seeded"`` when a generator is given and ``"secure"`` otherwise.

    Seeded noise without an explicit generator is refused rather than drawn from torch's global generator: every
    runtime seeds that generator from the run seed (which the server knows) before a client works, so such noise
    could be regenerated and subtracted by the server, and the release's epsilon would mean nothing.
    """
    if noise is None:
        noise = "secure" if generator is None else "seeded"
    if noise not in NOISE_SOURCES:
        raise ConfigError(f"noise must be one of {', '.join(map(repr, NOISE_SOURCES))}, got {noise!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigError(f"generator must be a torch.Generator or None, got {generator!r}")
    if noise == "secure" and generator is not None:
        raise ConfigError("noise='secure' draws from an OS-seeded generator; a generator is only for noise='seeded', "
                          f"got generator={generator!r}")
    if noise == "seeded" and generator is None:
        raise ConfigError("noise='seeded' needs an explicit torch.Generator whose seed only the client knows (torch's "
                          "global generator is seeded from the run seed, which the server knows); pass generator=, "
                          "or use noise='secure' (the default)")
    return noise  # type: ignore[return-value]


class GaussianMechanism:
    """Release ``value + N(0, sigma^2 I)``, (epsilon, delta)-DP for a value of L2 sensitivity ``sensitivity``.

    Privacy assumption: ``sensitivity`` bounds ``||f(D) - f(D')||_2`` over all neighbouring D, D' under
    ``relation`` (derive it with :mod:`privfl.privacy.sensitivity`, never type it in), and sigma depends only on
    public quantities (epsilon, delta, sensitivity), never on the data.

    Noise sources:

    - ``"secure"`` (the default without a generator): from a fresh generator seeded with 63 bits of
      ``secrets.randbits`` (the OS CSPRNG) at each call, independent of the experiment seed. Not reproducible, by
      design.
    - ``"seeded"``: from ``generator``, which must be given: reproducible, for research runs only; anyone who knows
      the generator's seed can subtract the noise, so the seed must be one only the client holds. The Gaussian itself
      is still sampled in floating point, which is open to the attacks of Mironov (2012); a discrete Gaussian would
      close that gap.

    Args (keyword-only):
        epsilon: target epsilon (natural log), finite and > 0.
        delta: target delta, in (0, 1).
        sensitivity: L2 sensitivity of the released value, > 0.
        relation: the neighbouring relation ``sensitivity`` holds under (recorded in :attr:`event`).
        noise: ``"secure"`` or ``"seeded"``; by default seeded exactly when ``generator`` is given.
        generator: the torch.Generator for ``"seeded"`` noise (required there, refused with ``"secure"``).

    >>> m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    >>> round(m.sigma, 3)
    3.731
    """

    def __init__(self, *, epsilon: float, delta: float, sensitivity: float,
                 relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
                 noise: NoiseSource | None = None, generator: torch.Generator | None = None) -> None:
        self.epsilon, self.delta = check_epsilon_delta(epsilon, delta)
        if isinstance(sensitivity, bool) or not isinstance(sensitivity, numbers.Real) \
                or not math.isfinite(sensitivity) or sensitivity <= 0:
            raise ConfigError(f"sensitivity must be a finite number > 0 (L2), got {sensitivity!r}")
        self.sensitivity = float(sensitivity)
        self.relation = check_relation(relation)
        self.noise = check_noise(noise, generator)
        self.generator = generator
        self.sigma = analytic_gaussian_sigma(self.epsilon, self.delta, self.sensitivity)

    @property
    def event(self) -> GaussianEvent:
        """The accounting event of one release by this mechanism."""
        return GaussianEvent(sigma=self.sigma, sensitivity=self.sensitivity, relation=self.relation)

    def _standard_normal(self, like: torch.Tensor) -> torch.Tensor:
        if self.noise == "secure":
            generator = torch.Generator(device=like.device)
            generator.manual_seed(secrets.randbits(63))
        else:
            generator = self.generator
        return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=generator.device).to(like.device)

    def add_noise(self, value: torch.Tensor) -> torch.Tensor:
        """``value + N(0, sigma^2 I)``, a new tensor of the same shape and dtype (floating point, all finite)."""
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ConfigError(f"the value to privatise must be a floating-point tensor, got {value!r}")
        if not bool(torch.isfinite(value).all()):
            raise ConfigError("the value to privatise contains NaN or inf; its sensitivity is unbounded")
        return value + self.sigma * self._standard_normal(value)

    def __repr__(self) -> str:
        return (f"GaussianMechanism(epsilon={self.epsilon}, delta={self.delta}, sensitivity={self.sensitivity}, "
                f"relation={self.relation.value!r}, noise={self.noise!r}, sigma={self.sigma:.6g})")


__all__ = ["NOISE_SOURCES", "GaussianMechanism", "NoiseSource", "check_epsilon_delta", "check_noise"]
