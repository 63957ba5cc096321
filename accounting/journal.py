"""The release journal: every release recorded in a :class:`~accounting.ledger.LedgerBook`, appended to a file as it
is recorded, one JSON line each, each line carrying the sha256 of the line before it.

The line is written before the release is delivered, so :meth:`ReleaseJournal.replay_into` can put back into a
checkpoint's book the releases made after it (a ledger never rolls back); :meth:`ReleaseJournal.repair`,
:meth:`ReleaseJournal.verify`, :class:`JournalPosition`, :meth:`ReleaseJournal.mark`. Why, and what the hash chain
does and does not detect: docs/privacy.md, "The release journal".

Lines are compact (format 2): ``"p"`` carries the first 16 hex digits of the previous line's sha256 (64 bits: enough
to notice an accident, and this is no signature), and a release whose record equals an earlier line's in everything
but its time names that line instead of repeating the record: ``{"p": .., "c": 7, "s": 12, "t": 1795866609.18}`` is
client 7's release, recorded at that time, of the record on line 12 (``"r"``: a record in full). A release made for
many clients names them (``"cs"``: a list) or the earlier line that listed the same clients (``"cl"``). A round of a
thousand clients' releases takes one line of about 60 bytes each. A journal written before (format 1: ``"prev"``,
the whole hash, every record in full) is read as it is, and a resumed run continues it in its own format.

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
from accounting.budget import ClientId
from accounting.ledger import LedgerBook, ReleaseRecord, _check_client_id

#: The hash a journal's first line carries in place of a previous line's.
GENESIS = hashlib.sha256(b"privfl release journal").hexdigest()

#: How many hex digits of the previous line's hash a compact line (format 2) carries.
SHORT_HASH = 16

#: The records a writer remembers to name instead of repeating (the most recent distinct ones).
_TEMPLATES = 64


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
    compact: bool = True            # format 2 (an empty journal is written in it)
    size: int = 0                   # bytes of the complete lines

    def position(self, lines: int | None = None) -> JournalPosition:
        n = len(self.entries) if lines is None else lines
        return JournalPosition(n, self.heads[n - 1] if n else GENESIS)


class ReleaseJournal:
    """The journal file at ``path`` (see the module docstring). Nothing is read until it is needed."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._position: JournalPosition | None = None   # of the file as this object last wrote or read it
        self._file: Any = None               # the file, open for appending, while this object writes it
        self._identity: tuple[int, int] | None = None   # (device, inode) of that file
        self._size = 0                       # its bytes as this object last wrote or read them
        self._compact = True                 # the format lines are appended in (the file's own, once it has lines)
        self._templates: dict[str, int] = {}  # a record's fields but its time (JSON) -> the line that holds it
        self._fast: dict[tuple[Any, ...], int] = {}   # the same, keyed by the record's fields themselves
        self._id_lists: dict[tuple[ClientId, ...], int] = {}   # clients of a many-client line -> that line

    # -- writing ----------------------------------------------------------------------------------------------------

    def append(self, client_id: ClientId, record: ReleaseRecord) -> None:
        """Append one recorded release of ``client_id``; call it before the release is delivered."""
        client_id = _check_client_id(client_id)
        self._release({"c": client_id}, {"client_id": client_id}, record)

    def append_for(self, client_ids: Sequence[ClientId], record: ReleaseRecord) -> None:
        """Append one release recorded for every client of ``client_ids`` (:meth:`LedgerBook.record_for`), as one
        line."""
        ids = [_check_client_id(c) for c in client_ids]
        self._release({"cs": ids}, {"client_ids": ids}, record, ids=tuple(ids))

    def mark(self, name: str, **fields: Any) -> None:
        """Append a mark: an event of the run that is not a release (``fields`` must be JSON-able)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a mark's name must be a non-empty str, got {name!r}")
        self._write({"mark": name, **fields})

    def _release(self, compact: dict[str, Any], full: dict[str, Any], record: ReleaseRecord, *,
                 ids: tuple[ClientId, ...] | None = None) -> None:
        self._prepare()
        if not self._compact:
            self._write({**full, "record": record.to_dict()}, prepared=True)
            return
        listed = None if ids is None else self._id_lists.get(ids)
        if listed is not None:                  # these clients were listed on an earlier line: name it
            compact, ids = {"cl": listed}, None
        # the line of an earlier record equal to this one but for its time: looked up by the record's fields (their
        # reprs: 1, 1.0 and True differ), else by their JSON
        fast = (record.event, record.purpose, record.round, record.audience,
                tuple((k, repr(v)) for k, v in record.metadata.items()))
        line = self._fast.get(fast)
        if line is not None:
            written = self._write({**compact, "s": line, "t": record.time}, prepared=True)
        else:
            values = record.to_dict()
            del values["time"]
            key = json.dumps(values, allow_nan=False)
            line = self._templates.get(key)
            if line is not None:
                written = self._write({**compact, "s": line, "t": record.time}, prepared=True)
            else:                               # a record not seen yet: in full, and named from now on
                written = line = self._write({**compact, "r": {**values, "time": record.time}}, prepared=True)
                self._remember(self._templates, key, line)
            self._remember(self._fast, fast, line)
        if ids is not None:
            self._id_lists[ids] = written

    @staticmethod
    def _remember(table: dict[Any, int], key: Any, line: int) -> None:
        table[key] = line
        if len(table) > _TEMPLATES:                              # the oldest goes: rounds move on
            del table[next(iter(table))]

    def _prepare(self) -> None:
        """Know the file's position and format before appending: read it once (and again whenever the path no longer
        names the file this object appends to: replaced, removed, or cut by another writer)."""
        if self._appending():
            return
        self._close()
        scan = self._scan()
        if scan.torn:
            raise JournalDamaged(f"release journal {self.path} ends in a line cut short ({scan.torn} bytes); "
                                 "call repair() before appending")
        if self.path.exists() and not scan.chained:
            raise JournalDamaged(f"release journal {self.path} was written without a hash chain (an earlier "
                                 "privfl); it cannot be continued")
        self._position, self._size, self._compact = scan.position(), scan.size, scan.compact
        self._templates, self._fast, self._id_lists = {}, {}, {}
        if scan.compact:           # go on naming the records and client lists the file holds
            for number, entry in enumerate(scan.entries, start=1):
                if "r" in entry and isinstance(entry["r"], dict):
                    self._remember(self._templates, json.dumps({k: v for k, v in entry["r"].items() if k != "time"},
                                                               allow_nan=False), number)
                if isinstance(entry.get("cs"), list):
                    self._id_lists[tuple(entry["cs"])] = number
        self._file = open(self.path, "ab")
        stat = os.fstat(self._file.fileno())
        self._identity = (stat.st_dev, stat.st_ino)

    def _appending(self) -> bool:
        """Whether this object's position is the file's: it appends to the file the path still names, as it left it."""
        return self._position is not None and self._file is not None and self._same_file()

    def _same_file(self) -> bool:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (stat.st_dev, stat.st_ino) == self._identity and stat.st_size == self._size

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Close the file this object appends to (it is opened again by the next append)."""
        self._close()
        self._position = None

    def _write(self, entry: dict[str, Any], *, prepared: bool = False) -> int:
        """Append ``entry`` as a line chained to the one before; return its number (counted from 1)."""
        if not prepared:
            self._prepare()
        assert self._position is not None and self._file is not None
        chain = {"p": self._position.head[:SHORT_HASH]} if self._compact else {"prev": self._position.head}
        line = json.dumps({**chain, **entry}, allow_nan=False, separators=(",", ":") if self._compact else None
                          ).encode("utf-8")
        f = self._file
        if faults.reached("journal_line"):       # a test's kill point (accounting.faults), inert otherwise
            f.write(line[: len(line) // 2])
            f.flush()
            faults.die()
        f.write(line + b"\n")
        f.flush()                                # in the operating system's hands: a killed process keeps it
        self._size += len(line) + 1
        self._position = JournalPosition(self._position.lines + 1, line_hash(line))
        if faults.reached("journal_after"):
            faults.die()
        return self._position.lines

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
        self.close()
        scan = self._scan()
        if scan.torn:
            with open(self.path, "r+b") as f:
                f.truncate(self.path.stat().st_size - scan.torn)
                f.flush()
                os.fsync(f.fileno())
        return scan.torn

    # -- reading ----------------------------------------------------------------------------------------------------

    def _scan(self) -> _Scan:
        if not self.path.exists():
            return _Scan([], [], 0, True)
        data = self.path.read_bytes()
        *complete, tail = data.split(b"\n")     # the text after the last newline is empty, or a line cut short
        entries, heads = [], []
        kind = None                             # "p" (format 2), "prev" (format 1) or "" (no chain), from line 1
        previous = GENESIS
        for number, raw in enumerate(complete, start=1):
            try:
                entry = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} is not JSON "
                                     f"({getattr(error, 'msg', error)})") from None
            if not isinstance(entry, dict):
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} is not a JSON object")
            has = "p" if "p" in entry else "prev" if "prev" in entry else ""
            if kind is None:
                kind = has
            elif kind != has:
                how = ("in another form than the lines before it" if kind and has else
                       "and the lines before it do not")
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} "
                                     f"{'carries' if has else 'lacks'} the previous line's hash {how} (lines of two "
                                     "journals were joined)")
            if kind and entry[kind] != (previous[:SHORT_HASH] if kind == "p" else previous):
                raise JournalDamaged(
                    f"release journal {self.path} is damaged: line {number} does not follow line {number - 1} (its "
                    f"hash of the line before it differs): a line was edited, removed or reordered")
            previous = line_hash(raw)
            entries.append(entry)
            heads.append(previous)
        return _Scan(entries, heads, len(tail), kind != "", kind in (None, "p"), len(data) - len(tail))

    def position(self) -> JournalPosition:
        """The journal's complete lines and the hash of the last (a line cut short does not count): where this object
        appended last, when the file is still the one it appends to, else read from the file."""
        if self._appending():
            assert self._position is not None
            return self._position
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

    def entries(self) -> list[tuple[ClientId, ReleaseRecord]]:
        """The journal's ``(client id, record)`` pairs in the order they were recorded (none if there is no file);
        a line recorded for many clients gives one pair per client, all with one record object. Marks are left
        out."""
        pairs: list[tuple[ClientId, ReleaseRecord]] = []
        lines = self._scan().entries
        for number, entry in enumerate(lines, start=1):
            if "mark" in entry:
                continue
            try:
                record = ReleaseRecord.from_dict(self._record_values(entry, lines, number))
                ids = self._client_ids(entry, lines, number)
                pairs += [(_check_client_id(client_id), record) for client_id in ids]
            except (KeyError, TypeError, ValueError) as exc:
                raise JournalDamaged(f"release journal {self.path} is damaged: line {number} is not a release "
                                     f"record ({exc!r})") from None
        return pairs

    @staticmethod
    def _earlier(entry: dict[str, Any], key: str, lines: list[dict[str, Any]], number: int, holds: str
                 ) -> dict[str, Any]:
        """The earlier line that ``entry[key]`` names, which must hold ``holds``."""
        named = entry[key]
        if not (isinstance(named, int) and not isinstance(named, bool) and 1 <= named < number
                and holds in lines[named - 1]):
            raise ValueError(f"{key!r} names line {named!r}, which is not an earlier line holding {holds!r}")
        return lines[named - 1]

    def _record_values(self, entry: dict[str, Any], lines: list[dict[str, Any]], number: int) -> Any:
        if "record" in entry:                   # format 1
            return entry["record"]
        if "r" in entry:
            return entry["r"]
        template = self._earlier(entry, "s", lines, number, "r")["r"]
        if not isinstance(template, dict):
            raise ValueError(f"line {entry['s']}'s record is not a JSON object")
        return {**template, "time": entry["t"]}

    def _client_ids(self, entry: dict[str, Any], lines: list[dict[str, Any]], number: int) -> list[Any]:
        for key in ("client_ids", "cs"):
            if key in entry:
                ids = entry[key]
                if not isinstance(ids, list):
                    raise ValueError(f"{key!r} is not a list of client ids")
                return ids
        if "cl" in entry:
            listed = self._earlier(entry, "cl", lines, number, "cs")["cs"]
            if not isinstance(listed, list):
                raise ValueError(f"line {entry['cl']}'s client ids are not a list")
            return listed
        return [entry["client_id"] if "client_id" in entry else entry["c"]]

    def marks(self) -> list[dict[str, Any]]:
        """The journal's marks, in order (each a dict with its ``mark`` name and fields)."""
        return [{k: v for k, v in e.items() if k not in ("prev", "p")} for e in self._scan().entries if "mark" in e]

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


__all__ = ["GENESIS", "SHORT_HASH", "JournalDamaged", "JournalMismatch", "JournalPosition", "ReleaseJournal",
           "line_hash"]
