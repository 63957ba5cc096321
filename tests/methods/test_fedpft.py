"""FedPFT / DP-FedPFT: exact payload bytes against the paper's formulas (also where K is capped at n_c, which the
release records), fp16 round trip, sampler counts, the one-shot run through the wire, the chain, the baselines (a
max-probability ensemble that saturated softmax cannot fool, selection on validation data), and DP epsilon per client
through the ledger (the whole requested budget, one jointly calibrated Gaussian)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from accounting import GaussianEvent, epsilon
from privfl.config import RunConfig
from privfl.data import FederationSpec, build_federation
from privfl.errors import ConfigError
from privfl.experiment import build_runtime
from privfl.federation.messages import Message
from privfl.methods import ModelFactory, get_method
from privfl.methods.fedpft import (
    ClassMixture,
    communication_floats,
    decode_mixtures,
    encode_mixtures,
    fit_class_mixtures,
    gmm_floats,
    payload_bytes,
    sample_mixtures,
)
from privfl.methods.fedpft_baselines import (
    MaxProbabilityEnsemble,
    accuracy,
    centralized_head,
    fedavg_head_curve,
    local_heads,
    pooled_validation,
    select_on_validation,
)
from privfl.metrics import score_model
from privfl.privacy.training import TrainingPrivacy

DIM, CLASSES = 12, 4
HEAD = {"head_lr": 5.0, "head_epochs": 10.0}


def spec(**overrides) -> FederationSpec:
    values = dict(source="synthetic", source_options={"num_samples": 1600, "dim": DIM, "num_classes": CLASSES,
                                                      "test_fraction": 0.25},
                  num_clients=4, partition="iid", split="train_test", novel_clients=1, val_fraction=0.0)
    values.update(overrides)
    return FederationSpec(**values)


@pytest.fixture(scope="module")
def federation():
    return build_federation(spec(), seed=0)


def run_fedpft(federation, dp_epsilon=None, dp_delta=1e-5, **method_config):
    privacy = TrainingPrivacy() if dp_epsilon is None else TrainingPrivacy(mode="record", epsilon=dp_epsilon,
                                                                         delta=dp_delta)
    config = RunConfig(federation=federation.spec, method="fedpft", method_config={**HEAD, **method_config},
                       rounds=1, select="last", privacy=privacy)
    runtime = build_runtime(config, federation)
    metrics = runtime.run_round(0)
    return runtime, metrics


def test_paper_formulas_worked_examples():
    # the FedPFT paper's eqs. 9-11 (docs/papers.md, FedPFT): CLIP d=512, C=101, K=10 diag -> 1,035,250 floats;
    # full K=1 -> 13,315,941 floats
    assert communication_floats(512, 10, 101, "diag") == 1_035_250
    assert communication_floats(512, 1, 101, "full") == 13_315_941
    assert communication_floats(512, 1, 101, "spherical") == 514 * 101
    assert payload_bytes(512, 1, 101, "spherical") == 2 * 514 * 101 + 4 * 101


@pytest.mark.parametrize("covariance", ["full", "diag", "spherical"])
def test_payload_bytes_on_the_wire_equal_the_formula(federation, covariance):
    runtime, _ = run_fedpft(federation, components=3, covariance=covariance)
    d, k = DIM, 3
    per_class = {"full": 2 * d + (d * d - d) // 2 + 1, "diag": 2 * d + 1, "spherical": d + 2}[covariance] * k
    for client in federation.training_clients:
        held = int((torch.bincount(client.y_train, minlength=CLASSES) > 0).sum())
        assert held == CLASSES  # iid, 300 samples: every class held with n_c >= K
        assert runtime.wire.bytes_up[client.client_id] == 2 * per_class * held + 4 * held
        assert runtime.wire.bytes_up[client.client_id] == payload_bytes(d, k, held, covariance)
    # non-private: every client's epsilon is infinite
    assert set(runtime.wire.ledgers.epsilons(1e-5).values()) == {math.inf}


def test_payload_bytes_where_k_is_capped_at_the_class_count():
    """Dirichlet(0.1) leaves classes with n_c < K: each such class sends K_eff = n_c components, the wire's bytes are
    the per-class sum of the formula at K_eff, and the release records the cap (no silent K_eff)."""
    fed = build_federation(spec(partition="dirichlet", alpha=0.1, num_clients=4), seed=1)
    k = 20
    runtime, _ = run_fedpft(fed, components=k, covariance="diag")
    capped_somewhere = False
    for client in fed.training_clients:
        counts = torch.bincount(client.y_train, minlength=CLASSES).tolist()
        held = {c: n for c, n in enumerate(counts) if n > 0}
        expected = sum(2 * gmm_floats(DIM, min(k, n), "diag") + 4 for n in held.values())
        assert runtime.wire.bytes_up[client.client_id] == expected
        (record,) = runtime.wire.ledgers[client.client_id].records
        meta = record.metadata
        assert meta["components_requested"] == k
        assert meta["components_effective"] == {str(c): min(k, n) for c, n in held.items()}
        assert meta["capped_classes"] == [c for c, n in held.items() if n < k]
        assert meta["raw_feature_classes"] == [c for c, n in held.items() if n <= k]
        capped_somewhere |= any(n < k for n in held.values())
    assert capped_somewhere  # the partition does exercise n_c < K


def test_fp16_round_trip_and_psd():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6))
    y = np.repeat([0, 2], 100)
    mixtures = fit_class_mixtures(x, y, num_classes=3, components=2, covariance="full", seed=0)
    assert [m.label for m in mixtures] == [0, 2] and [m.count for m in mixtures] == [100, 100]
    arrays = encode_mixtures(mixtures)
    assert arrays["c0.means"].dtype == torch.float16 and arrays["c0.covariances"].shape == (2, 21)
    decoded = decode_mixtures(arrays, covariance="full")
    for a, b in zip(mixtures, decoded):
        np.testing.assert_allclose(b.means, a.means, atol=2e-3)
        np.testing.assert_allclose(b.covariances, a.covariances, atol=5e-3)
        np.testing.assert_array_equal(b.covariances, np.transpose(b.covariances, (0, 2, 1)))
        assert abs(b.weights.sum() - 1) < 1e-12
    # features of std 300 give variances near 9e4, past float16's 65504: refused rather than sent as inf
    large = fit_class_mixtures(x * 300, y, num_classes=3, components=1, covariance="diag", seed=0)
    with pytest.raises(ConfigError, match=r"class 0's mixture does not fit in torch.float16 .*use normalize=True"):
        encode_mixtures(large)


def test_fit_refuses_labels_it_would_drop_or_truncate():
    x = np.random.default_rng(0).normal(size=(6, 3))
    for labels, needle in (([0, 1, 2, 0, 1, 5], r"labels must lie in \[0, 3\), got values in \[0, 5\]"),
                           ([0, 1, 1.5, 0, 1, 2], "labels must be integers")):
        with pytest.raises(ConfigError, match=needle):
            fit_class_mixtures(x, np.array(labels), num_classes=3, components=1, covariance="diag", seed=0)
    with pytest.raises(ConfigError, match="components must be an integer >= 1, got 0"):
        fit_class_mixtures(x, np.arange(6) % 3, num_classes=3, components=0, covariance="diag", seed=0)


def test_k_capped_at_class_size_and_single_sample_class():
    x = np.arange(14, dtype=float).reshape(7, 2)
    y = np.array([0, 0, 0, 1, 1, 1, 2])
    mixtures = fit_class_mixtures(x, y, num_classes=3, components=5, covariance="diag", seed=0)
    assert [m.components for m in mixtures] == [3, 3, 1]
    np.testing.assert_array_equal(mixtures[2].means, [[12.0, 13.0]])  # one sample: the mean is the raw feature


def test_sampler_draws_the_counts():
    m = ClassMixture(label=3, count=17, weights=np.array([0.5, 0.5]), means=np.zeros((2, 4)),
                     covariances=np.ones((2, 4)), covariance_type="diag")
    other = ClassMixture(label=1, count=5, weights=np.ones(1), means=np.full((1, 4), 9.0),
                         covariances=np.full(1, 1e-6), covariance_type="spherical")
    x, y = sample_mixtures([m, other], np.random.default_rng(0))
    assert np.bincount(y, minlength=4).tolist() == [0, 5, 0, 17]
    np.testing.assert_allclose(x[y == 1], 9.0, atol=0.01)
    x, y = sample_mixtures([m, other], np.random.default_rng(0), samples_per_class=8)
    assert np.bincount(y, minlength=4).tolist() == [0, 8, 0, 8]


def test_a_client_that_sends_no_class_does_not_stop_the_head_and_all_empty_is_named():
    # DP-FedPFT with noisy counts drops the classes whose count rounds to 0: a small client may send nothing at all,
    # after its budget is spent, and the server must still train the head on the others' mixtures.
    torch.manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(30, 5), dim=1)
    y = torch.arange(30) % 3
    full = encode_mixtures(fit_class_mixtures(x, y, num_classes=3, components=2, covariance="diag", seed=0))
    spec = get_method("fedpft")
    strategy = spec.strategy(model_factory=ModelFactory("mlp2nn", (5,), 3), config=spec.make_config(components=2),
                             seed=0, num_training_clients=2)
    metrics = strategy.aggregate_train(0, {0: Message(arrays=full), 1: Message(arrays={})})
    assert metrics["synthetic_samples"] == 30.0 and math.isfinite(metrics["train_loss"])
    with pytest.raises(ConfigError, match="none of the 2 clients' messages holds a class"):
        strategy.synthetic_features(0, {0: Message(arrays={}), 1: Message(arrays={})})


def test_one_shot_accuracy_close_to_centralized(federation):
    runtime, metrics = run_fedpft(federation, components=2, covariance="diag")
    assert metrics["synthetic_samples"] == sum(c.num_train for c in federation.training_clients) == 1200
    novel = federation.novel_clients[0]
    labels = federation.novel_labels.labels(novel.client_id)
    fedpft = 100 * score_model(runtime.novel_client_model(novel), novel.x, labels).accuracy
    head, nbytes = centralized_head(federation, settings=get_method("fedpft").make_config(**HEAD).head_settings(),
                                    seed=0)
    central = accuracy(head, novel.x, labels)
    assert nbytes == 1200 * DIM * 2
    assert central > 80 and fedpft > central - 4
    # one-shot: a second round sends nothing
    before = dict(runtime.wire.bytes_up)
    assert runtime.run_round(1) == {"clients": 4.0}
    assert dict(runtime.wire.bytes_up) == before


def test_decentralized_chain_accumulates(federation):
    fed = build_federation(spec(partition="dirichlet", alpha=0.1, num_clients=4), seed=1)
    runtime, _ = run_fedpft(fed, components=2, covariance="diag", topology="decentralized")
    assert runtime.strategy.train_stages == len(fed.training_clients)
    novel = fed.novel_clients[0]
    labels = fed.novel_labels.labels(novel.client_id)
    chain = [accuracy(runtime.training_client_model(c.client_id), novel.x, labels) for c in fed.training_clients]
    assert chain[-1] > chain[0] + 20  # the first client sees its few classes; the last sees everyone's mixtures
    # every hop is one recorded release
    assert all(len(runtime.wire.ledgers[c.client_id]) == 1 for c in fed.training_clients)


def test_ensemble_is_not_fooled_by_saturated_softmax():
    """Two heads confident in different classes: float32 softmax gives both exactly 1.0, so a max over probabilities
    ties and argmax picks the lower class index; the max-probability rule must pick the head with the larger margin."""
    a, b = nn.Linear(2, 4, bias=True), nn.Linear(2, 4, bias=True)
    with torch.no_grad():
        for head, label, margin in ((a, 1, 40.0), (b, 3, 60.0)):
            head.weight.zero_()
            head.bias.zero_()
            head.bias[label] = margin
    x = torch.zeros(5, 2)
    assert bool((torch.softmax(a(x), 1)[:, 1] == 1.0).all() and (torch.softmax(b(x), 1)[:, 3] == 1.0).all())
    prediction = MaxProbabilityEnsemble([a, b])(x).argmax(1)
    assert prediction.tolist() == [3] * 5
    # and where softmax does not saturate it is the plain max-probability rule
    with torch.no_grad():
        a.bias[1], b.bias[3] = 2.0, 1.5
    assert MaxProbabilityEnsemble([a, b])(x).argmax(1).tolist() == [1] * 5


def test_selection_uses_validation_splits(federation):
    with pytest.raises(ConfigError, match="validation"):
        pooled_validation(federation)  # val_fraction=0: refused rather than silently scored on something else
    fed = build_federation(spec(val_fraction=0.2), seed=0)
    x_val, y_val = pooled_validation(fed)
    assert len(y_val) == sum(c.num_val for c in fed.training_clients) > 0
    settings = get_method("fedpft").make_config(**HEAD).head_settings()
    lr, head, scores = select_on_validation(
        [1e-4, 5.0], fit=lambda lr: centralized_head(fed, settings={**settings, "lr": lr}, seed=0)[0],
        score=lambda head: accuracy(head, x_val, y_val))
    assert lr == 5.0 and scores["5.0"] > scores["0.0001"] + 20 and scores["5.0"] == accuracy(head, x_val, y_val)


def test_baselines_local_ensemble_fedavg(federation):
    settings = get_method("fedpft").make_config(**HEAD).head_settings()
    novel = federation.novel_clients[0]
    labels = federation.novel_labels.labels(novel.client_id)
    heads = local_heads(federation, settings=settings, seed=0)
    assert sorted(heads) == [c.client_id for c in federation.training_clients]
    ensemble = MaxProbabilityEnsemble(list(heads.values()))
    assert accuracy(ensemble, novel.x, labels) > 80
    curve = fedavg_head_curve(federation, rounds=2, lr=1.0, local_steps=5, batch_size=64, seed=0,
                              evaluate=lambda m: accuracy(m, novel.x, labels))
    per_round = 4 * (CLASSES * DIM + CLASSES) * len(federation.training_clients)  # float32 weight changes
    assert [p["bytes_up_total"] for p in curve] == [per_round, 2 * per_round]


def test_dp_epsilon_per_client_through_the_ledger(federation, balle_wang_sigma):
    eps, delta = 1.0, 1e-5
    runtime, _ = run_fedpft(federation, components=1, covariance="spherical", dp_epsilon=eps, dp_delta=delta)
    # spherical, unit-norm features, public counts: S2 = n_c is public, so the only block is S1 (sensitivity 2B = 2),
    # and the whole budget goes to it: sigma = 2 * 3.7306
    epsilons = runtime.wire.ledgers.epsilons(delta)
    for client in federation.training_clients:
        assert epsilons[client.client_id] == pytest.approx(eps, rel=1e-6)  # all of it (the equal split spent 0.695)
        (record,) = runtime.wire.ledgers[client.client_id].records
        assert record.purpose == "dp_gmm"
        assert record.event == GaussianEvent(sigma=record.event.sigma, sensitivity=1.0)
        assert record.metadata["sigmas"]["sum"] == pytest.approx(2 * balle_wang_sigma(eps, delta, 1.0), rel=1e-6)
        assert record.metadata["sigmas"]["sum"] == pytest.approx(7.4612, abs=1e-3)
        assert record.metadata["sigmas"]["second_moment_sum"] == 0.0 and record.metadata["second_moment_from_counts"]
    assert runtime.wire.bytes_up[0] == payload_bytes(DIM, 1, CLASSES, "spherical")


def test_dp_release_records_how_it_was_made_and_its_noise_is_not_the_run_seeds(federation):
    first, _ = run_fedpft(federation, components=1, covariance="spherical", dp_epsilon=1.0)
    second, _ = run_fedpft(federation, components=1, covariance="spherical", dp_epsilon=1.0)
    (record,) = first.wire.ledgers[0].records
    meta = record.metadata
    assert meta["noise"] == "secure" and meta["counts_public"] is True
    assert meta["relation"].startswith("replace_one within the public class histogram")
    assert meta["bytes"] == payload_bytes(DIM, 1, CLASSES, "spherical")
    # the same run seed gives other noise: a server that knows the seed cannot subtract it
    heads = [runtime.strategy.head_weights for runtime in (first, second)]
    assert any(not torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_dp_noisy_counts_calibrate_three_blocks_jointly(federation, balle_wang_sigma):
    runtime, _ = run_fedpft(federation, components=1, covariance="diag", dp_epsilon=2.0, dp_counts="noisy")
    # noisy counts, replace-one with label change: blocks (2B, sqrt2 B^2, sqrt2), each scaled to unit sensitivity,
    # one Gaussian of sensitivity sqrt3 at (2, 1e-5): block b's sigma is Delta_b * sigma_BW(2, 1e-5, sqrt3)
    (record,) = runtime.wire.ledgers[0].records
    joint = balle_wang_sigma(2.0, 1e-5, math.sqrt(3))
    assert record.metadata["sigmas"] == pytest.approx({"sum": 2 * joint, "second_moment_sum": math.sqrt(2) * joint,
                                                       "count": math.sqrt(2) * joint}, rel=1e-6)
    assert runtime.wire.ledgers.epsilons(1e-5)[0] == pytest.approx(2.0, rel=1e-6)
    assert epsilon(record.event, 1e-5) == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("values,name", [
    (dict(components=0), "components"),
    (dict(covariance="tied"), "covariance"),
    (dict(topology="ring"), "topology"),
    (dict(components=1, dp_relation="add_or_remove_one"), "dp_counts"),
])
def test_bad_config_names_the_value(values, name):
    with pytest.raises(ConfigError, match=name):
        get_method("fedpft").make_config(**values)


@pytest.mark.parametrize("values,privacy,name", [
    (dict(components=5), dict(epsilon=1.0), "components must be 1 with DP"),
    (dict(components=1, normalize=False), dict(epsilon=1.0), "normalize must be true with DP"),
    (dict(components=1, topology="decentralized"), dict(epsilon=1.0), "topology must be 'centralized' with DP"),
])
def test_dp_fedpft_settings_it_cannot_hold_under_are_refused_before_the_run(federation, values, privacy, name):
    with pytest.raises(ConfigError, match=name):
        RunConfig(federation=federation.spec, method="fedpft", method_config=values, rounds=1, select="last",
                  privacy=TrainingPrivacy(mode="record", **privacy))


def test_images_are_refused():
    fed = build_federation(FederationSpec(source="digits", num_clients=3, partition="iid"), seed=0)
    config = RunConfig(federation=fed.spec, method="fedpft", rounds=1, select="last", model="mlp2nn")
    with pytest.raises(ConfigError, match="feature vectors"):
        build_runtime(config, fed)
