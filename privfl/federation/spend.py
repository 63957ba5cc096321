"""What a run directory's files say a run spent and achieved, finished or not: the source of ``privfl ledger`` and
``privfl report``.

A run records every release in ``releases.jsonl`` before it is delivered (:mod:`accounting.journal`), keeps its
ledgers in each checkpoint, and writes ``ledger.json`` and ``summary.json`` when it finishes. :func:`read_spend`
rebuilds every client's ledger from the journal and sets it beside the other records present (``ledger.json``, and
for an unfinished run the last checkpoint's ledgers and journal position): where they disagree it says so, and each
client's epsilon is taken from the longest record, so that a damaged or cut file never lowers a reported epsilon. A
finished run's ``summary.json`` is the third record: where the epsilon it states for a client differs from the
recomputed one, a warning names both and the larger is reported. A file that cannot be read is named in one line
(:class:`~privfl.errors.ConfigError`), never skipped.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accounting import JournalDamaged, LedgerBook, PrivacyLedger, ReleaseJournal
from privfl.errors import ConfigError
from privfl.federation.rundir import RunDirectory

#: The ledger record metadata key that names the privfl run a release belongs to: a Flower node's ledger keeps its
#: client's lifetime, every run's releases, and tells them apart by it (:mod:`privfl.engines.flower.protocol`).
RUN_KEY = "run"

#: The journal mark of a run whose novel clients were served (written by :func:`privfl.experiment.finish`, with their
#: scores, so a run stopped after it finishes without serving them again).
NOVEL_SERVED = "novel_clients_served"


@dataclass
class RunSpend:
    """The releases a run directory records, per client, and how the files agree.

    ``book``: for each client the longest consistent record among the files read; ``status``: ``"finished"`` or a
    phrase starting with ``"unfinished"``; ``sources``: the files read; ``warnings``: each disagreement in one line.
    """

    root: Path
    delta: float
    book: LedgerBook
    status: str
    sources: list[str]
    warnings: list[str] = field(default_factory=list)
    rounds: tuple[int | None, int | None] = (None, None)     # rounds the last checkpoint holds, rounds planned
    #: Epsilons ``summary.json`` states above what the records give (an edited or damaged record): reported instead.
    claimed: dict[Any, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def epsilons(self) -> dict[Any, float]:
        """Each client's epsilon at :attr:`delta`: recomputed by the accountant from the records, or what
        ``summary.json`` states where that is larger (the files disagree, and a warning says so)."""
        found = self.book.epsilons(self.delta)
        for cid, value in self.claimed.items():
            found[cid] = max(found.get(cid, 0.0), value)
        return found

    def roles(self) -> dict[Any, str]:
        """``"training"`` for a client with a release in a round, ``"novel"`` for one whose releases have none."""
        return {cid: "training" if any(r.round is not None for r in ledger.records) else "novel"
                for cid, ledger in self.book.items()}


def read_spend(root: str | Path, delta: float | None = None) -> RunSpend:
    """The spend of the run in ``root`` (see the module docstring); ``delta`` defaults to the run's."""
    run = RunDirectory(root)
    config = run.read_json(RunDirectory.CONFIG)
    if not isinstance(config, dict):
        raise ConfigError(f"{run.path(RunDirectory.CONFIG)} is damaged: it holds a JSON {type(config).__name__}, "
                          "not a run config")
    if delta is None:
        delta = config.get("delta", 1e-5)
        if isinstance(delta, bool) or not isinstance(delta, float) or not 0 < delta < 1:
            raise ConfigError(f"{run.path(RunDirectory.CONFIG)} is damaged: its delta {delta!r} is not a "
                              "probability in (0, 1); pass --delta")
    finished = run.path(RunDirectory.SUMMARY).exists()
    sources, warnings = [], []
    books: dict[str, LedgerBook] = {}
    journal = ReleaseJournal(run.path(RunDirectory.RELEASES))
    marks: list[dict[str, Any]] = []
    if journal.path.exists():
        books[RunDirectory.RELEASES] = _journal_book(journal)
        marks = journal.marks()
        sources.append(RunDirectory.RELEASES)
    if run.path(RunDirectory.LEDGER).exists():
        books[RunDirectory.LEDGER] = _ledger_book(run.path(RunDirectory.LEDGER))
        sources.append(RunDirectory.LEDGER)
    rounds: tuple[int | None, int | None] = (None, config.get("rounds"))
    if not finished:
        checkpoint = _checkpoint(run)
        if checkpoint is not None:
            wire = checkpoint.get("runtime", {}).get("wire", {})
            rounds = (checkpoint.get("runtime", {}).get("completed_rounds"), config.get("rounds"))
            if wire.get("ledgers_on_nodes") and RunDirectory.LEDGER not in books:
                raise ConfigError(f"the run in {run.root} ran on Flower and has not finished: its clients' ledgers "
                                  f"are on its nodes (under {run.root / 'nodes'}), not in the run directory; read a "
                                  "node's ledger file there")
            if "ledgers" in wire:
                try:
                    books[RunDirectory.CHECKPOINT] = LedgerBook.from_state_dict(wire["ledgers"])
                except (ValueError, KeyError, TypeError) as error:
                    raise ConfigError(f"{run.path(RunDirectory.CHECKPOINT)} is damaged: its ledgers cannot be read "
                                      f"({error})") from None
                sources.append(RunDirectory.CHECKPOINT)
            seen = checkpoint.get("journal")
            if isinstance(seen, dict) and journal.position().lines < seen.get("lines", 0):
                warnings.append(f"{RunDirectory.RELEASES} holds {journal.position().lines} lines but the checkpoint "
                                f"was saved when it held {seen['lines']}: the journal was cut or emptied, so releases "
                                "made after the checkpoint may be missing from every file")
    if not books:
        if finished:
            raise ConfigError(f"{run.root} holds a finished run without {RunDirectory.LEDGER} or "
                              f"{RunDirectory.RELEASES}: its releases cannot be recomputed")
        books["none"] = LedgerBook()
    book = _merge(books, warnings, finished, float(delta))
    claimed = _cross_check_summary(run, book, float(delta), warnings) if finished else {}
    if finished:
        status = "finished"
    elif any(m.get("mark") == NOVEL_SERVED for m in marks):
        status = f"unfinished: its novel clients were served, but {RunDirectory.SUMMARY} is missing"
    else:
        done, planned = rounds
        status = "unfinished" + ("" if done is None else f": {done} of {planned} rounds in its last checkpoint")
    if claimed:
        sources.append(RunDirectory.SUMMARY)
    return RunSpend(root=run.root, delta=float(delta), book=book, status=status, sources=sources, warnings=warnings,
                    rounds=rounds, claimed=claimed)


