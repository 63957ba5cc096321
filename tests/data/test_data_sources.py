"""Sources: the real offline MNIST, digits, synthetic, features, and torchvision-format folders written here."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from privfl.data import SOURCE_NAMES, list_sources, load_source
from privfl.errors import ConfigError, DataUnavailableError

# ---------------------------------------------------------------------------------------------------------------
# tiny datasets in torchvision's on-disk formats (no CIFAR / Fashion-MNIST / EMNIST ships offline)


def write_idx_images(path: Path, images: np.ndarray) -> None:
    """idx3-ubyte: magic 0x0803 (unsigned byte, 3 dims), big-endian sizes, then the pixels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack(">IIII", 0x0803, *images.shape) + images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    """idx1-ubyte: magic 0x0801 (unsigned byte, 1 dim), big-endian size, then the labels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack(">II", 0x0801, len(labels)) + labels.astype(np.uint8).tobytes())


def write_mnist_format(folder: Path, sizes: dict[str, int], prefix: str = "", seed: int = 0) -> dict[str, tuple]:
    """Write ``{split}-images-idx3-ubyte`` / ``{split}-labels-idx1-ubyte`` for split in ``sizes`` (e.g. train, t10k).

    Returns split -> (uint8 images [N, 28, 28], labels [N]).
    """
    rng = np.random.default_rng(seed)
    written = {}
    for split, size in sizes.items():
        images = rng.integers(0, 256, size=(size, 28, 28), dtype=np.uint8)
        labels = np.arange(size) % 10
        write_idx_images(folder / f"{prefix}{split}-images-idx3-ubyte", images)
        write_idx_labels(folder / f"{prefix}{split}-labels-idx1-ubyte", labels)
        written[split] = (images, labels)
    return written


def _cifar_batch(rng: np.random.Generator, size: int, label_key: str, num_classes: int, keys_as_bytes: bool) -> dict:
    batch = {
        "batch_label": "fixture",
        label_key: [int(v) for v in rng.integers(0, num_classes, size=size)],
        "data": rng.integers(0, 256, size=(size, 3 * 32 * 32), dtype=np.uint8),
        "filenames": [f"img{i}.png" for i in range(size)],
    }
    return {key.encode(): value for key, value in batch.items()} if keys_as_bytes else batch


def write_cifar10(root: Path, per_batch: int = 4, seed: int = 0) -> dict[str, dict]:
    """``root/cifar-10-batches-py``: data_batch_1..5, test_batch and batches.meta, pickled as torchvision expects."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written = {}
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        written[name] = _cifar_batch(rng, per_batch, "labels", 10, keys_as_bytes=False)
        with open(folder / name, "wb") as f:
            pickle.dump(written[name], f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": per_batch}, f)
    return written


def write_cifar100(root: Path, size: int = 6, seed: int = 0) -> dict[str, dict]:
    """``root/cifar-100-python``: train, test and meta, with bytes keys (as Python 3 reads the originals)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    written = {}
    for name in ("train", "test"):
        written[name] = _cifar_batch(rng, size, "fine_labels", 100, keys_as_bytes=True)
        with open(folder / name, "wb") as f:
            pickle.dump(written[name], f)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f)
    return written


@pytest.fixture
def fashion_root(tmp_path: Path) -> tuple[Path, dict[str, tuple]]:
    """A data root with a small FashionMNIST/raw folder (12 train, 8 test images) and what was written."""
    return tmp_path, write_mnist_format(tmp_path / "FashionMNIST" / "raw", {"train": 12, "t10k": 8})


@pytest.fixture
def mnist_root(tmp_path: Path) -> tuple[Path, dict[str, tuple]]:
    """A data root with a small torchvision MNIST/raw folder (10 train, 5 test images)."""
    return tmp_path, write_mnist_format(tmp_path / "MNIST" / "raw", {"train": 10, "t10k": 5}, seed=1)


@pytest.fixture
def emnist_root(tmp_path: Path) -> tuple[Path, dict[str, tuple]]:
    """A data root with EMNIST/raw files for the ``balanced`` split (9 train, 4 test images)."""
    return tmp_path, write_mnist_format(tmp_path / "EMNIST" / "raw", {"train": 9, "test": 4}, prefix="emnist-balanced-")


@pytest.fixture
def cifar10_root(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A data root with a small cifar-10-batches-py folder (4 images per batch)."""
    return tmp_path, write_cifar10(tmp_path)


@pytest.fixture
def cifar100_root(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A data root with a small cifar-100-python folder (6 train, 6 test images, bytes keys)."""
    return tmp_path, write_cifar100(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# tests

# Official MNIST class counts, train (60,000) + test (10,000).
MNIST_CLASS_COUNTS = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]


def test_real_mnist_has_70000_images_with_the_official_label_counts() -> None:
    mnist = load_source("mnist")
    assert mnist.train.x.shape == (60_000, 1, 28, 28) and mnist.test.x.shape == (10_000, 1, 28, 28)
    assert mnist.train.x.dtype == np.float32 and mnist.train.y.dtype == np.int64
    for split in (mnist.train, mnist.test):
        assert 0.0 <= split.x.min() and split.x.max() < 1.0
    labels = np.concatenate([mnist.train.y, mnist.test.y])
    assert np.bincount(labels).tolist() == MNIST_CLASS_COUNTS
    assert (mnist.num_classes, mnist.input_shape, mnist.mean, mnist.std) == (10, (1, 28, 28), (0.1307,), (0.3081,))
    # Not all-black: the mean pixel is MNIST's well-known 0.13.
    assert abs(float(mnist.train.x.mean()) - 0.1307) < 0.002


def test_mnist_is_cached_and_read_only() -> None:
    first, second = load_source("mnist"), load_source("mnist")
    assert first.train.x is second.train.x
    with pytest.raises(ValueError, match="read-only"):
        first.train.x[0, 0, 0, 0] = 1.0


def test_mnist_prefers_a_torchvision_folder_under_the_data_root(mnist_root) -> None:
    root, written = mnist_root
    mnist = load_source("mnist", data_root=root)
    images, labels = written["train"]
    assert mnist.train.x.shape == (10, 1, 28, 28) and mnist.test.x.shape == (5, 1, 28, 28)
    np.testing.assert_allclose(mnist.train.x[:, 0], images / 255.0, atol=1e-7)
    np.testing.assert_array_equal(mnist.train.y, labels)


def test_digits_is_scaled_to_unit_range_with_a_fixed_split() -> None:
    digits = load_source("digits")
    assert digits.train.x.shape == (1437, 1, 8, 8) and digits.test.x.shape == (360, 1, 8, 8)
    assert digits.train.x.min() == 0.0 and digits.train.x.max() == 1.0
    np.testing.assert_array_equal(load_source("digits").train.y, digits.train.y)
    assert set(np.unique(digits.test.y)) == set(range(10))


def test_fashion_mnist_reads_torchvision_idx_files(fashion_root) -> None:
    root, written = fashion_root
    fashion = load_source("fashion_mnist", data_root=root)
    assert fashion.train.x.shape == (12, 1, 28, 28) and fashion.test.x.shape == (8, 1, 28, 28)
    for split, part in (("train", fashion.train), ("t10k", fashion.test)):
        images, labels = written[split]
        np.testing.assert_allclose(part.x[:, 0], images / 255.0, atol=1e-7)
        np.testing.assert_array_equal(part.y, labels)
    assert fashion.mean == (0.2860,) and fashion.std == (0.3530,)


def test_emnist_images_are_transposed_upright(emnist_root) -> None:
    root, written = emnist_root
    emnist = load_source("emnist", data_root=root, split="balanced")
    images, labels = written["train"]
    np.testing.assert_allclose(emnist.train.x[:, 0], np.swapaxes(images, 1, 2) / 255.0, atol=1e-7)
    np.testing.assert_array_equal(emnist.train.y, labels)
    assert emnist.num_classes == 47 and len(emnist.test) == 4


def test_emnist_rejects_an_unknown_split(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="split='nope'.*balanced"):
        load_source("emnist", data_root=tmp_path, split="nope")


def test_cifar10_reads_torchvision_batches_with_the_safe_unpickler(cifar10_root) -> None:
    root, written = cifar10_root
    cifar = load_source("cifar10", data_root=root)
    assert cifar.train.x.shape == (20, 3, 32, 32) and cifar.test.x.shape == (4, 3, 32, 32)
    first = written["data_batch_1"]
    np.testing.assert_allclose(cifar.train.x[:4], first["data"].reshape(4, 3, 32, 32) / 255.0, atol=1e-7)
    np.testing.assert_array_equal(cifar.train.y[:4], first["labels"])
    np.testing.assert_array_equal(cifar.test.y, written["test_batch"]["labels"])
    assert cifar.mean == (0.4914, 0.4822, 0.4465) and cifar.std == (0.2023, 0.1994, 0.2010)


def test_cifar100_reads_fine_labels_with_bytes_keys(cifar100_root) -> None:
    root, written = cifar100_root
    cifar = load_source("cifar100", data_root=root)
    assert cifar.num_classes == 100 and cifar.train.x.shape == (6, 3, 32, 32)
    np.testing.assert_array_equal(cifar.train.y, written["train"][b"fine_labels"])


def test_cifar_refuses_a_batch_that_would_run_code(cifar10_root) -> None:
    class RunsShell:
        def __reduce__(self):
            return os.system, ("echo should-not-run",)

    root, _ = cifar10_root
    with open(root / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump({"data": RunsShell(), "labels": []}, f)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        load_source("cifar10", data_root=root)


@pytest.mark.parametrize("name", ["fashion_mnist", "cifar10", "cifar100", "emnist"])
def test_a_missing_folder_names_the_directory_searched_and_the_remedy(tmp_path: Path, name: str) -> None:
    with pytest.raises(DataUnavailableError) as caught:
        load_source(name, data_root=tmp_path / "nowhere")
    message = str(caught.value)
    assert str((tmp_path / "nowhere").absolute()) in message
    assert "--data-root" in message and "--download" in message


def test_no_data_root_says_so(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailableError, match="needs a data root and none was given"):
        load_source("cifar10")


def test_compressed_idx_files_get_a_gunzip_hint(tmp_path: Path) -> None:
    folder = tmp_path / "FashionMNIST" / "raw"
    folder.mkdir(parents=True)
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(DataUnavailableError, match="gunzip"):
        load_source("fashion_mnist", data_root=tmp_path)


def test_list_sources_reports_availability_without_loading(cifar10_root) -> None:
    root, _ = cifar10_root
    infos = {info.name: info for info in list_sources(root)}
    assert tuple(infos) == SOURCE_NAMES
    assert infos["mnist"].available and infos["digits"].available and infos["synthetic"].available
    assert infos["cifar10"].available and str(root) in infos["cifar10"].detail
    assert not infos["cifar100"].available and "cifar-100-python" in infos["cifar100"].detail
    assert not {info.name: info for info in list_sources()}["fashion_mnist"].available


def test_unknown_source_and_option_name_the_valid_choices() -> None:
    with pytest.raises(ConfigError, match="unknown data source 'imagenet'.*mnist.*synthetic"):
        load_source("imagenet")
    with pytest.raises(ConfigError, match="no option colour; valid options: num_samples"):
        load_source("synthetic", colour="red")


def test_synthetic_is_deterministic_and_learnable_by_a_linear_model() -> None:
    from sklearn.linear_model import LogisticRegression

    data = load_source("synthetic")
    again = load_source("synthetic")
    np.testing.assert_array_equal(data.train.x, again.train.x)
    assert not np.array_equal(data.train.x, load_source("synthetic", seed=1).train.x)
    assert data.train.x.shape == (1600, 20) and data.test.x.shape == (400, 20) and data.mean is None
    accuracy = LogisticRegression(max_iter=500).fit(data.train.x, data.train.y).score(data.test.x, data.test.y)
    assert accuracy > 0.8


def test_synthetic_label_and_covariate_shift_touch_the_test_split_only() -> None:
    base = load_source("synthetic")
    shifted = load_source("synthetic", label_shift=2.0, covariate_shift=1.5)
    np.testing.assert_array_equal(base.train.x, shifted.train.x)
    base_priors = np.bincount(base.test.y, minlength=10) / len(base.test.y)
    shifted_priors = np.bincount(shifted.test.y, minlength=10) / len(shifted.test.y)
    assert np.allclose(base_priors, 0.1)
    assert np.abs(shifted_priors - 0.1).sum() > 0.3
    offset = shifted.test.x.mean() - base.test.x.mean()
    assert 1.0 < offset < 2.0  # +1.5 on every coordinate, up to the different class mix


def test_synthetic_validates_options() -> None:
    with pytest.raises(ConfigError, match="test_fraction=1.5"):
        load_source("synthetic", test_fraction=1.5)
    with pytest.raises(ConfigError, match="num_classes=1"):
        load_source("synthetic", num_classes=1)


def test_features_round_trip_and_validation(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "features.npz"
    np.savez(path, x=rng.normal(size=(30, 5)), y=np.arange(30) % 3,
             x_test=rng.normal(size=(6, 5)), y_test=np.arange(6) % 4)
    data = load_source("features", path=str(path))
    assert data.train.x.dtype == np.float32 and data.input_shape == (5,) and data.num_classes == 4
    assert load_source("features", data_root=tmp_path, path="features.npz").test.x.shape == (6, 5)

    with pytest.raises(ConfigError, match="needs the option path="):
        load_source("features")
    with pytest.raises(DataUnavailableError, match="missing.npz"):
        load_source("features", path=str(tmp_path / "missing.npz"))
    np.savez(path, x=rng.normal(size=(4, 5)), y=np.array([0.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ConfigError, match="y must be an integer array"):
        load_source("features", path=str(path))


def test_features_with_nan_is_a_config_error(tmp_path: Path) -> None:
    x = np.ones((10, 3))
    x[7, 1] = np.nan
    np.savez(tmp_path / "bad.npz", x=x, y=np.zeros(10, dtype=np.int64))
    with pytest.raises(ConfigError, match="NaN or infinite values in 1 rows \\(first: row 7\\)"):
        load_source("features", path=str(tmp_path / "bad.npz"))
