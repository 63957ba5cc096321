"""Central sanity check inside privfl: one client holding all 60,000 MNIST training images, record-level DP-SGD at
(epsilon 3, delta 1e-5), scored on MNIST's 10,000 test images.

The anchor is Tramer and Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)" (ICLR
2021): 98.7% for ScatterNet + linear and 98.1% for the end-to-end CNN at epsilon 3. Both models run through privfl's
own parts: the ScatterNet feature stage (:mod:`privfl.models.features`, J = 2, L = 8, per-record group norm with 27
groups), the targets ``linear`` and ``tanh_cnn`` (:mod:`privfl.models.targets`), and :class:`~privfl.privacy.dp_sgd.
DPSGDTrainer` with the noise multiplier calibrated by PLD for the whole run at the public Poisson rate batch / 60,000
(the client's size is public here: one client, the whole training split). Settings are Tramer and Boneh's (their
code, github ftramer/Handcrafted-DP): ScatterNet + linear at batch 4096, lr 4, momentum 0.9, 40 epochs, clip 0.1;
the CNN at batch 512, lr 0.5, momentum 0.9, 40 epochs, clip 0.1. Nothing is tuned here, on test data or otherwise.

    python benchmarks/central_dp_mnist.py [--models linear cnn] [--seeds 0 1 2] [--threads 1]

Each (model, seed) cell is stored in ``benchmarks/results/central_dp_mnist.json`` as soon as it ends (with the code
revision and CPU seconds) and skipped when stored, so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from privfl.data import load_source
from privfl.federation.rundir import update_json
from privfl.metrics import mean_sem
from privfl.models import build_model
from privfl.models.features import load_stage, map_inputs
from privfl.privacy.dp_sgd import DPSGDConfig, DPSGDTrainer
from privfl.provenance import numerics

RESULTS = ROOT / "benchmarks" / "results" / "central_dp_mnist.json"
EPSILON, DELTA = 3.0, 1e-5
#: Tramer and Boneh's settings (their code) per model: the target, whether ScatterNet features go in, batch, lr, epochs
#: and the per-record clip; momentum 0.9 for both.
MODELS = {
    "linear": {"target": "linear", "scatter": True, "batch": 4096, "lr": 4.0, "epochs": 40, "clip": 0.1},
    "cnn": {"target": "tanh_cnn", "scatter": False, "batch": 512, "lr": 0.5, "epochs": 40, "clip": 0.1},
}
ANCHOR = {"linear": 98.7, "cnn": 98.1}
TARGET = {"linear": 98.5, "cnn": 97.5}


def data(scatter: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    source = load_source("mnist")
    x, y = torch.tensor(source.train.x), torch.as_tensor(source.train.y, dtype=torch.int64)
    x_test, y_test = torch.tensor(source.test.x), torch.as_tensor(source.test.y, dtype=torch.int64)
    if scatter:
        stage = load_stage("scatter", tuple(x.shape[1:]))
        x, x_test = (torch.from_numpy(map_inputs(stage, part, progress=True)) for part in (x, x_test))
    return x, y, x_test, y_test


def run_cell(name: str, seed: int) -> dict:
    settings = MODELS[name]
    x, y, x_test, y_test = data(settings["scatter"])
    n, batch = len(y), settings["batch"]
    q = batch / n                                # public: the one client's size is the whole training split
    steps = math.ceil(settings["epochs"] / q)
    torch.manual_seed(seed)
    model = build_model(settings["target"], tuple(x.shape[1:]), 10)
    trainer = DPSGDTrainer(DPSGDConfig(target_epsilon=EPSILON, delta=DELTA, total_steps=steps,
                                       max_grad_norm=settings["clip"], noise="secure"))
    rng = np.random.default_rng(seed)
    started = time.process_time()
    per_epoch = math.ceil(1 / q)
    done = 0
    while done < steps:
        chunk = min(per_epoch, steps - done)
        trainer.train(model, x, y, lr=settings["lr"], steps=chunk, batch_size=batch, rng=rng, momentum=0.9,
                      sampling_rate=q)
        done += chunk
        print(f"{name} seed {seed}: {done}/{steps} steps", flush=True)
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(dim=1) == y_test).float().mean()) * 100
    return {"accuracy": accuracy, "epsilon": trainer.epsilon(), "noise_multiplier": trainer.noise_multiplier_for(
        n, batch, q), "steps": steps, "sampling_rate": q, "cpu_s": time.process_time() - started,
        "settings": settings, "numerics": numerics(ROOT)}


def table(stored: dict) -> str:
    lines = ["| model | accuracy (%, mean +- SEM) | seeds | per seed | target | anchor | CPU s per seed |",
             "|---|---|---|---|---|---|---|"]
    for name in MODELS:
        cells = [stored[k] for k in sorted(stored) if k.startswith(f"{name}|")]
        if not cells:
            continue
        mean, sem = mean_sem([c["accuracy"] for c in cells])
        each = ", ".join(f"{c['accuracy']:.2f}" for c in cells)
        lines.append(f"| {name} | {mean:.2f} +- {sem:.2f} | {len(cells)} | {each} | >= {TARGET[name]} | "
                     f"{ANCHOR[name]} | {np.mean([c['cpu_s'] for c in cells]):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.table_only:
        for name in args.models:
            for seed in args.seeds:
                key = f"{name}|seed{seed}"
                stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
                if key in stored:
                    continue
                cell = run_cell(name, seed)
                update_json(RESULTS, lambda runs, key=key, cell=cell: {**runs, key: cell})
                print(f"{key}: {cell['accuracy']:.2f}% at epsilon {cell['epsilon']:.3f} ({cell['cpu_s']:.0f} s)",
                      flush=True)
    print(table(json.loads(RESULTS.read_text()) if RESULTS.exists() else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
