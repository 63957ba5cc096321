"""Flower overhead: FedAvg rounds on the in-process runtime, Flower's simulation engine and Flower's deployment engine.

Setting: the MNIST protocol of ``runtime_overhead.py`` (MNIST 2NN, 20 local SGD steps x batch 64, pathological 2
shards), with 200 clients (100 training, 100 novel) so that a round can hold 10 or 100 training clients
(``client_fraction`` 0.1 or 1.0). Timed: ``--rounds`` training rounds after one warm-up round (which includes each
client process building its data); evaluation excluded. Ratios are to in-process at the same clients per round.

    nice python benchmarks/flower_overhead.py [--rounds 2] [--per-round 10 100] [--actors 1] [--profile]

Target: simulation within 2x of in-process at 100 clients per round. Writes benchmarks/results/flower_overhead.json.
The deployment engine is not timed here yet: it needs one SuperNode process per client, and Flower 1.41 runs every
message in a fresh ClientApp process (torch import + data load each time) after up to 3 s of SuperNode polling, so
its rounds are bounded below by seconds per message; tests/federation/test_flower.py times a 2-node run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "flower_overhead.json"


def spec(num_clients: int = 200):
    from privfl.data import FederationSpec

    return FederationSpec(source="mnist", num_clients=num_clients, partition="pathological", shards_per_client=2,
                          novel_fraction=0.5)


def run_config(per_round: int, rounds: int, num_clients: int = 200):
    from privfl.experiment import RunConfig

    training = num_clients // 2
    return RunConfig(federation=spec(num_clients), method="fedavg", model="mlp2nn", rounds=rounds + 1, seed=0,
                     method_config={"lr": 0.1, "local_steps": 20, "batch_size": 64},
                     client_fraction=per_round / training, select="last", eval_every=10_000)


def time_rounds(runtime, rounds: int, profile: bool = False) -> tuple[float, str]:
    runtime.run_round(0)                                   # warm-up: data built in every client process
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for round in range(1, rounds + 1):
        runtime.run_round(round)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    text = ""
    if profiler:
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats(18)
        # Paths relative to the repository and the venv, so the saved profile names no machine.
        text = buffer.getvalue().replace(str(Path(__file__).resolve().parents[1]) + "/", "").replace(sys.prefix + "/", "")
    return elapsed, text


def in_process(per_round: int, rounds: int) -> float:
    from privfl.data import build_federation
    from privfl.experiment import build_runtime

    config = run_config(per_round, rounds)
    return time_rounds(build_runtime(config, build_federation(config.federation, seed=0)), rounds)[0]


def simulation(per_round: int, rounds: int, actors: int, profile: bool) -> dict:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from privfl.data import build_federation
    from privfl.federation.flower import FlowerOptions
    from privfl.federation.flower import protocol as p
    from privfl.federation.flower.client_app import make_client_app
    from privfl.federation.flower.server_app import flower_runtime_factory

    config = run_config(per_round, rounds)
    options = FlowerOptions(max_actors=actors, threads=1)
    federation = build_federation(config.federation, seed=0)
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            runtime = flower_runtime_factory(grid, options)(config, federation)
            out["seconds"], out["profile"] = time_rounds(runtime, rounds, profile)
        except BaseException as error:
            out["error"] = repr(error)

    nodes = Path(tempfile.mkdtemp(prefix=f"privfl-flower-bench-{per_round}-"))
    client = make_client_app({p.RUN_CONFIG: json.dumps(config.to_dict()), p.NODES_ROOT: str(nodes),
                              p.THREADS: 1})
    started = time.perf_counter()
    run_simulation(server_app=app, client_app=client, num_supernodes=len(federation.training_clients),
                   backend_config=options.backend_config())
    out["total_seconds"] = time.perf_counter() - started
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-round", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"setting": "FedAvg, MNIST 2NN, 20 local steps x batch 64, 200 clients (100 training), "
                          f"{args.rounds} timed rounds after 1 warm-up, torch threads 1, Ray actors {args.actors}",
               "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), "
                          f"{__import__('os').cpu_count()} CPU cores (shared)",
               "runs": []}
    for per_round in args.per_round:
        base = in_process(per_round, args.rounds)
        sim = simulation(per_round, args.rounds, args.actors, args.profile)
        row = {"clients_per_round": per_round, "in_process_s": base, "simulation_s": sim["seconds"],
               "simulation_ratio": sim["seconds"] / base, "simulation_total_with_startup_s": sim["total_seconds"],
               "deployment_s": None, "deployment_ratio": None,
               "deployment_note": "not measured: needs one SuperNode process per client (see docstring)"}
        if args.profile:
            row["simulation_server_profile"] = sim["profile"]
        results["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "simulation_server_profile"}), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
