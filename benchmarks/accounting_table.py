"""Accountant reference table: two pinned cases priced by every accountant, with the time each takes.

Cases (delta = 1e-5):
  1. Gaussian mechanism, sigma = 1, L2 sensitivity 1, composed 100 times (exact answer known: it is one Gaussian
     with sigma = 0.1, whose epsilon follows from Balle and Wang 2018, Theorem 8).
  2. DP-SGD: Poisson sampling q = 0.01, noise multiplier 1.0, 1000 steps (no closed form).

Prints the table and writes benchmarks/results/accounting_table.json. Run from the repository root after
`make setup`:  python benchmarks/accounting_table.py
"""

from __future__ import annotations

import json
import os
import platform
import time
from importlib.metadata import version
from pathlib import Path

import dp_accounting

from accounting import (
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    RDP_ORDERS,
    GaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    epsilon,
    gaussian_delta,
)

DELTA = 1e-5
REPEATS = 3
ACCOUNTANTS = ("rdp", "pld", "prv")
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "accounting_table.json"

CASES = [
    {
        "case": "Gaussian sigma=1, sensitivity 1, composed 100 times",
        "event": SelfComposedEvent(GaussianEvent(1.0), 100),
        # 100 unit Gaussians compose into one Gaussian with sigma = 1 / sqrt(100).
        "exact": dp_accounting.get_epsilon_gaussian(0.1, DELTA),
    },
    {
        "case": "DP-SGD, Poisson q=0.01, noise multiplier 1.0, 1000 steps",
        "event": SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 1000),
        "exact": None,
    },
]


def _forget_priced() -> None:
    """Empty the accountants' memory of compositions priced before (``accounting.accountants`` remembers each, since
    a run's clients price the same ones), so that each repeat computes its epsilon afresh."""
    import accounting.accountants
    import accounting.pld

    accounting.accountants._epsilon_of_leaves.cache_clear()
    accounting.accountants._supported.cache_clear()
    accounting.pld._step_pld.cache_clear()


def timed_epsilon(event, accountant: str) -> tuple[float, float]:
    """Epsilon and the best wall time over REPEATS fresh computations (nothing is cached between them)."""
    best = float("inf")
    for _ in range(REPEATS):
        _forget_priced()
        start = time.perf_counter()
        value = epsilon(event, DELTA, accountant=accountant)
        best = min(best, time.perf_counter() - start)
    return value, best


def main() -> None:
    # Opacus (and torch with it) is imported on the first PRV call; time that once, apart from the accounting.
    start = time.perf_counter()
    import opacus.accountants  # noqa: F401

    prv_import_s = time.perf_counter() - start
    assert abs(gaussian_delta(0.1, CASES[0]["exact"]) - DELTA) < 1e-9  # two exact computations agree

    rows = []
    for case in CASES:
        row = {"case": case["case"], "delta": DELTA, "exact": case["exact"]}
        for accountant in ACCOUNTANTS:
            row[accountant], row[f"{accountant}_seconds"] = timed_epsilon(case["event"], accountant)
        rows.append(row)

    header = f"{'case':<58} {'exact':>9} {'RDP':>9} {'PLD':>9} {'PRV':>9}   {'RDP ms':>7} {'PLD ms':>7} {'PRV ms':>7}"
    print(f"epsilon at delta={DELTA:g}; best of {REPEATS} runs; PLD grid {PLD_VALUE_DISCRETIZATION_INTERVAL:g}, "
          f"{len(RDP_ORDERS)} RDP orders, PRV by Opacus (eps_error 0.01)")
    print(header)
    print("-" * len(header))
    for row in rows:
        exact = "n/a" if row["exact"] is None else f"{row['exact']:.4f}"
        print(f"{row['case']:<58} {exact:>9} {row['rdp']:>9.4f} {row['pld']:>9.4f} {row['prv']:>9.4f}   "
              f"{1e3 * row['rdp_seconds']:>7.1f} {1e3 * row['pld_seconds']:>7.1f} {1e3 * row['prv_seconds']:>7.1f}")
    print(f"(first PRV use also imports opacus and torch: {prv_import_s:.1f} s, once per process)")

    from privfl.provenance import numerics  # imports torch: after the timings

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": "benchmarks/accounting_table.py", "numerics": numerics(),
        "rows": rows,
        "prv_import_seconds": prv_import_s,
        "pld_value_discretization_interval": PLD_VALUE_DISCRETIZATION_INTERVAL,
        "rdp_orders": list(RDP_ORDERS),
        "versions": {name: version(name) for name in ("dp-accounting", "opacus", "numpy", "scipy")},
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
