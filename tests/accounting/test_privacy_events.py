"""Events: validation messages, JSON round-trips, relations and the mapping onto dp-accounting events."""

import dataclasses
import json
import math

import dp_accounting
import pytest

from accounting import (
    ComposedEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighboringRelation,
    NonPrivateEvent,
    SamplingMethod,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    event_from_dict,
)

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE = NeighboringRelation.REPLACE_ONE


def without_replacement(noise_multiplier=1.0, q=0.25, n=100):
    return SubsampledGaussianEvent(noise_multiplier, q, SamplingMethod.WITHOUT_REPLACEMENT, REPLACE, population_size=n)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GaussianEvent(-1.0), "sigma must be a finite number > 0, got -1.0"),
        (lambda: GaussianEvent(math.nan), "sigma must be a finite number > 0, got nan"),
        (lambda: GaussianEvent(math.inf), "sigma must be a finite number > 0, got inf"),
        (lambda: GaussianEvent("1.0"), "sigma must be a finite number > 0, got '1.0'"),
        (lambda: GaussianEvent(1.0, sensitivity=0), "sensitivity must be a finite number > 0, got 0"),
        (lambda: GaussianEvent(1.0, relation="neighbours"),
         "relation must be one of 'add_or_remove_one', 'replace_one', got 'neighbours'"),
        (lambda: LaplaceEvent(0.0), "scale must be a finite number > 0, got 0.0"),
        (lambda: LaplaceEvent(1.0, sensitivity=-2), "sensitivity must be a finite number > 0, got -2"),
        (lambda: SubsampledGaussianEvent(0.0, 0.1), "noise_multiplier must be a finite number > 0, got 0.0"),
        (lambda: SubsampledGaussianEvent(1.0, 1.5), "sampling_probability must be a probability in (0, 1], got 1.5"),
        (lambda: SubsampledGaussianEvent(1.0, 0), "sampling_probability must be a probability in (0, 1], got 0"),
        (lambda: SubsampledGaussianEvent(1.0, 0.1, "shuffle"),
         "sampling_method must be one of 'poisson', 'without_replacement', 'no_amplification', got 'shuffle'"),
        (lambda: SubsampledGaussianEvent(1.0, 0.1, relation=REPLACE),
         "sampling_method='poisson' is accounted only under relation 'add_or_remove_one', got 'replace_one'"),
        (lambda: SubsampledGaussianEvent(1.0, 0.1, SamplingMethod.WITHOUT_REPLACEMENT, population_size=10),
         "sampling_method='without_replacement' is accounted only under relation 'replace_one', "
         "got 'add_or_remove_one'"),
        (lambda: SubsampledGaussianEvent(1.0, 0.1, SamplingMethod.WITHOUT_REPLACEMENT, REPLACE),
         "population_size must be an integer >= 1, got None"),
        (lambda: without_replacement(q=0.1, n=25), "must be an integer; got 0.1 * 25 = 2.5"),
        (lambda: SubsampledGaussianEvent(1.0, 0.1, population_size=100),
         "population_size is used only with sampling_method='without_replacement', got population_size=100"),
        (lambda: SelfComposedEvent(GaussianEvent(1.0), 0), "count must be an integer >= 1, got 0"),
        (lambda: SelfComposedEvent(GaussianEvent(1.0), True), "count must be an integer >= 1, got True"),
        (lambda: SelfComposedEvent("gaussian", 2), "event must be a PrivacyEvent, got 'gaussian'"),
        (lambda: ComposedEvent([GaussianEvent(1.0), 3]), "events must contain only PrivacyEvent instances, got 3"),
        (lambda: ComposedEvent(GaussianEvent(1.0)), "events must be a sequence of PrivacyEvent"),
    ],
)
def test_bad_parameters_are_refused_with_a_message_naming_the_value(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


def test_a_composition_must_not_mix_neighbouring_relations():
    with pytest.raises(ValueError, match=r"different neighbouring relations \('add_or_remove_one', 'replace_one'\)"):
        ComposedEvent((GaussianEvent(1.0, relation=REPLACE), SubsampledGaussianEvent(1.0, 0.01)))


def test_relations_of_composed_and_non_private_events():
    assert NonPrivateEvent().relation is None
    assert ComposedEvent(()).relation is None
    assert ComposedEvent((NonPrivateEvent(), GaussianEvent(1.0))).relation is REPLACE
    assert SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 5).relation is ADD_REMOVE
    # A non-private release is non-private under every relation, so it composes with either.
    assert ComposedEvent((NonPrivateEvent(), SubsampledGaussianEvent(1.0, 0.01))).relation is ADD_REMOVE


