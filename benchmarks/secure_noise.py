"""Cost of hardened noise: time to noise a 200,000-coordinate vector with ``noise="secure"`` and ``"hardened"``.

Both run :meth:`privfl.privacy.mechanisms.GaussianMechanism.add_noise` (a fresh OS-seeded generator per call, then
one draw per coordinate, or Opacus' ``secure_mode`` sampler: one draw thrown away and four summed) in the same
process, interleaved, one CPU thread, float32 and float64. Prints the median time of each and their ratio:

    python benchmarks/secure_noise.py [--size 200000] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from privfl.privacy.mechanisms import GaussianMechanism


def median_seconds(mechanism: GaussianMechanism, value: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mechanism.add_noise(value)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mechanisms = {noise: GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise=noise)
                  for noise in ("secure", "hardened")}
    print(f"torch {torch.__version__}, {args.size} coordinates, median of {args.repeats} calls, 1 thread")
    for dtype in (torch.float32, torch.float64):
        value = torch.zeros(args.size, dtype=dtype)
        for mechanism in mechanisms.values():
            median_seconds(mechanism, value, 10)    # warm-up
        seconds = {noise: [] for noise in mechanisms}
        for _ in range(5):                          # interleaved rounds, so drift in machine load hits both
            for noise, mechanism in mechanisms.items():
                seconds[noise].append(median_seconds(mechanism, value, max(1, args.repeats // 5)))
        secure, hardened = (statistics.median(seconds[n]) for n in ("secure", "hardened"))
        print(f"{str(dtype):>14}: secure {secure * 1e3:7.3f} ms   hardened {hardened * 1e3:7.3f} ms   "
              f"ratio {hardened / secure:.2f}")


if __name__ == "__main__":
    main()
