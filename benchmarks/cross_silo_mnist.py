"""The cross-silo Rotated MNIST protocol of Liu, Hu, Wu and Smith ("On Privacy and Personalization in Cross-Silo
Federated Learning", NeurIPS 2022; their runner: github kenziyuliu/private-cross-silo-fl, ``runners/rotated_mnist``):
Local, FedAvg, FedAvg + fine-tuning and MR-MTL, without DP and under silo-specific sample-level DP (privfl's record
mode) at epsilon 1.

Protocol, as privfl expresses it:

* 40 silos of 1,500 training images each: MNIST's 60,000 training images dealt IID
  (``FederationSpec(split="client_test", partition="iid", num_clients=40)``), rotated by 0, 90, 180 or 270 degrees,
  10 silos each in contiguous blocks of ids (``train_angles=(0, 90, 180, 270), angle_assignment="balanced"``);
* each silo is scored on its own held-out images: MNIST's 10,000 test images dealt IID, 250 a silo, rotated as the
  silo (``client_test``'s validation split); a row is the mean accuracy over the 40 silos;
* the paper's CNN (``small_cnn``: conv 32 and 64, 3x3, max-pool, one linear layer), lr 0.1, batch 100, 1 local epoch a
  round (15 steps: 1,500 / 100 without DP; ``ceil(1 / q)`` at the public rate q = 100 / 1,500 under DP), every silo
  every round; MR-MTL with lambda = 0.001, the paper's runner's value;
* record-level DP at epsilon 1, delta 1e-5, clip 1: DP-SGD with Poisson sampling at q = 100 / 1,500 (every silo's
  1,500 records are public by the protocol: ``min_samples=1500``), the noise multiplier calibrated (PLD) so that a
  silo's planned rounds end at epsilon 1;
* Local: the registered ``local`` method without DP; under DP, MR-MTL with lambda = 0 (each silo's DP-SGD on its
  data alone: ``local`` trains without DP-SGD under record mode, since it releases nothing, so it is not the paper's
  private Local; ``tests/methods/test_mrmtl.py`` pins that MR-MTL with lambda = 0 is ``local`` without DP);
* FedAvg + fine-tuning: FedAvg's final model trained one more epoch on each silo (DP-SGD at the run's noise multiplier
  under DP), scored on the silo's images; its epoch is added to the silo's ledger (the FedAvg run's), so its epsilon is
  that of the run's rounds plus one, reported beside it (a little above 1);
* lambda sweep (``--sweep``): MR-MTL at each of ``SWEEP_LAMBDAS`` under DP on a seed of its own (``--sweep-seed``, a
  different partition, initialisation and noise, but the same MNIST test images dealt otherwise); the best is then run
  under DP on the reported seeds as the row "MR-MTL, lambda chosen on seed ...".

The paper runs 100 rounds; ``--rounds`` shrinks that (the README says how far and why: a round of 40 silos costs about
20 CPU seconds here). The noise is calibrated for the rounds actually run, so every private row is at epsilon 1.

    python benchmarks/cross_silo_mnist.py --threads 1 [--rounds 15] [--seeds 0,1,2] [--sweep] [--table]

Each (row, level, seed) cell is stored in ``benchmarks/results/cross_silo_mnist.json`` as soon as it ends and
skipped when already there with the same settings; the runs resume from their checkpoints under ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accounting import LedgerBook  # noqa: E402
from privfl.config import RunConfig, build_client, run_federation  # noqa: E402
from privfl.data import FederationSpec  # noqa: E402
from privfl.experiment import train_once  # noqa: E402
from privfl.federation import RunDirectory  # noqa: E402
from privfl.federation.rundir import update_json  # noqa: E402
from privfl.federation.seeding import derive_rng  # noqa: E402
from privfl.methods.local_training import sgd_settings  # noqa: E402
from privfl.metrics import score_model, summarize_scores  # noqa: E402
from privfl.privacy.training import TrainingPrivacy  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "cross_silo_mnist.json"
EPSILON, DELTA, CLIP = 1.0, 1e-5, 1.0
SILOS, SILO_SIZE, BATCH = 40, 1500, 100
ANGLES = (0.0, 90.0, 180.0, 270.0)
PAPER_LAMBDA = 0.001
SWEEP_LAMBDAS = (0.01, 0.1, 1.0)
LOCAL = {"lr": 0.1, "local_steps": SILO_SIZE // BATCH, "batch_size": BATCH}
FEDERATION = FederationSpec(source="mnist", split="client_test", num_clients=SILOS, partition="iid", val_fraction=0.0,
                            train_angles=ANGLES, angle_assignment="balanced")
#: Rows of the table: name -> (registered method, its settings beyond LOCAL, without DP, under DP).
ROWS = {
    "Local": (("local", {}), ("mrmtl", {"lam": 0.0})),
    "FedAvg": (("fedavg", {}), ("fedavg", {})),
    "FedAvg + fine-tuning": (("fedavg", {}), ("fedavg", {})),
    "MR-MTL (lambda 0.001)": (("mrmtl", {"lam": PAPER_LAMBDA}), ("mrmtl", {"lam": PAPER_LAMBDA})),
}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}     # Student t quantiles for 95% intervals over seeds


def privacy_of(level: str) -> TrainingPrivacy:
    if level == "nonprivate":
        return TrainingPrivacy()
    return TrainingPrivacy(mode="record", epsilon=EPSILON, delta=DELTA, clip=CLIP, min_samples=SILO_SIZE,
                           sampling_rate=BATCH / SILO_SIZE)


def run_config(method: str, settings: dict, level: str, seed: int, rounds: int) -> RunConfig:
    return RunConfig(federation=FEDERATION, method=method, model="small_cnn", method_config={**LOCAL, **settings},
                     rounds=rounds, eval_every=rounds, checkpoint_every=1, select="last", seed=seed, delta=DELTA,
                     privacy=privacy_of(level))


def run_dir(args, method: str, settings: dict, level: str, seed: int) -> Path:
    tag = "".join(f"-{k}{v:g}" for k, v in sorted(settings.items()))
    return Path(args.out) / f"{method}{tag}-{level}-r{args.rounds}-seed{seed}"


def key_of(row: str, level: str, seed: int, rounds: int) -> str:
    return f"{row}|{level}|rounds{rounds}|seed{seed}"


def stored(args) -> dict:
    import json

    path = Path(args.results)
    return json.loads(path.read_text()).get("cells", {}) if path.exists() else {}


def store(args, key: str, cell: dict) -> None:
    update_json(Path(args.results), lambda old: {**old, "cells": {**old.get("cells", {}), key: cell}})


def train_cell(args, method: str, settings: dict, level: str, seed: int) -> tuple[dict, RunConfig, Path]:
    """One run (resumed or read back if it is already under ``--out``): its summary's numbers and CPU seconds."""
    config = run_config(method, settings, level, seed, args.rounds)
    out = run_dir(args, method, settings, level, seed)
    resumed = (out / RunDirectory.CHECKPOINT).exists()
    cpu, wall = time.process_time(), time.perf_counter()
    summary = train_once(config, str(out), progress=True)
    val = summary["training_val"]
    cell = {"method": method, "settings": config.method_config, "level": level, "seed": seed, "rounds": args.rounds,
            "accuracy": val["accuracy_mean"], "accuracy_sem_over_silos": val["accuracy_sem"],
            "silos": val["num_clients"], "epsilon_max": summary["privacy"]["epsilon_max_training"],
            "delta": DELTA, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
            "run_wall_s": summary["wall_time_s"], "resumed": resumed, "run_name": out.name,
            "command": " ".join(sys.argv), "numerics": numerics()}
    return cell, config, out


