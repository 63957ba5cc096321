"""What the accountants here price, stated: the least noise, the largest target epsilon and the most memory.

A release whose noise is below :data:`NOISE_MULTIPLIER_FLOOR` protects nothing a number could describe (one such
Gaussian release is already about (92, 1e-5)-DP at the floor, and its privacy loss grows as 1 / z^2 below it), and
pricing it exactly would take memory without bound (dp-accounting's privacy-loss grid of one Gaussian spans about
1 / z^2 + 20 / z, so z = 1e-6 asks for 1e16 points). Such a release is refused when it is recorded
(:func:`accounting.check_supported`, :meth:`accounting.PrivacyLedger.record`); one already in a ledger's history (a
file written before the floor existed) is priced as no guarantee at all, epsilon infinite, which bounds it soundly.

A target epsilon above :data:`EPSILON_CEILING` is refused where noise is calibrated for one by an accountant
(:func:`accounting.calibration.calibrate_noise_multiplier`) and by a run's privacy settings: no calibration here
needs noise below the floor to meet it at a delta up to 0.45 (a Gaussian release at the floor is (50, 0.46)-DP),
and its guarantee (a likelihood ratio of e^50 = 5e21) is none in practice. A target delta below :data:`DELTA_FLOOR`
is refused there too: the accountant cannot resolve it (its epsilon reads infinite whatever the noise).

The PLD accountant's grid of privacy losses (:data:`~accounting.pld.PLD_VALUE_DISCRETIZATION_INTERVAL`) is
coarsened where one distribution would hold more than :data:`PLD_MAX_POINTS` points, so every composition is priced
in bounded memory and time (:mod:`accounting.pld`). A coarser grid is still a pessimistic discretisation: the epsilon
it gives is an upper bound, looser by at most about the grid's width per composed release.

Noise multipliers are sigma / sensitivity (Gaussian) or scale / sensitivity (Laplace); epsilon is natural-log.
"""

from __future__ import annotations

from accounting.events import GaussianEvent, LaplaceEvent, PrivacyEvent, SubsampledGaussianEvent

#: The least noise multiplier of one release the accountants price (see the module docstring).
NOISE_MULTIPLIER_FLOOR = 0.1

#: The largest target epsilon noise is calibrated for (see the module docstring).
EPSILON_CEILING = 50.0

#: The least delta a target is calibrated at: the PLD accountant cuts up to about 1e-15 of probability mass from the
#: tails of each composition (and e^-50 from each Gaussian's noise), pessimistically counted at infinite privacy
#: loss, so below about 1e-14 its epsilon reads infinite (one DP-SGD schedule: 3.9 at 1e-12, 8.6 at 1e-14, infinite
#: at 1e-15). 1e-12 leaves a hundredfold margin.
DELTA_FLOOR = 1e-12

#: The most points of one privacy-loss distribution the PLD accountant builds: about 32 MiB an array, under 1 GiB at
#: the peak of building one. The floor's single release takes 2.9 million points at the default grid.
PLD_MAX_POINTS = 2 ** 22


def noise_multiplier_of(leaf: PrivacyEvent) -> float | None:
    """The noise multiplier of an elementary release (``None`` for one without noise, a non-private release)."""
    if isinstance(leaf, GaussianEvent):
        return leaf.noise_multiplier
    if isinstance(leaf, LaplaceEvent):
        return leaf.scale / leaf.sensitivity
    if isinstance(leaf, SubsampledGaussianEvent):
        return leaf.noise_multiplier
    return None


def below_floor(event: PrivacyEvent) -> str | None:
    """Why ``event`` cannot be priced (a release of noise multiplier below :data:`NOISE_MULTIPLIER_FLOOR`, named),
    or ``None`` when every release in it can."""
    for leaf in event.leaf_counts():
        z = noise_multiplier_of(leaf)
        if z is not None and not z >= NOISE_MULTIPLIER_FLOOR:
            return (f"{leaf!r} has noise multiplier {z:g}, below the floor {NOISE_MULTIPLIER_FLOOR:g} the accountants "
                    f"price (one release at the floor is about (92, 1e-5)-DP; below it the privacy loss grows as "
                    f"1 / z^2): use a noise multiplier >= {NOISE_MULTIPLIER_FLOOR:g}")
    return None


def check_target_delta(delta: float, name: str = "delta") -> float:
    """``delta`` when it is at least :data:`DELTA_FLOOR`; else ``ValueError`` naming it and the floor."""
    if not delta >= DELTA_FLOOR:
        raise ValueError(f"{name} must be at least {DELTA_FLOOR:g} (the least delta the accountants resolve: below it "
                         f"the mass they cut from each composition's tails exceeds delta, and epsilon reads "
                         f"infinite), got {delta!r}")
    return delta


def check_target_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """``epsilon`` when it is at most :data:`EPSILON_CEILING`; else ``ValueError`` naming it and the ceiling."""
    if not epsilon <= EPSILON_CEILING:
        raise ValueError(f"{name} must be at most {EPSILON_CEILING:g} (the largest target noise is calibrated for: "
                         f"a likelihood ratio of e^{EPSILON_CEILING:g} protects nothing, and meeting more would need "
                         f"noise below the floor {NOISE_MULTIPLIER_FLOOR:g} the accountants price), got {epsilon!r}")
    return epsilon


__all__ = ["DELTA_FLOOR", "EPSILON_CEILING", "NOISE_MULTIPLIER_FLOOR", "PLD_MAX_POINTS", "below_floor",
           "check_target_delta", "check_target_epsilon", "noise_multiplier_of"]
