"""Fault injection: a run killed with SIGKILL at seeded points (between releases, halfway through a journal line,
halfway through a checkpoint or another file's atomic write; :mod:`accounting.faults`), then resumed, ends with the
numbers of an uninterrupted run (seeded noise), reports every release the killed process made, and leaves no
temporary file behind.

Each killed run is a forked child of the test process (no interpreter start-up per kill); it dies by the kill hook's
SIGKILL, with no Python cleanup, as a kill -9 from outside would leave it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import signal
from collections import Counter

import pytest
import torch

from accounting import LedgerBook, ReleaseJournal, faults
from privfl.experiment import train
from privfl.federation.spend import read_spend

#: Kill points and how often each is drawn: the journal and the checkpoint (written many times a run) most, the
#: files a finishing run writes once each less.
KINDS = ("journal_line", "journal_after", "write:checkpoint.pt") * 2 + (
    "write:config.json", "write:clients.csv", "write:ledger.json", "write:summary.json")
SEEDS = range(24)


def _config():
    from conftest import tiny_dp_config

    return tiny_dp_config(checkpoint_every=1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run without faults: its summary, its ledgers, and how often it reaches each kill point."""
    reached: Counter[str] = Counter()
    real = faults.reached

    def counting(point: str) -> bool:
        reached[point] += 1
        return real(point)

    faults.reached = counting
    try:
        out = tmp_path_factory.mktemp("uninterrupted") / "run"
        summary = train(_config(), str(out), progress=False)
    finally:
        faults.reached = real
    return summary, LedgerBook.load(out / "ledger.json"), reached


def _run_until_killed(out: str, point: str) -> None:
    import os

    os.environ[faults.ENV] = point
    torch.set_num_threads(1)
    train(_config(), out, progress=False)


def _kill(out, point: str) -> int:
    child = multiprocessing.get_context("fork").Process(target=_run_until_killed, args=(str(out), point))
    child.start()
    child.join()
    return child.exitcode


