"""Client-level DP for model updates: clip a client's whole update, add Gaussian noise on the client, record the event.

The unit of privacy is a **client**: two federations are neighbours when one client's whole local dataset is replaced
by any other (user-level DP, McMahan et al. 2018). The ledger speaks of ``REPLACE_ONE``; here the "one" is that
client's dataset, not one of its records.

The construction, and why it is the honest one in this house
------------------------------------------------------------
The runtime hands every release to the server one by one, labelled with the client's id (no secure aggregation), and
noise may be added only on the client, in this package, before the release. So the guarantee a client's ledger can
claim is the guarantee of **its own releases as the server sees them**:

1. Clip: Delta <- Delta * min(1, C / ||Delta||_2), with the L2 norm taken over every tensor of the update at once
   (for FedTTA the concatenation (Delta psi, Delta phi)). Two datasets of the client give two updates in the ball of
   radius C, so the L2 sensitivity of the clipped update is the ball's diameter, 2 C.
2. Add N(0, sigma^2 I) with :class:`~privfl.privacy.GaussianMechanism` and record ``GaussianEvent(sigma, 2 C,
   REPLACE_ONE)`` for this release. The ledger composes the client's releases over all the rounds it takes part in.
3. Calibrate sigma for the client's whole life: a client that may release k times (``participations``) must end at
   (epsilon, delta). The k-fold composition of Gaussian mechanisms of sensitivity s and noise sigma has exactly the
   privacy-loss distribution of one Gaussian mechanism of sensitivity sqrt(k) s and noise sigma (the privacy-loss
   random variables are Gaussian, their means and variances add), so sigma = analytic_gaussian_sigma(epsilon, delta,
   sqrt(k) * 2 C). That is the analytic Gaussian mechanism (Balle and Wang 2018), exact, never the classic formula.

Why no amplification by client sampling (no ``SubsampledGaussianEvent`` with q = client fraction): amplification
by subsampling holds only for an observer who does not learn whether the individual was sampled. The server here
receives client i's release under client i's id, so it knows exactly when i took part; the releases it sees are
plain Gaussian releases. Client sampling lowers the number k of a client's releases (that is what the ledger
counts), it does not hide them. Amplification would be honest only for an observer of the aggregate alone (the
published model) under secure aggregation, which this runtime does not implement.

``mode="distributed"`` is the secure-aggregation variant, kept for the record: each of the M clients of a round adds
only 1/sqrt(M) of the noise, so the **sum** of M releases carries sigma_central = sqrt(M) sigma_share, calibrated as
in step 3. The sum is (epsilon, delta)-DP at the client level (``central_event``), but only for an observer who sees
the sum alone and only if all M clients add their share. The ledger records what the server in this runtime really
sees, each share, ``GaussianEvent(sigma_share, 2 C)``, so the ledger's epsilon is the (much larger) honest one.

Units: epsilon natural-log, delta a probability, ``max_norm`` (C) an L2 norm in the units of the update.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping

import torch

from accounting import GaussianEvent, NeighboringRelation, PrivacyBudget, SelfComposedEvent
from accounting import epsilon as accounting_epsilon

from privfl.errors import ConfigError
from privfl.privacy.mechanisms import GaussianMechanism, NoiseSource, check_epsilon_delta

MODES = ("local", "distributed")


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all tensors of ``update`` taken together (as one flattened vector)."""
    return float(torch.sqrt(sum((t.detach().double() ** 2).sum() for t in update.values())))


