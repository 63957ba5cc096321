"""pFedHN, IT-PFL-HN and PeFLL on ScatterNet features with a generated head (issue 41, item 2): record-level DP at
training epsilon 8 (delta 1e-5) beside the same method without DP, on the main job's federation.

The federation and the privacy are the privacy sweep's (:class:`privfl.sweep.SweepConfig` and its ``run_config``):
MNIST, all 60,000 training images, 50 training clients of 2 classes each, 5 novel clients from the test split; a
linear target on the frozen ScatterNet stage (``features="scatter"``, ``model="linear"``); per-record clip 0.1,
``min_samples`` 1020; 100 rounds at client fraction 0.2; the last round's model. Only ``eval_every`` and
``checkpoint_every`` are set to the last round (the sweep evaluates every fifth round; with ``select="last"`` that
changes nothing trained, only the cost).

Each method takes the sweep's ODPFL-HN local training (one step a round of batch 512, lr 4, no local momentum; no
batch-gradient clip, which DP-SGD's per-record clip replaces) and ``--generated`` (default ``"head_bias"``): on the
linear target the last layer *is* the whole target, so ``"head"`` would generate everything (the same as ``"all"``);
``"head_bias"`` has the hypernetwork emit the per-client bias (a label prior) while the 39,690 weights are one shared
part moved by FedAvg's step (``shared_momentum`` 0.5), as the sweep's ODPFL-HN does. Nothing else is set: the stored
cells use each method's default hypernetwork learning rate (``--hn-lr`` sets pFedHN's and IT-PFL-HN's ``hn_lr``, PeFLL's
``server_lr``, for whoever wants to tune it; its cells are stored under a key of their own). IT-PFL-HN uses the DP-ready
encoder (``dp_deepset``) in both rows, with one encoder-regression step a round (``encoder_steps=1``, not its default 5:
each private step is two per-record releases over a client's whole split, which made a round about ten times pFedHN's).

Reported per cell, as ``benchmarks/methods_dp_mnist.py`` reports these methods: the training clients' validation
accuracy (every method; pFedHN and PeFLL serve no unlabelled novel client) and, for IT-PFL-HN, the novel clients'
accuracy; the largest training epsilon spent; the CPU seconds of the cell (this process, one thread).

    python benchmarks/hypernets_features_mnist.py [--methods pfedhn itpflhn pefll] [--seeds 0] [--epsilons 8 inf]
        [--generated head_bias] [--hn-lr pfedhn=0.1 ...] [--threads 1]

Each cell is stored in ``benchmarks/results/hypernets_features_mnist.json`` as soon as it ends (with the command,
the run's config and the code revision) and skipped when stored.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from privfl.provenance import numerics
from privfl.sweep import SweepConfig

RESULTS = ROOT / "benchmarks" / "results" / "hypernets_features_mnist.json"
METHODS = ("pfedhn", "itpflhn", "pefll")
#: The sweep's ODPFL-HN local training, carried to each method's own setting names.
LOCAL = {"lr": 4.0, "local_steps": 1, "batch_size": 512}
SETTINGS = {
    "pfedhn": {**LOCAL, "momentum": 0.0, "grad_clip": None},
    "itpflhn": {**LOCAL, "momentum": 0.0, "grad_clip": None, "encoder": "dp_deepset", "encoder_steps": 1},
    "pefll": {**LOCAL, "momentum": 0.0, "grad_clip": 0.0},
}
#: The hypernetwork learning rate's setting in each method.
HN_LR = {"pfedhn": "hn_lr", "itpflhn": "hn_lr", "pefll": "server_lr"}


def settings_for(method: str, generated: str, hn_lr: float | None) -> dict:
    settings = {**SETTINGS[method], "generated": generated, "shared_momentum": 0.5}
    if hn_lr is not None:
        settings[HN_LR[method]] = hn_lr
    return settings


def config_for(method: str, epsilon: float | None, seed: int, settings: dict, rounds: int = 100) -> RunConfig:
    """The sweep's training run of ``method`` at ``epsilon`` (``None``: without DP), evaluated at the last round."""
    sweep = SweepConfig(method=method, method_config=settings, seed=seed, train_epsilons=(epsilon,), rounds=rounds)
    config = sweep.run_config(epsilon)
    return dataclasses.replace(config, eval_every=config.rounds, checkpoint_every=config.rounds)


