"""Every registered method at one privacy setting: record-level DP-SGD at epsilon 8 per training client (delta 1e-5)
beside the same method trained without DP, on the FedTTA paper's MNIST protocol.

Protocol (FedTTA paper section 4.1; ``benchmarks/fedtta_mnist.py``): MNIST train and test merged, 100 clients with
pathological 2-shard partitions, 50% novel, training clients split 85/15 train/validation, MNIST 2NN target, all 50
training clients every round, 20 local steps of batch 64, the paper's Table 4 learning rates where it gives them
(the methods' defaults otherwise). Both rows report the last round's model (selection on validation would spend
private data, and the non-private row is selected the same way so the two differ only by DP); ``--rounds`` defaults
to 50 rather than the paper's 200 so the whole table fits a working day on two cores.

The private row: ``RunConfig(privacy=TrainingPrivacy(mode="record", epsilon=8, delta=1e-5, clip=--clip,
min_samples=--min-samples))``; every training client of the protocol holds 595 training records (equal shards, so the
size is public by construction), the default ``--min-samples``: DP-SGD then samples at the public rate 64 / 595 and
every mean over records is calibrated at 595 (``docs/record_level.md``). The layer calibrates each method's noise for
its participations and releases and the table reports the largest epsilon any training client's ledger holds at the end
(it must not exceed 8). A method whose registration refuses record-level DP is listed with its reason. Novel-client
accuracy is the mean over novel clients after each method's own serving (adaptation, descriptor, or the global model);
the validation accuracy is the training clients' own.

    python benchmarks/methods_dp_mnist.py [--methods fedavg fedprox ...] [--rounds 50] [--seed 0]

Each (method, level) is stored in ``benchmarks/results/methods_dp_mnist.json`` as soon as it ends and skipped when
already stored with the same settings, so an interrupted table resumes; the runs themselves resume from their
checkpoints (``privfl.experiment.train_once``). Prints the Markdown table of ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import fields
from pathlib import Path

import torch
from fedtta_mnist import CODE_STABILISERS, FEDTTA_MNIST, FEDTTA_PROX_MNIST, MNIST_SPEC, ODPFLHN_PIXELS, SETTINGS

from privfl.config import RunConfig
from privfl.errors import ConfigError
from privfl.experiment import train_once
from privfl.federation.rundir import update_json
from privfl.memory import reuse_freed_memory
from privfl.methods import METHODS
from privfl.privacy.training import TrainingPrivacy
from privfl.provenance import numerics

RESULTS = Path(__file__).parent / "results" / "methods_dp_mnist.json"
EPSILON, DELTA = 8.0, 1e-5
# The FedTTA paper's Table 4 (MNIST) where it names the method; ODPFL-HN as the privacy sweep trains it.
METHOD_SETTINGS = {
    **SETTINGS,
    "fedtta": FEDTTA_MNIST,
    "fedtta_prox": FEDTTA_PROX_MNIST,
    "fedtta_pp": FEDTTA_PROX_MNIST,
    "tent": {"lr": 0.1, "adapt": "all"},
    # IT-PFL-HN with the encoder that record-level DP can clip and noise (its default max-pooled DeepSet cannot be
    # made private), in both rows so that they differ only by DP
    "itpflhn": {"encoder": "dp_deepset"},
    "odpflhn": {k: v for k, v in ODPFLHN_PIXELS.items() if k not in ("local_steps", "batch_size")},
}


# The stabilisers of the authors' code (``fedtta_mnist.py --code-stabilisers``: local weight decay, gradient-norm
# clip, lr decay) for the FedAvg and FedTTA families, as their MNIST benchmarks run them: without them the paper's
# learning rates diverge within 20 rounds (FedProx at lr 0.3, SCAFFOLD at server lr 1.5, the FedTTA meta-training at
# lr 0.3). The private row drops the clip (config_for), which DP-SGD's per-record clip replaces.
STABILISED = ("afl", "fedadg", "fedavg", "fedgma", "fedprox", "fedsr", "fedtta", "fedtta_pp", "fedtta_prox", "scaffold",
              "tent")


def settings_for(method: str) -> dict:
    """The method's settings: the protocol's 20 steps of batch 64 where the method has local steps, and the
    stabilisers where :data:`STABILISED` names it."""
    fields = set(METHODS[method].config().to_dict())
    local = {k: v for k, v in {"local_steps": 20, "batch_size": 64}.items() if k in fields}
    return {**local, **(CODE_STABILISERS if method in STABILISED else {}), **METHOD_SETTINGS.get(method, {})}


def config_for(method: str, privacy: TrainingPrivacy, args) -> RunConfig:
    settings = settings_for(method)
    if privacy.mode == "record" and settings.get("grad_clip", METHODS[method].config().to_dict().get("grad_clip")):
        # the batch-gradient stabiliser that DP-SGD's per-record clip replaces: None where the field is optional,
        # 0 (off) where it is a plain number
        optional = "None" in str(next(f.type for f in fields(METHODS[method].config()) if f.name == "grad_clip"))
        settings["grad_clip"] = None if optional else 0.0
    return RunConfig(federation=MNIST_SPEC, method=method, method_config=settings, model="mlp2nn",
                     rounds=args.rounds, eval_every=args.rounds, checkpoint_every=10, select="last", seed=args.seed,
                     delta=DELTA, privacy=privacy)


def run_level(method: str, eps: float | None, args) -> dict:
    privacy = TrainingPrivacy() if eps is None else TrainingPrivacy(mode="record", epsilon=eps, delta=DELTA,
                                                                     clip=args.clip, min_samples=args.min_samples)
    try:
        config = config_for(method, privacy, args)
    except ConfigError as refusal:
        return {"refused": str(refusal)}
    level = "nonprivate" if eps is None else f"eps{eps:g}"
    started = time.perf_counter()
    try:
        summary = train_once(config, str(Path(args.out) / f"{method}-{level}-seed{args.seed}"), progress=True)
    except ConfigError as refusal:   # a refusal that needs the federation (the method's check_privacy)
        return {"refused": str(refusal)}
    return {"novel_accuracy": summary["novel"]["accuracy_mean"], "novel_sem": summary["novel"]["accuracy_sem"],
            "val_accuracy": summary["training_val"]["accuracy_mean"],
            "epsilon_max_training": summary["privacy"]["epsilon_max_training"],
            "wall_s": time.perf_counter() - started, "settings": config.method_config}


def key_of(method: str, eps: float | None, args) -> str:
    level = "nonprivate" if eps is None else f"eps{eps:g}-clip{args.clip:g}-min{args.min_samples}"
    return f"{method}|{level}|rounds{args.rounds}|seed{args.seed}"


def stored() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def cell(row: dict | None, field: str) -> str:
    if row is None:
        return "not run"
    if "refused" in row:
        return "refused"
    value = row[field]
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def table(args) -> str:
    runs = stored()
    lines = ["| method | novel acc, no DP | novel acc, eps 8 | val acc, no DP | val acc, eps 8 | max training eps |",
             "|---|---|---|---|---|---|"]
    notes = []
    for method in args.methods:
        plain, private = (runs.get(key_of(method, e, args)) for e in (None, EPSILON))
        spent = "-" if not private or "refused" in private else f"{private['epsilon_max_training']:.3f}"
        lines.append(f"| {method} | {cell(plain, 'novel_accuracy')} | {cell(private, 'novel_accuracy')} | "
                     f"{cell(plain, 'val_accuracy')} | {cell(private, 'val_accuracy')} | {spent} |")
        if private and "refused" in private:
            notes.append(f"- {method}: {private['refused']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=sorted(METHODS), choices=sorted(METHODS))
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip", type=float, default=1.0, help="DP-SGD per-record clip C")
    parser.add_argument("--min-samples", type=int, default=595,
                        help="the public lower bound on a training client's records (the protocol's clients hold 595 "
                             "each): DP-SGD's rate is 64 / it, means over records are calibrated at it")
    parser.add_argument("--out", default="runs/methods_dp_mnist")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table-only", action="store_true", help="print the stored table and run nothing")
    args = parser.parse_args()
    if args.rounds < 1 or not args.clip > 0:
        parser.error(f"--rounds must be >= 1 and --clip > 0; got {args.rounds} and {args.clip}")
    torch.set_num_threads(args.threads)
    reuse_freed_memory()
    if not args.table_only:
        for method in args.methods:
            for eps in (None, EPSILON):
                key = key_of(method, eps, args)
                if key in stored():
                    print(f"{key}: stored; skipped", flush=True)
                    continue
                row = {**run_level(method, eps, args), "numerics": numerics()}
                update_json(RESULTS, lambda runs, key=key, row=row: {**runs, key: row})
                print(f"{key}: {row}", flush=True)
    print(table(args))


if __name__ == "__main__":
    main()
