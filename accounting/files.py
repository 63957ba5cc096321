"""Writing a file so that a crash leaves either its old content or its new content, never a torn file: the one
helper every package that saves state uses (ledgers here; run directories, checkpoints and Flower node state in
privfl).

The temporary file is created with mode 0o666 through ``os.open``, so the kernel applies the process's umask as it
does to any new file; the umask is never read or changed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically.

    Steps: 1. write a temporary file in the same directory (same filesystem, so the rename is atomic); 2. with
    ``durable``, fsync it, so the data is on disk before the name points at it; 3. ``os.replace`` it over ``path``;
    4. with ``durable``, fsync the directory, so the rename itself survives a power loss. Without ``durable`` a power
    loss may bring the previous content back (a Flower node's client state, whose round the node checks).

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "state.json"
    >>> atomic_write(target, b"{}")
    >>> target.read_bytes()
    b'{}'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


__all__ = ["atomic_write"]
