"""Noise calibration: the least noise that meets a target (epsilon, delta).

Epsilon is in natural-log units, delta is a probability, sensitivity is L2.

A single Gaussian release is calibrated with the analytic Gaussian mechanism of Balle and Wang, "Improving the
Gaussian Mechanism for Differential Privacy: Analytical Calibration and Optimal Denoising" (ICML 2018,
arXiv:1805.06530), which is exact for every epsilon > 0. The textbook closed-form calibration is proved only for
epsilon < 1 and under-noises above epsilon of about 8 (see tests/accounting/test_calibration.py); it is not used here.

A DP-SGD schedule (Poisson-sampled Gaussian steps) is calibrated by bisection on an accountant from
:mod:`accounting.accountants`.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable

from accounting.accountants import AccountantName
from accounting.accountants import epsilon as accountant_epsilon
from accounting.events import PrivacyEvent, SelfComposedEvent, SubsampledGaussianEvent
from accounting.limits import NOISE_MULTIPLIER_FLOOR, check_target_delta, check_target_epsilon
from accounting.validation import is_finite, is_int_at_least


def _check_epsilon(value: object, *, allow_zero: bool = False) -> float:
    if not is_finite(value) or float(value) < 0 or (float(value) == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"epsilon must be a finite number {bound}, got {value!r}")
    return float(value)


def _check_delta(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < 1:
        raise ValueError(f"delta must be a probability in (0, 1), got {value!r}")
    return float(value)


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _log_gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """ln delta(sigma) for the Gaussian mechanism; -inf where delta underflows to 0.

    Balle and Wang (2018), Theorem 8: the Gaussian mechanism with noise ``sigma`` and L2 sensitivity ``Delta`` is
    (epsilon, delta)-DP iff  delta >= Phi(Delta/(2 sigma) - epsilon sigma/Delta)
                                     - e^epsilon Phi(-Delta/(2 sigma) - epsilon sigma/Delta).
    Both terms are taken in log space (log_ndtr) so that e^epsilon never overflows and tiny tails keep their digits.
    """
    from scipy.special import log_ndtr  # here: importing scipy takes a noticeable part of a second

    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    log_first = float(log_ndtr(a - b))
    log_second = epsilon + float(log_ndtr(-a - b))
    if log_second >= log_first:  # delta is 0 to within rounding
        return -math.inf
    return log_first + math.log1p(-math.exp(log_second - log_first))


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """The exact delta at which one Gaussian release is (epsilon, delta)-DP.

    Args:
        sigma: standard deviation of the Gaussian noise, in the units of the released value.
        epsilon: target epsilon (natural log), >= 0.
        sensitivity: L2 sensitivity of the released value under the neighbouring relation in use.

    Returns:
        The smallest delta for which the release is (epsilon, delta)-DP (Balle and Wang 2018, Theorem 8).

    >>> round(gaussian_delta(3.7306, 1.0), 7)
    1e-05
    """
    sigma = _check_positive("sigma", sigma)
    epsilon = _check_epsilon(epsilon, allow_zero=True)
    sensitivity = _check_positive("sensitivity", sensitivity)
    return math.exp(_log_gaussian_delta(sigma, epsilon, sensitivity))


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """The smallest noise standard deviation that makes one Gaussian release (epsilon, delta)-DP.

    The analytic Gaussian mechanism (Balle and Wang 2018, Algorithm 1): delta(sigma) of Theorem 8 decreases in sigma,
    so sigma is the root of ln delta(sigma) = ln delta, found with Brent's method on ln sigma. The returned sigma
    satisfies ``gaussian_delta(sigma, epsilon, sensitivity) <= delta``.

    Privacy assumption: ``sensitivity`` bounds the L2 change of the released value between any two neighbouring
    datasets under the relation the release is accounted under; the noise is N(0, sigma^2 I).

    Args:
        epsilon: target epsilon (natural log), finite and > 0.
        delta: target delta, in (0, 1).
        sensitivity: L2 sensitivity, > 0.

    Returns:
        sigma, in the units of the released value (it scales linearly with ``sensitivity``).

    >>> round(analytic_gaussian_sigma(1.0, 1e-5), 3)
    3.731
    """
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    sensitivity = _check_positive("sensitivity", sensitivity)
    log_delta = math.log(delta)

    # Work with unit sensitivity (sigma scales linearly with it) and x = ln sigma. Where delta underflows to 0 the
    # log is clamped to a finite floor far below any representable delta, so Brent's method never sees -inf.
    def excess(x: float) -> float:
        return max(_log_gaussian_delta(math.exp(x), epsilon, 1.0), -1e4) - log_delta

    # 1. Bracket the root: excess decreases from ln(1/delta) > 0 (sigma -> 0) to -inf (sigma -> inf).
    lo = hi = 0.0
    while excess(lo) <= 0:
        lo -= 1.0
    while excess(hi) > 0:
        hi += 1.0
    # 2. Brent's method; the root is unique because delta(sigma) is strictly decreasing.
    from scipy.optimize import brentq

    x = brentq(excess, lo, hi, xtol=1e-14, rtol=4 * sys.float_info.epsilon)
    # 3. Round towards more noise so the guarantee holds, not just approximately.
    sigma = math.exp(x)
    while _log_gaussian_delta(sigma, epsilon, 1.0) > log_delta:
        sigma = math.nextafter(sigma, math.inf)
    return sigma * sensitivity


def noise_multiplier_for_epsilon(
    target_epsilon: float,
    delta: float,
    *,
    sampling_probability: float,
    steps: int,
    accountant: AccountantName = "pld",
    rtol: float = 1e-3,
) -> float:
    """The noise multiplier (sigma / clipping norm) that makes a DP-SGD schedule (target_epsilon, delta)-DP.

    The schedule is ``steps`` Poisson-sampled Gaussian steps with sampling probability ``sampling_probability``
    under add-or-remove-one (DP-SGD as in Opacus), priced by ``accountant``; :func:`calibrate_noise_multiplier`
    finds it.

    Args:
        target_epsilon: epsilon (natural log), finite and > 0.
        delta: delta, in (0, 1).
        sampling_probability: q, the probability that each record enters a step, in (0, 1].
        steps: number of steps, >= 1.
        accountant: "pld" (tight), "rdp" (looser, fast) or "prv" (Opacus' default accountant).
        rtol: relative precision of the returned noise multiplier, > 0.

    >>> round(noise_multiplier_for_epsilon(2.0, 1e-5, sampling_probability=0.01, steps=1000, accountant="rdp"), 2)
    1.02
    """
    if not is_int_at_least(steps, 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return calibrate_noise_multiplier(
        lambda z: SelfComposedEvent(SubsampledGaussianEvent(z, sampling_probability), steps), target_epsilon, delta,
        accountant=accountant, rtol=rtol,
        what=f"{steps} steps at sampling_probability={sampling_probability!r}")


def calibrate_noise_multiplier(event_at: Callable[[float], PrivacyEvent], target_epsilon: float, delta: float, *,
                               accountant: AccountantName = "pld", rtol: float = 1e-3, what: str = "the schedule",
                               ) -> float:
    """The smallest noise multiplier z (to a factor ``1 + rtol``) for which ``event_at(z)`` is
    (target_epsilon, delta)-DP by ``accountant``.

    ``event_at`` describes a whole schedule of releases whose noise is z times their sensitivity (DP-SGD steps, a
    training client's every release over a run), so its epsilon falls as z grows. Found by bisection on ln z between
    :data:`~accounting.limits.NOISE_MULTIPLIER_FLOOR` and 1e6; the returned value always meets the target under that
    accountant. Refused (``ValueError``, naming what would be valid): a target above
    :data:`~accounting.limits.EPSILON_CEILING` or at a delta below :data:`~accounting.limits.DELTA_FLOOR`, one that
    even noise at the floor meets (the schedule spends less whatever the noise: a sampling rate so small that a
    record is almost never sampled, say), and one no noise multiplier up to 1e6 meets.

    >>> from accounting.events import GaussianEvent
    >>> z = calibrate_noise_multiplier(lambda z: SelfComposedEvent(GaussianEvent(z), 4), 1.0, 1e-5)
    >>> round(z, 2), accountant_epsilon(SelfComposedEvent(GaussianEvent(z), 4), 1e-5) <= 1.0
    (7.47, True)
    """
    target_epsilon = check_target_epsilon(_check_epsilon(target_epsilon), "target_epsilon")
    delta = check_target_delta(_check_delta(delta))
    rtol = _check_positive("rtol", rtol)

    def eps_at(noise_multiplier: float) -> float:
        return accountant_epsilon(event_at(noise_multiplier), delta, accountant=accountant)

    # 1. Bracket: eps_at(hi) <= target < eps_at(lo), between the floor the accountants price and 1e6.
    lo, hi = 0.5, 1.0
    while eps_at(hi) > target_epsilon:
        lo, hi = hi, 2.0 * hi
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon={target_epsilon!r} at delta={delta!r} "
                             f"for {what}")
    if hi == 1.0:
        while (spent := eps_at(lo)) <= target_epsilon:
            if lo <= NOISE_MULTIPLIER_FLOOR:
                valid = (f"a target epsilon below {spent:.4g}, or" if spent > 0 else
                         "a larger sampling rate (at this one a record is sampled with probability below delta, "
                         "which epsilon 0 prices), or")
                raise ValueError(
                    f"epsilon={target_epsilon!r} at delta={delta!r} cannot be calibrated for {what}: even the least "
                    f"noise the accountants price (noise multiplier {NOISE_MULTIPLIER_FLOOR:g}) spends only epsilon "
                    f"{spent:.4g}, so no noise multiplier is the least that meets it; give {valid} a noise "
                    f"multiplier >= {NOISE_MULTIPLIER_FLOOR:g} instead of a target")
            lo, hi = max(lo / 2.0, NOISE_MULTIPLIER_FLOOR), lo
    # 2. Bisection in log space, keeping the invariant.
    while hi / lo - 1.0 > rtol:
        mid = math.sqrt(lo * hi)
        if eps_at(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi
