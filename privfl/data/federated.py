"""Federated datasets: labelled training clients, and novel clients that arrive later without labels.

:func:`build_federation` turns a :class:`FederationSpec` and a seed into a :class:`FederatedDataset` of
:class:`TrainingClient` objects and :class:`NovelClient` objects, which hold no labels (the evaluator keeps them in
:class:`NovelLabels`). The steps (pools, partition, splits, shifts) and what a novel client can see:
docs/federation.md, "Federated datasets".

Example:
    >>> spec = FederationSpec(source="synthetic", num_clients=10, partition="iid")
    >>> federation = build_federation(spec, seed=0)
    >>> len(federation.training_clients), len(federation.novel_clients)
    (5, 5)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from privfl.data.partition import partition_dirichlet, partition_iid, partition_pathological
from privfl.data.sources import SOURCE_NAMES, SourceData, load_source
from privfl.errors import ConfigError, InternalError

__all__ = ["FederationSpec", "FederatedDataset", "TrainingClient", "NovelClient", "NovelLabels", "build_federation",
           "PARTITIONS", "SPLITS"]

PARTITIONS = ("pathological", "dirichlet", "iid")
SPLITS = ("merged", "train_test", "client_test")
#: How concept-shift angles go to clients: drawn uniformly per client, or in equal contiguous blocks of client ids.
ANGLE_ASSIGNMENTS = ("random", "balanced")
# Sources whose inputs are vectors, on which image shifts are meaningless.
_VECTOR_SOURCES = ("features", "synthetic")
_OPTION_SCALARS = (str, int, float, bool, type(None))


# ---------------------------------------------------------------------------------------------------------------
# spec


class FrozenOptions(Mapping):
    """An immutable, hashable, picklable mapping of source options (JSON scalars, or lists of them as tuples)."""

    __slots__ = ("_items",)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        items = {}
        for key, value in dict(options or {}).items():
            if not isinstance(key, str):
                raise ConfigError(f"source option names must be strings, got {key!r}")
            if isinstance(value, (list, tuple)) and all(isinstance(v, _OPTION_SCALARS) for v in value):
                value = tuple(value)
            elif not isinstance(value, _OPTION_SCALARS):
                raise ConfigError(
                    f"source option {key}={value!r} is invalid: options must be strings, numbers, booleans, None "
                    "or lists of those (so that a run's config.json can record them)"
                )
            items[key] = value
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __repr__(self) -> str:
        return f"FrozenOptions({self._items!r})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (tuples become lists)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self._items.items()}


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.number)) and math.isfinite(value)


def _is_count(value: Any, minimum: int = 1) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and bool(value >= minimum)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is invalid; valid choices: {', '.join(choices)}")


def _require(condition: bool, name: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ConfigError(f"{name}={value!r} is invalid: {requirement}")


@dataclass(frozen=True)
class FederationSpec:
    """Everything that, with a seed, determines a federated dataset.

    Attributes:
        source: data source name (see :data:`privfl.data.SOURCE_NAMES`).
        source_options: options passed to the source (e.g. ``{"path": "feats.npz"}``); stored as a FrozenOptions.
        data_root: folder with torchvision-format data; ``download``: let torchvision fetch missing files there.
        num_clients: ``merged``: all clients (training + novel); ``train_test``, ``client_test``: training clients
            only.
        partition: ``pathological`` (``shards_per_client`` label-sorted shards each), ``dirichlet`` (per-class
            Dir(``alpha``)) or ``iid``.
        novel_fraction: ``merged`` only: fraction of the (non-empty) clients made novel, in (0, 1);
            ``round(fraction * clients)``, at least one of each kind.
        split: ``merged``, ``train_test`` or ``client_test`` (see the module docstring); ``client_test`` needs
            ``partition="iid"`` (a label-skewed part of the test split would not match its client's training labels)
            and ``val_fraction=0`` (the held-out part is the validation split), and has no novel clients.
        novel_clients: ``train_test`` only (required there): how many novel clients to cut from the test split.
        novel_partition, novel_alpha, novel_shards_per_client: ``train_test`` only: the novel clients' partition
            settings; ``None`` means the training value.
        val_fraction: per training client, ``floor(val_fraction * n)`` samples go to validation, in [0, 1); a
            client with ``val_fraction * n < 1`` has an empty validation split.
        max_samples: cap on each pool (the merged pool, or each of the train and test pools), drawn at random.
        novel_blur_sigma, novel_blur_kernel: Gaussian blur of novel clients' images (sigma in pixels, 0 = off;
            odd kernel size in pixels).
        novel_rotation: rotation of novel clients' images, degrees counter-clockwise.
        train_angles, novel_angles: concept shift (rotated MNIST): every training client's images are rotated by
            one angle from ``train_angles``, every novel client's by one from ``novel_angles`` (degrees); give both
            or neither (``client_test``, which has no novel clients: ``train_angles`` only).
        angle_assignment: ``random`` (each client's angle drawn uniformly from its set) or ``balanced`` (the
            clients in increasing id are dealt the angles in order, in contiguous blocks whose sizes differ by at
            most one: 40 clients and 4 angles give clients 0-9 the first angle, 10-19 the second, ...).
    """

    source: str = "mnist"
    source_options: Mapping[str, Any] = field(default_factory=FrozenOptions)
    data_root: str | None = None
    download: bool = False
    num_clients: int = 100
    partition: str = "pathological"
    shards_per_client: int = 2
    alpha: float = 0.1
    novel_fraction: float = 0.5
    split: str = "merged"
    novel_clients: int | None = None
    novel_partition: str | None = None
    novel_alpha: float | None = None
    novel_shards_per_client: int | None = None
    val_fraction: float = 0.15
    max_samples: int | None = None
    novel_blur_sigma: float = 0.0
    novel_blur_kernel: int = 5
    novel_rotation: float = 0.0
    train_angles: tuple[float, ...] = ()
    novel_angles: tuple[float, ...] = ()
    angle_assignment: str = "random"

    def __post_init__(self) -> None:
        self._normalise_types()
        self._validate_source()
        self._validate_partitions()
        self._validate_split()
        self._validate_shifts()

    def _normalise_types(self) -> None:
        """Store options as FrozenOptions, paths as str and angles as tuples of floats, so specs compare and hash."""
        object.__setattr__(self, "source_options", FrozenOptions(self.source_options))
        if self.data_root is not None:
            object.__setattr__(self, "data_root", str(self.data_root))
        for name in ("train_angles", "novel_angles"):
            angles = getattr(self, name)
            _require(isinstance(angles, (list, tuple)) and all(_is_number(a) for a in angles), name, angles,
                     "it must be a list of finite angles in degrees")
            object.__setattr__(self, name, tuple(float(a) for a in angles))

    def _validate_source(self) -> None:
        _choice("source", self.source, SOURCE_NAMES)
        _require(isinstance(self.download, bool), "download", self.download, "it must be true or false")

    def _validate_partitions(self) -> None:
        _choice("partition", self.partition, PARTITIONS)
        _require(_is_count(self.shards_per_client), "shards_per_client", self.shards_per_client,
                 "it must be an integer >= 1")
        _require(_is_number(self.alpha) and self.alpha > 0, "alpha", self.alpha, "it must be a finite number > 0")
        if self.novel_partition is not None:
            _choice("novel_partition", self.novel_partition, PARTITIONS)
        if self.novel_shards_per_client is not None:
            _require(_is_count(self.novel_shards_per_client), "novel_shards_per_client", self.novel_shards_per_client,
                     "it must be an integer >= 1 (or None for shards_per_client)")
        if self.novel_alpha is not None:
            _require(_is_number(self.novel_alpha) and self.novel_alpha > 0, "novel_alpha", self.novel_alpha,
                     "it must be a finite number > 0 (or None for alpha)")
        _require(_is_number(self.val_fraction) and 0 <= self.val_fraction < 1, "val_fraction", self.val_fraction,
                 "it must be in [0, 1)")
        if self.max_samples is not None:
            _require(_is_count(self.max_samples), "max_samples", self.max_samples, "it must be an integer >= 1 or None")

    def _validate_split(self) -> None:
        _choice("split", self.split, SPLITS)
        _require(_is_number(self.novel_fraction) and 0 < self.novel_fraction < 1, "novel_fraction",
                 self.novel_fraction, "it must lie strictly between 0 and 1")
        novel_only = ("novel_clients", "novel_partition", "novel_alpha", "novel_shards_per_client")
        if self.split == "merged":
            _require(_is_count(self.num_clients, 2), "num_clients", self.num_clients,
                     "split='merged' needs an integer >= 2 (at least one training and one novel client)")
            for name in novel_only:
                _require(getattr(self, name) is None, name, getattr(self, name),
                         "it applies only to split='train_test' (in 'merged' novel clients share the partition)")
        elif self.split == "client_test":
            _require(_is_count(self.num_clients), "num_clients", self.num_clients, "it must be an integer >= 1")
            for name in novel_only:
                _require(getattr(self, name) is None, name, getattr(self, name),
                         "it applies only to split='train_test' ('client_test' has no novel clients)")
            _require(self.partition == "iid", "partition", self.partition,
                     "split='client_test' needs 'iid': each training client's part of the test split is drawn "
                     "independently of its training part, which a label-skewed partition would not match")
            _require(self.val_fraction == 0, "val_fraction", self.val_fraction,
                     "split='client_test' takes each training client's validation split from the test split; set "
                     "val_fraction=0")
        else:
            _require(_is_count(self.num_clients), "num_clients", self.num_clients, "it must be an integer >= 1")
            _require(_is_count(self.novel_clients), "novel_clients", self.novel_clients,
                     "split='train_test' needs the number of novel clients, an integer >= 1")

    def _validate_shifts(self) -> None:
        _require(_is_number(self.novel_blur_sigma) and self.novel_blur_sigma >= 0, "novel_blur_sigma",
                 self.novel_blur_sigma, "it must be a finite number >= 0 (pixels; 0 = no blur)")
        _require(_is_count(self.novel_blur_kernel) and self.novel_blur_kernel % 2 == 1, "novel_blur_kernel",
                 self.novel_blur_kernel, "it must be an odd integer >= 1 (pixels)")
        _require(_is_number(self.novel_rotation), "novel_rotation", self.novel_rotation,
                 "it must be a finite angle in degrees")
        if self.split == "client_test":
            _require(not self.novel_angles, "novel_angles", self.novel_angles,
                     "split='client_test' has no novel clients; give train_angles only")
        else:
            _require(bool(self.train_angles) == bool(self.novel_angles), "train_angles/novel_angles",
                     (self.train_angles, self.novel_angles), "give both (concept shift) or neither")
        _choice("angle_assignment", self.angle_assignment, ANGLE_ASSIGNMENTS)
        _require(self.angle_assignment == "random" or bool(self.train_angles), "angle_assignment",
                 self.angle_assignment, "it assigns concept-shift angles, and train_angles gives none")
        if self.has_image_shift and self.source in _VECTOR_SOURCES:
            raise ConfigError(
                f"source={self.source!r} yields vectors: blur, rotation and angle shifts apply only to image sources "
                f"({', '.join(s for s in SOURCE_NAMES if s not in _VECTOR_SOURCES)})"
            )

    @property
    def has_image_shift(self) -> bool:
        """Whether any blur, rotation or concept-shift angle is requested."""
        return self.novel_blur_sigma > 0 or self.novel_rotation != 0 or bool(self.train_angles)

    def novel_partition_settings(self) -> tuple[str, int, float]:
        """The novel clients' ``(partition, shards_per_client, alpha)`` in ``train_test`` mode (defaults filled in)."""
        return (
            self.novel_partition or self.partition,
            self.novel_shards_per_client or self.shards_per_client,
            self.novel_alpha if self.novel_alpha is not None else self.alpha,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (options as a dict, angles as lists)."""
        result = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        assert isinstance(self.source_options, FrozenOptions)   # __post_init__ made it one
        result["source_options"] = self.source_options.to_dict()
        result["train_angles"], result["novel_angles"] = list(self.train_angles), list(self.novel_angles)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FederationSpec:
        """The inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys raise ConfigError."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"unknown federation setting(s) {', '.join(unknown)}; valid settings: {', '.join(names)}")
        return cls(**data)


# ---------------------------------------------------------------------------------------------------------------
# clients


@dataclass(frozen=True, eq=False)
class TrainingClient:
    """A labelled training client: normalised float32 inputs and int64 labels, split into train and validation."""

    client_id: int
    x_train: torch.Tensor = field(repr=False)
    y_train: torch.Tensor = field(repr=False)
    x_val: torch.Tensor = field(repr=False)
    y_val: torch.Tensor = field(repr=False)

    @property
    def num_train(self) -> int:
        """Number of training samples."""
        return len(self.y_train)

    @property
    def num_val(self) -> int:
        """Number of validation samples."""
        return len(self.y_val)

    def label_histogram(self, num_classes: int) -> torch.Tensor:
        """Label counts over train and validation together, int64 of shape ``[num_classes]``."""
        labels = torch.cat([self.y_train, self.y_val])
        if len(labels) and int(labels.max()) >= num_classes:
            raise ConfigError(
                f"num_classes={num_classes} is too small: client {self.client_id} has label {int(labels.max())}"
            )
        return torch.bincount(labels, minlength=num_classes)


class NovelClient:
    """A client that joins after training: an id and unlabelled, normalised inputs ``x`` (float32, ``[N, ...]``).

    It holds nothing else, by construction: two slots and no ``__dict__``, no reference to any labelled object,
    ``x`` copied into storage of its own (so no view leads back to a labelled pool), and no attribute can be set
    after construction. Its samples are in random order, so not even position hints at a label.
    """

    __slots__ = ("client_id", "x")
    client_id: int
    x: torch.Tensor

    def __init__(self, client_id: int, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.ndim < 2:
            raise TypeError(f"NovelClient needs x as a tensor of shape [N, ...], got {type(x).__name__}")
        object.__setattr__(self, "client_id", int(client_id))
        object.__setattr__(self, "x", x.detach().clone(memory_format=torch.contiguous_format))

    @property
    def num_samples(self) -> int:
        """Number of (unlabelled) samples."""
        return len(self.x)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"NovelClient is read-only (tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"NovelClient is read-only (tried to delete {name!r})")

    def __reduce__(self) -> tuple[type, tuple[int, torch.Tensor]]:
        # Rebuild through __init__: the default slot-state path would call the blocked __setattr__.
        return NovelClient, (self.client_id, self.x)

    def __repr__(self) -> str:
        return f"NovelClient(client_id={self.client_id}, num_samples={self.num_samples})"


class NovelLabels:
    """The novel clients' hidden labels, held by the evaluator and never handed to a method.

    Example:
        >>> hidden = NovelLabels({7: torch.tensor([0, 2, 2])})
        >>> 7 in hidden, hidden.histogram(7, num_classes=3).tolist()
        (True, [1, 0, 2])
    """

    def __init__(self, labels: Mapping[int, torch.Tensor]) -> None:
        self._labels = {int(client_id): y.detach().clone() for client_id, y in labels.items()}

    def labels(self, client_id: int) -> torch.Tensor:
        """The labels of novel client ``client_id`` (int64, aligned with its ``x``); a copy."""
        if client_id not in self._labels:
            raise KeyError(f"no novel client {client_id!r}; novel client ids: {sorted(self._labels)}")
        return self._labels[client_id].clone()

    def histogram(self, client_id: int, num_classes: int) -> torch.Tensor:
        """Label counts of novel client ``client_id``, int64 of shape ``[num_classes]``."""
        return torch.bincount(self.labels(client_id), minlength=num_classes)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._labels

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._labels))

    def __len__(self) -> int:
        return len(self._labels)


