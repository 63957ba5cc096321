"""Analytic Gaussian calibration against the classic closed form, at sensitivity 1 and delta = 1e-5.

For each epsilon: the classic sigma, the analytic sigma (Balle and Wang 2018), how much more noise the classic one
adds, and the delta the classic sigma really gives (Balle and Wang, Theorem 8). Above epsilon of about 8.4 the classic
sigma is too small and its true delta exceeds the claim. Run from the repository root after `make setup`:
python benchmarks/noise_table.py
"""

from __future__ import annotations

import math

from accounting import analytic_gaussian_sigma, gaussian_delta

DELTA = 1e-5
EPSILONS = (0.1, 0.3, 1.0, 3.0, 10.0)


def classic_sigma(eps: float, delta: float) -> float:
    return math.sqrt(2 * math.log(1.25 / delta)) / eps  # classic formula (Dwork-Roth Thm A.1), proved for eps < 1 only


def main() -> None:
    header = (f"{'epsilon':>7} {'classic sigma':>13} {'analytic sigma':>14} {'ratio':>6} "
              f"{'true delta (classic)':>21}  verdict")
    print(f"sensitivity 1, claimed delta = {DELTA:g}")
    print(header)
    print("-" * len(header))
    for eps in EPSILONS:
        classic, analytic = classic_sigma(eps, DELTA), analytic_gaussian_sigma(eps, DELTA)
        true_delta = gaussian_delta(classic, eps)
        if true_delta <= DELTA:
            verdict = f"valid, {100 * (classic / analytic - 1):.0f}% more noise than needed"
        else:
            verdict = f"VIOLATES the claim: true delta is {true_delta / DELTA:.1f}x the claimed {DELTA:g}"
        print(f"{eps:>7g} {classic:>13.4f} {analytic:>14.4f} {classic / analytic:>6.3f} {true_delta:>21.2e}  {verdict}")


if __name__ == "__main__":
    main()
