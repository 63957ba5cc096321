"""Noise mechanisms: the only code in privfl that adds noise to anything that leaves a client.

:class:`GaussianMechanism` releases ``value + N(0, sigma^2 I)`` with sigma calibrated by the analytic Gaussian
mechanism (Balle and Wang 2018, via :func:`accounting.analytic_gaussian_sigma`), which is exact for every epsilon > 0.
Epsilon is natural-log, delta a probability, sensitivity L2 in the units of the released value.

Noise sources (the ``noise`` argument of every mechanism here, recorded in each release's metadata):

- ``"secure"`` (the default): a fresh torch generator seeded with 63 bits of the OS CSPRNG at each call.
- ``"hardened"``: the same OS-seeded generator, and each coordinate drawn as Opacus' ``secure_mode`` draws it
  against floating-point attacks (:func:`standard_normal`); about 3 to 3.5 times the drawing cost
  (``benchmarks/secure_noise.py``).
- ``"seeded"``: a generator the caller holds; reproducible, for research runs only.
"""

from __future__ import annotations

import math
import numbers
import secrets
from typing import Literal

import torch

from accounting import GaussianEvent, NeighboringRelation, analytic_gaussian_sigma
from accounting.validation import is_finite
from privfl.errors import ConfigError
from privfl.privacy.sensitivity import check_relation

NoiseSource = Literal["seeded", "secure", "hardened"]
NOISE_SOURCES = ("seeded", "secure", "hardened")
#: Draws per coordinate of hardened noise: ``2 n`` with n = 2, Opacus' choice (see :func:`standard_normal`).
HARDENED_DRAWS = 4


def check_epsilon_delta(epsilon: object, delta: object) -> tuple[float, float]:
    """Validated ``(epsilon, delta)``; :class:`ConfigError` naming the bad value otherwise."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) \
            or epsilon <= 0:
        raise ConfigError(f"epsilon must be a finite number > 0 (natural log), got {epsilon!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or delta <= 0 or not delta < 1:  # NaN too
        raise ConfigError(f"delta must be a probability in the open interval (0, 1), got {delta!r}")
    return float(epsilon), float(delta)


def check_noise(noise: object, generator: object) -> NoiseSource:
    """Validated noise source: ``"secure"`` and ``"hardened"`` take no generator, ``"seeded"`` needs one; ``None``
    (the default of every mechanism) means ``"seeded"`` when a generator is given and ``"secure"`` otherwise.

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
    if noise != "seeded" and generator is not None:
        raise ConfigError(f"noise={noise!r} draws from an OS-seeded generator; a generator is only for "
                          f"noise='seeded', got generator={generator!r}")
    if noise == "seeded" and generator is None:
        raise ConfigError("noise='seeded' needs an explicit torch.Generator whose seed only the client knows (torch's "
                          "global generator is seeded from the run seed, which the server knows); pass generator=, "
                          "or use noise='secure' (the default)")
    return noise  # type: ignore[return-value]


def os_seeded_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh torch generator on ``device`` seeded with 63 bits of ``secrets.randbits`` (the OS CSPRNG)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(63))
    return generator


