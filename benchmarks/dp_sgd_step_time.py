"""Time per DP-SGD step against a plain SGD step, batch 64, one CPU thread, on the models the project trains.

For each model (the MNIST 2NN, LeNet on 3x32x32, the FedTTA CNN on 1x28x28) four steps run side by side in one
process, interleaved, on the same 64 random records:

- ``plain``: :func:`privfl.methods.local_training.local_sgd`, the local step every method shares;
- ``engine``: :meth:`privfl.privacy.dp_sgd.DPSGDTrainer.train` with its default ``grad_sample_mode="auto"`` (per-sample
  clipping, one noise draw, division by batch_size), with n = batch_size = 64 so that q = 1 and every step clips all
  64 records (no Poisson variance in the work);
- ``engine_hardened``: the same with ``noise="hardened"`` (each noise coordinate four draws summed and halved);
- ``opacus_ghost``: Opacus' own ghost-clipping step (``GradSampleModuleFastGradientClipping`` + its DPOptimizer),
  the previous engine, as the reference.

Each timing is one call of ``--steps`` steps (the engine's per-round setup included, divided over the steps);
``--repeats`` rounds of the four calls alternate, and the ratio is the median of the per-round ratios to the plain
step of the same round. The time of the noise draw alone (one ``normal_`` over every parameter) is printed beside
it, since it is a floor no clipping trick removes.

    python benchmarks/dp_sgd_step_time.py [--repeats 15] [--steps 20] [--models mlp2nn,lenet,fedtta_cnn]

Writes ``benchmarks/results/dp_sgd_step_time.json``; for a model whose engine ratio misses the target it adds a
cProfile summary of the engine's step.
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

import numpy as np
import torch
from torch import nn

from privfl.methods.local_training import local_sgd
from privfl.models import build_model
from privfl.privacy.dp_sgd import DPSGDConfig, DPSGDTrainer
from privfl.provenance import numerics

TARGET_RATIO = 2.5
BATCH = 64
MODELS = {"mlp2nn": (1, 28, 28), "lenet": (3, 32, 32), "fedtta_cnn": (1, 28, 28)}
RESULTS = Path(__file__).parent / "results" / "dp_sgd_step_time.json"


def plain_call(model, x, y, steps):
    return lambda: local_sgd(model, x, y, lr=0.01, steps=steps, batch_size=BATCH, rng=np.random.default_rng(0))


def engine_call(model, x, y, steps, trainer):
    return lambda: trainer.train(model, x, y, lr=0.01, steps=steps, batch_size=BATCH, rng=np.random.default_rng(0))


def opacus_ghost_call(model, x, y, steps):
    """Opacus' ghost-clipping step end to end (its clipping, its noise, its optimizer): the reference."""
    from opacus.grad_sample.utils import prepare_module
    from opacus.optimizers import get_optimizer_class
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = prepare_module(model, "ghost", True, batch_first=True, loss_reduction="mean", max_grad_norm=1.0)
        optimizer = get_optimizer_class("flat", False, "ghost")(
            torch.optim.SGD(model.parameters(), lr=0.01), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=BATCH, loss_reduction="mean")
    dp_loss = DPLossFastGradientClipping(gsm, optimizer, nn.CrossEntropyLoss(), "mean")

    def run():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                dp_loss(gsm(x), y).backward()
                optimizer.step()

    return run, gsm._close


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def noise_ms(model: nn.Module, repeats: int = 30) -> float:
    flat = torch.empty(sum(p.numel() for p in model.parameters()))
    generator = torch.Generator().manual_seed(0)
    times = [timed(lambda: flat.normal_(0.0, 1.0, generator=generator)) for _ in range(repeats)]
    return 1e3 * statistics.median(times)


def profile_engine(model, x, y, steps: int) -> list[str]:
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    engine_call(model, x, y, 2, trainer)()
    profiler = cProfile.Profile()
    profiler.enable()
    engine_call(model, x, y, steps, trainer)()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(10)
    # Keep paths relative to the package roots: a results file must not carry this machine's paths.
    lines = [re.sub(r"\S*(site-packages|privfl)/", r"\1/", ln) for ln in text.getvalue().splitlines() if ln.strip()]
    return lines[-11:]


def bench_model(name: str, repeats: int, steps: int) -> dict:
    shape = MODELS[name]
    torch.manual_seed(0)
    x, y = torch.rand(BATCH, *shape), torch.randint(0, 10, (BATCH,))
    variants = ("plain", "engine", "engine_hardened", "opacus_ghost")
    models = {variant: build_model(name, shape, 10) for variant in variants}
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    hardened = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0, noise="hardened"))
    ghost, close = opacus_ghost_call(models["opacus_ghost"], x, y, steps)
    calls = {"plain": plain_call(models["plain"], x, y, steps),
             "engine": engine_call(models["engine"], x, y, steps, trainer),
             "engine_hardened": engine_call(models["engine_hardened"], x, y, steps, hardened),
             "opacus_ghost": ghost}
    for call in calls.values():   # warm-up (imports, allocator, first-call dispatch)
        call()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for variant, call in calls.items():
            times[variant].append(1e3 * timed(call) / steps)
    close()
    row = {"input_shape": list(shape), "parameters": sum(p.numel() for p in models["plain"].parameters()),
           "engine_path": trainer.gradient_path, "noise_draw_ms": noise_ms(models["plain"])}
    for variant, values in times.items():
        row[f"{variant}_median_ms"] = statistics.median(values)
        if variant != "plain":
            row[f"{variant}_ratio"] = statistics.median(v / p for v, p in zip(values, times["plain"], strict=True))
    row["engine_meets_target"] = row["engine_ratio"] <= TARGET_RATIO
    if not row["engine_meets_target"]:
        row["profile_engine_top_tottime"] = profile_engine(models["engine"], x, y, steps)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds of the four calls")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed call")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    print(f"batch {BATCH}, 1 thread, {args.repeats} interleaved rounds of {args.steps} steps; ratio = median of "
          "per-round ratios to plain")
    print(f"{'model':<11} {'params':>9} {'plain ms':>9} {'engine ms':>10} {'ratio':>6} {'hardened ms':>12} "
          f"{'ratio':>6} {'opacus ghost ms':>16} {'ratio':>6} {'noise ms':>9}  path")
    for name in args.models.split(","):
        row = rows[name] = bench_model(name, args.repeats, args.steps)
        print(f"{name:<11} {row['parameters']:>9} {row['plain_median_ms']:>9.2f} {row['engine_median_ms']:>10.2f} "
              f"{row['engine_ratio']:>6.2f} {row['engine_hardened_median_ms']:>12.2f} "
              f"{row['engine_hardened_ratio']:>6.2f} {row['opacus_ghost_median_ms']:>16.2f} "
              f"{row['opacus_ghost_ratio']:>6.2f} {row['noise_draw_ms']:>9.2f}  {row['engine_path']}", flush=True)
        if not row["engine_meets_target"]:
            print("\n".join(row["profile_engine_top_tottime"]))
    result = {
        "benchmark": "dp_sgd_step_time", "batch_size": BATCH, "threads": 1, "repeats": args.repeats,
        "steps_per_call": args.steps, "torch": torch.__version__, "python": platform.python_version(),
        "target_ratio": TARGET_RATIO, "rows": rows,
        "all_meet_target": all(row["engine_meets_target"] for row in rows.values()),
        "numerics": numerics(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
