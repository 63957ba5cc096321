"""Paired, per-silo comparisons of the cross-silo Rotated MNIST runs of ``cross_silo_mnist.py``.

Over two or three seeds, the table of ``cross_silo_mnist.py`` reads its ordering from Student-t intervals over the
seeds' means (12.7 SEMs wide at two seeds), which separate rows only when they are far apart. The runs hold more: each
silo's own accuracy (``clients.csv``), and the same seed gives every row the same silos, the same data and the same
initialisation. This script pairs them: for each seed, the mean over the 40 silos of (row A's accuracy on silo i minus
row B's on silo i), with its SEM over silos, and the per-seed differences' mean over seeds with its SEM and 95% t
half-width (``cross_silo_mnist.interval``); the verdict says whether that interval excludes 0 (one seed: none).
Silos within a seed are not independent (MR-MTL and FedAvg silos share a mean), so the SEM over silos describes the
spread between silos, not a test. FedAvg + fine-tuning stores no per-silo scores and is left out.

Needs the run directories under ``--out`` of ``cross_silo_mnist.py`` with the same ``--rounds`` and ``--seeds``.

    python benchmarks/cross_silo_paired.py --rounds 100 --seeds 0,1 [--level eps1] [--out runs/cross_silo_mnist]

Writes ``benchmarks/results/cross_silo_paired.json`` (one entry per rounds, level and seeds; command and numerics).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cross_silo_mnist import ROWS, interval, run_dir  # noqa: E402

from privfl.errors import ConfigError  # noqa: E402
from privfl.federation.rundir import update_json  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "cross_silo_paired.json"
#: The rows with a run directory of their own, and the pairs compared (first minus second): the paper's ordering.
PAIRS = (("MR-MTL (lambda 0.001)", "Local"), ("MR-MTL (lambda 0.001)", "FedAvg"), ("FedAvg", "Local"))


def silo_accuracies(args: argparse.Namespace, row: str, seed: int) -> dict[int, float]:
    """Each training silo's accuracy in percent, from the row's run directory for ``seed``."""
    nonprivate, private = ROWS[row]
    method, settings = private if args.level == "eps1" else nonprivate
    path = run_dir(args, method, settings, args.level, seed) / "clients.csv"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: run `python benchmarks/cross_silo_mnist.py --rounds {args.rounds} "
                          f"--seeds {seed} --levels {args.level} --out {args.out}` first")
    with open(path, newline="") as f:
        return {int(r["client_id"]): float(r["accuracy"]) for r in csv.DictReader(f) if r["role"] == "training"}


def compare(args: argparse.Namespace) -> list[dict]:
    rows = {row for pair in PAIRS for row in pair}
    scores = {(row, seed): silo_accuracies(args, row, seed) for row in sorted(rows) for seed in args.seeds}
    out = []
    for a, b in PAIRS:
        per_seed = []
        for seed in args.seeds:
            first, second = scores[(a, seed)], scores[(b, seed)]
            if set(first) != set(second):
                raise ConfigError(f"seed {seed}: {a} and {b} scored different silos ({sorted(first)} vs "
                                  f"{sorted(second)}); were the runs made with one federation?")
            diff, sem, _ = interval([first[i] - second[i] for i in first])
            wins = sum(first[i] > second[i] for i in first)
            per_seed.append({"seed": seed, "difference": diff, "sem_over_silos": sem, "silos": len(first),
                             "silos_above": wins})
        mean, sem, half = interval([s["difference"] for s in per_seed])
        verdict = ("one seed: no interval" if math.isnan(half) else
                   "above, interval excludes 0" if mean - half > 0 else
                   "below, interval excludes 0" if mean + half < 0 else "interval includes 0")
        out.append({"first": a, "second": b, "per_seed": per_seed, "mean_difference": mean, "sem_over_seeds": sem,
                    "t95_half_width": half, "verdict": verdict})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, required=True, help="the --rounds the runs were made with")
    p.add_argument("--seeds", type=lambda t: [int(s) for s in t.split(",")], default=[0, 1, 2])
    p.add_argument("--level", choices=("eps1", "nonprivate"), default="eps1")
    p.add_argument("--out", default="runs/cross_silo_mnist", help="cross_silo_mnist.py's --out")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    pairs = compare(args)
    for pair in pairs:
        seeds = "; ".join(f"seed {s['seed']}: {s['difference']:+.2f} +- {s['sem_over_silos']:.2f} over silos, "
                          f"{s['silos_above']} of {s['silos']} silos above" for s in pair["per_seed"])
        print(f"{pair['first']} - {pair['second']} ({args.level}, {args.rounds} rounds): "
              f"{pair['mean_difference']:+.2f} +- {pair['sem_over_seeds']:.2f} over seeds "
              f"(95%: +- {pair['t95_half_width']:.2f}), {pair['verdict']} [{seeds}]")
    key = f"{args.level}|rounds{args.rounds}|seeds{','.join(map(str, args.seeds))}"
    entry = {"pairs": pairs, "command": " ".join(sys.argv), "numerics": numerics()}
    update_json(Path(args.results), lambda old: {**old, key: entry})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
