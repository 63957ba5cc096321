"""Parallel clients: a FedAvg round of the in-process runtime with its clients in 2 worker processes against 1.

Setting: FedAvg, MNIST 2NN, 50 training clients x 20 local SGD steps x batch 64 per round, all clients every round,
real MNIST (100 clients, pathological 2 shards, half of them novel), one torch thread per process (``--threads 1``,
as ``--workers`` requires). Each variant runs in its own child process of this script, alternating; a child builds
the federation and the runtime, runs one untimed round (the workers fork in it), then times ``--rounds`` rounds.
The ratio is of the medians of the per-round times. Each child also records the CPU seconds a round cost it and its
workers together (Linux's ``/proc``), which a busy machine does not inflate as it does wall time, and a checksum of
the server weights after its rounds: the variants must agree exactly (the same numbers,
:mod:`privfl.federation.workers`).

    python benchmarks/workers.py [--repeats 3] [--rounds 3] [--workers 2]

Target: 2 workers / 1 worker <= 0.6 on 2 cores. Writes benchmarks/results/workers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of the processes ``pids`` so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])   # utime, stime (fields 14 and 15 of proc(5))
    return total / ticks


def child(workers: int, rounds: int) -> dict:
    from privfl.config import RunConfig
    from privfl.data import FederationSpec, build_federation
    from privfl.experiment import build_runtime

    torch.set_num_threads(1)
    federation = build_federation(FederationSpec(source="mnist", num_clients=100, partition="pathological",
                                                 shards_per_client=2, novel_fraction=0.5), seed=0)
    config = RunConfig(method="fedavg", method_config={"lr": 0.1, "local_steps": 20, "batch_size": 64},
                       model="mlp2nn", rounds=rounds + 1, seed=0, workers=workers)
    runtime = build_runtime(config, federation)
    try:
        runtime.run_round(0)   # untimed: the workers fork here
        pids = [os.getpid(), *(p.pid for p in (runtime._pool._processes if runtime._pool else []))]
        times, cpu = [], []
        for round in range(1, rounds + 1):
            start, start_cpu = time.perf_counter(), cpu_seconds(pids)
            runtime.run_round(round)
            times.append(time.perf_counter() - start)
            cpu.append(cpu_seconds(pids) - start_cpu)
    finally:
        runtime.close()
    weights = runtime.strategy.state_dict()
    checksum = sum(float(v.double().abs().sum()) for v in weights.values() if isinstance(v, torch.Tensor))
    return {"workers": workers, "round_s": times, "round_cpu_s": cpu, "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per child (after one untimed)")
    parser.add_argument("--workers", type=int, default=2, help="the parallel variant's worker count")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "workers.json"))
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.rounds)))
        return
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    runs: dict[int, list[dict]] = {1: [], args.workers: []}
    for repeat in range(args.repeats):
        for workers in (1, args.workers) if repeat % 2 == 0 else (args.workers, 1):
            done = subprocess.run([sys.executable, __file__, "--child", str(workers), "--rounds", str(args.rounds)],
                                  env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[workers].append(result)
            print(f"repeat {repeat}: {workers} worker(s): rounds {', '.join(f'{t:.2f}' for t in result['round_s'])} s, "
                  f"CPU {', '.join(f'{t:.2f}' for t in result['round_cpu_s'])} s", flush=True)
    checksums = {r["checksum"] for rs in runs.values() for r in rs}
    medians = {w: statistics.median(t for r in rs for t in r["round_s"]) for w, rs in runs.items()}
    cpu = {w: statistics.median(t for r in rs for t in r["round_cpu_s"]) for w, rs in runs.items()}
    ratio = medians[args.workers] / medians[1]
    from privfl.provenance import numerics
    result = {"setting": "FedAvg, MNIST 2NN, 50 training clients x 20 steps x batch 64, 1 thread per process",
              "repeats": args.repeats, "timed_rounds_per_child": args.rounds, "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "median_round_s": {str(w): m for w, m in medians.items()},
              "median_round_cpu_s": {str(w): c for w, c in cpu.items()},
              "ratio": ratio, "same_weights": len(checksums) == 1,
              "runs": {str(w): rs for w, rs in runs.items()}, "numerics": numerics()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"median round: 1 worker {medians[1]:.2f} s, {args.workers} workers {medians[args.workers]:.2f} s; "
          f"ratio {ratio:.3f} (target <= 0.6); CPU per round {cpu[1]:.2f} s and {cpu[args.workers]:.2f} s; "
          f"same server weights in every run: {len(checksums) == 1}")


if __name__ == "__main__":
    main()
