"""A run directory: everything one run writes, in files others can load.

``config.json`` (how to reproduce it), ``metrics.jsonl`` (one line per evaluation), ``clients.csv`` (one row per
client), ``ledger.json`` (every release of every client), ``summary.json`` (means, SEMs, epsilon and the
neighbouring relations it holds under, wall time, peak memory), ``plots.png`` (learning curve, accuracy against label
shift), ``checkpoint.pt`` (to resume) and ``releases.jsonl`` (each release's ledger record as it is made, so that a
run resumed after a kill keeps the releases made since its last checkpoint; :mod:`accounting.journal`). The journal is
appended a line at a time (a line a kill cut short is ignored, and removed on resume); every other file is written
atomically: a crash mid-write leaves the previous version, never a torn file, and the temporary file a kill leaves
behind is removed when a run starts or resumes. Checkpoints load with ``weights_only=True`` (invariant 6 of
docs/invariants.md).

A directory is claimed by one run: :meth:`RunDirectory.occupant` says what else a directory holds (a run that made
releases, a sweep, runs in subdirectories), and every command that writes a run refuses such a directory unless told
to overwrite it. A run directory whose run failed before its first release holds nothing a retry could lose.
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

from accounting.files import atomic_write, remove_leftovers
from privfl.errors import ConfigError

#: A file that marks a sweep's output folder (:mod:`privfl.sweep` writes it before it trains anything).
SWEEP_MARK = "sweep-config.json"


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
    #: A Flower run's node ledgers as the nodes reported them at its end: each client's lifetime (every run's
    #: releases on its node, this one's included), from which ``privfl ledger`` recomputes the lifetime epsilons.
    NODE_LEDGERS = "node-ledgers.json"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / name

    #: Every file a run writes (``plots.png`` included).
    FILES = (CONFIG, METRICS, CLIENTS, SUMMARY, LEDGER, CHECKPOINT, RELEASES, NODE_LEDGERS, "plots.png")

    #: The keys every ``config.json`` privfl writes holds (a run config): a file named so without them is another's.
    CONFIG_KEYS = frozenset({"federation", "method", "rounds", "seed", "privacy"})

    def foreign(self) -> list[str]:
        """The files here that bear a run's names but that privfl did not write: a ``config.json`` that is not a run
        config, or any other file of a run (:attr:`FILES`) beside no ``config.json`` (privfl writes the config
        first). No command writes over them, ``--overwrite`` or not: they may be a user's."""
        if not self.root.is_dir():
            return []
        config = self.path(self.CONFIG)
        if not config.exists():
            return [name for name in self.FILES if self.path(name).exists()]
        try:
            values = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return [self.CONFIG]
        return [] if isinstance(values, dict) and self.CONFIG_KEYS <= set(values) else [self.CONFIG]

    def check_not_foreign(self) -> None:
        """Refuse a directory holding files privfl did not write (:meth:`foreign`), whatever ``--overwrite`` says."""
        foreign = self.foreign()
        if foreign:
            raise ConfigError(f"{self.root} holds {', '.join(foreign)}, not the files of a privfl run (beside no "
                              "config.json, or one that is not a run config): privfl writes over no file it did not "
                              "write, with --overwrite or without; choose another --out, or move those files")

    def occupant(self) -> str | None:
        """What this directory holds that a new run here would mix with or replace: ``"a run"`` (one that recorded
        a release, a metric or a result), ``"a sweep"``, ``"runs in its subdirectories a, b"``; ``None`` for nothing
        (absent, empty, unrelated files, or a run that failed before its first release: only its config and
        round-0 checkpoint)."""
        if not self.root.is_dir():
            return None
        if self.path(SWEEP_MARK).exists() or self.path("sweep.json").exists():
            return "a sweep"
        recorded = [name for name in (self.SUMMARY, self.LEDGER, self.METRICS, self.RELEASES, self.CLIENTS)
                    if self.path(name).exists() and self.path(name).stat().st_size > 0]
        # nodes/ beside a config: a Flower run whose releases its nodes' ledgers hold. Without a config it is the
        # nodes of a simulation about to start here (they keep their state before the server creates the run).
        if recorded or ((self.root / "nodes").is_dir() and self.path(self.CONFIG).exists()):
            return "a run"
        inner = sorted(child.name for child in self.root.iterdir()
                       if child.is_dir() and (child / self.CONFIG).exists())
        if inner:
            return f"runs in its subdirectories {', '.join(inner[:5])}{', ...' if len(inner) > 5 else ''}"
        return None

    def check_free(self, *, overwrite: bool, flag: str = "--overwrite", resume: bool = True) -> None:
        """Refuse (before anything is built) a directory that holds something a run here would replace or mix with,
        unless ``overwrite``; the message says how to resume (``resume``), pick another folder, or overwrite."""
        self.check_not_foreign()
        occupant = self.occupant()
        if occupant is None or overwrite:
            return
        hint = f"resume it with --resume {self.root}, " if resume and occupant == "a run" else ""
        raise ConfigError(f"{self.root} already holds {occupant}; {hint}choose another --out, or pass {flag} to "
                          "replace it")

    def create(self, config: dict[str, Any], *, overwrite: bool = False) -> None:
        """Start a new run here; refuses a directory that holds another run or a sweep unless ``overwrite``
        (:meth:`occupant`). A run that failed before its first release is replaced without it."""
        self.check_free(overwrite=overwrite)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create the run directory {self.root}: {error.strerror}; choose another --out") \
                from None
        for name in self.FILES:
            self.path(name).unlink(missing_ok=True)
        self.remove_leftovers()
        self.write_json(self.CONFIG, config)

    def remove_leftovers(self) -> list[Path]:
        """Remove the temporary files a process killed mid-write left here (only while no run writes here)."""
        return remove_leftovers(self.root, list(self.FILES))

    def read_json(self, name: str) -> Any:
        path = self.path(name)
        if not path.exists():
            if name != self.CONFIG and self.path(self.CONFIG).exists():
                raise ConfigError(f"{path} does not exist: the run in {self.root} has not finished (or the file was "
                                  "removed)")
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

    def save_checkpoint(self, state: dict[str, Any]) -> int:
        """Write ``state`` to ``checkpoint.pt`` atomically; return its size in bytes."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_bytes(self.path(self.CHECKPOINT), buffer.getvalue())
        return buffer.tell()

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.path(self.CHECKPOINT)
        if not path.exists():
            return None
        try:
            state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
            return state
        except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
            raise ConfigError(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                              "checkpoints are written whole, so it was changed or cut afterwards: start the run "
                              "again") from None