def fine_tune(config: RunConfig, out: Path, seed: int) -> dict:
    """FedAvg's final model trained one more local epoch on each silo (the run's DP-SGD under DP) and scored on the
    silo's held-out images; the epoch's event is added to the silo's ledger from the run."""
    cpu, wall = time.process_time(), time.perf_counter()
    federation = run_federation(config)
    weights = torch.load(RunDirectory(out).path(RunDirectory.CHECKPOINT), weights_only=True)["runtime"]["strategy"][
        "weights"]
    procedure = build_client(config, federation.input_shape, federation.num_classes,
                             len(federation.training_clients))
    procedure = getattr(procedure, "inner", procedure)      # fit is the method's own (record level: its DP-SGD plan)
    ledgers = LedgerBook.load(RunDirectory(out).path(RunDirectory.LEDGER))
    settings = sgd_settings(config.method_settings().round_config(config.rounds))
    scores, epsilons = [], []
    for silo in federation.training_clients:
        model = procedure.model_from(weights)
        _, event = procedure.fit(model, silo, settings, derive_rng(seed, "fine_tune", silo.client_id))
        scores.append(score_model(model, silo.x_val, silo.y_val))
        if event is None:
            epsilons.append(math.inf)
        else:
            ledger = ledgers[silo.client_id]
            ledger.record(event, purpose="fine_tune", round=config.rounds)
            epsilons.append(ledger.spent(DELTA).epsilon)
    val = summarize_scores(scores)
    return {"accuracy": val["accuracy_mean"], "accuracy_sem_over_silos": val["accuracy_sem"],
            "silos": val["num_clients"], "epsilon_max": max(epsilons), "fine_tune_cpu_s": time.process_time() - cpu,
            "fine_tune_wall_s": time.perf_counter() - wall}