def _cross_check_summary(run: RunDirectory, book: LedgerBook, delta: float, warnings: list[str]) -> dict[Any, float]:
    """The third record of a finished run: each client's epsilon ``summary.json`` states, set beside the one the
    journal and ``ledger.json`` give (at the run's delta only: the summary holds no other). Every disagreement is a
    warning naming the client and both figures; the clients whose stated epsilon is the larger, with it (a journal
    and ledger edited alike, hash chain recomputed, must not lower what is reported)."""
    summary = run.read_json(RunDirectory.SUMMARY)
    privacy = summary.get("privacy") if isinstance(summary, dict) else None
    if not isinstance(privacy, dict) or not isinstance(privacy.get("epsilon_per_client"), dict):
        warnings.append(f"{RunDirectory.SUMMARY} states no epsilon per client: it was changed or cut after the run "
                        "wrote it; the epsilons are recomputed from the releases")
        return {}
    stated_delta = privacy.get("delta")
    if not isinstance(stated_delta, float) or not math.isclose(stated_delta, delta, rel_tol=1e-12):
        return {}
    recomputed = {str(cid): eps for cid, eps in book.epsilons(delta).items()}
    ids = {str(cid): cid for cid in book}
    larger: dict[Any, float] = {}
    for key, value in privacy["epsilon_per_client"].items():
        try:
            stated = float(value)
        except (TypeError, ValueError):
            warnings.append(f"{RunDirectory.SUMMARY} states epsilon {value!r} for client {key}, not a number")
            continue
        found = recomputed.get(str(key), 0.0)
        if _same_epsilon(stated, found):
            continue
        warnings.append(f"client {key}: {RunDirectory.SUMMARY} states epsilon {stated:.6g} but the recorded releases "
                        f"({RunDirectory.RELEASES}, {RunDirectory.LEDGER}) give {found:.6g}: the run's records "
                        f"disagree (edited or damaged); the larger, {max(stated, found):.6g}, is reported")
        if stated > found:
            larger[ids.get(str(key), _client_key(str(key)))] = stated
    return larger


