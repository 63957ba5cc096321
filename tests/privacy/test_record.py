"""Record-level DP owned by the privacy layer: the declarations a method makes, their events and sensitivities,
the calibration and its cache, the noise keying, the refusals of the DP-SGD fit, and that no method module does
privacy arithmetic of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from accounting import (
    ComposedEvent,
    GaussianEvent,
    NeighboringRelation,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    analytic_gaussian_sigma,
)
from accounting import epsilon as accounting_epsilon
from privfl.errors import ConfigError
from privfl.privacy import record
from privfl.privacy.record import ClippedMean, DPSGDFit, Repeated, round_event
from privfl.privacy.training import TrainingPrivacy

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE


def test_a_clipped_mean_has_sensitivity_two_bound_over_min_samples_and_its_mechanism_records_its_event():
    release = ClippedMean(0.5, 8)
    assert release.certificate().value == 0.125
    assert not release.certificate().n_public
    assert release.event(2.0) == GaussianEvent(sigma=0.25, sensitivity=0.125, relation=ADD_REMOVE)
    mechanism = release.mechanism(2.0, noise="seeded", generator=torch.Generator().manual_seed(0))
    assert mechanism.event == release.event(2.0)
    noise = mechanism.add_noise(torch.zeros(200_000, dtype=torch.float64))
    assert float(noise.std()) == pytest.approx(0.25, rel=0.01)


def test_one_clipped_mean_at_the_analytic_noise_multiplier_of_epsilon_one_prices_at_epsilon_one():
    z = analytic_gaussian_sigma(1.0, 1e-5, 1.0)
    assert accounting_epsilon(round_event((ClippedMean(3.0, 50),), z), 1e-5) == pytest.approx(1.0, abs=2e-3)


def test_a_round_composes_its_declarations_in_order():
    fit = DPSGDFit(steps=3, sampling_rate=0.25)
    assert round_event((fit,), 1.1) == SelfComposedEvent(SubsampledGaussianEvent(1.1, 0.25), 3)
    step = (ClippedMean(1.0, 4), ClippedMean(2.0, 4))
    declared = round_event((fit, Repeated(step, 5)), 1.0)
    means = ComposedEvent((GaussianEvent(sigma=0.5, sensitivity=0.5, relation=ADD_REMOVE),
                           GaussianEvent(sigma=1.0, sensitivity=1.0, relation=ADD_REMOVE)))
    assert declared == ComposedEvent((SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.25), 3),
                                      SelfComposedEvent(means, 5)))
    with pytest.raises(ConfigError, match="declares at least one release"):
        round_event((), 1.0)


def test_a_loop_of_releases_composes_each_step_then_repeats_the_same_step():
    a, b = ClippedMean(1.0, 10).event(2.0), ClippedMean(0.5, 10).event(2.0)
    assert record.made_in_turn([(a, b), (a, b), (a, b)]) == SelfComposedEvent(ComposedEvent((a, b)), 3)
    assert record.made_in_turn([(a,), (b,)]) == ComposedEvent((a, b))
    # the loop's price is the price of its declaration: Repeated((two clipped means), 3)
    declared = Repeated((ClippedMean(1.0, 10), ClippedMean(0.5, 10)), 3).event(2.0)
    assert record.made_in_turn([(a, b)] * 3) == declared
    assert accounting_epsilon(declared, 1e-5) == pytest.approx(accounting_epsilon(ComposedEvent((a, b, a, b, a, b)),
                                                                                  1e-5), rel=1e-9)
    for empty in ([], [()]):
        with pytest.raises(ConfigError, match="at least one step"):
            record.made_in_turn(empty)


def test_a_round_of_local_epochs_is_epochs_times_batches_in_the_clear_and_epochs_over_q_at_record_level():
    from privfl.data import TrainingClient
    from privfl.methods import ModelFactory, get_method

    spec = get_method("mrmtl")
    data = TrainingClient(client_id=0, x_train=torch.zeros(250, 4), y_train=torch.zeros(250, dtype=torch.int64),
                          x_val=torch.zeros(0, 4), y_val=torch.zeros(0, dtype=torch.int64))
    round_config = {"local_steps": 7, "local_epochs": 3, "batch_size": 64}
    kwargs = {"model_factory": ModelFactory("mlp2nn", (4,), 2), "config": spec.config(local_epochs=3, batch_size=64)}
    plain = spec.client(**kwargs)
    assert plain.round_steps(data, round_config) == 3 * 4                 # 3 passes of ceil(250 / 64) batches
    assert plain.round_steps(data, {**round_config, "local_epochs": 0}) == 7
    private = TrainingPrivacy(mode="record", noise_multiplier=1.0, clip=1.0, min_samples=200)
    client = spec.client(**kwargs, privacy=private)
    q = 64 / 200                                                          # public: batch over the public lower bound
    assert client.record_sampling_rate() == q
    assert client.round_steps(data, round_config) == client.record_steps() == 10   # ceil(3 / 0.32): n stays unread


def test_the_calibration_meets_the_target_over_the_participations_and_is_computed_once_per_key():
    record.clear_calibrations()
    privacy = TrainingPrivacy(mode="record", epsilon=2.0, delta=1e-5, min_samples=20)
    calls = []

    def event_at(z):
        calls.append(z)
        return round_event((ClippedMean(1.0, 20),), z)

    key = lambda: "key"   # noqa: E731
    z = record.calibrated_noise_multiplier(privacy, 4, key, event_at)
    assert accounting_epsilon(SelfComposedEvent(event_at(z), 4), 1e-5) == pytest.approx(2.0, abs=1e-2)
    # four Gaussian releases at epsilon 2 overall: each about as noisy as one at epsilon 1
    assert z == pytest.approx(analytic_gaussian_sigma(1.0, 1e-5 / 4, 1.0), rel=0.15)
    count = len(calls)
    assert record.calibrated_noise_multiplier(privacy, 4, key, lambda z: 1 / 0) == z        # reused, not recomputed
    assert len(calls) == count
    assert record.calibrated_noise_multiplier(privacy, 8, key, event_at) > z                 # more rounds, more noise
    fixed = TrainingPrivacy(mode="record", noise_multiplier=1.7)
    # a fixed noise multiplier asks for neither the key nor the event
    assert record.calibrated_noise_multiplier(fixed, 4, lambda: 1 / 0, lambda z: 1 / 0) == 1.7
    record.clear_calibrations()


def test_seeded_noise_is_keyed_by_the_callers_key_of_the_privacy_seed_and_secure_noise_by_none():
    seeded = TrainingPrivacy(mode="record", noise_multiplier=1.0, noise="seeded", noise_seed=7)
    keys = []
    source = record.noise_source(seeded, lambda seed: keys.append(seed) or 1234)
    assert keys == [7] and source["noise"] == "seeded"
    assert torch.equal(torch.randn(3, generator=source["generator"]),
                       torch.randn(3, generator=torch.Generator().manual_seed(1234)))
    secure = TrainingPrivacy(mode="record", noise_multiplier=1.0)
    assert record.noise_source(secure, lambda seed: 1 / 0) == {"noise": "secure", "generator": None}


def test_a_dp_sgd_fit_asked_for_another_plan_or_a_batch_clip_is_refused_before_training():
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    privacy = TrainingPrivacy(mode="record", noise_multiplier=1.0, clip=1.0, min_samples=8)
    plan = DPSGDFit(steps=2, sampling_rate=0.5)
    common = {"batch_size": 4, "noise_multiplier": 1.0, "rng": np.random.default_rng(0)}
    with pytest.raises(ConfigError, match="asked for 5 DP-SGD steps at batch size 4, .* is 2 steps at batch size 4"):
        record.train_dp_sgd(model, x, y, privacy, plan, settings={"lr": 0.1, "steps": 5, "batch_size": 4}, **common)
    with pytest.raises(ConfigError, match="grad_clip=1.0 clips each step's batch gradient"):
        record.train_dp_sgd(model, x, y, privacy, plan,
                            settings={"lr": 0.1, "steps": 2, "batch_size": 4, "grad_clip": 1.0}, **common)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    _, event = record.train_dp_sgd(model, x, y, privacy, plan, settings={"lr": 0.1, "steps": 2, "batch_size": 4},
                                   **common)
    assert event == plan.event(1.0)


#: Names that are privacy arithmetic: sensitivities, mechanisms, the events of single mechanisms.
ARITHMETIC = {"GaussianEvent", "SubsampledGaussianEvent", "GaussianMechanism", "certify_mean_of_clipped",
              "certify_mean_of_batch_means", "certify_gradient_mean", "certify_labelled_mean",
              "analytic_gaussian_sigma", "calibrate_noise_multiplier"}


def test_no_method_module_does_privacy_arithmetic_of_its_own():
    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "privfl" / "methods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("privfl.privacy.sensitivity",
                                                                    "privfl.privacy.mechanisms"):
                found.append(f"{path.name} imports {node.module}")
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.name} imports {a.name}" for a in node.names if a.name in ARITHMETIC]
    assert not found, found
