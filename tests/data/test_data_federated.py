"""build_federation: determinism, the FedTTA MNIST protocol, shifts, validation, and the no-labels guarantee."""

from __future__ import annotations

import copy
import gc
import json
import math
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as tvf

from privfl.data import (
    FederatedDataset,
    FederationSpec,
    NovelClient,
    NovelLabels,
    TrainingClient,
    build_federation,
    load_source,
)
from privfl.errors import ConfigError

SYNTHETIC = FederationSpec(source="synthetic", num_clients=20, partition="pathological", shards_per_client=2)
DIGITS = FederationSpec(source="digits", num_clients=10, partition="iid")


def _tensors(federation: FederatedDataset) -> list[torch.Tensor]:
    tensors = []
    for client in federation.training_clients:
        tensors += [client.x_train, client.y_train, client.x_val, client.y_val]
    for client in federation.novel_clients:
        tensors += [client.x, federation.novel_labels.labels(client.client_id)]
    return tensors


def test_synthetic_federation_is_deterministic_in_the_seed() -> None:
    first, again, other = (build_federation(SYNTHETIC, seed=s) for s in (3, 3, 4))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(first), _tensors(again), strict=True))
    assert [c.client_id for c in first.novel_clients] == [c.client_id for c in again.novel_clients]
    assert not all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(_tensors(first), _tensors(other))
    )


def test_clients_cover_the_ids_with_the_requested_novel_fraction() -> None:
    federation = build_federation(SYNTHETIC, seed=0)
    training_ids = [c.client_id for c in federation.training_clients]
    novel_ids = [c.client_id for c in federation.novel_clients]
    assert sorted(training_ids + novel_ids) == list(range(20)) and len(novel_ids) == 10
    assert all(isinstance(i, int) for i in training_ids + novel_ids)
    assert training_ids == sorted(training_ids) and list(federation.novel_labels) == novel_ids
    # 2000 samples, 40 shards of 50: every client 100 samples, split 85 / 15.
    for client in federation.training_clients:
        assert (client.num_train, client.num_val) == (85, 15)
        assert client.x_train.dtype == torch.float32 and client.y_train.dtype == torch.int64
        assert client.x_train.is_contiguous() and client.label_histogram(10).sum() == 100
    assert federation.training_client(training_ids[0]) is federation.training_clients[0]
    with pytest.raises(KeyError):
        federation.training_client(novel_ids[0])
    assert "10 training clients" in federation.describe() and "10 novel clients" in federation.describe()


def test_fedtta_mnist_protocol_on_the_real_data() -> None:
    federation = build_federation(FederationSpec(), seed=0)  # the defaults are the FedTTA MNIST protocol
    assert len(federation.training_clients) == 50 and len(federation.novel_clients) == 50
    assert all((c.num_train, c.num_val) == (595, 105) for c in federation.training_clients)
    assert all(c.num_samples == 700 and c.x.shape[1:] == (1, 28, 28) for c in federation.novel_clients)
    # Equal label-sorted shards can straddle a class boundary (MNIST classes are not multiples of 350).
    labels_per_client = [int((c.label_histogram(10) > 0).sum()) for c in federation.training_clients]
    assert np.mean(labels_per_client) < 2.3 and max(labels_per_client) <= 4
    pooled = torch.cat([c.x_train for c in federation.training_clients])
    assert abs(float(pooled.mean())) < 0.05 and abs(float(pooled.std()) - 1.0) < 0.05  # normalised


def test_novel_client_exposes_no_labels() -> None:
    federation = build_federation(SYNTHETIC, seed=0)
    novel = federation.novel_clients[0]
    hidden = federation.novel_labels.labels(novel.client_id)

    assert not hasattr(novel, "__dict__") and NovelClient.__slots__ == ("client_id", "x")
    referents = [r for r in gc.get_referents(novel) if r is not NovelClient]
    assert len(referents) == 2 and referents[0] == novel.client_id and referents[1] is novel.x
    assert novel.__reduce__()[1] == (novel.client_id, novel.x)
    restored = copy.deepcopy(novel)  # goes through __reduce__, as pickling does
    assert restored.client_id == novel.client_id and torch.equal(restored.x, novel.x)
    assert pickle.dumps(novel)
    with pytest.raises(AttributeError, match="read-only"):
        novel.labels = hidden
    with pytest.raises(AttributeError, match="read-only"):
        novel.x = torch.zeros(1)

    # x owns its storage: no view leads back to anything labelled (training tensors, the evaluator's labels).
    assert novel.x._base is None and novel.x.grad_fn is None
    labelled = [t for t in _tensors(federation) if t is not novel.x]
    labelled += list(vars(federation.novel_labels)["_labels"].values())
    pointer = novel.x.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != pointer for t in labelled)

    # Samples come in random order, so position says nothing about the class.
    for client in federation.novel_clients:
        labels = federation.novel_labels.labels(client.client_id)
        assert len(torch.unique(labels)) <= 2
        assert (labels[1:] != labels[:-1]).sum() > 5