def _same_epsilon(a: float, b: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _client_key(key: str) -> Any:
    return int(key) if key.lstrip("-").isdigit() else key


def _journal_book(journal: ReleaseJournal) -> LedgerBook:
    book = LedgerBook()
    try:
        journal.replay_into(book)
    except JournalDamaged as error:
        raise ConfigError(f"{error}; the releases it records cannot be recounted: restore it from a copy, and "
                          "until then count the epsilons of ledger.json or the summary as a lower bound") from None
    except ValueError as error:     # a record the ledger refuses (two relations for one client)
        raise ConfigError(f"release journal {journal.path} is damaged: {error}") from None
    return book


def _ledger_book(path: Path) -> LedgerBook:
    try:
        return LedgerBook.load(path)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is damaged (not JSON: {error.msg} at line {error.lineno}); the run writes it "
                          "whole, so it was changed or cut afterwards: the journal releases.jsonl holds the same "
                          "records") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"{path} is damaged (not a ledger book: {str(error)[:200]}); the journal releases.jsonl "
                          "holds the same records") from None


def _checkpoint(run: RunDirectory) -> dict[str, Any] | None:
    path = run.path(RunDirectory.CHECKPOINT)
    if not path.exists():
        return None
    try:   # mapped, not read: only the ledgers and the position are used
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return state
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as error:
        raise ConfigError(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                          "checkpoints are written whole, so it was changed or cut afterwards") from None


def _merge(books: dict[str, LedgerBook], warnings: list[str], finished: bool, delta: float) -> LedgerBook:
    """One ledger per client: the longest record among ``books`` when every other is a prefix of it (a journal
    ahead of the last checkpoint); when two disagree, the one with the larger epsilon, and a warning either way
    where a file lost records another holds."""
    merged = LedgerBook()
    for cid in sorted({cid for book in books.values() for cid in book}, key=_order):
        held = {name: book[cid] for name, book in books.items() if cid in book}
        longest = max(held, key=lambda name: (len(held[name]), name == RunDirectory.RELEASES))
        chosen = held[longest]
        for name, ledger in held.items():
            if ledger.records != held[longest].records[:len(ledger)]:
                warnings.append(f"client {cid}: {name} and {longest} disagree from record "
                                f"{_first_difference(ledger.records, held[longest].records)}; the larger of their "
                                "epsilons is reported")
                chosen = max(chosen, ledger, key=lambda kept: kept.spent(delta).epsilon)
            elif len(ledger) < len(held[longest]) and (name == RunDirectory.RELEASES or
                                                        (finished and name == RunDirectory.LEDGER)):
                warnings.append(f"client {cid}: {name} holds {len(ledger)} releases, {longest} {len(held[longest])}: "
                                f"{name} lost records (or releases were made after it was written); the longer is "
                                "counted")
        merged.add(_copy(chosen))
    return merged


def _copy(ledger: PrivacyLedger) -> PrivacyLedger:
    return PrivacyLedger.from_state_dict(ledger.state_dict())