@dataclass
class FederatedDataset:
    """Training clients, novel clients, and the novel clients' hidden labels.

    Attributes:
        spec: the spec it was built from.
        training_clients, novel_clients: in increasing client id.
        novel_labels: the novel clients' labels, for the evaluator only.
        num_classes, input_shape: of the source (``(C, H, W)`` or ``(D,)``).
        angles: client id -> concept-shift rotation in degrees, for every client when ``train_angles`` is set,
            empty otherwise (``novel_rotation`` is not included).
    """

    spec: FederationSpec
    training_clients: list[TrainingClient]
    novel_clients: list[NovelClient]
    novel_labels: NovelLabels
    num_classes: int
    input_shape: tuple[int, ...]
    angles: dict[int, float]

    def training_client(self, client_id: int) -> TrainingClient:
        """The training client with id ``client_id``."""
        for client in self.training_clients:
            if client.client_id == client_id:
                return client
        raise KeyError(f"no training client {client_id!r}; ids: {[c.client_id for c in self.training_clients]}")

    def novel_client(self, client_id: int) -> NovelClient:
        """The novel client with id ``client_id``."""
        for client in self.novel_clients:
            if client.client_id == client_id:
                return client
        raise KeyError(f"no novel client {client_id!r}; ids: {[c.client_id for c in self.novel_clients]}")

    def describe(self) -> str:
        """One line: source, split, partition, client and sample counts, shifts."""
        spec = self.spec
        partition = {"pathological": f"pathological ({spec.shards_per_client} shards/client)",
                     "dirichlet": f"dirichlet (alpha={spec.alpha:g})", "iid": "iid"}[spec.partition]
        num_train = sum(c.num_train for c in self.training_clients)
        num_val = sum(c.num_val for c in self.training_clients)
        num_novel = sum(c.num_samples for c in self.novel_clients)
        shifts = [f"{name}={getattr(spec, name)}" for name in ("novel_blur_sigma", "novel_rotation", "novel_angles")
                  if getattr(spec, name)]
        return (
            f"{spec.source} ({spec.split}, {partition}): {len(self.training_clients)} training clients "
            f"({num_train:,} train + {num_val:,} val samples), {len(self.novel_clients)} novel clients "
            f"({num_novel:,} samples), {self.num_classes} classes, inputs {tuple(self.input_shape)}"
            + (f", shifts: {', '.join(shifts)}" if shifts else "")
        )


