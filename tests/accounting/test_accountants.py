"""Accountants: pinned reference values, non-private releases, relation semantics and refusals."""

import functools
import math

import dp_accounting
import pytest

from accounting import (
    ComposedEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighboringRelation,
    NonPrivateEvent,
    PrivacySpent,
    SamplingMethod,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    UnsupportedAccountingError,
    check_supported,
    delta_for_epsilon,
    epsilon,
    gaussian_delta,
    privacy_spent,
)

DELTA = 1e-5
GAUSSIAN_100 = SelfComposedEvent(GaussianEvent(1.0), 100)  # sigma = 1, sensitivity 1, composed 100 times
DP_SGD = SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 1000)  # Poisson q = 0.01, noise 1.0, 1000 steps
WITHOUT_REPLACEMENT = SelfComposedEvent(
    SubsampledGaussianEvent(1.0, 0.25, SamplingMethod.WITHOUT_REPLACEMENT, NeighboringRelation.REPLACE_ONE,
                            population_size=100),
    10,
)


@functools.cache
def cached_epsilon(event, accountant):
    """The slow reference computations (about 4 s for GAUSSIAN_100 by PLD) are shared between tests."""
    return epsilon(event, DELTA, accountant=accountant)


# Reference values (benchmarks/accounting_table.py, table in benchmarks/README.md, "Accounting"): the exact Gaussian
# composition, dp-accounting's RDP and PLD, Opacus' PRV. PLD and RDP are pinned to 4 decimals; the PLD grid of 1e-4
# reaches them.
@pytest.mark.parametrize(
    ("event", "accountant", "expected"),
    [
        (GAUSSIAN_100, "pld", 91.8173),
        (GAUSSIAN_100, "rdp", 96.1163),
        (DP_SGD, "pld", 1.8282),
        (DP_SGD, "rdp", 2.1014),
    ],
    ids=["gaussian100-pld", "gaussian100-rdp", "dpsgd-pld", "dpsgd-rdp"],
)
def test_pinned_epsilons(event, accountant, expected):
    assert round(cached_epsilon(event, accountant), 4) == expected


def test_pinned_prv_epsilons():
    # Opacus' PRV returns an upper bound with eps_error = 0.01, so it is pinned to 2e-3 only.
    assert epsilon(DP_SGD, DELTA, accountant="prv") == pytest.approx(1.8384, abs=2e-3)
    assert epsilon(GAUSSIAN_100, DELTA, accountant="prv") == pytest.approx(91.8295, abs=2e-2)


def test_pld_matches_the_exact_gaussian_composition():
    # 100 compositions of N(0, 1) at sensitivity 1 are exactly one Gaussian with sigma = 0.1.
    eps = cached_epsilon(GAUSSIAN_100, "pld")
    assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(0.1, DELTA), abs=1e-4)
    assert gaussian_delta(0.1, eps) == pytest.approx(DELTA, rel=1e-3)


def test_an_unsampled_gaussian_is_priced_by_sigma_over_sensitivity_whatever_the_relation():
    # The sensitivity given is the one under the event's relation, so the relation does not change the price.
    # (dp-accounting's PLD under REPLACE_ONE would read the same noise as a per-record bound and give 9.997.)
    replace = GaussianEvent(1.0, relation=NeighboringRelation.REPLACE_ONE)
    add_remove = GaussianEvent(1.0, relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    for accountant in ("pld", "rdp"):
        assert epsilon(replace, DELTA, accountant=accountant) == epsilon(add_remove, DELTA, accountant=accountant)
    assert epsilon(replace, DELTA) == pytest.approx(4.3772, abs=1e-4)
    assert epsilon(GaussianEvent(2.0, sensitivity=2.0), DELTA) == epsilon(GaussianEvent(1.0), DELTA)


@pytest.mark.parametrize("accountant", ["pld", "rdp", "prv"])
def test_any_non_private_release_makes_epsilon_infinite(accountant):
    assert epsilon(NonPrivateEvent(), DELTA, accountant=accountant) == math.inf
    assert epsilon(ComposedEvent((DP_SGD, NonPrivateEvent())), DELTA, accountant=accountant) == math.inf


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_delta_for_epsilon(accountant):
    event = SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 100)
    eps = epsilon(event, DELTA, accountant=accountant)
    assert delta_for_epsilon(event, eps, accountant=accountant) == pytest.approx(DELTA, rel=0.05)
    assert delta_for_epsilon(NonPrivateEvent(), 10.0, accountant=accountant) == 1.0
    assert delta_for_epsilon(ComposedEvent(()), 0.0, accountant=accountant) == 0.0


def test_empty_composition_spends_nothing():
    assert epsilon(ComposedEvent(()), DELTA) == 0.0


