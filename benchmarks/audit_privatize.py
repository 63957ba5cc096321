"""Empirical DP audit of privatize, and of two deliberately broken mechanisms the same audit must catch.

For privatize at eps = 1 and 4 (delta = 1e-5, replace-one, worst-case pair, psi = identity): the 95% lower bound on
epsilon from a threshold test (Clopper-Pearson, test chosen on a held-out half), and its ratio to the claim; the ratio
must stay below 1. Then the classic closed-form calibration at eps = 20 (true delta ~1.5e-3; caught by the
delta-violation test at the claimed eps) and a mean+max encoder released with mean-pool noise (caught by eps_lb).
Then the DP-FedPFT release (dp_gmm: diag covariance, public counts, replace-one, one class of n = 20 records in
dim 2) at eps = 1 and 4, audited through its S1 block: the k = 2 unit-scaled blocks share one Gaussian of joint
sensitivity sqrt(2) calibrated at the release's (eps, delta), so the claim set against the bound is the S1 block's own
epsilon at delta (the accountant's, for that noise multiplier: 2.69 for a release at eps 4); the whole release's eps
is in ``epsilon_release``. Then one record-level ODPFL-HN encoder-gradient release (the training client's own code,
add/remove-one with n private, noise calibrated at min_samples = 20) at eps = 1 and 4 on its worst-case pair: 20
records against the same 20 and one more, whose clipped contributions differ by 2C/21 against the certified 2C/20.

    .venv/bin/python benchmarks/audit_privatize.py [--trials 1000000] [--out benchmarks/results/audit_privatize.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attacks.audit import format_table, run_audit  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1_000_000, help="releases per neighbouring input")
    parser.add_argument("--seeds", type=int, default=3, help="independent repetitions of each privatize audit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/audit_privatize.json"))
    args = parser.parse_args(argv)
    delta = 1e-5
    rows, table = [], []
    cases = [("privatize", 1.0, args.trials, s) for s in range(args.seeds)] + \
            [("privatize", 4.0, args.trials, s) for s in range(args.seeds)] + \
            [("classic", 20.0, args.trials, 0), ("maxpool", 1.0, min(args.trials, 100_000), 0)] + \
            [("dp_gmm", 1.0, args.trials, s) for s in range(args.seeds)] + \
            [("dp_gmm", 4.0, args.trials, s) for s in range(args.seeds)] + \
            [("odpflhn_gradient", 1.0, args.trials, s) for s in range(args.seeds)] + \
            [("odpflhn_gradient", 4.0, args.trials, s) for s in range(args.seeds)]
    # the project's mechanisms; classic and maxpool are deliberately broken
    consistent = {"privatize", "dp_gmm", "odpflhn_gradient"}
    for mechanism, eps, trials, seed in cases:
        t0 = time.perf_counter()
        result = run_audit(mechanism, eps, delta, trials=trials, seed=seed)
        seconds = time.perf_counter() - t0
        rows.append({"mechanism": mechanism, "seed": seed, "seconds": round(seconds, 3), **result.to_dict()})
        table.append((f"{mechanism}/{seed}", result))
    print(format_table(table))
    ok = all((r["violated"] is False) == (r["mechanism"] in consistent) for r in rows)
    print("expected verdicts (privatize, dp_gmm and odpflhn_gradient consistent, classic and maxpool violations):",
          "yes" if ok else "NO")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from privfl.provenance import numerics

    out.write_text(json.dumps({"benchmark": "audit_privatize", "numerics": numerics(),
                               "command": " ".join(["benchmarks/audit_privatize.py", *sys.argv[1:]]),
                               "delta": delta, "trials_per_input": args.trials,
                               "confidence": 0.95, "python": platform.python_version(),
                               "expected_verdicts": ok, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
