"""FedAvg on ScatterNet features with record-level DP: the main job's federation (MNIST, all 60,000 training images,
50 training clients of 2 classes each, 5 novel clients from the test split), epsilon 3 (delta 1e-5) and without DP.

The settings are those of Tramer and Boneh's ScatterNet + linear model (ICLR 2021) carried into the federation:
a linear head on the ScatterNet stage (``RunConfig(features="scatter", model="linear")``), per-record clip 0.1,
one DP-SGD step a round at the public rate 0.5 (a batch of 510 of a client's 1,020 records in expectation; the size
is public by construction, ``min_samples=1020``), local lr 4, server momentum 0.9, every client every round, 100
rounds. They were set on seed 0 from the central settings and not tuned further; seeds 1 and 2 repeat them.

    python benchmarks/features_dp_mnist.py [--seeds 0 1 2] [--epsilons 3 inf] [--out runs/features_dp_mnist]

Each (epsilon, seed) cell is stored in ``benchmarks/results/features_dp_mnist.json`` as soon as it ends (novel and
validation accuracy, the largest epsilon spent, CPU seconds, code revision) and skipped when stored.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from privfl.config import RunConfig
from privfl.experiment import train_once
from privfl.federation.rundir import update_json
from privfl.metrics import mean_sem
from privfl.privacy.training import TrainingPrivacy
from privfl.provenance import numerics
from privfl.sweep import SweepConfig

RESULTS = ROOT / "benchmarks" / "results" / "features_dp_mnist.json"
SETTINGS = {"lr": 4.0, "local_steps": 1, "batch_size": 510, "server_momentum": 0.9}
CLIP, MIN_SAMPLES, SAMPLING_RATE, ROUNDS = 0.1, 1020, 0.5, 100


def config_for(epsilon: float | None, seed: int) -> RunConfig:
    privacy = TrainingPrivacy() if epsilon is None else TrainingPrivacy(
        mode="record", epsilon=epsilon, clip=CLIP, min_samples=MIN_SAMPLES, sampling_rate=SAMPLING_RATE)
    return RunConfig(federation=SweepConfig().federation(), method="fedavg", method_config=dict(SETTINGS),
                     features="scatter", model="linear", rounds=ROUNDS, client_fraction=1.0, eval_every=ROUNDS,
                     checkpoint_every=ROUNDS, select="last", seed=seed, privacy=privacy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilons", nargs="+", default=["3", "inf"])
    parser.add_argument("--out", default=str(ROOT / "runs" / "features_dp_mnist"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for text in args.epsilons:
        epsilon = None if text == "inf" else float(text)
        for seed in args.seeds:
            key = f"fedavg|eps{text}|seed{seed}"
            if RESULTS.exists() and key in json.loads(RESULTS.read_text()):
                continue
            started = time.process_time()
            summary = train_once(config_for(epsilon, seed), f"{args.out}/{key.replace('|', '-')}", progress=False)
            cell = {"novel_accuracy": summary["novel"]["accuracy_mean"],
                    "val_accuracy": summary["training_val"]["accuracy_mean"],
                    "epsilon_max_training": summary["privacy"]["epsilon_max_training"],
                    "cpu_s": time.process_time() - started, "numerics": numerics(ROOT)}
            update_json(RESULTS, lambda runs, key=key, cell=cell: {**runs, key: cell})
            print(f"{key}: {cell}", flush=True)
    stored = json.loads(RESULTS.read_text())
    for text in args.epsilons:
        cells = [v for k, v in sorted(stored.items()) if k.startswith(f"fedavg|eps{text}|")]
        mean, sem = mean_sem([c["novel_accuracy"] for c in cells])
        each = ", ".join(f"{c['novel_accuracy']:.2f}" for c in cells)
        print(f"FedAvg, epsilon {text}: novel {mean:.2f} +- {sem:.2f} over {len(cells)} seeds ({each}), "
              f"CPU {sum(c['cpu_s'] for c in cells):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