def clip_update(update: Mapping[str, torch.Tensor], max_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """``update * min(1, max_norm / ||update||_2)`` (joint L2 norm over every tensor) and the norm before clipping.

    >>> clipped, norm = clip_update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    >>> norm, [round(float(v), 3) for v in (clipped["a"], clipped["b"])]
    (5.0, [0.6, 0.8])
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not math.isfinite(max_norm) \
            or max_norm <= 0:
        raise ConfigError(f"max_norm must be a finite number > 0 (L2), got {max_norm!r}")
    norm = update_norm(update)
    if not math.isfinite(norm):
        raise ConfigError("the update to clip contains NaN or inf; its norm (and so its sensitivity) is unbounded")
    scale = min(1.0, float(max_norm) / norm) if norm > 0 else 1.0
    return {k: v.detach() * scale for k, v in update.items()}, norm


@functools.lru_cache(maxsize=64)
def _lifetime_budget(event: GaussianEvent, participations: int, delta: float) -> PrivacyBudget:
    """PLD's epsilon of ``participations`` releases of ``event`` (cached: every release of a run asks for it, and
    one PLD composition takes about 0.2 s)."""
    return PrivacyBudget(epsilon=accounting_epsilon(SelfComposedEvent(event, participations), delta), delta=delta)


class ClientLevelGaussian:
    """Clip-and-noise release of a client's model update, (epsilon, delta)-DP at the client level over its life.

    Privacy assumption: the client releases at most ``participations`` updates in its life, each through
    :meth:`release`, and everything else it sends is data-independent. :meth:`release` counts nothing itself: the
    caller records each release with ``calibrated_for=`` :attr:`lifetime_budget`, and the client's ledger refuses the
    release that would pass it. See the module docstring for the argument.

    Args (keyword-only):
        epsilon, delta: the client-level guarantee after ``participations`` releases (natural log; probability).
        max_norm: C, the L2 norm every update is clipped to.
        participations: k, the most releases the client makes in the run (>= 1).
        mode: ``"local"`` (each release carries the full noise; what the ledger can honestly claim) or
            ``"distributed"`` (each of ``num_shares`` clients adds a 1/sqrt(M) share; the guarantee holds for
            the sum under secure aggregation only).
        num_shares: M, the clients whose shares make up one sum (``"distributed"`` only).
        noise, generator: as for :class:`GaussianMechanism`.

    >>> dp = ClientLevelGaussian(epsilon=4.0, delta=1e-5, max_norm=1.0, participations=100)
    >>> round(dp.sigma, 2), dp.event.sensitivity
    (21.62, 2.0)
    """

    def __init__(self, *, epsilon: float, delta: float, max_norm: float, participations: int, mode: str = "local",
                 num_shares: int = 1, noise: NoiseSource | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.epsilon, self.delta = check_epsilon_delta(epsilon, delta)
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not math.isfinite(max_norm) \
                or max_norm <= 0:
            raise ConfigError(f"max_norm must be a finite number > 0 (L2), got {max_norm!r}")
        if isinstance(participations, bool) or not isinstance(participations, numbers.Integral) or participations < 1:
            raise ConfigError(f"participations must be an integer >= 1 (the client's most releases in the run), "
                              f"got {participations!r}")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if isinstance(num_shares, bool) or not isinstance(num_shares, numbers.Integral) or num_shares < 1:
            raise ConfigError(f"num_shares must be an integer >= 1, got {num_shares!r}")
        if mode == "local" and num_shares != 1:
            raise ConfigError(f"num_shares is for mode='distributed' only, got num_shares={num_shares!r} with "
                              "mode='local'")
        self.max_norm = float(max_norm)
        self.participations = int(participations)
        self.mode = mode
        self.num_shares = int(num_shares)
        # Step 3: one Gaussian of sensitivity sqrt(k) * 2C is the k-fold composition; the share is 1/sqrt(M) of it.
        self.sensitivity = 2.0 * self.max_norm
        life_sensitivity = math.sqrt(self.participations / self.num_shares) * self.sensitivity
        self.mechanism = GaussianMechanism(epsilon=self.epsilon, delta=self.delta, sensitivity=life_sensitivity,
                                           relation=NeighboringRelation.REPLACE_ONE, noise=noise, generator=generator)
        self.sigma = self.mechanism.sigma

    @property
    def event(self) -> GaussianEvent:
        """What one release is, as the server sees it: the event recorded in the client's ledger."""
        return GaussianEvent(sigma=self.sigma, sensitivity=self.sensitivity,
                             relation=NeighboringRelation.REPLACE_ONE)

    @property
    def lifetime_budget(self) -> PrivacyBudget:
        """What the ledger reaches after ``participations`` releases of :attr:`event` (PLD, at ``delta``): the
        ``calibrated_for`` of each release, so that the ledger refuses a release beyond the cap. It is ``epsilon``
        in ``"local"`` mode (step 3 calibrates exactly for it) and more in ``"distributed"`` mode (each share is
        recorded as the server sees it)."""
        return _lifetime_budget(self.event, self.participations, self.delta)

    @property
    def central_event(self) -> SelfComposedEvent:
        """The whole run as seen by an observer of the per-round sums only (secure aggregation; ``"distributed"``)."""
        central = GaussianEvent(sigma=self.sigma * math.sqrt(self.num_shares), sensitivity=self.sensitivity,
                                relation=NeighboringRelation.REPLACE_ONE)
        return SelfComposedEvent(central, self.participations)

    def release(self, update: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], GaussianEvent, float]:
        """Steps 1 and 2: the clipped, noised update, its event and the norm before clipping (keep that local)."""
        clipped, norm = clip_update(update, self.max_norm)
        names = list(clipped)
        flat = torch.cat([clipped[k].reshape(-1) for k in names])
        noisy = self.mechanism.add_noise(flat)
        out, start = {}, 0
        for k in names:
            size = clipped[k].numel()
            out[k] = noisy[start:start + size].view_as(clipped[k])
            start += size
        return out, self.event, norm

    def __repr__(self) -> str:
        return (f"ClientLevelGaussian(epsilon={self.epsilon}, delta={self.delta}, max_norm={self.max_norm}, "
                f"participations={self.participations}, mode={self.mode!r}, num_shares={self.num_shares}, "
                f"sigma={self.sigma:.6g})")


__all__ = ["MODES", "ClientLevelGaussian", "clip_update", "update_norm"]