def run_row(args, row: str, level: str, seed: int, method: str, settings: dict) -> None:
    key = key_of(row, level, seed, args.rounds)
    done = stored(args)
    if key in done:
        return
    if row == "FedAvg + fine-tuning":
        base = done.get(key_of("FedAvg", level, seed, args.rounds))
        if base is None:
            run_row(args, "FedAvg", level, seed, method, settings)
            base = stored(args)[key_of("FedAvg", level, seed, args.rounds)]
        config = run_config(method, settings, level, seed, args.rounds)
        tuned = fine_tune(config, Path(args.out) / base["run_name"], seed)
        cell = {**base, **tuned, "cpu_s": base["cpu_s"] + tuned["fine_tune_cpu_s"],
                "note": "cpu_s: the FedAvg run's plus the fine-tuning's; epsilon_max includes the fine-tuning epoch"}
    else:
        cell, _, _ = train_cell(args, method, settings, level, seed)
    cell["row"] = row
    store(args, key, cell)
    print(f"{row} | {level} | seed {seed}: {cell['accuracy']:.2f}% (epsilon {cell['epsilon_max']:.3f}, "
          f"{cell['cpu_s']:.0f} CPU s)", flush=True)


def sweep_choice(args) -> float | None:
    """The lambda of :data:`SWEEP_LAMBDAS` with the best private accuracy on the sweep seed (``None`` until all ran)."""
    done = stored(args)
    found = {lam: done.get(key_of(f"sweep: MR-MTL (lambda {lam:g})", "eps1", args.sweep_seed, args.rounds))
             for lam in SWEEP_LAMBDAS}
    if any(cell is None for cell in found.values()):
        return None
    return max(found, key=lambda lam: found[lam]["accuracy"])


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean, SEM and the half-width of the 95% Student-t interval over seeds."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sem = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, sem, T_975.get(n - 1, 1.96) * sem