def key_of(method: str, generated: str, hn_lr: float | None, epsilon: float | None, seed: int,
           rounds: int = 100) -> str:
    lr = "" if hn_lr is None else f"|hnlr{hn_lr:g}"
    lr += "" if rounds == 100 else f"|rounds{rounds}"
    return f"{method}|{generated}{lr}|eps{'inf' if epsilon is None else f'{epsilon:g}'}|seed{seed}"


def stored() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epsilons", nargs="+", default=["8", "inf"])
    parser.add_argument("--generated", default="head_bias", choices=("all", "head", "head_bias"))
    parser.add_argument("--hn-lr", nargs="*", default=[], metavar="METHOD=LR",
                        help="the hypernetwork's learning rate of a method (its default otherwise)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "hypernets_features_mnist"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=100, help="the sweep's 100 by default (fewer for a smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lrs = {m: float(v) for m, v in (item.split("=") for item in args.hn_lr)}
    for method in args.methods:
        settings = settings_for(method, args.generated, lrs.get(method))
        for text in args.epsilons:
            epsilon = None if text == "inf" else float(text)
            for seed in args.seeds:
                key = key_of(method, args.generated, lrs.get(method), epsilon, seed, args.rounds)
                if key in stored():
                    print(f"{key}: stored; skipped", flush=True)
                    continue
                config = config_for(method, epsilon, seed, settings, args.rounds)
                started = time.process_time()
                summary = train_once(config, f"{args.out}/{key.replace('|', '-')}", progress=False)
                novel = summary["novel"]
                cell = {"val_accuracy": summary["training_val"]["accuracy_mean"],
                        "novel_accuracy": novel["accuracy_mean"] if novel.get("num_clients") else None,
                        "epsilon_max_training": summary["privacy"]["epsilon_max_training"],
                        "cpu_s": time.process_time() - started,
                        "command": " ".join(["python", "benchmarks/hypernets_features_mnist.py", *sys.argv[1:]]),
                        "config": config.to_dict(), "numerics": numerics(ROOT)}
                update_json(RESULTS, lambda runs, key=key, cell=cell: {**runs, key: cell})
                print(f"{key}: val {cell['val_accuracy']:.2f}, novel {cell['novel_accuracy']}, "
                      f"eps {cell['epsilon_max_training']}, cpu {cell['cpu_s']:.0f} s", flush=True)
    runs = stored()
    print("| method | generated | hn lr | val acc, no DP | val acc, eps 8 | novel acc, no DP | novel acc, eps 8 | "
          "max eps | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        lr = lrs.get(method)
        cells = {text: [runs[k] for s in args.seeds
                        if (k := key_of(method, args.generated, lr, None if text == "inf" else float(text), s,
                                        args.rounds)) in runs]
                 for text in ("inf", "8")}

        def stat(rows: list[dict], field: str) -> str:
            values = [r[field] for r in rows if r.get(field) is not None]
            if not values:
                return "-"
            mean, sem = mean_sem(values)
            return f"{mean:.2f}" + (f" +- {sem:.2f}" if len(values) > 1 else "")

        spent = max((c["epsilon_max_training"] for c in cells["8"]), default=float("nan"))
        cpu = sum(c["cpu_s"] for rows in cells.values() for c in rows)
        print(f"| {method} | {args.generated} | {'default' if lr is None else f'{lr:g}'} | "
              f"{stat(cells['inf'], 'val_accuracy')} | {stat(cells['8'], 'val_accuracy')} | "
              f"{stat(cells['inf'], 'novel_accuracy')} | {stat(cells['8'], 'novel_accuracy')} | {spent:.3f} | "
              f"{cpu:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
