"""Read pickled numpy data without letting the file run code.

A pickle names the functions that rebuild its objects, and the unpickler calls them: a hostile file can name
``os.system``. Data files that arrive as pickles (the MNIST bundle, CIFAR batches, packaged weights) are therefore read
with an unpickler that resolves only the handful of globals numpy needs to rebuild arrays, dtypes and scalars (invariant
6 of ``docs/invariants.md``). Lists, tuples, dicts, strings, bytes and numbers need no globals at all.

Example:
    >>> import io, pickle, numpy as np
    >>> blob = io.BytesIO(pickle.dumps({"x": np.arange(3)}))
    >>> load_numpy_pickle(blob)["x"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import codecs
import gzip as gzip_module
import io
import os
import pickle
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

__all__ = ["load_numpy_pickle"]

_GZIP_MAGIC = b"\x1f\x8b"


def _numpy_global(module: str, name: str) -> Callable[[], Any]:
    """Look up ``numpy.<module>.<name>`` lazily, in numpy 2's private layout (``numpy._core``)."""

    def resolve() -> Any:
        target = np
        for part in (*module.split("."), name):
            target = getattr(target, part)
        return target

    return resolve


# (module, name) as written in the pickle -> the object it may resolve to. Pickles written by numpy 1.x name
# ``numpy.core``; numpy 2 moved it to ``numpy._core`` and warns on the old path, so both resolve to the new one.
_ALLOWED_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    **{
        (f"numpy.{core}.multiarray", "_reconstruct"): _numpy_global("_core.multiarray", "_reconstruct")
        for core in ("core", "_core")
    },
    **{
        (f"numpy.{core}.multiarray", "scalar"): _numpy_global("_core.multiarray", "scalar")
        for core in ("core", "_core")
    },
    # Protocol 5 rebuilds contiguous arrays from a buffer.
    **{
        (f"numpy.{core}.numeric", "_frombuffer"): _numpy_global("_core.numeric", "_frombuffer")
        for core in ("core", "_core")
    },
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    # Protocol 2 written by Python 3 stores ``bytes`` (an array's raw data) as _codecs.encode(text, "latin1").
    ("_codecs", "encode"): lambda: codecs.encode,
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in ``_ALLOWED_GLOBALS`` and refuses every other one."""

    def find_class(self, module: str, name: str) -> Any:
        resolve = _ALLOWED_GLOBALS.get((module, name))
        if resolve is None:
            raise pickle.UnpicklingError(
                f"refused to load global {module}.{name}: this loader accepts numpy arrays, dtypes, scalars and "
                "builtin containers only (a data pickle that needs anything else may run code)"
            )
        return resolve()


def _open_binary(source: str | os.PathLike | BinaryIO) -> tuple[BinaryIO, bool]:
    """Return ``(stream, owned)``: a readable binary stream, and whether the caller must close it."""
    if isinstance(source, (str, os.PathLike)):
        return open(source, "rb"), True
    return source, False


def _peek(stream: BinaryIO, size: int) -> tuple[BinaryIO, bytes]:
    """Read the first ``size`` bytes without consuming them; wraps unseekable streams in a buffer."""
    if stream.seekable():
        start = stream.tell()
        head = stream.read(size)
        stream.seek(start)
        return stream, head
    buffered = io.BytesIO(stream.read())
    return buffered, buffered.getvalue()[:size]


def load_numpy_pickle(
    source: str | os.PathLike | BinaryIO,
    *,
    gzip: bool | None = None,
    encoding: str = "latin1",
) -> Any:
    """Unpickle ``source`` (a path or a binary stream) allowing only numpy arrays and builtin containers.

    Args:
        source: a file path, or a readable binary stream positioned at the pickle.
        gzip: whether the data is gzip-compressed; ``None`` detects it from the two magic bytes ``1f 8b``.
        encoding: how to decode Python 2 ``str`` objects. ``latin1`` (the default) is the one that restores the
            raw bytes of numpy arrays pickled by Python 2 (the MNIST bundle and the CIFAR batches); it does not
            affect pickles written by Python 3.

    Returns:
        The unpickled object.

    Raises:
        pickle.UnpicklingError: the pickle names a global outside the allow-list (nothing of it is called)
            or is malformed.
    """
    raw, owned = _open_binary(source)
    try:
        stream, head = _peek(raw, len(_GZIP_MAGIC))
        compressed = head == _GZIP_MAGIC if gzip is None else gzip
        if compressed:
            with gzip_module.GzipFile(fileobj=stream, mode="rb") as unzipped:
                return _NumpyOnlyUnpickler(unzipped, encoding=encoding).load()
        return _NumpyOnlyUnpickler(stream, encoding=encoding).load()
    finally:
        if owned:
            raw.close()