def table(args) -> str:
    done = stored(args)
    seeds = args.seeds
    chosen = sweep_choice(args)
    rows = list(ROWS) + ([f"MR-MTL (lambda {chosen:g}, chosen on seed {args.sweep_seed})"] if chosen else [])
    lines = ["| row | no DP: mean over silos (%) | epsilon 1: mean over silos (%) | epsilon spent | "
             "CPU s per run, no DP / epsilon 1 | seeds |", "|---|---|---|---|---|---|"]
    summary: dict[str, dict[str, tuple[float, float, float]]] = {}
    for row in rows:
        parts, cpus, spent, counts = [], [], "-", []
        for level in ("nonprivate", "eps1"):
            cells = [done[k] for s in seeds if (k := key_of(row, level, s, args.rounds)) in done]
            counts.append(len(cells))
            if not cells:
                parts.append("not run")
                cpus.append("-")
                continue
            mean, sem, half = interval([c["accuracy"] for c in cells])
            summary.setdefault(row, {})[level] = (mean, sem, half)
            parts.append(f"{mean:.2f} +- {sem:.2f} (95%: +- {half:.2f})" if len(cells) > 1 else f"{mean:.2f}")
            cpus.append(f"{sum(c['cpu_s'] for c in cells) / len(cells):.0f}")
            if level == "eps1":
                spent = f"{max(c['epsilon_max'] for c in cells):.3f}"
        lines.append(f"| {row} | {parts[0]} | {parts[1]} | {spent} | {cpus[0]} / {cpus[1]} | "
                     f"{counts[0]} / {counts[1]} |")
    sweep = [(lam, done.get(key_of(f"sweep: MR-MTL (lambda {lam:g})", "eps1", args.sweep_seed, args.rounds)))
             for lam in SWEEP_LAMBDAS]
    if any(cell for _, cell in sweep):
        lines += ["", f"lambda sweep, epsilon 1, seed {args.sweep_seed}: " + ", ".join(
            f"lambda {lam:g}: {cell['accuracy']:.2f}% ({cell['cpu_s']:.0f} CPU s)" for lam, cell in sweep if cell)]
    lines += ["", ordering(summary, chosen, args)]
    return "\n".join(lines)


def ordering(summary: dict, chosen: float | None, args) -> str:
    """The paper's claim at epsilon 1 (MR-MTL at or above FedAvg, above Local), read where the 95% intervals
    separate."""
    private = {row: values["eps1"] for row, values in summary.items() if "eps1" in values}
    names = [r for r in private if r.startswith("MR-MTL")]
    if "FedAvg" not in private or "Local" not in private or not names:
        return "ordering at epsilon 1: not all rows have run"
    out = []
    for name in names:
        for other, claim in (("FedAvg", "at or above"), ("Local", "above")):
            (a, _, ha), (b, _, hb) = private[name], private[other]
            if math.isnan(ha) or math.isnan(hb):
                verdict = "one seed only: no interval"
            elif a - ha > b + hb:
                verdict = "above, intervals separate"
            elif b - hb > a + ha:
                verdict = "below, intervals separate"
            else:
                verdict = "intervals overlap"
            out.append(f"{name} vs {other} (paper: {claim}): {a:.2f} vs {b:.2f}, {verdict}")
    return "ordering at epsilon 1: " + "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15, help="rounds of one local epoch (the paper runs 100)")
    p.add_argument("--seeds", type=lambda t: [int(s) for s in t.split(",")], default=[0, 1, 2])
    p.add_argument("--sweep", action="store_true", help="also run the lambda sweep and the row it chooses")
    p.add_argument("--sweep-seed", type=int, default=100)
    p.add_argument("--levels", default="eps1,nonprivate", help="which levels to run, in this order")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/cross_silo_mnist")
    p.add_argument("--results", default=str(RESULTS), help="the JSON file of stored cells")
    p.add_argument("--table", action="store_true", help="only print the table from the stored cells")
    args = p.parse_args(argv)
    if not args.table:
        torch.set_num_threads(args.threads)
        levels = args.levels.split(",")
        for level in levels:
            if level == "eps1":     # the private rows first: the paper's claim is about them
                for seed in args.seeds:
                    for row, (_, (method, settings)) in ROWS.items():
                        run_row(args, row, level, seed, method, settings)
                if args.sweep:      # private only: the sweep is about how far private silos should federate
                    for lam in SWEEP_LAMBDAS:
                        run_row(args, f"sweep: MR-MTL (lambda {lam:g})", level, args.sweep_seed, "mrmtl",
                                {"lam": lam})
                    chosen = sweep_choice(args)
                    for seed in args.seeds:
                        run_row(args, f"MR-MTL (lambda {chosen:g}, chosen on seed {args.sweep_seed})", level, seed,
                                "mrmtl", {"lam": chosen})
            else:
                for seed in args.seeds:
                    for row, ((method, settings), _) in ROWS.items():
                        run_row(args, row, level, seed, method, settings)
    print(table(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
