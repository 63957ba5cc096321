"""The numpy-only unpickler loads numpy data and refuses everything that could run code."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

import privfl.safe_pickle
from privfl.safe_pickle import load_numpy_pickle


def _payload() -> dict:
    return {
        "x": np.arange(12, dtype=np.float32).reshape(3, 4),
        "y": np.array([0, 1, 2], dtype=np.int64),
        "scalar": np.float64(2.5),
        "nested": [(np.zeros(2, dtype=np.uint8), "text", b"bytes", 3)],
    }


def _assert_same(loaded: dict) -> None:
    expected = _payload()
    np.testing.assert_array_equal(loaded["x"], expected["x"])
    assert loaded["x"].dtype == np.float32 and loaded["y"].dtype == np.int64
    np.testing.assert_array_equal(loaded["y"], expected["y"])
    assert loaded["scalar"] == 2.5 and isinstance(loaded["scalar"], np.float64)
    assert loaded["nested"][0][1:] == ("text", b"bytes", 3)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_loads_numpy_pickles_of_every_protocol(protocol: int) -> None:
    _assert_same(load_numpy_pickle(io.BytesIO(pickle.dumps(_payload(), protocol=protocol))))


def test_detects_gzip_from_magic_bytes_for_paths_and_streams(tmp_path: Path) -> None:
    path = tmp_path / "data.pkl.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(_payload(), f, protocol=2)
    _assert_same(load_numpy_pickle(path))
    _assert_same(load_numpy_pickle(str(path), gzip=True))
    with open(path, "rb") as f:
        _assert_same(load_numpy_pickle(f))


def test_reads_unseekable_streams() -> None:
    class OneWay(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self._data = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            chunk = self._data.read(len(buffer))
            buffer[: len(chunk)] = chunk
            return len(chunk)

    _assert_same(load_numpy_pickle(OneWay(gzip.compress(pickle.dumps(_payload())))))


class _RunsShell:
    """Unpickling this would call os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_refuses_a_pickle_that_would_run_a_command_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    blob = pickle.dumps({"x": np.zeros(3), "evil": _RunsShell(f"touch {marker}")}, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match=r"refused to load global (posix|nt|os)\.system"):
        load_numpy_pickle(io.BytesIO(blob))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        load_numpy_pickle(io.BytesIO(gzip.compress(blob)))
    assert not marker.exists()


@pytest.mark.parametrize("target", [eval, getattr, __import__, pickle.loads])
def test_refuses_other_code_paths(target) -> None:
    class Evil:
        def __reduce__(self):
            return target, ("1",)

    with pytest.raises(pickle.UnpicklingError, match="refused to load global"):
        load_numpy_pickle(io.BytesIO(pickle.dumps(Evil())))


def test_refuses_arbitrary_classes() -> None:
    with pytest.raises(pickle.UnpicklingError, match="refused to load global collections.OrderedDict"):
        load_numpy_pickle(io.BytesIO(pickle.dumps(__import__("collections").OrderedDict(a=1))))


def test_the_module_never_calls_the_bare_pickle_loaders() -> None:
    source = Path(privfl.safe_pickle.__file__).read_text()
    assert re.search(r"pickle\.loads?\(", source) is None
