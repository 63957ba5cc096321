"""Flower deployment: a round's time with the SuperLink's state in a SQLite file (``privfl flower superlink``'s
default, kept across restarts) against in memory (``--database :memory:``), side by side.

Setting: ``scaling.py``'s federation and FedAvg settings (MNIST 2NN, 1,000 training clients, 10 local steps of batch
32, one torch thread) at ``--per-round`` clients per round, 2 SuperNodes of 500 clients each on loopback; the two
variants alternate ``--repeats`` times; each run is a warm-up round and ``--rounds`` timed rounds.

    nice python benchmarks/deployment_database.py [--per-round 10] [--rounds 2] [--repeats 2]

Writes benchmarks/results/deployment_database.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from flower_overhead import deployment
from scaling import TRAINING_CLIENTS, run_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "deployment_database.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = run_config(args.per_round, "mlp2nn", "none", args.rounds)
    work = Path(tempfile.mkdtemp(prefix="privfl-deploy-db-"))
    runs: dict[str, list[dict]] = {"file": [], "memory": []}
    try:
        for repeat in range(args.repeats):
            for variant in (("file", "memory") if repeat % 2 == 0 else ("memory", "file")):
                result = deployment(config, args.rounds, work, training_clients=TRAINING_CLIENTS,
                                    database=":memory:" if variant == "memory" else None)
                result["seconds_per_round"] = result["seconds"] / args.rounds
                runs[variant].append(result)
                print(json.dumps({"repeat": repeat, "database": variant, "seconds_per_round":
                                  result["seconds_per_round"], "breakdown": result["breakdown"]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from privfl.provenance import numerics
    out = {"command": "nice python benchmarks/deployment_database.py " + " ".join(sys.argv[1:]),
           "clients_per_round": args.per_round, "runs": runs, "numerics": numerics()}
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    for variant, results in runs.items():
        print(variant, [round(r["seconds_per_round"], 3) for r in results])


if __name__ == "__main__":
    main()