def test_novel_client_copies_a_view_it_is_given() -> None:
    pool = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    novel = NovelClient(3, pool[2:5])
    assert novel.x.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()
    pool.zero_()
    assert novel.x[0, 0] == 8.0 and novel.num_samples == 3


def test_novel_labels_give_copies_and_histograms() -> None:
    hidden = NovelLabels({4: torch.tensor([1, 1, 3])})
    hidden.labels(4)[0] = 0
    assert hidden.labels(4).tolist() == [1, 1, 3] and hidden.histogram(4, 5).tolist() == [0, 2, 0, 1, 0]
    assert 4 in hidden and 5 not in hidden and list(hidden) == [4] and len(hidden) == 1
    with pytest.raises(KeyError, match="no novel client 5"):
        hidden.labels(5)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.2, float("nan")])
def test_novel_fraction_outside_the_open_unit_interval_is_refused(fraction: float) -> None:
    with pytest.raises(ConfigError, match=f"novel_fraction={fraction!r}"):
        FederationSpec(source="synthetic", novel_fraction=fraction)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(partition="shards"), "partition='shards' is invalid; valid choices: pathological, dirichlet, iid"),
        (dict(split="both"), "valid choices: merged, train_test"),
        (dict(source="imagenet"), "valid choices: mnist, digits"),
        (dict(novel_partition="iid"), "applies only to split='train_test'"),
        (dict(split="train_test"), "novel_clients=None"),
        (dict(val_fraction=1.0), r"val_fraction=1.0 is invalid: it must be in \[0, 1\)"),
        (dict(alpha=0.0), "alpha=0.0"),
        (dict(num_clients=1), "num_clients=1"),
        (dict(source="digits", novel_blur_kernel=4), "novel_blur_kernel=4 is invalid: it must be an odd"),
        (dict(source="digits", train_angles=(0, 30)), "give both"),
        (dict(source="digits", train_angles=(0, 30), novel_angles=(15,), angle_assignment="blocks"),
         "angle_assignment='blocks' is invalid; valid choices: random, balanced"),
        (dict(source="digits", angle_assignment="balanced"), "train_angles gives none"),
        (dict(split="client_test", val_fraction=0.0), "partition='pathological' is invalid: split='client_test' needs"),
        (dict(split="client_test", partition="iid"), "val_fraction=0.15 is invalid: .* set val_fraction=0"),
        (dict(split="client_test", partition="iid", val_fraction=0.0, novel_clients=4), "no novel clients"),
        (dict(split="client_test", partition="iid", val_fraction=0.0, train_angles=(0,), novel_angles=(90,)),
         "novel_angles=\\(90.0,\\) is invalid: split='client_test' has no novel clients"),
        (dict(source="synthetic", novel_rotation=15.0), "yields vectors"),
        (dict(source_options={"path": object()}), "source option path="),
    ],
)
def test_spec_validation_names_the_value_and_the_choices(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FederationSpec(**settings)


def test_spec_round_trips_through_json_and_is_hashable() -> None:
    spec = FederationSpec(
        source="synthetic", source_options={"num_samples": 500, "label_shift": 0.5}, split="train_test",
        num_clients=8, novel_clients=4, novel_partition="dirichlet", novel_alpha=0.3, max_samples=300,
    )
    restored = FederationSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert restored == spec and hash(restored) == hash(spec)
    assert copy.deepcopy(spec) == spec and pickle.dumps(spec)
    assert dict(spec.source_options) == {"num_samples": 500, "label_shift": 0.5}
    with pytest.raises(ConfigError, match="unknown federation setting.*colour; valid settings: source"):
        FederationSpec.from_dict({"colour": "red"})


def test_train_test_split_uses_the_test_split_for_novel_clients() -> None:
    spec = FederationSpec(
        source="synthetic", source_options={"label_shift": 1.0}, split="train_test", num_clients=6,
        partition="iid", novel_clients=4, novel_partition="dirichlet", novel_alpha=1.0,
    )
    federation = build_federation(spec, seed=1)
    assert [c.client_id for c in federation.training_clients] == list(range(6))
    assert [c.client_id for c in federation.novel_clients] == [6, 7, 8, 9]
    assert sum(c.num_train + c.num_val for c in federation.training_clients) == 1600
    assert sum(c.num_samples for c in federation.novel_clients) == 400
    source = load_source("synthetic", label_shift=1.0)
    novel_labels = torch.cat([federation.novel_labels.labels(i) for i in federation.novel_labels])
    expected = torch.from_numpy(np.bincount(source.test.y, minlength=10))
    assert torch.equal(torch.bincount(novel_labels, minlength=10), expected)


@pytest.mark.parametrize("options", [{"label_shift": 1.0}, {"covariate_shift": 5.0}])
def test_a_shifted_test_split_is_not_merged_into_training_clients(options) -> None:
    # the synthetic source draws its test split from the shifted distribution; merging would give training clients
    # shifted samples (a quarter of each client's, by chance), where the shift belongs to novel clients only
    spec = FederationSpec(source="synthetic", source_options=options, split="merged", num_clients=10,
                          partition="iid", novel_fraction=0.4)
    with pytest.raises(ConfigError, match="shifted test split.*split='train_test'"):
        build_federation(spec, seed=1)
    assert not load_source("synthetic").test_shifted and load_source("synthetic", **options).test_shifted
    build_federation(FederationSpec(source="synthetic", split="merged", num_clients=10, partition="iid",
                                    novel_fraction=0.4), seed=1)    # no shift: merging is fine


def test_train_test_needs_a_test_split(tmp_path: Path) -> None:
    np.savez(tmp_path / "f.npz", x=np.ones((20, 2)), y=np.arange(20) % 2)
    spec = FederationSpec(source="features", source_options={"path": str(tmp_path / "f.npz")}, split="train_test",
                          num_clients=2, novel_clients=2, partition="iid")
    with pytest.raises(ConfigError, match="needs a test split"):
        build_federation(spec, seed=0)


def test_nan_features_are_refused(tmp_path: Path) -> None:
    x = np.ones((20, 2))
    x[3, 0] = np.inf
    np.savez(tmp_path / "f.npz", x=x, y=np.arange(20) % 2)
    spec = FederationSpec(source="features", source_options={"path": str(tmp_path / "f.npz")}, num_clients=4,
                          partition="iid")
    with pytest.raises(ConfigError, match="NaN or infinite"):
        build_federation(spec, seed=0)


def test_max_samples_and_empty_clients_are_dropped_with_a_warning() -> None:
    spec = FederationSpec(source="synthetic", num_clients=30, partition="dirichlet", alpha=0.01, max_samples=60)
    with pytest.warns(UserWarning, match=r"\d+ of 30 clients received no samples and were dropped"):
        federation = build_federation(spec, seed=0)
    total = sum(c.num_train + c.num_val for c in federation.training_clients)
    total += sum(c.num_samples for c in federation.novel_clients)
    assert total == 60
    assert all(c.num_train >= 1 for c in federation.training_clients)


def test_too_few_non_empty_clients_is_a_config_error() -> None:
    spec = FederationSpec(source="synthetic", source_options={"num_samples": 10, "test_fraction": 0.0},
                          num_clients=20, partition="iid", max_samples=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="only 1 of num_clients=20 clients received samples"):
            build_federation(spec, seed=0)


def test_tiny_clients_may_have_an_empty_validation_split() -> None:
    spec = FederationSpec(source="synthetic", source_options={"num_samples": 120}, num_clients=20, partition="iid")
    federation = build_federation(spec, seed=0)
    assert all((c.num_train, c.num_val) == (6, 0) for c in federation.training_clients)  # 0.15 * 6 < 1


def _same_clients(a: FederatedDataset, b: FederatedDataset) -> tuple[bool, bool]:
    """(training clients identical, novel clients identical)."""
    training = all(torch.equal(x.x_train, y.x_train) and torch.equal(x.x_val, y.x_val)
                   for x, y in zip(a.training_clients, b.training_clients, strict=True))
    novel = all(torch.equal(x.x, y.x) for x, y in zip(a.novel_clients, b.novel_clients, strict=True))
    return training, novel


@pytest.mark.parametrize("shift", [dict(novel_blur_sigma=1.0, novel_blur_kernel=3), dict(novel_rotation=30.0)])
def test_blur_and_rotation_change_novel_clients_only(shift: dict) -> None:
    plain = build_federation(DIGITS, seed=0)
    shifted = build_federation(FederationSpec(source="digits", num_clients=10, partition="iid", **shift), seed=0)
    training_same, novel_same = _same_clients(plain, shifted)
    assert training_same and not novel_same
    for a, b in zip(plain.novel_clients, shifted.novel_clients):
        assert a.client_id == b.client_id and torch.isfinite(b.x).all()


def _raw(x: torch.Tensor, source) -> torch.Tensor:
    return x * torch.tensor(source.std).view(1, -1, 1, 1) + torch.tensor(source.mean).view(1, -1, 1, 1)


def test_concept_shift_angles_come_from_the_right_sets_and_are_applied() -> None:
    source = load_source("digits")
    plain = build_federation(DIGITS, seed=0)
    spec = FederationSpec(source="digits", num_clients=10, partition="iid",
                          train_angles=(0, 30, 60), novel_angles=(15, 45))
    rotated = build_federation(spec, seed=0)
    training_ids = {c.client_id for c in rotated.training_clients}
    assert set(rotated.angles) == training_ids | {c.client_id for c in rotated.novel_clients}
    for client_id, angle in rotated.angles.items():
        assert angle in ((0.0, 30.0, 60.0) if client_id in training_ids else (15.0, 45.0))

    # Each client's images are its unshifted images rotated by its angle (before normalisation, black fill).
    k = next(i for i, c in enumerate(rotated.training_clients) if rotated.angles[c.client_id] != 0)
    pairs = [
        (rotated.training_clients[k].client_id, plain.training_clients[k].x_train, rotated.training_clients[k].x_train),
        (rotated.novel_clients[0].client_id, plain.novel_clients[0].x, rotated.novel_clients[0].x),
    ]
    for client_id, before, after in pairs:
        expected = tvf.rotate(_raw(before, source), rotated.angles[client_id],
                              interpolation=InterpolationMode.BILINEAR, fill=0.0)
        torch.testing.assert_close(_raw(after, source), expected, atol=1e-5, rtol=0)


def test_client_test_holds_out_a_rotated_iid_part_of_the_test_split_per_client_with_balanced_angles() -> None:
    # the cross-silo protocol (Liu et al., NeurIPS 2022) in small: 8 silos, 2 per rotation, each scored on its own
    # part of the test split rotated alike, every training image used, no novel clients
    source = load_source("digits")
    settings = dict(source="digits", split="client_test", num_clients=8, partition="iid", val_fraction=0.0)
    plain = build_federation(FederationSpec(**settings), seed=3)
    rotated = build_federation(FederationSpec(**settings, train_angles=(0, 90, 180, 270),
                                              angle_assignment="balanced"), seed=3)
    assert rotated.angles == {0: 0.0, 1: 0.0, 2: 90.0, 3: 90.0, 4: 180.0, 5: 180.0, 6: 270.0, 7: 270.0}
    assert rotated.novel_clients == [] and len(rotated.novel_labels) == 0
    assert sum(c.num_train for c in rotated.training_clients) == len(source.train.y)
    assert {c.num_val for c in rotated.training_clients} == {len(source.test.y) // 8}
    held_out = torch.cat([c.y_val for c in rotated.training_clients])
    expected_labels = torch.from_numpy(np.bincount(source.test.y, minlength=10))
    assert torch.equal(torch.bincount(held_out, minlength=10), expected_labels)
    for before, after in zip(plain.training_clients, rotated.training_clients, strict=True):
        turns = int(rotated.angles[after.client_id]) // 90     # a quarter turn is exact: the pixels move, unchanged
        for x_plain, x_rotated in ((before.x_train, after.x_train), (before.x_val, after.x_val)):
            expected = torch.rot90(_raw(x_plain, source), turns, dims=(2, 3))
            torch.testing.assert_close(_raw(x_rotated, source), expected, atol=1e-5, rtol=0)
        assert torch.equal(before.y_val, after.y_val)
    # the random assignment still draws what the seed drew before the balanced one existed
    drawn = build_federation(FederationSpec(source="digits", num_clients=10, partition="iid", train_angles=(0, 30, 60),
                                            novel_angles=(15, 45)), seed=0).angles
    assert drawn == {0: 0.0, 4: 30.0, 5: 30.0, 6: 0.0, 8: 0.0, 1: 15.0, 2: 45.0, 3: 45.0, 7: 15.0, 9: 15.0}


def test_training_client_is_a_frozen_record() -> None:
    client = build_federation(SYNTHETIC, seed=0).training_clients[0]
    assert isinstance(client, TrainingClient) and "x_train" not in repr(client)
    with pytest.raises(AttributeError):
        client.client_id = 99
    assert math.isclose(float(client.label_histogram(10).sum()), client.num_train + client.num_val)
