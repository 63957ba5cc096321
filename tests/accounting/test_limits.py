"""What the accountants price: the noise floor (refused at record, infinite in a history), the target ceiling, and a
PLD grid widened so that every composition is priced in bounded memory, still as an upper bound."""

import math

import dp_accounting
import pytest

import accounting.calibration
import accounting.pld
from accounting import (
    EPSILON_CEILING,
    NOISE_MULTIPLIER_FLOOR,
    GaussianEvent,
    LaplaceEvent,
    LedgerBook,
    PrivacyLedger,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    UnsupportedAccountingError,
    check_supported,
    delta_for_epsilon,
    epsilon,
)
from accounting.calibration import calibrate_noise_multiplier
from accounting.pld import PLD_VALUE_DISCRETIZATION_INTERVAL, composed_pld

DELTA = 1e-5


@pytest.mark.parametrize("event", [
    GaussianEvent(sigma=1e-300),
    GaussianEvent(sigma=0.5, sensitivity=10.0),                       # noise multiplier 0.05
    SelfComposedEvent(SubsampledGaussianEvent(1e-6, 0.01), 100),
    LaplaceEvent(scale=0.01),
])
def test_a_release_below_the_noise_floor_is_refused_when_recorded_and_leaves_no_record(event):
    ledger = PrivacyLedger(0)
    with pytest.raises(UnsupportedAccountingError, match=r"noise multiplier .* below the floor 0\.1 .* use a noise "
                                                         r"multiplier >= 0\.1"):
        ledger.record(event, purpose="descriptor")
    assert len(ledger) == 0 and ledger.spent(DELTA).epsilon == 0.0
    book = LedgerBook()
    relation = "add_or_remove_one" if isinstance(event, SelfComposedEvent) else "replace_one"
    book[1].record(GaussianEvent(1.0, relation=relation), purpose="earlier")
    with pytest.raises(UnsupportedAccountingError, match="below the floor"):
        book.record_for([1, 2], event, purpose="central_aggregate")
    assert len(book[1]) == 1 and 2 not in book


def test_the_floor_itself_is_priced():
    ledger = PrivacyLedger(0)
    ledger.record(GaussianEvent(sigma=NOISE_MULTIPLIER_FLOOR), purpose="descriptor")
    # one Gaussian release at the floor is about (91.8, 1e-5)-DP, what the limits' docstrings say
    assert ledger.spent(DELTA).epsilon == pytest.approx(dp_accounting.get_epsilon_gaussian(0.1, DELTA), abs=1e-3)
    assert 91 < ledger.spent(DELTA).epsilon < 93


def test_a_history_below_the_floor_loads_and_is_priced_as_no_guarantee():
    # a ledger written before the floor existed (what a run at --dp-noise-multiplier 1e-6 left): it loads, every
    # command can report it, and the report is the sound bound infinity rather than a crash
    state = PrivacyLedger(3).state_dict()
    state["records"] = [{"event": GaussianEvent(sigma=1e-6).to_dict(), "purpose": "model_update", "round": 0,
                         "time": 0.0, "metadata": {}}]
    ledger = PrivacyLedger.from_state_dict(state)
    assert ledger.spent(DELTA).epsilon == math.inf
    assert epsilon(GaussianEvent(sigma=1e-300), DELTA) == math.inf
    assert delta_for_epsilon(GaussianEvent(sigma=1e-6), 10.0) == 1.0
    with pytest.raises(UnsupportedAccountingError, match="below the floor"):
        check_supported(GaussianEvent(sigma=1e-6), accountant="rdp")


