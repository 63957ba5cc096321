"""One writer per run directory: a lock file naming its holder, taken by every command that writes a run.

Two processes writing one run (a ``--resume`` while the run goes on, say) would each train the same rounds and each
make their releases: the clients spend privacy twice for one round, and the run's files hold both. A writer holds
``run.lock`` in the run directory for as long as it writes: an exclusive ``flock`` on the file (the kernel releases
it when the process ends, however it ends) and, in the file, who holds it (host, process id, engine, the engine's
run id, the command, since when), which the refusal of a second writer names with the command that stops the first.

A lock whose holder died (``kill -9``, a lost machine) is taken over: on this host the ``flock`` is free once its
process is gone. A lock written on another host (a run directory on a shared file system) is refused, since this
host cannot tell whether its holder lives; the message says how to check and what to remove.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from privfl.errors import ConfigError

#: The lock file's name in a run directory.
LOCK = "run.lock"


def _holder(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text() or "{}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return values if isinstance(values, dict) else {}


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:    # another user's live process
        return True
    return True


class RunBusyError(ConfigError):
    """Another live process writes the run directory: nothing was written to it, and nothing must be (the message
    names the holder and how to stop it)."""


def _busy(root: Path, holder: dict[str, Any]) -> RunBusyError:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    run = f" {holder['run_id']}" if holder.get("run_id") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if holder.get("since") else "?"
    here = host == socket.gethostname()
    stop = f"kill -INT {pid}" + ("" if here else f" on host {host}")
    return RunBusyError(
        f"{root} is being written by another privfl process: pid {pid} on host {host} ({holder.get('engine', '?')} "
        f"run{run}, since {since}: {holder.get('command', '?')}); a second writer would train its rounds again and "
        f"release them twice. Stop it first with {stop} (it finishes its round and saves; then resume with privfl "
        f"train --resume {root}), or wait until it ends"
        + ("" if here else f"; if no such process runs on {host} any more, remove {root / LOCK}"))


@contextlib.contextmanager
def hold(root: str | os.PathLike[str], *, engine: str = "inprocess", run_id: str | None = None) -> Iterator[None]:
    """Hold the writer's lock of the run directory ``root`` (created if missing) while the block runs; refuse with a
    :class:`ConfigError` naming the holder and how to stop it when another live process holds it. The lock file is
    removed when the block ends."""
    import fcntl  # POSIX only, and only needed here

    root = Path(root)
    path = root / LOCK
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the run directory {root}: {error.strerror}; choose another --out") from None
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as error:
            raise ConfigError(f"cannot write the run directory {root} ({error.strerror}: {path}); make it writable, "
                              "or choose another --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            os.close(fd)
            raise _busy(root, _holder(path)) from None
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                os.close(fd)
                raise
            locked = False      # a file system without flock: the holder's process id is all there is to go by
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:            # its holder removed the file between our open and our lock: lock the new one
            os.close(fd)
            continue
        holder = _holder(path)
        if holder and holder.get("host") != socket.gethostname():
            os.close(fd)
            raise _busy(root, holder)
        if holder and not locked and holder.get("pid") != os.getpid() and _alive(holder.get("pid")):
            os.close(fd)
            raise _busy(root, holder)
        break
    else:   # pragma: no cover (the file changed under us five times running)
        raise ConfigError(f"{path} keeps changing: another process is taking the lock of {root}; try again")
    try:
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "engine": engine, "run_id": run_id,
                "command": " ".join([Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]),
                "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        os.fsync(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()       # while still locked: a waiting writer then locks a new file
        os.close(fd)


__all__ = ["LOCK", "RunBusyError", "hold"]