def test_strings_are_accepted_for_enums_and_numbers_are_stored_as_floats():
    event = GaussianEvent(2, relation="add_or_remove_one")
    assert event.relation is ADD_REMOVE
    assert isinstance(event.sigma, float) and event.sigma == 2.0
    assert SubsampledGaussianEvent(1, 0.5, "no_amplification").sampling_method is SamplingMethod.NO_AMPLIFICATION


def test_events_are_frozen_and_hashable():
    event = GaussianEvent(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.sigma = 2.0
    assert len({GaussianEvent(1.0), GaussianEvent(1.0), GaussianEvent(2.0)}) == 2


ALL_EVENTS = [
    GaussianEvent(1.5, sensitivity=0.25),
    GaussianEvent(3.0, relation=ADD_REMOVE),
    LaplaceEvent(2.0, sensitivity=3.0),
    SubsampledGaussianEvent(1.1, 0.01),
    SubsampledGaussianEvent(0.9, 0.3, SamplingMethod.NO_AMPLIFICATION, REPLACE),
    without_replacement(),
    NonPrivateEvent(),
    SelfComposedEvent(SubsampledGaussianEvent(1.1, 0.01), 250),
    ComposedEvent(()),
    ComposedEvent((GaussianEvent(1.0), SelfComposedEvent(ComposedEvent((LaplaceEvent(1.0), NonPrivateEvent())), 3))),
]


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: type(e).__name__)
def test_json_round_trip(event):
    text = json.dumps(event.to_dict())
    restored = event_from_dict(json.loads(text))
    assert restored == event
    assert type(restored) is type(event)
    assert restored.to_dict() == event.to_dict()


def test_event_from_dict_refuses_unknown_and_malformed_dicts():
    with pytest.raises(ValueError, match="event type must be one of .*, got 'gaussian_mixture'"):
        event_from_dict({"type": "gaussian_mixture"})
    with pytest.raises(ValueError, match="malformed 'gaussian' event dict"):
        event_from_dict({"type": "gaussian", "sigma": 1.0, "noise": 2.0})
    with pytest.raises(ValueError, match="malformed 'self_composed' event dict"):
        event_from_dict({"type": "self_composed", "count": 2})
    with pytest.raises(ValueError, match="sigma must be a finite number > 0, got -3"):
        event_from_dict({"type": "gaussian", "sigma": -3})


def test_mapping_onto_dp_accounting_events():
    gaussian = dp_accounting.GaussianDpEvent(1.0)
    assert GaussianEvent(2.0, sensitivity=0.5).to_dp_event() == dp_accounting.GaussianDpEvent(4.0)
    assert LaplaceEvent(3.0, sensitivity=1.5).to_dp_event() == dp_accounting.LaplaceDpEvent(2.0)
    assert SubsampledGaussianEvent(1.0, 0.01).to_dp_event() == dp_accounting.PoissonSampledDpEvent(0.01, gaussian)
    assert without_replacement().to_dp_event() == dp_accounting.SampledWithoutReplacementDpEvent(100, 25, gaussian)
    no_amplification = SubsampledGaussianEvent(1.0, 0.01, SamplingMethod.NO_AMPLIFICATION)
    assert no_amplification.to_dp_event() == gaussian
    assert NonPrivateEvent().to_dp_event() == dp_accounting.NonPrivateDpEvent()
    assert SelfComposedEvent(GaussianEvent(1.0), 7).to_dp_event() == dp_accounting.SelfComposedDpEvent(gaussian, 7)
    composed = ComposedEvent((GaussianEvent(1.0), NonPrivateEvent())).to_dp_event()
    assert composed == dp_accounting.ComposedDpEvent([gaussian, dp_accounting.NonPrivateDpEvent()])


def test_leaf_counts_group_equal_mechanisms():
    a, b = GaussianEvent(1.0), LaplaceEvent(1.0)
    event = SelfComposedEvent(ComposedEvent((a, b, a)), 3)
    assert event.leaf_counts() == {a: 6, b: 3}
    assert event.num_releases == 9
    assert without_replacement().sample_size == 25
    assert SubsampledGaussianEvent(1.0, 0.5).sample_size is None