# ---------------------------------------------------------------------------------------------------------------
# building


class _Streams(NamedTuple):
    """Independent random streams, so that changing one choice (say the val split) leaves the others alone."""

    subsample: np.random.Generator
    partition: np.random.Generator
    novel_partition: np.random.Generator
    novel_selection: np.random.Generator
    angles: np.random.Generator
    val_split: np.random.Generator
    novel_order: np.random.Generator

    @classmethod
    def from_seed(cls, seed: int) -> _Streams:
        children = np.random.SeedSequence(seed).spawn(len(cls._fields))
        return cls(*(np.random.default_rng(child) for child in children))


class _Pool(NamedTuple):
    x: np.ndarray
    y: np.ndarray


def _pools(spec: FederationSpec, source: SourceData, rng: np.random.Generator) -> tuple[_Pool, _Pool | None]:
    """``(training pool, novel pool)``: the merged pool and None, or the train and test splits; each capped at
    ``max_samples`` by a random subset (kept in pool order)."""
    splits = [source.train] if source.test is None else [source.train, source.test]
    if spec.split == "merged" and source.test_shifted:
        raise ConfigError(f"source {source.name!r} has a shifted test split (its label or covariate shift), and "
                          "split='merged' would spread it over training clients too; use split='train_test' so that "
                          "only novel clients get it")
    if spec.split == "merged":
        pools = [_Pool(np.concatenate([s.x for s in splits]), np.concatenate([s.y for s in splits]))]
    elif source.test is None:
        raise ConfigError(
            f"split={spec.split!r} needs a test split, and source {source.name!r} has none; use split='merged'"
        )
    else:
        pools = [_Pool(s.x, s.y) for s in splits]
    capped = []
    for pool in pools:
        if spec.max_samples is not None and spec.max_samples < len(pool.y):
            keep = np.sort(rng.choice(len(pool.y), size=spec.max_samples, replace=False))
            pool = _Pool(pool.x[keep], pool.y[keep])
        capped.append(pool)
    return capped[0], (capped[1] if len(capped) > 1 else None)


