"""The release journal: every release recorded in a :class:`~accounting.ledger.LedgerBook`, appended to a file as it
is recorded, one JSON line each, each line carrying the sha256 of the line before it.

The line is written before the release is delivered, so :meth:`ReleaseJournal.replay_into` can put back into a
checkpoint's book the releases made after it (a ledger never rolls back); :meth:`ReleaseJournal.repair`,
:meth:`ReleaseJournal.verify`, :class:`JournalPosition`, :meth:`ReleaseJournal.mark`. Why, and what the hash chain
does and does not detect: docs/privacy.md, "The release journal".

>>> import tempfile, pathlib
>>> from accounting.events import GaussianEvent
>>> journal = ReleaseJournal(pathlib.Path(tempfile.mkdtemp()) / "releases.jsonl")
>>> book = LedgerBook()
>>> journal.append(3, book[3].record(GaussianEvent(5.0), purpose="descriptor", round=0))
>>> journal.replay_into(LedgerBook())     # a book saved before that release gets it back
1
>>> journal.position().lines
1
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accounting import faults
from accounting.ledger import ClientId, LedgerBook, ReleaseRecord, _check_client_id

#: The hash a journal's first line carries in place of a previous line's.
GENESIS = hashlib.sha256(b"privfl release journal").hexdigest()


def line_hash(line: bytes) -> str:
    """The sha256 (hex) of one journal line, without its newline: what the next line carries as ``prev``."""
    return hashlib.sha256(line).hexdigest()


class JournalDamaged(ValueError):
    """A release journal cannot be read as written: a line is not JSON, not a release, or breaks the hash chain."""


class JournalMismatch(ValueError):
    """A release journal is intact but is not the journal a checkpoint saw: shorter, or different in its first lines."""


@dataclass(frozen=True)
class JournalPosition:
    """How far a journal went: its number of complete lines and the hash of the last (:data:`GENESIS` when empty)."""

    lines: int
    head: str

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "head": self.head}

    @classmethod
    def from_dict(cls, values: Any) -> JournalPosition:
        if not (isinstance(values, dict) and isinstance(values.get("lines"), int) and values["lines"] >= 0
                and isinstance(values.get("head"), str) and len(values["head"]) == 64):
            raise ValueError(f"a journal position is {{'lines': int >= 0, 'head': sha256 hex}}, got {values!r}")
        return cls(lines=values["lines"], head=values["head"])


@dataclass(frozen=True)
class _Scan:
    entries: list[dict[str, Any]]   # every complete line, parsed
    heads: list[str]                # heads[i]: the hash of line i (0-based)
    torn: int                       # bytes after the last newline (a line a kill cut short)
    chained: bool                   # False for a journal written before lines carried hashes

    def position(self, lines: int | None = None) -> JournalPosition:
        n = len(self.entries) if lines is None else lines
        return JournalPosition(n, self.heads[n - 1] if n else GENESIS)


class ReleaseJournal:
    """The journal file at ``path`` (see the module docstring). Nothing is read until it is needed."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._position: JournalPosition | None = None   # of the file as this object last wrote or read it

    # -- writing ----------------------------------------------------------------------------------------------------

    def append(self, client_id: ClientId, record: ReleaseRecord) -> None:
        """Append one recorded release of ``client_id``; call it before the release is delivered."""
        self._write({"client_id": _check_client_id(client_id), "record": record.to_dict()})

    def append_for(self, client_ids: Sequence[ClientId], record: ReleaseRecord) -> None:
        """Append one release recorded for every client of ``client_ids`` (:meth:`LedgerBook.record_for`), as one
        line."""
        self._write({"client_ids": [_check_client_id(c) for c in client_ids], "record": record.to_dict()})

    def mark(self, name: str, **fields: Any) -> None:
        """Append a mark: an event of the run that is not a release (``fields`` must be JSON-able)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a mark's name must be a non-empty str, got {name!r}")
        self._write({"mark": name, **fields})

    def _write(self, entry: dict[str, Any]) -> None:
        if self._position is None:
            scan = self._scan()
            if scan.torn:
                raise JournalDamaged(f"release journal {self.path} ends in a line cut short ({scan.torn} bytes); "
                                     "call repair() before appending")
            if self.path.exists() and not scan.chained:
                raise JournalDamaged(f"release journal {self.path} was written without a hash chain (an earlier "
                                     "privfl); it cannot be continued")
            self._position = scan.position()
        line = json.dumps({"prev": self._position.head, **entry}, allow_nan=False).encode("utf-8")
        with open(self.path, "ab") as f:
            if faults.reached("journal_line"):       # a test's kill point (accounting.faults), inert otherwise
                f.write(line[: len(line) // 2])
                f.flush()
                faults.die()
            f.write(line + b"\n")
            f.flush()
        self._position = JournalPosition(self._position.lines + 1, line_hash(line))
        if faults.reached("journal_after"):
            faults.die()

    def sync(self) -> None:
        """fsync the journal, so that what it holds survives a power loss (before a checkpoint that names it)."""
        if self.path.exists():
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def repair(self) -> int:
        """Remove a last line a kill cut short (its release was never delivered); return the bytes removed."""
        scan = self._scan()
        if scan.torn:
            with open(self.path, "r+b") as f:
                f.truncate(self.path.stat().st_size - scan.torn)
                f.flush()
                os.fsync(f.fileno())
        self._position = None
        return scan.torn

    # -- reading ----------------------------------------------------------------------------------------------------

    def _scan(self) -> _Scan:
        if not self.path.exists():
            return _Scan([], [], 0, True)
        data = self.path.read_bytes()
        *complete, tail = data.split(b"\n")     # the text after the last newline is empty, or a line cut short
        entries, heads = [], []
        chained = None
        previous = GENESIS
        for number, raw in enumerate(complete, start=1):
            try:
                entry = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} is not JSON "
                                     f"({getattr(error, 'msg', error)})") from None
            if not isinstance(entry, dict):
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} is not a JSON object")
            has_prev = "prev" in entry
            if chained is None:
                chained = has_prev
            elif chained != has_prev:
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} "
                                     f"{'carries' if has_prev else 'lacks'} the previous line's hash and the lines "
                                     "before it do not (lines of two journals were joined)")
            if chained and entry["prev"] != previous:
                raise JournalDamaged(
                    f"release journal {self.path} is damaged: line {number} does not follow line {number - 1} (its "
                    f"hash of the line before it differs): a line was edited, removed or reordered")
            previous = line_hash(raw)
            entries.append(entry)
            heads.append(previous)
        return _Scan(entries, heads, len(tail), chained is not False)

    def position(self) -> JournalPosition:
        """The journal's complete lines and the hash of the last (a line cut short does not count)."""
        return self._scan().position()

    def verify(self, expected: JournalPosition) -> None:
        """Raise :class:`JournalMismatch` unless the journal's first ``expected.lines`` lines are the ones a
        checkpoint saw (their last hash is ``expected.head``), and :class:`JournalDamaged` if it cannot be read."""
        scan = self._scan()
        if len(scan.entries) < expected.lines:
            raise JournalMismatch(f"release journal {self.path} holds {len(scan.entries)} lines, but the checkpoint "
                                  f"was saved when it held {expected.lines}: the journal was cut, emptied or "
                                  "replaced, and the releases it lost would go unreported")
        if scan.position(expected.lines) != expected:
            raise JournalMismatch(f"release journal {self.path} differs from the one the checkpoint saw (the hash of "
                                  f"its line {expected.lines} is not the one the checkpoint recorded): it was "
                                  "replaced, or belongs to another run")

    def _release_entries(self) -> list[tuple[int, dict[str, Any]]]:
        return [(n, e) for n, e in enumerate(self._scan().entries, start=1) if "mark" not in e]

    def entries(self) -> list[tuple[ClientId, ReleaseRecord]]:
        """The journal's ``(client id, record)`` pairs in the order they were recorded (none if there is no file);
        a line recorded for many clients gives one pair per client, all with one record object. Marks are left
        out."""
        pairs: list[tuple[ClientId, ReleaseRecord]] = []
        for number, entry in self._release_entries():
            try:
                record = ReleaseRecord.from_dict(entry["record"])
                ids = entry["client_ids"] if "client_ids" in entry else [entry["client_id"]]
                pairs += [(_check_client_id(client_id), record) for client_id in ids]
            except (KeyError, TypeError, ValueError) as exc:
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} is not a release "
                                     f"record ({exc!r})") from None
        return pairs

    def marks(self) -> list[dict[str, Any]]:
        """The journal's marks, in order (each a dict with its ``mark`` name and fields)."""
        return [{k: v for k, v in e.items() if k != "prev"} for e in self._scan().entries if "mark" in e]

    def replay_into(self, book: LedgerBook) -> int:
        """Add to ``book`` the journal's records beyond those it holds for each client (releases made after the book
        was saved); return how many. The book's records must be the first of the journal's for every client.

        Replayed records are history, as in :meth:`PrivacyLedger.from_state_dict`: not re-checked against a budget.
        """
        seen: Counter[ClientId] = Counter()
        saved: dict[ClientId, tuple[ReleaseRecord, ...]] = {}    # each client's records as the book held them
        added = 0
        for client_id, record in self.entries():
            ledger = book[client_id]
            held = saved.setdefault(client_id, ledger.records)
            if seen[client_id] < len(held):
                if held[seen[client_id]] != record:
                    raise JournalMismatch(f"release journal {self.path} does not match the ledger of client "
                                          f"{client_id!r} at its record {seen[client_id]}: they come from different "
                                          "runs")
            else:
                ledger._append_history(record)
                added += 1
            seen[client_id] += 1
        return added


__all__ = ["GENESIS", "JournalDamaged", "JournalMismatch", "JournalPosition", "ReleaseJournal", "line_hash"]
