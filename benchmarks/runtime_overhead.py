"""Runtime overhead: privfl's in-process runtime against a minimal hand-written FedAvg loop doing the same work.

Setting: FedAvg, MNIST 2NN, 50 training clients x 20 local SGD steps x batch 64 per round, 20 rounds,
all clients every round, on the real MNIST (100 clients, pathological 2 shards, half of them novel). Both variants
draw the same minibatches and do the same arithmetic; evaluation is excluded from both. Each variant runs in its own
child process of this script (so each has its own peak memory), alternating, and the ratio is of medians.

    python benchmarks/runtime_overhead.py [--repeats 3] [--rounds 20]

Target: runtime / minimal <= 1.15. Writes benchmarks/results/runtime_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def federation():
    from privfl.data import FederationSpec, build_federation

    return build_federation(FederationSpec(source="mnist", num_clients=100, partition="pathological",
                                           shards_per_client=2, novel_fraction=0.5), seed=0)


def run_minimal(rounds: int) -> float:
    """The reference: a loop one would write by hand, with nothing but the computation."""
    from privfl.federation.seeding import derive_rng
    from privfl.methods.local_training import minibatches
    from privfl.models import build_model

    fed = federation()
    clients = fed.training_clients
    torch.manual_seed(0)
    model = build_model("mlp2nn", fed.input_shape, fed.num_classes)
    global_weights = {k: v.clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    for round in range(rounds):
        total = sum(c.num_train for c in clients)
        new = {k: torch.zeros_like(v) for k, v in global_weights.items()}
        for c in clients:
            model.load_state_dict(global_weights)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            rng = derive_rng(0, "client_train", round, c.client_id)
            for index in minibatches(c.num_train, 64, 20, rng):
                batch = torch.from_numpy(index)
                loss = torch.nn.functional.cross_entropy(model(c.x_train[batch]), c.y_train[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    new[k] += v * (c.num_train / total)
        global_weights = new
    return time.perf_counter() - start


def run_privfl(rounds: int) -> float:
    """privfl's runtime: strategy, client procedure, wire with ledger, transactional rounds."""
    from privfl.config import RunConfig
    from privfl.experiment import build_runtime

    fed = federation()
    config = RunConfig(method="fedavg", method_config={"lr": 0.1, "local_steps": 20, "batch_size": 64},
                       model="mlp2nn", rounds=rounds, seed=0)
    runtime = build_runtime(config, fed)
    start = time.perf_counter()
    for round in range(rounds):
        runtime.run_round(round)
    return time.perf_counter() - start


def child(variant: str, rounds: int, threads: int) -> None:
    torch.set_num_threads(threads)
    seconds = {"minimal": run_minimal, "privfl": run_privfl}[variant](rounds)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"variant": variant, "seconds": seconds, "peak_rss_mib": peak_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    parser.add_argument("--child", choices=["minimal", "privfl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds, args.threads)
        return
    results: dict[str, list[dict]] = {"minimal": [], "privfl": []}
    for repeat in range(args.repeats):
        for variant in ("minimal", "privfl"):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--rounds", str(args.rounds),
                                  "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout
            results[variant].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {repeat}: {variant:8s} {results[variant][-1]['seconds']:.2f} s", flush=True)
    med = {v: statistics.median(r["seconds"] for r in rs) for v, rs in results.items()}
    peak = {v: max(r["peak_rss_mib"] for r in rs) for v, rs in results.items()}
    ratio = med["privfl"] / med["minimal"]
    from privfl.provenance import numerics

    report = {
        "command": " ".join(["benchmarks/runtime_overhead.py", *sys.argv[1:]]), "numerics": numerics(),
        "setting": f"FedAvg, MNIST 2NN, 50 clients x 20 steps x batch 64, {args.rounds} rounds",
        "median_seconds": med, "seconds_per_round": {v: s / args.rounds for v, s in med.items()},
        "ratio_privfl_over_minimal": ratio, "target_ratio": 1.15, "peak_rss_mib": peak,
        "runs": results, "torch_threads": args.threads,
    }
    Path(__file__).parent.joinpath("results").mkdir(exist_ok=True)
    Path(__file__).parent.joinpath("results", "runtime_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nmedian: minimal {med['minimal']:.2f} s, privfl {med['privfl']:.2f} s, ratio {ratio:.3f} "
          f"(target <= 1.15); peak RSS minimal {peak['minimal']:.0f} MiB, privfl {peak['privfl']:.0f} MiB")


if __name__ == "__main__":
    main()