def _partition(
    labels: np.ndarray, num_clients: int, settings: tuple[str, int, float], rng: np.random.Generator
) -> list[np.ndarray]:
    """Dispatch to the partition named by ``settings = (kind, shards_per_client, alpha)``."""
    kind, shards_per_client, alpha = settings
    if kind == "pathological":
        return partition_pathological(labels, num_clients, shards_per_client, rng)
    if kind == "dirichlet":
        return partition_dirichlet(labels, num_clients, alpha, rng)
    return partition_iid(len(labels), num_clients, rng)


def _drop_empty(parts: dict[int, np.ndarray], kind: str) -> dict[int, np.ndarray]:
    """Remove clients without samples, warning with their count and ids (``kind`` names them, e.g. "novel clients")."""
    kept = {client_id: idx for client_id, idx in parts.items() if len(idx)}
    dropped = sorted(set(parts) - set(kept))
    if dropped:
        warnings.warn(
            f"{len(dropped)} of {len(parts)} {kind} received no samples and were dropped (ids {dropped})",
            stacklevel=4,  # the caller of build_federation
        )
    return kept


def _assign_clients(
    spec: FederationSpec, training_pool: _Pool, novel_pool: _Pool | None, streams: _Streams
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Partition the pool(s): ``(training parts, novel parts)`` as client id -> indices into their pool.

    ``merged``: ids 0..num_clients-1 in partition order; ``train_test``: training ids 0..num_clients-1, novel ids
    num_clients..num_clients+novel_clients-1; ``client_test``: training ids 0..num_clients-1 and no novel clients.
    Empty clients are dropped before novel clients are chosen.
    """
    training_settings = (spec.partition, spec.shards_per_client, spec.alpha)
    parts = _partition(training_pool.y, spec.num_clients, training_settings, streams.partition)
    if spec.split == "client_test":
        training = _drop_empty(dict(enumerate(parts)), "training clients")
        if not training:
            raise ConfigError("no training client received samples; lower num_clients or add samples")
        return training, {}
    if spec.split == "merged":
        clients = _drop_empty(dict(enumerate(parts)), "clients")
        ids = sorted(clients)
        if len(ids) < 2:
            raise ConfigError(
                f"only {len(ids)} of num_clients={spec.num_clients} clients received samples; at least one training "
                "and one novel client are needed (use fewer clients or more samples)"
            )
        num_novel = min(max(round(len(ids) * spec.novel_fraction), 1), len(ids) - 1)
        novel_ids = set(streams.novel_selection.permutation(ids)[:num_novel].tolist())
        return ({i: clients[i] for i in ids if i not in novel_ids}, {i: clients[i] for i in ids if i in novel_ids})
    if novel_pool is None or spec.novel_clients is None:   # train_test: the spec requires both, _pools cuts the pool
        raise InternalError(f"split {spec.split!r} without a novel pool or novel_clients")
    novel_parts = _partition(novel_pool.y, spec.novel_clients, spec.novel_partition_settings(), streams.novel_partition)
    training = _drop_empty(dict(enumerate(parts)), "training clients")
    novel = _drop_empty({spec.num_clients + i: idx for i, idx in enumerate(novel_parts)}, "novel clients")
    for kind, clients, setting in (("training", training, "num_clients"), ("novel", novel, "novel_clients")):
        if not clients:
            raise ConfigError(f"no {kind} client received samples; lower {setting} or add samples")
    return training, novel


def _held_out_parts(spec: FederationSpec, test_pool: _Pool, training_ids: list[int],
                    rng: np.random.Generator) -> dict[int, np.ndarray]:
    """``client_test``: the test split dealt IID into ``num_clients`` parts, part k held out for training client k
    (indices into the test pool); the parts of dropped (empty) training clients are left unused."""
    parts = partition_iid(len(test_pool.y), spec.num_clients, rng)
    return {i: parts[i] for i in training_ids}


def _draw_angles(
    spec: FederationSpec, training_ids: list[int], novel_ids: list[int], rng: np.random.Generator
) -> dict[int, float]:
    """Concept shift: one angle per client from ``train_angles`` (training) or ``novel_angles`` (novel), drawn
    uniformly (``angle_assignment="random"``) or dealt in contiguous blocks of increasing id (``"balanced"``)."""
    if not spec.train_angles:
        return {}
    angles: dict[int, float] = {}
    for ids, choices in ((training_ids, spec.train_angles), (novel_ids, spec.novel_angles)):
        if spec.angle_assignment == "balanced":
            angles.update({i: choices[rank * len(choices) // len(ids)] for rank, i in enumerate(sorted(ids))})
        else:
            angles.update({i: float(rng.choice(choices)) for i in ids})
    return angles


def _shift_images(x: np.ndarray, rotation: float, blur_sigma: float, blur_kernel: int) -> np.ndarray:
    """Rotate (degrees counter-clockwise, bilinear, black fill) then blur raw [0, 1] images ``[N, C, H, W]``."""
    # imported only for a shift: torchvision's import (its models, torch._dynamo) takes seconds most runs need not pay
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as tvf

    images = torch.from_numpy(x)
    if rotation:
        images = tvf.rotate(images, rotation, interpolation=InterpolationMode.BILINEAR, fill=0.0)
    if blur_sigma > 0:
        images = tvf.gaussian_blur(images, kernel_size=[blur_kernel, blur_kernel], sigma=[blur_sigma, blur_sigma])
    return images.numpy()


def _prepare_inputs(
    client_id: int, x: np.ndarray, source: SourceData, rotation: float, blur: tuple[float, int]
) -> np.ndarray:
    """Shift (images only), normalise with the source's per-channel mean and std, and check finiteness."""
    if rotation or blur[0] > 0:
        x = _shift_images(x, rotation, *blur)
    if source.mean is not None:
        shape = (1, -1) + (1,) * (x.ndim - 2)
        x = (x - np.asarray(source.mean, np.float32).reshape(shape)) / np.asarray(source.std, np.float32).reshape(shape)
    if not np.isfinite(x).all():
        raise ConfigError(f"client {client_id} has NaN or infinite inputs after preprocessing; check the source data")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_image_shifts(spec: FederationSpec, source: SourceData) -> None:
    """Shifts need images, and a blur kernel whose padding fits inside them."""
    if not spec.has_image_shift:
        return
    if not source.is_image:
        raise ConfigError(f"source {source.name!r} yields vectors {source.input_shape}; blur and rotation need images")
    height, width = source.input_shape[1:]
    if spec.novel_blur_sigma > 0 and spec.novel_blur_kernel // 2 >= min(height, width):
        raise ConfigError(
            f"novel_blur_kernel={spec.novel_blur_kernel} is too large for {height}x{width} images; "
            f"use an odd size below {2 * min(height, width)}"
        )


def _training_client(
    client_id: int, x: np.ndarray, y: np.ndarray, val_fraction: float, rng: np.random.Generator
) -> TrainingClient:
    """Shuffle, then the first ``floor(val_fraction * n)`` samples are validation and the rest train."""
    order = rng.permutation(len(y))
    num_val = math.floor(val_fraction * len(y))
    val, train = order[:num_val], order[num_val:]
    return TrainingClient(
        client_id,
        torch.from_numpy(x[train]), torch.from_numpy(y[train].astype(np.int64)),
        torch.from_numpy(x[val]), torch.from_numpy(y[val].astype(np.int64)),
    )


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed={seed!r} is invalid: it must be an integer >= 0")
    return int(seed)


def build_federation(spec: FederationSpec, *, seed: int) -> FederatedDataset:
    """Build the federated dataset that ``spec`` describes; the same (spec, seed) gives identical tensors.

    Raises:
        ConfigError: invalid settings for this source (shifts on vectors, ``train_test`` without a test split, a
            partition that leaves no training or no novel client, non-finite inputs).
        DataUnavailableError: the source's files are not here.
    """
    streams = _Streams.from_seed(_check_seed(seed))
    source = load_source(spec.source, data_root=spec.data_root, download=spec.download, **spec.source_options)
    _check_image_shifts(spec, source)
    training_pool, novel_pool = _pools(spec, source, streams.subsample)
    training_parts, novel_parts = _assign_clients(spec, training_pool, novel_pool, streams)
    if novel_pool is None:
        novel_pool = training_pool
    angles = _draw_angles(spec, sorted(training_parts), sorted(novel_parts), streams.angles)

    held_out = (_held_out_parts(spec, novel_pool, sorted(training_parts), streams.novel_partition)
                if spec.split == "client_test" else {})

    training_clients = []
    for client_id, idx in sorted(training_parts.items()):
        rotation = angles.get(client_id, 0.0)
        x = _prepare_inputs(client_id, training_pool.x[idx], source, rotation, (0.0, 0))
        y = training_pool.y[idx]
        client = _training_client(client_id, x, y, spec.val_fraction, streams.val_split)
        if client_id in held_out:     # client_test: its validation split is its part of the test split, rotated alike
            part = held_out[client_id]
            client = dataclasses.replace(
                client, x_val=torch.from_numpy(_prepare_inputs(client_id, novel_pool.x[part], source, rotation,
                                                               (0.0, 0))),
                y_val=torch.from_numpy(novel_pool.y[part].astype(np.int64)))
        training_clients.append(client)

    novel_clients, hidden = [], {}
    blur = (spec.novel_blur_sigma, spec.novel_blur_kernel)
    for client_id, idx in sorted(novel_parts.items()):
        # Random order: partitions list samples class by class, and a method must not read labels off positions.
        idx = streams.novel_order.permutation(idx)
        rotation = angles.get(client_id, 0.0) + spec.novel_rotation
        x = _prepare_inputs(client_id, novel_pool.x[idx], source, rotation, blur)
        novel_clients.append(NovelClient(client_id, torch.from_numpy(x)))
        hidden[client_id] = torch.from_numpy(novel_pool.y[idx].astype(np.int64))

    return FederatedDataset(
        spec=spec,
        training_clients=training_clients,
        novel_clients=novel_clients,
        novel_labels=NovelLabels(hidden),
        num_classes=source.num_classes,
        input_shape=tuple(source.input_shape),
        angles=angles,
    )
