"""A run directory: everything one run writes, in files others can load.

``config.json`` (how to reproduce it), ``metrics.jsonl`` (one line per evaluation), ``clients.csv`` (one row per
client), ``ledger.json`` (every release of every client), ``summary.json`` (means, SEMs, epsilon and the
neighbouring relations it holds under, wall time, peak memory), ``plots.png`` (learning curve, accuracy against label
shift), ``checkpoint.pt`` (to resume) and ``releases.jsonl`` (each release's ledger record as it is made, so that a
run resumed after a kill keeps the releases made since its last checkpoint). The journal is appended a line at a time
(a line a kill cut short is ignored); every other file is written atomically: a crash mid-write leaves the previous
version, never a torn file. Checkpoints load with ``weights_only=True`` (invariant 6 of docs/invariants.md).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accounting.files import atomic_write
from privfl.errors import ConfigError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (:func:`accounting.files.atomic_write`): a crash mid-write
    leaves the previous version. The file gets the mode any new file gets under the process's umask."""
    atomic_write(path, data)


def to_json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (strict JSON has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(to_json_safe(value), indent=2, sort_keys=False, allow_nan=False)


def update_json(path: Path, mutate: Callable[[Any], Any]) -> Any:
    """Read ``path`` (``{}`` if absent), pass it to ``mutate``, write back what it returns; return that value.

    Held under an exclusive ``flock`` on ``<path>.lock`` and written with :func:`atomic_write_bytes` as strict JSON
    (:func:`to_json_safe`): several processes (one per core) merging rows into one results file never lose one
    another's rows, and a reader never sees half a file. The lock file stays: removing it would race with a process
    waiting on it.
    """
    import fcntl  # POSIX only, and only needed here

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        value = mutate(json.loads(path.read_text()) if path.exists() else {})
        atomic_write_bytes(path, (dumps(value) + "\n").encode())
    return value


class RunDirectory:
    """The files of one run under ``root``."""

    CONFIG, METRICS, CLIENTS, SUMMARY, LEDGER, CHECKPOINT, RELEASES = (
        "config.json", "metrics.jsonl", "clients.csv", "summary.json", "ledger.json", "checkpoint.pt",
        "releases.jsonl")

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / name

    def create(self, config: dict[str, Any], *, overwrite: bool = False) -> None:
        """Start a new run here; refuses to mix two runs in one directory unless ``overwrite``."""
        if self.path(self.CONFIG).exists() and not overwrite:
            raise ConfigError(
                f"run directory {self.root} already holds a run; resume it with --resume {self.root}, "
                "choose another --out, or pass --overwrite")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create the run directory {self.root}: {error.strerror}; choose another --out") \
                from None
        for name in (self.METRICS, self.CLIENTS, self.SUMMARY, self.LEDGER, self.CHECKPOINT, self.RELEASES,
                     "plots.png"):
            self.path(name).unlink(missing_ok=True)
        self.write_json(self.CONFIG, config)

    def read_json(self, name: str) -> Any:
        path = self.path(name)
        if not path.exists():
            raise ConfigError(f"{path} does not exist; is {self.root} a privfl run directory?")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is damaged (not JSON: {error.msg} at line {error.lineno}); a run writes it "
                              "whole, so it was changed or cut afterwards") from None

    def write_json(self, name: str, value: Any) -> None:
        atomic_write_bytes(self.path(name), (dumps(value) + "\n").encode())

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one evaluation record as a JSON line (flushed and synced, so an interrupted run keeps it)."""
        with open(self.path(self.METRICS), "a") as f:
            f.write(json.dumps(to_json_safe(record), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        path = self.path(self.METRICS)
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line torn by a crash: everything before it is intact
        return records

    def truncate_metrics(self, completed_rounds: int) -> None:
        """Keep the records of rounds a resumed run will not redo (``round <= completed_rounds``)."""
        kept = [r for r in self.read_metrics() if r.get("round", 0) <= completed_rounds]
        atomic_write_bytes(self.path(self.METRICS), "".join(json.dumps(r) + "\n" for r in kept).encode())

    def write_clients(self, rows: list[dict[str, Any]]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else ["client_id"])
        writer.writeheader()
        writer.writerows(to_json_safe(rows))
        atomic_write_bytes(self.path(self.CLIENTS), buffer.getvalue().encode())

    def read_clients(self) -> list[dict[str, str]]:
        with open(self.path(self.CLIENTS), newline="") as f:
            return list(csv.DictReader(f))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_bytes(self.path(self.CHECKPOINT), buffer.getvalue())

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.path(self.CHECKPOINT)
        if not path.exists():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
            raise ConfigError(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                              "checkpoints are written whole, so it was changed or cut afterwards: start the run "
                              "again") from None
