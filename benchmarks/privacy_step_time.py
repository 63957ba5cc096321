"""Time of a private round against a non-private one, per privacy mode, measured side by side in one process.

FedAvg on MNIST (100 clients, 2 shards each, 20 per round, the 2NN, 10 local steps of 64, one torch thread). Each
mode's runtime is built once; rounds of the modes are interleaved (round r of every mode before round r + 1 of any),
so a change in the machine's load falls on all of them alike. Reported: the median round time of each mode and its
ratio to the non-private median. Every mode takes server steps of ``server_lr`` 1e-3: local mode's full noise on every
client's update (multiplier 1, clip 1) would otherwise make the model diverge within the timed rounds; the scale of
the step changes none of the work being timed.

    python benchmarks/privacy_step_time.py [--rounds 12] [--warmup 2]

Writes ``benchmarks/results/privacy_step_time.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from privfl.config import RunConfig  # noqa: E402
from privfl.data import FederationSpec, build_federation  # noqa: E402
from privfl.experiment import build_runtime  # noqa: E402
from privfl.privacy.training import TrainingPrivacy  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "privacy_step_time.json"
MODES = {
    "none": TrainingPrivacy(),
    # every client of this protocol holds 700 records (equal shards, no validation split): public by construction,
    # so DP-SGD samples at the public 64 / 700, the rate the per-client calibration used before it became public
    "record": TrainingPrivacy(mode="record", noise_multiplier=1.0, clip=1.0, min_samples=700),
    "local": TrainingPrivacy(mode="local", noise_multiplier=1.0, clip=1.0),
    "distributed": TrainingPrivacy(mode="distributed", noise_multiplier=1.0, clip=1.0),
    "central": TrainingPrivacy(mode="central", noise_multiplier=1.0, clip=1.0),
    "central_adaptive": TrainingPrivacy(mode="central", noise_multiplier=1.0, clip="adaptive"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = FederationSpec(source="mnist", num_clients=100, partition="pathological", shards_per_client=2,
                          novel_fraction=0.1, val_fraction=0.0)
    federation = build_federation(spec, seed=0)
    runtimes = {}
    for name, privacy in MODES.items():
        config = RunConfig(federation=spec, method="fedavg", model="mlp2nn",
                           method_config={"lr": 0.1, "local_steps": 10, "batch_size": 64, "server_lr": 1e-3},
                           rounds=args.rounds + args.warmup, client_fraction=0.2, select="last", privacy=privacy)
        runtimes[name] = build_runtime(config, federation)
    times: dict[str, list[float]] = {name: [] for name in MODES}
    for round_index in range(args.rounds + args.warmup):
        for name, runtime in runtimes.items():
            started = time.perf_counter()
            runtime.run_round(round_index)
            if round_index >= args.warmup:
                times[name].append(time.perf_counter() - started)
    base = statistics.median(times["none"])
    rows = {name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / base, "rounds": len(t)}
            for name, t in times.items()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "clients_per_round": 18, "numerics": numerics()}, indent=2) + "\n")
    print("| mode | median s/round | ratio to no DP |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_s']:.3f} | {row['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