def test_a_grid_that_would_not_fit_is_widened_and_still_bounds_the_exact_epsilon(monkeypatch):
    # 100 unit Gaussians are one Gaussian of noise multiplier 0.1, whose exact epsilon is known; its default grid
    # holds 2.9 million points. With room for 2^16 the grid is widened about 45 times, and the epsilon read from it
    # is still an upper bound, within a few grid widths of the exact one.
    monkeypatch.setattr(accounting.pld, "PLD_MAX_POINTS", 2 ** 16)
    exact = dp_accounting.get_epsilon_gaussian(0.1, DELTA)
    pld, interval = composed_pld(SelfComposedEvent(GaussianEvent(1.0), 100).leaf_counts())
    assert 40 * PLD_VALUE_DISCRETIZATION_INTERVAL < interval < 50 * PLD_VALUE_DISCRETIZATION_INTERVAL
    assert max(pld._pmf_remove.size, pld._pmf_add.size) <= 2 ** 16
    assert exact <= pld.get_epsilon_for_delta(DELTA) <= exact + 3 * interval


def test_a_self_composition_that_would_not_fit_is_widened_before_it_is_convolved(monkeypatch):
    # one DP-SGD step at q = 0.01 holds 56541 points, its 1000-fold composition 204793: the grid is widened for
    # the composition (the Chernoff bounds dp-accounting truncates it at), not only for the step
    fine_pld, fine_interval = composed_pld(SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 1000).leaf_counts())
    fine = fine_pld.get_epsilon_for_delta(DELTA)
    assert fine_interval == PLD_VALUE_DISCRETIZATION_INTERVAL and fine == pytest.approx(1.8282, abs=1e-4)
    monkeypatch.setattr(accounting.pld, "PLD_MAX_POINTS", 2 ** 16)
    pld, interval = composed_pld(SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 1000).leaf_counts())
    assert interval > 3 * PLD_VALUE_DISCRETIZATION_INTERVAL
    assert max(pld._pmf_remove.size, pld._pmf_add.size) <= 2 ** 16
    assert fine <= pld.get_epsilon_for_delta(DELTA) <= fine + 0.05


def test_a_target_above_the_ceiling_is_refused_before_any_accounting():
    assert EPSILON_CEILING == 50.0
    with pytest.raises(ValueError, match=r"target_epsilon must be at most 50 .*got 1000000\.0"):
        calibrate_noise_multiplier(lambda z: GaussianEvent(z), 1e6, DELTA)


def test_a_target_that_even_the_floor_meets_is_refused_naming_what_would_be_valid(monkeypatch):
    # at sampling rate 1e-9 a record enters 3 steps with probability 3e-9 < delta: epsilon is 0 whatever the noise,
    # so no noise multiplier is the least that meets epsilon 1 (the search used to go on down to 1e-4, gigabytes).
    # The floor is raised to 0.4 here only to keep the test fast (PLD at 0.1 with q = 1e-9 takes seconds).
    monkeypatch.setattr(accounting.calibration, "NOISE_MULTIPLIER_FLOOR", 0.4)
    with pytest.raises(ValueError, match=r"epsilon=1\.0 at delta=1e-05 cannot be calibrated for the schedule: even "
                                         r"the least noise the accountants price \(noise multiplier 0\.4\) spends only "
                                         r"epsilon 0, .*give a larger sampling rate .* or a noise multiplier >= 0\.4"):
        calibrate_noise_multiplier(lambda z: SelfComposedEvent(SubsampledGaussianEvent(z, 1e-9), 3), 1.0, DELTA)
    # a target the floor cannot meet is calibrated as before, above the floor
    z = calibrate_noise_multiplier(lambda z: SelfComposedEvent(GaussianEvent(z), 4), 1.0, DELTA, accountant="rdp")
    assert z > 1.0 and epsilon(SelfComposedEvent(GaussianEvent(z), 4), DELTA, accountant="rdp") <= 1.0


def test_a_delta_the_accountant_cannot_resolve_is_refused_as_a_target():
    # below about 1e-14 the mass the PLD cuts from the tails exceeds delta and epsilon reads infinite whatever the
    # noise (the property test drew delta = 1.2e-38 and a run reported epsilon inf for every client)
    schedule = SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 1000)
    assert math.isfinite(epsilon(schedule, 1e-12)) and epsilon(schedule, 1e-15) == math.inf
    with pytest.raises(ValueError, match=r"delta must be at least 1e-12 .*got 1e-14"):
        calibrate_noise_multiplier(lambda z: GaussianEvent(z), 1.0, 1e-14)
