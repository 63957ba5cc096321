"""Epsilon reported against releases made, for runs killed with SIGKILL at the fault-injection suite's seeded points
(tests/federation/test_faults.py) and resumed.

For each point: the releases the killed process journaled, the releases the whole run made (the release lines of
the final ``releases.jsonl``: each is written before its release is delivered), the releases ``ledger.json`` reports,
and the largest client epsilon of each. A run under-reports when ``ledger.json`` holds fewer releases, or a lower
epsilon, than were made.

    python benchmarks/fault_cases.py [--seeds 24] [--out runs/fault_cases]

Prints the Markdown table of benchmarks/README.md ("Faults never hide privacy spend").
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from accounting import LedgerBook, ReleaseJournal, faults  # noqa: E402
from privfl.experiment import train  # noqa: E402

KINDS = ("journal_line", "journal_after", "write:checkpoint.pt") * 2 + (
    "write:config.json", "write:clients.csv", "write:ledger.json", "write:summary.json")


def config():
    from conftest import tiny_dp_config

    return tiny_dp_config(checkpoint_every=1)


def killed(out: str, point: str) -> None:
    os.environ[faults.ENV] = point
    torch.set_num_threads(1)
    train(config(), out, progress=False)


def journal_book(path: Path) -> LedgerBook:
    book = LedgerBook()
    ReleaseJournal(path).replay_into(book)
    return book


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--out", default="runs/fault_cases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    reached: Counter[str] = Counter()
    real = faults.reached
    faults.reached = lambda point: bool(reached.update([point])) or real(point)
    train(config(), str(root / "uninterrupted"), progress=False)
    faults.reached = real
    print("| kill point | journaled by the killed process | releases made | releases in ledger.json | "
          "max epsilon of the releases made | max epsilon reported |")
    print("|---|---:|---:|---:|---:|---:|")
    for seed in range(args.seeds):
        kind = KINDS[seed % len(KINDS)]
        point = f"{kind}:{random.Random(seed).randint(1, reached[kind])}"
        out = root / f"seed{seed}"
        child = multiprocessing.get_context("fork").Process(target=killed, args=(str(out), point))
        child.start()
        child.join()
        assert child.exitcode == -signal.SIGKILL, point
        before = sum(len(ledger) for _, ledger in journal_book(out / "releases.jsonl").items())
        if (out / "config.json").exists():
            train(None, str(out), resume=True, progress=False)
        else:
            train(config(), str(out), progress=False)
        made, reported = journal_book(out / "releases.jsonl"), LedgerBook.load(out / "ledger.json")
        count = [sum(len(ledger) for _, ledger in book.items()) for book in (made, reported)]
        eps = [max(book.epsilons(1e-5).values()) for book in (made, reported)]
        print(f"| `{point}` | {before} | {count[0]} | {count[1]} | {eps[0]:.3f} | {eps[1]:.3f} |")


if __name__ == "__main__":
    main()