def standard_normal(shape: torch.Size | tuple[int, ...], *, generator: torch.Generator, hardened: bool = False,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``N(0, I)`` of ``shape`` from ``generator`` (on the generator's device).

    ``hardened=False``: one ``torch.randn`` draw per coordinate. ``hardened=True``: the mitigation Opacus' DP-SGD
    optimizer applies in ``secure_mode`` (``opacus.optimizers.optimizer._generate_noise``): one draw is thrown away,
    then each coordinate is ``(z_1 + z_2 + z_3 + z_4) / 2`` with the ``z_k`` independent ``N(0, 1)``, again exactly
    ``N(0, 1)`` (variance 4/4). Why: torch samples a Gaussian in floating point, and the set of floating-point values
    its sampler can output is sparse and structured, so an observer of ``value + noise`` can test, for each candidate
    ``value``, whether ``output - value`` is a value the sampler can produce; this distinguished neighbouring inputs
    against DP-SGD in Jin, McMurtry, Rubinstein and Ohrimenko, "Are We There Yet? Timing and Floating-Point Attacks
    on Differential Privacy Systems" (IEEE S&P 2022, arXiv:2112.05307), the Gaussian counterpart of Mironov's
    (CCS 2012) attack on the Laplace mechanism. Holohan and Braghin, "Secure Random Sampling in Differential
    Privacy" (ESORICS 2021, arXiv:2107.10138, section 5.1) sum ``2n`` samples of an infinitely divisible
    distribution instead, which raises the attack's work to about ``2^(p (2n - 1))`` for a p-bit mantissa; with
    float64 (p = 53) and n = 2 that is ``2^159`` against ``2^53`` for one draw, Opacus' argument for n = 2 (float32,
    p = 24: ``2^72`` against ``2^24``).

    This is a mitigation, not a proof: the result is still a floating-point number and the DP proof is for real
    arithmetic; only a discrete Gaussian on a fixed grid (Canonne, Kamath and Steinke 2020) closes the gap. Opacus
    pairs the mitigation with a CSPRNG for every draw (torchcsprng); here the generator is torch's own, seeded from
    the OS CSPRNG by the ``"secure"`` and ``"hardened"`` sources (torchcsprng's last release, 0.2.1 of March 2021,
    is built for torch 1.8 and does not install with the torch 2 this project pins).

    >>> g = torch.Generator().manual_seed(0)
    >>> standard_normal((3,), generator=g, hardened=True).shape
    torch.Size([3])
    """
    if not hardened:
        return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device)
    torch.randn((1, 1), generator=generator, dtype=dtype, device=generator.device)   # thrown away, as in Opacus
    total = torch.zeros(shape, dtype=dtype, device=generator.device)
    for _ in range(HARDENED_DRAWS):
        total += torch.randn(shape, generator=generator, dtype=dtype, device=generator.device)
    return total / math.sqrt(HARDENED_DRAWS)


class GaussianMechanism:
    """Release ``value + N(0, sigma^2 I)``, (epsilon, delta)-DP for a value of L2 sensitivity ``sensitivity``.

    Privacy assumption: ``sensitivity`` bounds ``||f(D) - f(D')||_2`` over all neighbouring D, D' under
    ``relation`` (derive it with :mod:`privfl.privacy.sensitivity`, never type it in), and sigma depends only on
    public quantities (epsilon, delta, sensitivity), never on the data.

    Noise sources:

    - ``"secure"`` (the default without a generator): from a fresh generator seeded with 63 bits of
      ``secrets.randbits`` (the OS CSPRNG) at each call, independent of the experiment seed. Not reproducible, by
      design. One floating-point draw per coordinate, which is open to floating-point attacks (Mironov 2012; Jin et
      al. 2022).
    - ``"hardened"``: as ``"secure"``, with every coordinate the sum of four draws halved (Opacus' ``secure_mode``
      sampler, :func:`standard_normal`), which raises the work of those attacks from about ``2^53`` to ``2^159``
      in float64. Off by default: drawing costs about 3 to 3.5 times as much (``benchmarks/secure_noise.py``). The
      noise has the same distribution, so sigma, :attr:`event` and epsilon are those of ``"secure"``.
    - ``"seeded"``: from ``generator``, which must be given: reproducible, for research runs only; anyone who knows
      the generator's seed can subtract the noise, so the seed must be one only the client holds.

    Args (keyword-only):
        epsilon: target epsilon (natural log), finite and > 0.
        delta: target delta, in (0, 1).
        noise_multiplier: instead of ``epsilon`` and ``delta``: sigma = noise_multiplier * sensitivity, for a release
            that is one of a schedule calibrated as a whole (a training client's every release over a run, whose
            epsilon its ledger composes); ``epsilon`` and ``delta`` are then ``None``.
        sensitivity: L2 sensitivity of the released value, > 0.
        relation: the neighbouring relation ``sensitivity`` holds under (recorded in :attr:`event`).
        noise: ``"secure"``, ``"hardened"`` or ``"seeded"``; by default seeded exactly when ``generator`` is given.
        generator: the torch.Generator for ``"seeded"`` noise (required there, refused with the other two).

    >>> m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    >>> round(m.sigma, 3)
    3.731
    """

    def __init__(self, *, epsilon: float | None = None, delta: float | None = None, sensitivity: float,
                 relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
                 noise: NoiseSource | None = None, generator: torch.Generator | None = None,
                 noise_multiplier: float | None = None) -> None:
        if not is_finite(sensitivity) or sensitivity <= 0:
            raise ConfigError(f"sensitivity must be a finite number > 0 (L2), got {sensitivity!r}")
        self.sensitivity = float(sensitivity)
        self.relation = check_relation(relation)
        self.noise = check_noise(noise, generator)
        self.generator = generator
        self.epsilon: float | None   # both None when noise_multiplier sets sigma
        self.delta: float | None
        if noise_multiplier is None:
            self.epsilon, self.delta = check_epsilon_delta(epsilon, delta)
            self.sigma = analytic_gaussian_sigma(self.epsilon, self.delta, self.sensitivity)
        else:
            if epsilon is not None or delta is not None:
                raise ConfigError(f"give either epsilon and delta or noise_multiplier, got epsilon={epsilon!r}, "
                                  f"delta={delta!r}, noise_multiplier={noise_multiplier!r}")
            if not is_finite(noise_multiplier) or noise_multiplier <= 0:
                raise ConfigError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
            self.epsilon = self.delta = None
            self.sigma = float(noise_multiplier) * self.sensitivity

    @property
    def event(self) -> GaussianEvent:
        """The accounting event of one release by this mechanism."""
        return GaussianEvent(sigma=self.sigma, sensitivity=self.sensitivity, relation=self.relation)

    def _standard_normal(self, like: torch.Tensor) -> torch.Tensor:
        if self.noise != "seeded":
            generator = os_seeded_generator(like.device)
        elif self.generator is not None:
            generator = self.generator
        else:   # refused by check_noise at construction: reached only if generator was set to None since
            raise ConfigError("noise='seeded' needs an explicit torch.Generator whose seed only the client knows, got "
                              "generator=None; pass generator=, or use noise='secure'")
        return standard_normal(like.shape, generator=generator, hardened=self.noise == "hardened",
                               dtype=like.dtype).to(like.device)

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


__all__ = ["HARDENED_DRAWS", "NOISE_SOURCES", "GaussianMechanism", "NoiseSource", "check_epsilon_delta", "check_noise",
           "os_seeded_generator", "standard_normal"]