def _records(book: LedgerBook) -> dict:
    """Each client's records without their time (a resumed run's repeat of a round is the same release, later)."""
    return {cid: [dataclasses.replace(r, time=0.0) for r in book[cid].records] for cid in book}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_run_killed_at_a_seeded_point_resumes_to_the_uninterrupted_numbers_and_reports_every_release(
        tmp_path, seed, uninterrupted, monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    full_summary, full_book, reached = uninterrupted
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    assert reached[kind] >= 1, f"the run never reaches {kind}"
    point = f"{kind}:{rng.randint(1, reached[kind])}"
    out = tmp_path / "run"
    assert _kill(out, point) == -signal.SIGKILL, f"the run was not killed at {point}"

    # what the killed process released: every complete journal line (a line cut short was never delivered)
    journal = ReleaseJournal(out / "releases.jsonl")
    made = LedgerBook()
    journal.replay_into(made)
    if made and (out / "config.json").exists():
        # `privfl ledger` on the killed run already reports at least that
        spent = read_spend(out).epsilons()
        assert all(spent[cid] >= eps for cid, eps in made.epsilons(1e-5).items()), point
    resumed_from = (torch.load(out / "checkpoint.pt", weights_only=True)["runtime"]["completed_rounds"]
                    if (out / "checkpoint.pt").exists() else 0)

    if (out / "config.json").exists():
        summary = train(None, str(out), resume=True, progress=False)
    else:   # killed while writing config.json: nothing was released, the run is simply started again
        assert not made
        summary = train(_config(), str(out), progress=False)

    assert summary["novel"] == full_summary["novel"], point
    assert summary["training_val"] == full_summary["training_val"], point
    assert not list(out.glob(".*.tmp")), f"{point}: temporary files left: {list(out.glob('.*.tmp'))}"
    # the ledger holds what the killed process released, then the rounds the resumed run ran again: never less
    book = LedgerBook.load(out / "ledger.json")
    expected = _records(made)
    for cid, records in _records(full_book).items():
        expected[cid] = expected.get(cid, []) + [r for r in records if r.round is not None and r.round >= resumed_from]
    assert _records(book) == expected, point
    epsilons, full_epsilons = book.epsilons(1e-5), full_book.epsilons(1e-5)
    assert all(epsilons[cid] >= full_epsilons[cid] for cid in full_epsilons), point
    assert all(epsilons[cid] >= eps for cid, eps in made.epsilons(1e-5).items()), point
    assert summary["privacy"]["epsilon_max_training"] == max(epsilons.values())


def test_the_seeded_points_cover_every_kind_of_fault():
    kinds = Counter(KINDS[seed % len(KINDS)] for seed in SEEDS)
    assert len(SEEDS) >= 20 and set(kinds) == set(KINDS)
    assert min(kinds[k] for k in ("journal_line", "journal_after", "write:checkpoint.pt")) >= 4


def _hold_lock(out: str, ready) -> None:
    import time

    from privfl.federation.lock import hold

    with hold(out, engine="inprocess"):
        ready.set()
        time.sleep(120)


def test_a_second_writer_is_refused_naming_the_first_and_a_dead_writer_s_lock_is_taken_over(tmp_path, monkeypatch):
    from privfl.experiment import RunInterrupted
    from privfl.federation.lock import LOCK, RunBusyError

    monkeypatch.delenv(faults.ENV, raising=False)
    out = tmp_path / "run"
    with pytest.raises(RunInterrupted):
        train(_config(), str(out), progress=False, stop_after_round=2)
    journal = (out / "releases.jsonl").read_bytes()
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    writer = context.Process(target=_hold_lock, args=(str(out), ready))
    writer.start()
    try:
        assert ready.wait(30)
        # a resume while the run goes on trained its rounds a second time (18 releases for 9): refused, naming the
        # writer and the command that stops it, and nothing is written
        with pytest.raises(RunBusyError, match=rf"{out} is being written by another privfl process: pid {writer.pid} "
                                               rf"on host .*Stop it first with kill -INT {writer.pid}"):
            train(None, str(out), resume=True, progress=False)
        with pytest.raises(RunBusyError, match=f"pid {writer.pid}"):
            train(_config(), str(out), overwrite=True, progress=False)
        assert (out / "releases.jsonl").read_bytes() == journal
    finally:
        writer.kill()
        writer.join()
    # killed (-9): its lock file stays, naming a dead process; the next writer takes it over, and removes it at its end
    assert (out / LOCK).exists()
    summary = train(None, str(out), resume=True, progress=False)
    assert summary["rounds_completed"] == 4 and not (out / LOCK).exists()


def test_a_resume_that_would_pass_the_target_says_by_how_much_before_it_runs(tmp_path, monkeypatch):
    import re

    from privfl.errors import ConfigError
    from privfl.privacy.training import TrainingPrivacy

    monkeypatch.delenv(faults.ENV, raising=False)
    privacy = TrainingPrivacy(mode="record", epsilon=3.0, clip=1.0, noise="seeded", noise_seed=1)
    config = dataclasses.replace(_config(), privacy=privacy, checkpoint_every=2)

    def killed_in_round_3(out: str) -> None:
        import os

        os.environ[faults.ENV] = "journal_after:14"    # 4 releases a round: 2 of round 3's after round 2's 4
        torch.set_num_threads(1)
        train(config, out, progress=False)

    out = tmp_path / "run"
    child = multiprocessing.get_context("fork").Process(target=killed_in_round_3, args=(str(out),))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL
    journal = (out / "releases.jsonl").read_bytes()
    # the checkpoint holds rounds 0-1; rounds 2 and 3 were released (in part) and would be again: above the target
    with pytest.raises(ConfigError, match=r"resuming .* from round 2 would take training clients \[.*\] to epsilon "
                                          r"[0-9.]+ at delta 1e-05, [0-9.]+ above the target 3 .*--allow-overshoot"
                       ) as refusal:
        train(None, str(out), resume=True, progress=False)
    assert (out / "releases.jsonl").read_bytes() == journal            # refused before any release
    projected = float(re.search(r"to epsilon ([0-9.]+)", str(refusal.value)).group(1))
    assert projected > 3.0
    summary = train(None, str(out), resume=True, progress=False, allow_overshoot=True)
    # the amount said before the run is the amount the run then reports
    assert summary["privacy"]["epsilon_max_training"] == pytest.approx(projected, abs=1e-4)
