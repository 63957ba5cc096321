"""Split sample indices over clients: IID, pathological label shards, Dirichlet label skew.

Every function returns ``list[np.ndarray]``, one int64 index array per client in client order, and draws all its
randomness from the ``np.random.Generator`` it is given, so the same generator state gives the same partition.

Example:
    >>> labels = np.repeat(np.arange(10), 100)
    >>> parts = partition_pathological(labels, num_clients=10, shards_per_client=2, rng=np.random.default_rng(0))
    >>> [len(p) for p in parts] == [100] * 10
    True
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privfl.errors import ConfigError

__all__ = ["partition_iid", "partition_pathological", "partition_dirichlet"]


def _check_count(name: str, value: Any) -> int:
    """An integer >= 1 (bools are refused: ``True`` clients is a bug, not one client)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid: it must be an integer >= 1")
    return int(value)


def _check_rng(rng: Any) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ConfigError(
            f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {type(rng).__name__}"
        )
    return rng


def _check_labels(labels: Any) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(f"labels must be a 1-D integer array, got {labels.dtype} of shape {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ConfigError("labels must be >= 0")
    return labels


def partition_iid(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` and deal it into ``num_clients`` parts whose sizes differ by at most one.

    With more clients than samples, the last clients are empty.
    """
    num_samples = int(num_samples)
    if num_samples < 0:
        raise ConfigError(f"num_samples={num_samples!r} is invalid: it must be >= 0")
    num_clients = _check_count("num_clients", num_clients)
    order = _check_rng(rng).permutation(num_samples).astype(np.int64)
    return list(np.array_split(order, num_clients))


def partition_pathological(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """McMahan et al.'s label shards: each client gets ``shards_per_client`` shards of label-sorted samples.

    Indices are sorted by label (stable, so ties keep their original order), cut into
    ``num_clients * shards_per_client`` shards of equal size ``len(labels) // num_shards`` (the remainder, at the
    high-label end, is dropped), and every client receives ``shards_per_client`` distinct shards at random.
    A shard that straddles a class boundary holds two labels, so a client holds at most ``2 * shards_per_client``
    labels, and exactly ``shards_per_client`` at most when every class size is a multiple of the shard size.

    Raises:
        ConfigError: more shards than samples (a shard would be empty), or invalid counts.
    """
    labels = _check_labels(labels)
    num_clients = _check_count("num_clients", num_clients)
    shards_per_client = _check_count("shards_per_client", shards_per_client)
    rng = _check_rng(rng)
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ConfigError(
            f"num_clients * shards_per_client = {num_clients} * {shards_per_client} = {num_shards} shards is more "
            f"than the {len(labels)} samples; use fewer clients or shards per client"
        )
    shard_size = len(labels) // num_shards
    shards = np.argsort(labels, kind="stable")[: num_shards * shard_size].reshape(num_shards, shard_size)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [shards[client_shards].reshape(-1).astype(np.int64) for client_shards in assignment]


def partition_dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per-class Dirichlet label skew (Hsu et al. 2019, as in FedTTA's released code).

    For each class c in turn: shuffle its indices, draw proportions ``p ~ Dir(alpha * 1_num_clients)``, and cut the
    shuffled indices at ``floor(cumsum(p) * n_c)``; client k receives the k-th piece. Small ``alpha`` (e.g. 0.1)
    gives each client few classes, large ``alpha`` (e.g. 100) near-IID mixes. Clients may come out empty; the
    caller decides what to do with them.

    Raises:
        ConfigError: ``alpha`` not finite and > 0, or invalid counts.
    """
    labels = _check_labels(labels)
    num_clients = _check_count("num_clients", num_clients)
    is_number = not isinstance(alpha, bool) and isinstance(alpha, (int, float, np.number))
    if not is_number or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"alpha={alpha!r} is invalid: the Dirichlet concentration must be a finite number > 0")
    rng = _check_rng(rng)
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(num_clients, float(alpha)))
        cuts = np.floor(np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
        for client, piece in enumerate(np.split(members, cuts)):
            pieces[client].append(piece)
    return [np.concatenate(client_pieces).astype(np.int64) for client_pieces in pieces]