def test_laplace_is_pure_dp_at_sensitivity_over_scale():
    laplace = LaplaceEvent(2.0, sensitivity=1.0)
    assert 0.49 < epsilon(laplace, DELTA) <= 0.5 + 1e-3
    assert delta_for_epsilon(laplace, 0.5) < 1e-9
    same_ratio = LaplaceEvent(4.0, sensitivity=2.0)
    assert epsilon(same_ratio, DELTA, accountant="rdp") == epsilon(laplace, DELTA, accountant="rdp")


def test_grouping_equal_releases_changes_nothing():
    step = SubsampledGaussianEvent(1.0, 0.01)
    assert epsilon(ComposedEvent((step,) * 50), DELTA) == epsilon(SelfComposedEvent(step, 50), DELTA)


def test_poisson_sampling_with_probability_one_is_the_plain_gaussian():
    full_batch = SubsampledGaussianEvent(1.0, 1.0)
    assert epsilon(full_batch, DELTA) == pytest.approx(epsilon(GaussianEvent(1.0), DELTA), abs=1e-3)


def test_sampling_without_replacement_is_priced_by_rdp_only():
    eps = epsilon(WITHOUT_REPLACEMENT, DELTA, accountant="rdp")
    assert eps < epsilon(SelfComposedEvent(GaussianEvent(1.0), 10), DELTA, accountant="rdp")  # amplification
    with pytest.raises(UnsupportedAccountingError, match="no analysis of sampling without replacement; use "):
        epsilon(WITHOUT_REPLACEMENT, DELTA, accountant="pld")
    with pytest.raises(UnsupportedAccountingError, match="'prv' accountant .* Gaussian releases"):
        epsilon(WITHOUT_REPLACEMENT, DELTA, accountant="prv")


def test_check_supported_is_the_cheap_form_of_the_refusals():
    check_supported(ComposedEvent((DP_SGD, NonPrivateEvent())), accountant="prv")
    check_supported(WITHOUT_REPLACEMENT, accountant="rdp")
    with pytest.raises(UnsupportedAccountingError, match="use accountant='rdp'"):
        check_supported(WITHOUT_REPLACEMENT, accountant="pld")
    with pytest.raises(UnsupportedAccountingError, match="LaplaceEvent"):
        check_supported(LaplaceEvent(1.0), accountant="prv")


def test_prv_refuses_what_it_cannot_price():
    with pytest.raises(UnsupportedAccountingError, match="LaplaceEvent"):
        epsilon(LaplaceEvent(1.0), DELTA, accountant="prv")
    with pytest.raises(UnsupportedAccountingError, match="reports epsilon for a given delta only"):
        delta_for_epsilon(DP_SGD, 1.0, accountant="prv")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: epsilon(DP_SGD, 0.0), "delta must be a probability in (0, 1), got 0.0"),
        (lambda: epsilon(DP_SGD, 1.5), "delta must be a probability in (0, 1), got 1.5"),
        (lambda: epsilon(DP_SGD, DELTA, accountant="gdp"), "accountant must be one of 'pld', 'rdp', 'prv', got 'gdp'"),
        (lambda: epsilon("gaussian", DELTA), "event must be an accounting PrivacyEvent, got 'gaussian'"),
        (lambda: delta_for_epsilon(DP_SGD, -1.0), "epsilon must be a finite number >= 0, got -1.0"),
        (lambda: delta_for_epsilon(DP_SGD, math.inf), "epsilon must be a finite number >= 0, got inf"),
    ],
)
def test_bad_inputs_name_the_value(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_privacy_spent():
    spent = privacy_spent(ComposedEvent((DP_SGD, GaussianEvent(50.0, relation="add_or_remove_one"))), DELTA,
                          accountant="rdp")
    assert spent == PrivacySpent(epsilon=spent.epsilon, delta=DELTA, num_releases=1001, accountant="rdp")
    assert spent.epsilon > cached_epsilon(DP_SGD, "rdp")


def test_an_epsilon_is_the_same_bits_whatever_the_order_its_releases_were_composed_in():
    # composition is exact up to rounding, whose last bits follow the order: epsilon composes one order per multiset,
    # whatever the order the releases were made in or the process's hash seed (a frozenset's order before)
    from accounting import accountants

    a = SelfComposedEvent(SubsampledGaussianEvent(1.1, 0.01), 300)
    b = GaussianEvent(sigma=0.7, sensitivity=0.25, relation="add_or_remove_one")
    c = SelfComposedEvent(SubsampledGaussianEvent(0.9, 0.02), 50)
    forward, backward = ComposedEvent((a, b, c)), ComposedEvent((c, b, a))
    first = epsilon(forward, 1e-5)
    accountants._epsilon_of_leaves.cache_clear()
    assert epsilon(backward, 1e-5) == first
    assert list(accountants.in_canonical_order(reversed(list(forward.leaf_counts().items())))) == \
        list(accountants.in_canonical_order(forward.leaf_counts().items()))