def _first_difference(a: tuple[Any, ...], b: tuple[Any, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _order(cid: Any) -> tuple[bool, int, str]:
    return (isinstance(cid, str), cid if isinstance(cid, int) else 0, str(cid))


def run_summary(root: str | Path) -> dict[str, Any]:
    """The run's ``summary.json`` with ``"status": "finished"`` and ``"run_dir"``; for an unfinished run, what its
    files say: its method, the last validation scores in ``metrics.jsonl``, epsilons recomputed by
    :func:`read_spend` (no novel-client results: none were written), ``"status"`` saying how far it got and
    ``"warnings"``. A finished run's summary is cross-checked against its journal and ledger: where the three
    records disagree (a journal with more releases than the ledger, a summary edited after the run) its epsilons
    are the largest any of them gives, with a warning naming each mismatch."""
    run = RunDirectory(root)
    if run.path(RunDirectory.SUMMARY).exists():
        summary = run.read_json(RunDirectory.SUMMARY)
        if not isinstance(summary, dict):
            raise ConfigError(f"{run.path(RunDirectory.SUMMARY)} is damaged: not a run summary")
        summary = {**summary, "status": "finished", "run_dir": str(run.root), "warnings": []}
        # the three records cross-checked: the journal, ledger.json and the summary's own figures
        spend = read_spend(root)
        # the epsilons a table shows are the accountant's, from the recorded releases, never the summary's own
        summary["privacy"] = {**summary.get("privacy", {}), **_privacy(spend)}
        if spend.warnings or _journal_counts(run) != _ledger_counts(run):
            summary["warnings"] = ([f"{RunDirectory.RELEASES} and {RunDirectory.LEDGER} record different releases; "
                                    "the epsilons are recomputed from the longer"]
                                   if _journal_counts(run) != _ledger_counts(run) else []) + spend.warnings
        return summary
    config = run.read_json(RunDirectory.CONFIG)
    spend = read_spend(root)
    metrics = run.read_metrics()
    last = metrics[-1] if metrics else {}
    done, planned = spend.rounds
    return {
        "method": config.get("method") if isinstance(config, dict) else None,
        "status": spend.status, "run_dir": str(run.root), "warnings": spend.warnings,
        "novel": {}, "training_val": {"accuracy_mean": last.get("val_accuracy_mean"),
                                      "accuracy_sem": last.get("val_accuracy_sem")},
        "privacy": {**_privacy(spend), "training_mode": ((config.get("privacy") or {}).get("mode")
                                                         if isinstance(config, dict) else None)},
        "selected_round": None, "rounds_completed": done if done is not None else last.get("round", 0),
        "rounds_planned": planned, "wall_time_s": None,
    }


def _privacy(spend: RunSpend) -> dict[str, Any]:
    epsilons, roles = spend.epsilons(), spend.roles()
    return {
        "delta": spend.delta,
        "epsilon_max_training": max((e for c, e in epsilons.items() if roles.get(c, "training") == "training"),
                                    default=0.0),
        "epsilon_max_novel": max((e for c, e in epsilons.items() if roles.get(c) == "novel"), default=0.0),
        "epsilon_per_client": {str(c): e for c, e in epsilons.items()},
        "noise_sources": spend.book.private_metadata_counts("noise"),
        "relations": spend.book.relations(),
        # the records the accountant recomputed these from (summary.json only where it states more, with a warning)
        "epsilon_source": (" + ".join(spend.sources) or "no record") + " (recomputed)",
    }


def _journal_counts(run: RunDirectory) -> dict[str, int] | None:
    journal = ReleaseJournal(run.path(RunDirectory.RELEASES))
    if not journal.path.exists():
        return None
    try:
        entries = journal.entries()
    except JournalDamaged as error:
        raise ConfigError(str(error)) from None
    counts: dict[str, int] = {}
    for cid, _ in entries:
        counts[str(cid)] = counts.get(str(cid), 0) + 1
    return counts


def _ledger_counts(run: RunDirectory) -> dict[str, int] | None:
    if not run.path(RunDirectory.LEDGER).exists():
        return _journal_counts(run)     # nothing to compare with
    book = _ledger_book(run.path(RunDirectory.LEDGER))
    return {str(cid): len(book[cid]) for cid in book if len(book[cid])}


def lifetime_of(book: LedgerBook, run_id: str, delta: float, *, clients: Iterable[Any] = ()) -> dict[str, Any]:
    """What a Flower run's summary says of its clients' lifetimes (``flower.lifetime``), from their lifetime ledgers
    ``book`` (every record each client's node ledger holds): each client's epsilon at ``delta`` (0 for one of
    ``clients`` without a record) and the earlier runs its ledger holds (records whose metadata :data:`RUN_KEY` names
    another run than ``run_id``, or none: from before run ids). ``privfl ledger`` recomputes the same from the run's
    ``node-ledgers.json`` (:func:`read_lifetime`)."""
    runs: dict[Any, list[str]] = {}
    for cid in book:
        others = {str(r.metadata.get(RUN_KEY) or "untagged") for r in book[cid].records} - {run_id}
        if others and run_id:
            runs[cid] = sorted(others)
    epsilons = book.epsilons(delta)
    everyone = sorted(set(clients) | set(epsilons), key=_order)
    return {"run_id": run_id, "delta": delta,
            "epsilon_per_client": {str(cid): float(epsilons.get(cid, 0.0)) for cid in everyone},
            "earlier_runs": sorted({run for found in runs.values() for run in found}),
            "earlier_runs_per_client": {str(cid): runs[cid] for cid in sorted(runs, key=_order)}}


def read_lifetime(root: str | Path, delta: float) -> tuple[dict[str, Any], str, list[str]] | None:
    """The lifetime epsilons of a finished Flower run's clients at ``delta``, recomputed by the accountant from the
    node ledgers the run saved (``node-ledgers.json``, :func:`lifetime_of`), set beside what ``summary.json`` states
    (at the run's delta): where the summary states more for a client, a warning names both and the larger is
    reported. Returns (lifetime, its source, warnings), or None for a run that has no lifetime (not on Flower). A
    run written before node ledgers were saved gives the summary's figures, its source saying so."""
    run = RunDirectory(root)
    summary = run.read_json(RunDirectory.SUMMARY) if run.path(RunDirectory.SUMMARY).exists() else {}
    stated = ((summary.get("flower") or {}).get("lifetime") or {}) if isinstance(summary, dict) else {}
    path = run.path(RunDirectory.NODE_LEDGERS)
    if not path.exists():
        if not stated:
            return None
        return stated, (f"{RunDirectory.SUMMARY} (not recomputed: the run saved no {RunDirectory.NODE_LEDGERS}), at "
                        f"delta={float(stated['delta']):g}"), []
    lifetime = lifetime_of(_ledger_book(path), str(stated.get("run_id") or ""), delta,
                           clients=[_client_key(c) for c in stated.get("epsilon_per_client", {})])
    warnings = []
    if stated and math.isclose(float(stated.get("delta", -1)), delta, rel_tol=1e-12):
        for key, value in stated.get("epsilon_per_client", {}).items():
            found = lifetime["epsilon_per_client"].get(str(key), 0.0)
            if not _same_epsilon(float(value), found):
                warnings.append(f"client {key}: {RunDirectory.SUMMARY} states lifetime epsilon {float(value):.6g} but "
                                f"the node ledgers ({RunDirectory.NODE_LEDGERS}) give {found:.6g}: the run's records "
                                f"disagree (edited or damaged); the larger, {max(float(value), found):.6g}, is "
                                "reported")
                lifetime["epsilon_per_client"][str(key)] = max(float(value), found)
    return lifetime, f"{RunDirectory.NODE_LEDGERS} (recomputed)", warnings


__all__ = ["NOVEL_SERVED", "RUN_KEY", "RunSpend", "lifetime_of", "read_lifetime", "read_spend", "run_summary"]
