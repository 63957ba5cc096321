"""Partitions: sizes, label counts, determinism, Dirichlet concentration, validation."""

from __future__ import annotations

import numpy as np
import pytest

from privfl.data import partition_dirichlet, partition_iid, partition_pathological
from privfl.errors import ConfigError

# MNIST-like: 10 classes of 7,000, in scrambled order.
MNIST_LIKE = np.random.default_rng(123).permutation(np.repeat(np.arange(10), 7000))


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _assert_disjoint(parts: list[np.ndarray], num_samples: int) -> np.ndarray:
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == len(everything), "a sample went to two clients"
    assert everything.min(initial=0) >= 0 and everything.max(initial=0) < num_samples
    assert all(p.dtype == np.int64 for p in parts)
    return everything


def test_pathological_gives_every_client_700_samples_of_at_most_two_labels() -> None:
    parts = partition_pathological(MNIST_LIKE, num_clients=100, shards_per_client=2, rng=_rng())
    assert len(parts) == 100 and all(len(p) == 700 for p in parts)
    assert max(len(np.unique(MNIST_LIKE[p])) for p in parts) <= 2
    assert len(_assert_disjoint(parts, len(MNIST_LIKE))) == 70_000


def test_pathological_drops_the_remainder() -> None:
    labels = np.arange(1003) % 10
    parts = partition_pathological(labels, num_clients=10, shards_per_client=2, rng=_rng())
    assert [len(p) for p in parts] == [100] * 10  # 20 shards of 50; 3 samples dropped
    _assert_disjoint(parts, len(labels))


def test_partitions_are_deterministic_in_the_generator_state() -> None:
    for partition in (
        lambda rng: partition_pathological(MNIST_LIKE, 100, 2, rng),
        lambda rng: partition_dirichlet(MNIST_LIKE, 20, 0.5, rng),
        lambda rng: partition_iid(1000, 7, rng),
    ):
        first, again, other = partition(_rng(5)), partition(_rng(5)), partition(_rng(6))
        assert all(np.array_equal(a, b) for a, b in zip(first, again))
        assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_more_shards_than_samples_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="20 shards is more than the 15 samples"):
        partition_pathological(np.arange(15) % 3, num_clients=10, shards_per_client=2, rng=_rng())


def _labels_per_client(parts: list[np.ndarray]) -> float:
    return float(np.mean([len(np.unique(MNIST_LIKE[p])) for p in parts if len(p)]))


def _mean_label_entropy(parts: list[np.ndarray]) -> float:
    """Mean Shannon entropy (nats) of the clients' label distributions."""
    entropies = []
    for p in parts:
        if len(p):
            freq = np.bincount(MNIST_LIKE[p], minlength=10) / len(p)
            freq = freq[freq > 0]
            entropies.append(float(-(freq * np.log(freq)).sum()))
    return float(np.mean(entropies))


def test_dirichlet_concentration_controls_label_skew() -> None:
    skewed = partition_dirichlet(MNIST_LIKE, num_clients=50, alpha=0.05, rng=_rng())
    mixed = partition_dirichlet(MNIST_LIKE, num_clients=50, alpha=100.0, rng=_rng())
    for parts in (skewed, mixed):
        assert len(_assert_disjoint(parts, len(MNIST_LIKE))) == 70_000  # every sample placed exactly once
    assert _labels_per_client(skewed) < 5.0 and _labels_per_client(mixed) == 10.0
    assert _mean_label_entropy(mixed) > np.log(10) - 0.01  # near uniform
    assert _mean_label_entropy(mixed) - _mean_label_entropy(skewed) > 1.0


def test_dirichlet_may_leave_clients_empty() -> None:
    parts = partition_dirichlet(np.arange(30) % 3, num_clients=40, alpha=0.01, rng=_rng())
    assert len(parts) == 40 and any(len(p) == 0 for p in parts)
    assert sum(len(p) for p in parts) == 30


def test_iid_is_balanced_and_covers_every_sample() -> None:
    parts = partition_iid(1003, num_clients=10, rng=_rng())
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003
    _assert_disjoint(parts, 1003)
    # Shuffled: no client holds a contiguous run of the original order.
    assert not np.array_equal(np.sort(parts[0]), np.arange(parts[0].min(), parts[0].min() + len(parts[0])))


@pytest.mark.parametrize("num_clients", [0, -3, 2.5, True, "10"])
def test_num_clients_must_be_a_positive_integer(num_clients) -> None:
    with pytest.raises(ConfigError, match="num_clients="):
        partition_iid(10, num_clients, _rng())


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
def test_alpha_must_be_finite_and_positive(alpha: float) -> None:
    with pytest.raises(ConfigError, match="alpha="):
        partition_dirichlet(MNIST_LIKE[:100], 5, alpha, _rng())


def test_other_arguments_are_validated() -> None:
    with pytest.raises(ConfigError, match="shards_per_client=0"):
        partition_pathological(MNIST_LIKE, 10, 0, _rng())
    with pytest.raises(ConfigError, match="numpy.random.Generator"):
        partition_iid(10, 2, np.random.RandomState(0))
    with pytest.raises(ConfigError, match="1-D integer array"):
        partition_dirichlet(np.ones(10), 2, 1.0, _rng())
