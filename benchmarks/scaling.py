"""How a round's cost grows with the work: seconds per FedAvg round against clients per round and model size, on the
in-process runtime, Flower's simulation engine and Flower's deployment engine, without DP and with record-level
DP-SGD.

Setting: MNIST (train and test merged) over 1,111 clients with 2 pathological shards each (about 63 images), 111 of
them novel, so 1,000 training clients; FedAvg, 10 local SGD steps of batch 32, lr 0.05, one torch thread. A round
holds 10, 100 or 1,000 of them (``client_fraction`` 0.01, 0.1, 1). Models: the three target networks of the
project, LeNet (85,822 parameters), the MNIST 2NN (199,210) and the FedTTA CNN (1,663,370). DP: record-level DP-SGD
with a fixed noise multiplier (``TrainingPrivacy(mode="record", noise_multiplier=1, clip=1)``): the per-record
clipping, the noise and the ledger records, with no calibration step (calibration is paid once per client size and
would swamp short runs).

Two sweeps share the cells where they meet:

* clients per round: 10, 100, 1,000 with the 2NN, every engine;
* model size: LeNet, 2NN, FedTTA CNN at 100 clients per round, every engine.

In-process every cell runs without and with DP; on the Flower engines (whose start-up builds the data of every
client, minutes at 1,000 training clients) DP runs at 100 clients per round with the 2NN only, unless ``--all``.

Every cell is one run: a warm-up round (data built in every client process, the workers and the engines started),
then ``--rounds`` timed rounds, reported as seconds per round. The engines are those of ``flower_overhead.py``: the
simulation with 1 Ray actor and the clients per virtual SuperNode the run chooses; the deployment on loopback with a
SuperLink and 2 SuperNodes (TLS, node authentication) in process isolation, each holding 500 training clients. Cells
are stored in ``benchmarks/results/scaling.json`` as they end and skipped when already stored, so an interrupted run
resumes; ``--plot-only`` redraws ``scaling.png`` and prints the tables from the stored cells.

    nice python benchmarks/scaling.py [--per-round 10 100 1000] [--models lenet mlp2nn fedtta_cnn]
        [--engines inprocess simulation deployment] [--privacy none dp] [--rounds 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from flower_overhead import deployment, in_process, simulation

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "scaling.json"
NUM_CLIENTS, NOVEL_FRACTION, TRAINING_CLIENTS = 1111, 0.1, 1000
MODEL_AXIS_PER_ROUND = 100
ENGINES = ("inprocess", "simulation", "deployment")
MODELS = ("lenet", "mlp2nn", "fedtta_cnn")
PRIVACY = ("none", "dp")
METHOD = {"lr": 0.05, "local_steps": 10, "batch_size": 32}


def run_config(per_round: int, model: str, privacy: str, rounds: int):
    """The RunConfig of one cell: ``rounds`` timed rounds after a warm-up round."""
    from privfl.config import RunConfig
    from privfl.data import FederationSpec
    from privfl.privacy.training import TrainingPrivacy

    spec = FederationSpec(source="mnist", num_clients=NUM_CLIENTS, partition="pathological", shards_per_client=2,
                          novel_fraction=NOVEL_FRACTION)
    # every training client of this protocol holds 53 training records (equal shards): public by construction, so
    # DP-SGD samples at the public 32 / 53, the rate the per-client calibration used before it became public
    layer = TrainingPrivacy() if privacy == "none" else TrainingPrivacy(mode="record", noise_multiplier=1.0,
                                                                        clip=1.0, delta=1e-5, min_samples=53)
    return RunConfig(federation=spec, method="fedavg", model=model, rounds=rounds + 1, seed=0, method_config=METHOD,
                     client_fraction=per_round / TRAINING_CLIENTS, select="last", eval_every=10_000,
                     checkpoint_every=10_000, privacy=layer, delta=1e-5)


def key_of(engine: str, per_round: int, model: str, privacy: str, rounds: int) -> str:
    return f"{engine}|{per_round}|{model}|{privacy}|rounds{rounds}"


def measured(engine: str, per_round: int, model: str, privacy: str) -> bool:
    """Whether the default grid has this cell: every cell in-process; on the Flower engines (whose start-up builds
    every client's data, minutes at 1,000 training clients) the cells without DP, and DP at 100 clients per round
    with the 2NN, where the DP cost on each engine is read against its own non-private cell."""
    return engine == "inprocess" or privacy == "none" or (per_round, model) == (MODEL_AXIS_PER_ROUND, "mlp2nn")


def cells(args) -> list[tuple[str, int, str, str]]:
    """(engine, clients per round, model, privacy) of both sweeps, each once, cheapest first (``--all`` adds the
    Flower engines' DP cells that :func:`measured` leaves out)."""
    wanted = [(e, n, "mlp2nn", p) for n in args.per_round for e in args.engines for p in args.privacy]
    if MODEL_AXIS_PER_ROUND in args.per_round:
        wanted += [(e, MODEL_AXIS_PER_ROUND, m, p) for m in args.models for e in args.engines for p in args.privacy]
    unique = [c for c in dict.fromkeys(wanted) if args.all or measured(*c)]
    size = {m: i for i, m in enumerate(MODELS)}
    return sorted(unique, key=lambda c: (c[1], size[c[2]], ENGINES.index(c[0]), PRIVACY.index(c[3])))


def measure(engine: str, per_round: int, model: str, privacy: str, rounds: int, work: Path) -> dict:
    config = run_config(per_round, model, privacy, rounds)
    started = time.perf_counter()
    if engine == "inprocess":
        result = in_process(config, rounds)
    elif engine == "simulation":
        result = simulation(config, rounds, actors=1)
    else:
        result = deployment(config, rounds, work, training_clients=TRAINING_CLIENTS)
    keep = ("seconds", "warm_up_round_s", "connect_s", "nodes", "clients_per_node")
    return {"seconds_per_round": result["seconds"] / rounds, "rounds": rounds,
            "wall_with_startup_s": time.perf_counter() - started, **{k: result[k] for k in keep if k in result}}


def stored(results: Path) -> dict:
    return json.loads(results.read_text())["cells"] if results.exists() else {}


def store(results: Path, key: str, row: dict) -> None:
    from privfl.federation.rundir import update_json

    def add(data: dict) -> dict:
        return {"setting": __doc__.split("\n\n")[1].replace("\n", " "),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs)",
                "cells": {**data.get("cells", {}), key: row}}

    update_json(results, add)


@functools.cache
def parameters(model: str) -> int:
    from privfl.models import build_model

    return sum(p.numel() for p in build_model(model, (1, 28, 28), 10).parameters())


def tables(args) -> str:
    runs = stored(args.out)

    def cell(engine, n, model, privacy) -> str:
        row = runs.get(key_of(engine, n, model, privacy, args.rounds))
        if row is None:
            return "not run" if measured(engine, n, model, privacy) else "-"
        return "failed" if "failed" in row else f"{row['seconds_per_round']:.2f}"

    def ratio(engine, n, model, privacy) -> str:
        row = runs.get(key_of(engine, n, model, privacy, args.rounds))
        base = runs.get(key_of("inprocess", n, model, privacy, args.rounds))
        if row is None or base is None or "failed" in row or "failed" in base:
            return ""
        return f" ({row['seconds_per_round'] / base['seconds_per_round']:.2f}x)"

    head = "| {} | " + " | ".join(f"{e}, {p}" for e in ENGINES for p in PRIVACY) + " |"
    rule = "|---|" + "---|" * (len(ENGINES) * len(PRIVACY))
    lines = ["Seconds per round against clients per round (MNIST 2NN; in brackets: against in-process, same privacy; "
             "-: not in the default grid)",
             "", head.format("clients per round"), rule]
    for n in args.per_round:
        lines.append(f"| {n} | " + " | ".join(cell(e, n, "mlp2nn", p) + ratio(e, n, "mlp2nn", p)
                                               for e in ENGINES for p in PRIVACY) + " |")
    lines += ["", f"Seconds per round against model size ({MODEL_AXIS_PER_ROUND} clients per round)", "",
              head.format("model (parameters)"), rule]
    for m in MODELS:
        lines.append(f"| {m} ({parameters(m):,}) | " + " | ".join(
            cell(e, MODEL_AXIS_PER_ROUND, m, p) + ratio(e, MODEL_AXIS_PER_ROUND, m, p)
            for e in ENGINES for p in PRIVACY) + " |")
    return "\n".join(lines)


def plot(args) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = stored(args.out)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = dict(zip(ENGINES, ("tab:blue", "tab:orange", "tab:green")))
    for engine in ENGINES:
        for privacy, style in zip(PRIVACY, ("-", "--")):
            label = f"{engine}{', DP-SGD' if privacy == 'dp' else ''}"
            points = [(n, runs[k]["seconds_per_round"]) for n in sorted(args.per_round)
                      if "seconds_per_round" in runs.get(k := key_of(engine, n, "mlp2nn", privacy, args.rounds), {})]
            if points:
                left.plot(*zip(*points), style, marker="o", color=colours[engine], label=label)
            points = [(parameters(m), runs[k]["seconds_per_round"]) for m in MODELS
                      if "seconds_per_round" in runs.get(k := key_of(engine, MODEL_AXIS_PER_ROUND, m, privacy,
                                                                         args.rounds), {})]
            if points:
                right.plot(*zip(*sorted(points)), style, marker="o", color=colours[engine], label=label)
    for m in MODELS:   # the models differ in layers too (LeNet and the FedTTA CNN are convolutional): name them
        row = runs.get(key_of("inprocess", MODEL_AXIS_PER_ROUND, m, "none", args.rounds), {})
        if "seconds_per_round" in row:
            right.annotate(m, (parameters(m), row["seconds_per_round"]), textcoords="offset points", xytext=(4, -12),
                           fontsize=8)
    left.set(xscale="log", yscale="log", xlabel="clients per round", ylabel="seconds per round",
             title="FedAvg round, MNIST 2NN")
    right.set(xscale="log", yscale="log", xlabel="model parameters",
              ylabel="seconds per round", title=f"{MODEL_AXIS_PER_ROUND} clients per round")
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    figure.tight_layout()
    path = args.out.with_suffix(".png")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-round", type=int, nargs="+", default=[10, 100, 1000],
                        help="clients per round of the 2NN sweep (at most %(default)s's largest, the training "
                             "clients); the model sweep runs at 100 when 100 is among them")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--privacy", nargs="+", default=list(PRIVACY), choices=PRIVACY,
                        help="none, or dp: record-level DP-SGD with noise multiplier 1 and clip 1")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per cell, after one warm-up round")
    parser.add_argument("--all", action="store_true", help="also DP on the Flower engines at every clients per round "
                        "and model (by default only at 100 clients per round with the 2NN)")
    parser.add_argument("--plot-only", action="store_true", help="draw the plot and print the tables; run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file; the plot goes beside it as .png "
                        "(default benchmarks/results/scaling.json)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    bad = [n for n in args.per_round if not 1 <= n <= TRAINING_CLIENTS]
    if bad or args.rounds < 1:
        parser.error(f"--per-round takes 1 to {TRAINING_CLIENTS} (the training clients) and --rounds >= 1; got "
                     f"{bad or args.per_round} and {args.rounds}")
    torch.set_num_threads(1)
    from privfl.provenance import numerics
    if not args.plot_only:
        work = Path(tempfile.mkdtemp(prefix="privfl-scaling-"))   # the deployment's node data, built once
        try:
            for engine, n, model, privacy in cells(args):
                key = key_of(engine, n, model, privacy, args.rounds)
                if key in stored(args.out):
                    print(f"{key}: stored; skipped", flush=True)
                    continue
                try:
                    row = measure(engine, n, model, privacy, args.rounds, work)
                except RuntimeError as error:   # a run that failed (flower_overhead raises with the log's tail)
                    row = {"failed": str(error)[-1500:]}
                store(args.out, key, {**row, "command": "nice python benchmarks/scaling.py " + " ".join(sys.argv[1:]),
                                      "numerics": numerics()})
                print(f"{key}: {json.dumps(row)}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(tables(args))
    print(f"plot: {plot(args)}")


if __name__ == "__main__":
    main()
