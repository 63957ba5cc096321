"""Time per DP-SGD step on the MNIST 2NN (784-200-200-10), batch 64, one CPU thread: plain SGD against Opacus modes.

Each private mode runs the real step of :mod:`privfl.privacy.dp_sgd` (per-sample clipping, noise, scaling by the
expected batch size) on a fixed batch of 64 random MNIST-shaped records, so the numbers are per-step compute, without
Poisson sampling variance. Median of ``--steps`` steps after ``--warmup`` steps.

    python benchmarks/dp_sgd_step_time.py [--steps 300] [--warmup 30]

Writes ``benchmarks/results/dp_sgd_step_time.json``; if no mode reaches the target ratio, adds a cProfile summary of
the default mode.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import re
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from privfl.models import build_model
from privfl.privacy.dp_sgd import GRAD_SAMPLE_MODES

TARGET_RATIO = 3.0
DEFAULT_MODE = "ghost"
RESULTS = Path(__file__).parent / "results" / "dp_sgd_step_time.json"


def plain_step_fn(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step, lambda: None


def dp_step_fn(model, x, y, mode):
    """One DP-SGD step built exactly as privfl.privacy.dp_sgd builds it."""
    from opacus.grad_sample.utils import prepare_module
    from opacus.optimizers import get_optimizer_class
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    ghost = mode == "ghost"
    kwargs = {"max_grad_norm": 1.0} if ghost else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = prepare_module(model, mode, True, batch_first=True, loss_reduction="mean", **kwargs)
        optimizer = get_optimizer_class("flat", False, mode)(
            torch.optim.SGD(model.parameters(), lr=0.01), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=len(y), loss_reduction="mean")
    criterion = nn.CrossEntropyLoss()
    dp_loss = DPLossFastGradientClipping(gsm, optimizer, criterion, "mean") if ghost else None

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = gsm(x)
        (dp_loss(out, y) if ghost else criterion(out, y)).backward()
        optimizer.step()

    return step, gsm._close


def time_steps(step, steps: int, warmup: int) -> list[float]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.rand(64, 1, 28, 28)
    y = torch.randint(0, 10, (64,))

    rows = {}
    for name in ("non_private", *GRAD_SAMPLE_MODES):
        model = build_model("mlp2nn", (1, 28, 28), 10)
        try:
            step, close = plain_step_fn(model, x, y) if name == "non_private" else dp_step_fn(model, x, y, name)
            times = time_steps(step, args.steps, args.warmup)
            close()
            rows[name] = {"median_ms": 1e3 * statistics.median(times),
                          "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))]}
        except Exception as exc:  # noqa: BLE001 - a mode that fails is reported, not fatal
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
    base = rows["non_private"]["median_ms"]
    for name, row in rows.items():
        if "median_ms" in row:
            row["ratio"] = row["median_ms"] / base

    print(f"MNIST 2NN, batch 64, 1 thread, median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'mode':<12} {'median ms':>10} {'p90 ms':>8} {'ratio':>7}")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<12} failed: {row['error']}")
        else:
            print(f"{name:<12} {row['median_ms']:>10.3f} {row['p90_ms']:>8.3f} {row['ratio']:>7.2f}")

    private = {k: v for k, v in rows.items() if k != "non_private" and "ratio" in v}
    best = min(private, key=lambda k: private[k]["ratio"])
    result = {
        "benchmark": "dp_sgd_step_time", "model": "mlp2nn 784-200-200-10", "batch_size": 64, "threads": 1,
        "steps": args.steps, "warmup": args.warmup, "torch": torch.__version__, "python": platform.python_version(),
        "target_ratio": TARGET_RATIO, "default_mode": DEFAULT_MODE, "rows": rows,
        "default_meets_target": rows.get(DEFAULT_MODE, {}).get("ratio", float("inf")) <= TARGET_RATIO,
        "best_mode": best, "best_ratio": private[best]["ratio"],
    }
    if not result["default_meets_target"]:
        model = build_model("mlp2nn", (1, 28, 28), 10)
        step, close = dp_step_fn(model, x, y, DEFAULT_MODE)
        time_steps(step, 0, args.warmup)
        profiler = cProfile.Profile()
        profiler.enable()
        time_steps(step, 200, 0)
        profiler.disable()
        close()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        # Keep paths relative to site-packages: a results file must not carry this machine's paths.
        lines = [re.sub(r"\S*site-packages/", "", ln) for ln in text.getvalue().splitlines() if ln.strip()]
        result["profile_default_mode_top_tottime"] = lines[-13:]
        print(f"\ndefault mode {DEFAULT_MODE!r} ratio {rows[DEFAULT_MODE]['ratio']:.2f} > {TARGET_RATIO}; "
              f"best {best!r} {private[best]['ratio']:.2f}. cProfile of 200 {DEFAULT_MODE} steps (tottime):")
        print("\n".join(lines[-13:]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
