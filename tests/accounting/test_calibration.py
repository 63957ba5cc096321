"""Calibration: the analytic Gaussian mechanism, and why the classic closed form is not used anywhere else.

This is the one file in the project allowed to write down the classic formula, in order to show that it is wrong.
"""

import math
import re
from pathlib import Path

import dp_accounting
import pytest
from scipy.stats import norm

from accounting import (
    SelfComposedEvent,
    SubsampledGaussianEvent,
    analytic_gaussian_sigma,
    epsilon,
    gaussian_delta,
    noise_multiplier_for_epsilon,
)

ACCOUNTING_DIR = Path(__file__).resolve().parents[2] / "accounting"


def classic_sigma(eps, delta, sensitivity=1.0):
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / eps  # classic formula (Dwork-Roth A.1): eps < 1


@pytest.mark.parametrize(
    ("eps", "expected", "digits"),
    [(1.0, 3.731, 3), (10.0, 0.500, 3), (0.1, 30.75, 2), (20.0, 0.290, 3)],
)
def test_analytic_sigma_pinned_values(eps, expected, digits):
    assert round(analytic_gaussian_sigma(eps, 1e-5), digits) == expected


@pytest.mark.parametrize("eps", [1e-3, 0.1, 1.0, 8.0, 20.0, 100.0, 1000.0])
@pytest.mark.parametrize("delta", [1e-12, 1e-5, 0.1])
def test_analytic_sigma_is_exact_and_agrees_with_dp_accounting(eps, delta):
    sigma = analytic_gaussian_sigma(eps, delta)
    assert gaussian_delta(sigma, eps) <= delta  # the guarantee holds ...
    assert gaussian_delta(sigma * (1 - 1e-9), eps) > delta  # ... and no less noise would do
    assert sigma == pytest.approx(dp_accounting.get_sigma_gaussian(eps, delta), rel=1e-8)


def test_sigma_scales_linearly_with_sensitivity():
    unit = analytic_gaussian_sigma(1.0, 1e-5)
    assert analytic_gaussian_sigma(1.0, 1e-5, sensitivity=2.5) == pytest.approx(2.5 * unit)
    assert gaussian_delta(5.0, 1.0, sensitivity=2.0) == pytest.approx(gaussian_delta(2.5, 1.0))


def test_gaussian_delta_at_epsilon_zero_is_the_total_variation_distance():
    assert gaussian_delta(2.0, 0.0) == pytest.approx(2 * norm.cdf(1 / 4) - 1)


def test_gaussian_delta_decreases_with_noise():
    deltas = [gaussian_delta(s, 1.0) for s in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert deltas == sorted(deltas, reverse=True)
    assert gaussian_delta(1e3, 50.0) == 0.0  # underflows cleanly, never negative or nan


def test_classic_formula_breaks_above_epsilon_about_8_and_wastes_noise_below_1():
    # eps = 10 and 20: the classic sigma is too small; its true delta exceeds the claimed 1e-5.
    assert gaussian_delta(classic_sigma(10.0, 1e-5), 10.0) == pytest.approx(2.3e-5, rel=0.05)
    assert gaussian_delta(classic_sigma(20.0, 1e-5), 20.0) == pytest.approx(1.5e-3, rel=0.05)
    assert classic_sigma(10.0, 1e-5) < analytic_gaussian_sigma(10.0, 1e-5)
    # eps = 1: valid, but 30% more noise than needed.
    assert round(classic_sigma(1.0, 1e-5), 3) == 4.845
    assert round(analytic_gaussian_sigma(1.0, 1e-5), 3) == 3.731
    assert gaussian_delta(classic_sigma(1.0, 1e-5), 1.0) == pytest.approx(4.1e-8, rel=0.05)


def test_the_classic_formula_appears_nowhere_in_the_accounting_package():
    pattern = re.compile(r"1\.25\s*/")
    offenders = [str(p) for p in ACCOUNTING_DIR.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: analytic_gaussian_sigma(0, 1e-5), "epsilon must be a finite number > 0, got 0"),
        (lambda: analytic_gaussian_sigma(-1.0, 1e-5), "epsilon must be a finite number > 0, got -1.0"),
        (lambda: analytic_gaussian_sigma(math.inf, 1e-5), "epsilon must be a finite number > 0, got inf"),
        (lambda: analytic_gaussian_sigma(math.nan, 1e-5), "epsilon must be a finite number > 0, got nan"),
        (lambda: analytic_gaussian_sigma(1.0, 0.0), "delta must be a probability in (0, 1), got 0.0"),
        (lambda: analytic_gaussian_sigma(1.0, 1.0), "delta must be a probability in (0, 1), got 1.0"),
        (lambda: analytic_gaussian_sigma(1.0, 1e-5, sensitivity=0), "sensitivity must be a finite number > 0, got 0"),
        (lambda: gaussian_delta(-2.0, 1.0), "sigma must be a finite number > 0, got -2.0"),
        (lambda: gaussian_delta(1.0, -0.5), "epsilon must be a finite number >= 0, got -0.5"),
        (lambda: noise_multiplier_for_epsilon(1.0, 1e-5, sampling_probability=0.01, steps=0),
         "steps must be an integer >= 1, got 0"),
        (lambda: noise_multiplier_for_epsilon(1.0, 1e-5, sampling_probability=1.5, steps=10),
         "sampling_probability must be a probability in (0, 1], got 1.5"),
        (lambda: noise_multiplier_for_epsilon(1.0, 1e-5, sampling_probability=0.1, steps=10, accountant="gdp"),
         "accountant must be one of 'pld', 'rdp', 'prv', got 'gdp'"),
    ],
)
def test_bad_inputs_name_the_value(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def _schedule_epsilon(noise_multiplier, accountant, steps, q=0.01):
    return epsilon(SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, q), steps), 1e-5, accountant=accountant)


# PLD takes up to half a second per evaluation here, so its tolerance is loose to keep the test fast.
CALIBRATION_CASES = {"rdp": (1000, 1e-3), "pld": (100, 5e-2), "prv": (100, 1e-2)}  # accountant: (steps, rtol)
TARGET_EPSILON = 0.5


@pytest.fixture(scope="module")
def calibrated():
    return {
        accountant: noise_multiplier_for_epsilon(
            TARGET_EPSILON, 1e-5, sampling_probability=0.01, steps=steps, accountant=accountant, rtol=rtol
        )
        for accountant, (steps, rtol) in CALIBRATION_CASES.items()
    }


@pytest.mark.parametrize("accountant", CALIBRATION_CASES)
def test_noise_multiplier_meets_the_target_and_is_nearly_minimal(calibrated, accountant):
    steps, rtol = CALIBRATION_CASES[accountant]
    nm = calibrated[accountant]
    assert _schedule_epsilon(nm, accountant, steps) <= TARGET_EPSILON
    assert _schedule_epsilon(nm / (1 + rtol), accountant, steps) > TARGET_EPSILON


def test_tighter_accountants_need_less_noise(calibrated):
    rdp_100_steps = noise_multiplier_for_epsilon(
        TARGET_EPSILON, 1e-5, sampling_probability=0.01, steps=100, accountant="rdp"
    )
    assert calibrated["pld"] < rdp_100_steps
    assert calibrated["prv"] < rdp_100_steps
