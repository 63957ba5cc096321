"""Why the main job's descriptor is ignored, and what two ODPFL-HN settings change: the descriptor's signal against
the noise it is trained and released with, then the sweep's descriptor margin with those settings.

1. **Signal against noise** (no training: the main job's encoder is never trained, ``encoder_lr=0``, so its seeded
   initialisation is the served one). phi ends in a softmax over 32 prototypes (:class:`PrototypeSoftmax`), whose
   mean over a client's records is its descriptor. Per softmax temperature: the standard deviation across the 50
   training clients of each coordinate of their noiseless descriptors (mean and largest over coordinates), beside the
   noise the descriptor meets: ``train_mean_noise`` in training (0.03 in the main job) and a novel client's release
   through ``privatize`` (bound 1, replace-one: sensitivity 2 / n) at epsilon 1, delta 1e-5, n = 50 and 1,000.
2. **Margins.** ``privfl sweep`` at the main job's settings but for the named changes (:data:`VARIANTS`): training
   without DP and at training epsilon 8 and 1, the sweep's novel clients at n = 50, 500 and 1,000, novel epsilon 1
   (one noise draw), per seed. Per cell: the novel non-private accuracy, the two controls, the margin over the better
   one, and the sweep's verdict (``SweepConfig.min_margin`` = 2 points at every n). The main job's own figures with
   its default settings are ``results/sweep_demo*.json`` (the same trainings, mixes and controls: the clean and
   control cells do not depend on the novel epsilons or repeats served).

    python benchmarks/descriptor_settings.py [--seeds 0 1 2] [--out runs/descriptor_settings]

Writes ``benchmarks/results/descriptor_settings.json`` as each (variant, seed) ends (a rerun skips the stored ones,
and each sweep reuses its finished trainings); the two values tried per setting were chosen from part 1, on the
training clients' data, and are the only ones run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accounting.calibration import analytic_gaussian_sigma  # noqa: E402
from privfl.config import run_federation  # noqa: E402
from privfl.experiment import build_runtime  # noqa: E402
from privfl.federation.rundir import update_json  # noqa: E402
from privfl.metrics import mean_sem  # noqa: E402
from privfl.models.set_encoders import PrototypeSoftmax  # noqa: E402
from privfl.provenance import numerics  # noqa: E402
from privfl.sweep import DEFAULT_METHOD, SweepConfig, run_sweep  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "descriptor_settings.json"
TEMPERATURES = (1.0, 0.3, 0.1, 0.03)
#: The changes to the main job's ODPFL-HN settings (``privfl.sweep.DEFAULT_METHOD``) that are run.
VARIANTS: dict[str, dict[str, float | int]] = {
    "temperature_0.1": {"encoder_temperature": 0.1},
    "temperature_0.1_linear_hn": {"encoder_temperature": 0.1, "hn_layers": 0},
}
TRAIN_EPSILONS = (None, 8.0, 1.0)


def signal_and_noise(seed: int, temperatures: tuple[float, ...] = TEMPERATURES) -> dict:
    """Part 1 for one seed: per temperature, the spread of the training clients' noiseless descriptors, and the
    standard deviations of the noise they meet."""
    config = SweepConfig(seed=seed)
    run = config.run_config(None)
    runtime = build_runtime(run, run_federation(run, progress=False))
    encoder = runtime.strategy.encoder.eval()
    softmax = next(m for m in encoder.modules() if isinstance(m, PrototypeSoftmax))
    spread = {}
    for temperature in temperatures:
        softmax.temperature = temperature
        with torch.no_grad():
            descriptors = torch.stack([encoder(runtime.clients[c].x_train) for c in sorted(runtime.clients)])
        std = descriptors.std(dim=0)
        spread[f"{temperature:g}"] = {"mean_std": std.mean().item(), "max_std": std.max().item()}
    assert config.method_config is not None
    release = {f"n{n}": analytic_gaussian_sigma(1.0, config.delta, 2 * config.bound / n) for n in (50, 1000)}
    return {"between_client_std": spread, "train_mean_noise": config.method_config["train_mean_noise"],
            "release_noise_std_epsilon1": release}


def margins(variant: str, seed: int, out: Path) -> dict:
    """Part 2 for one (variant, seed): one sweep, its cells per training."""
    config = SweepConfig(method_config={**DEFAULT_METHOD, **VARIANTS[variant]}, train_epsilons=TRAIN_EPSILONS,
                         epsilons=(1.0,), repeats=1, seed=seed)
    result = run_sweep(config, out / variant / f"seed{seed}", progress=True)
    cells = {}
    for key, training in result["trainings"].items():
        table = training["table"]
        cells[key] = {
            "validation_accuracy": training["training"]["training_val_accuracy"],
            "epsilon_max_training": training["training"]["epsilon_max_training"],
            "novel": {n: c["accuracy"] for n, c in table["inf"].items()},
            "novel_epsilon1": {n: c["accuracy"] for n, c in table["1"].items()},
            "controls": {name: {n: c["accuracy"] for n, c in table[name].items()}
                         for name in ("control_mean_training", "control_other_mix")},
            "margin": training["descriptor_margin"], "informative": training["descriptor_informative"],
            "numerics": training["training"]["numerics"]}
    return {"method_config": config.method_config, "trainings": cells, "wall_s": result["wall_s"],
            "numerics": result["numerics"]}


def summarise(stored: dict) -> dict:
    """Per variant and training: mean +- SEM over the seeds stored of the margin and accuracies per n."""
    out: dict = {}
    for variant in VARIANTS:
        seeds = [v for k, v in stored.get("margins", {}).items() if k.startswith(f"{variant}|")]
        if not seeds:
            continue
        for key in seeds[0]["trainings"]:
            rows = [s["trainings"][key] for s in seeds]
            cell = out.setdefault(variant, {})[key] = {"seeds": len(rows)}
            for name in ("margin", "novel", "novel_epsilon1"):
                cell[name] = {n: dict(zip(("mean", "sem"), mean_sem([r[name][n] for r in rows])))
                              for n in rows[0][name]}
            cell["validation_accuracy"] = dict(zip(("mean", "sem"), mean_sem(
                [r["validation_accuracy"] for r in rows])))
            cell["informative_seeds"] = sum(r["informative"] for r in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "descriptor_settings")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = " ".join(["benchmarks/descriptor_settings.py", *sys.argv[1:]])
    for seed in args.seeds:
        found = signal_and_noise(seed)
        update_json(args.results, lambda old, s=seed, f=found: {
            **old, "signal_and_noise": {**old.get("signal_and_noise", {}), f"seed{s}": f}})
        print(f"seed {seed}: between-client std per temperature "
              + ", ".join(f"T={t} {v['mean_std']:.4f} (max {v['max_std']:.4f})"
                          for t, v in found["between_client_std"].items())
              + f"; train noise {found['train_mean_noise']}, release noise at epsilon 1 "
              + ", ".join(f"{k} {v:.4f}" for k, v in found["release_noise_std_epsilon1"].items()))
    for variant in args.variants:
        for seed in args.seeds:
            key = f"{variant}|seed{seed}"
            if args.results.exists() and key in json.loads(args.results.read_text()).get("margins", {}):
                continue
            cell = {**margins(variant, seed, args.out), "command": command}
            update_json(args.results, lambda old, k=key, c=cell: {
                **old, "margins": {**old.get("margins", {}), k: c}, "numerics": numerics()})
            for training, row in cell["trainings"].items():
                print(f"{variant} seed {seed} training {training}: margin "
                      + ", ".join(f"n={n} {m:+.2f}" for n, m in row["margin"].items())
                      + f"; informative {row['informative']}")
    update_json(args.results, lambda old: {**old, "over_seeds": summarise(old)})
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
