"""How much room a personalised part has in the main job, and how much of it a label prior read from a private
histogram of the shared model's own predictions takes.

For every training (without DP and at each training epsilon) of each sweep directory given (``privfl sweep --out
runs/main_seed<S> --seed <S>``), the model the hypernetwork serves for the mean of the training clients' descriptors
(the sweep's first control, ``control_mean_training``) is scored on every pair of classes of the held-out pool, with
each pair's images split in two: the novel client's unlabelled images (the first n of the largest size's), and the
rest, on which every column is scored:

* ``control``: the model as it is;
* ``oracle``: each prediction restricted to the pair's two classes, the most a descriptor-dependent bias could add;
* ``label_prior``: the novel client releases the mean of the model's softmax over its n images through
  :func:`privfl.privacy.privatize` (phi the model's softmax, mean pooling, psi the identity: per-record outputs on the
  simplex, clipped to the unit ball, replace-one, recorded in the client's ledger; or without noise), and is served
  the model with ``log(h / uniform)`` added to its logits, h the release floored at :data:`FLOOR` and renormalised:
  Saerens, Latinne and Decaestecker (2002)'s correction of a classifier's outputs to a new label prior;
* ``wrong_prior``: the same correction with the release of another pair (the next one, in the order of the pairs):
  the counterpart of the sweep's second control, ``control_other_mix``.

``label_prior`` minus the better of ``control`` and ``wrong_prior``, without noise, is the margin the sweep's
descriptor verdict reads (``SweepConfig.min_margin`` = 2 points at every n). FLOOR was not tuned. Without noise the
correction needs no release: the control model is built from the training clients' releases alone, so a novel client
can compute h and correct its logits locally, at epsilon 0; that column is the bar a released descriptor has to clear
(docs/methods/hypernetworks.md, "A label prior from the client's own predictions").

    python benchmarks/descriptor_headroom.py --runs runs/main_seed0 runs/main_seed1 runs/main_seed2

Writes ``benchmarks/results/descriptor_headroom.json`` (per seed, training, n and novel epsilon: mean +- SEM over the
45 pairs; over seeds: mean +- SEM of the seeds' means; the command, numerics and each training's numerics).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accounting import PrivacyLedger  # noqa: E402
from privfl.config import run_federation  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402
from privfl.evaluation.novel_pool import held_out_pool  # noqa: E402
from privfl.experiment import build_runtime  # noqa: E402
from privfl.federation import RunDirectory  # noqa: E402
from privfl.federation.rundir import update_json  # noqa: E402
from privfl.metrics import mean_sem  # noqa: E402
from privfl.models.features import load_stage, map_inputs  # noqa: E402
from privfl.models.set_encoders import MeanPool  # noqa: E402
from privfl.privacy import privatize  # noqa: E402
from privfl.provenance import numerics  # noqa: E402
from privfl.sweep import SweepConfig, train_directory, train_key  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "descriptor_headroom.json"
#: The smallest prior a class keeps after the release is floored (a noisy release can be 0 or negative).
FLOOR = 1e-4
COLUMNS = ("control", "oracle", "label_prior", "wrong_prior")
#: The fewest images of a pair left to score on once the largest novel client's images are set aside.
MIN_SCORED = 500


class SoftmaxHistogram(nn.Module):
    """phi = the served model's softmax per record, pooled by their mean, psi the identity: the novel client's
    predicted label histogram, in the phi -> MeanPool -> psi form :func:`privfl.privacy.privatize` certifies."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.phi = nn.Sequential(model, nn.Softmax(dim=1))
        self.pool = MeanPool()
        self.psi = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.psi(self.pool(self.phi(x)))


def release_histogram(model: nn.Module, x: torch.Tensor, epsilon: float | None, delta: float,
                      ledger: PrivacyLedger | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The mean of ``model``'s softmax over ``x``: exact when ``epsilon`` is ``None``, else one (epsilon, delta)
    release through :func:`privfl.privacy.privatize` (bound 1, replace-one; recorded in ``ledger``)."""
    encoder = SoftmaxHistogram(model).eval()
    with torch.no_grad():
        if epsilon is None:
            return encoder(x)
        return privatize(encoder, epsilon, delta, bound=1.0, ledger=ledger, generator=generator)(x)


def prior_logits(logits: torch.Tensor, histogram: torch.Tensor, floor: float = FLOOR) -> torch.Tensor:
    """``logits + log(h / (1 / C))`` with h = ``histogram`` floored at ``floor`` and renormalised (C classes): the
    Bayes correction of a classifier trained under a uniform label prior to the prior h."""
    if not 0 < floor < 1:
        raise ConfigError(f"floor must be in (0, 1), got {floor!r}")
    prior = histogram.clamp(min=floor)
    prior = prior / prior.sum()
    return logits + torch.log(prior * histogram.numel())


def sweep_config(out: Path) -> SweepConfig:
    """The settings a sweep directory was made with (its ``sweep-config.json`` mark, as ``privfl sweep`` wrote it)."""
    mark = out / "sweep-config.json"
    if not mark.exists():
        raise ConfigError(f"{mark} does not exist: run `privfl sweep --out {out} --seed S` first")
    settings = json.loads(mark.read_text())
    fields = {f.name: f for f in dataclasses.fields(SweepConfig)}
    for name, value in settings.items():
        if isinstance(value, list) and name in fields:
            settings[name] = tuple(value)
    return SweepConfig(**settings)


def score(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return 100.0 * (logits.argmax(1) == labels).float().mean().item()


def measure_training(config: SweepConfig, out: Path, epsilon: float | None, features: torch.Tensor,
                     labels: torch.Tensor, sizes: list[int], novel_epsilons: list[float | None],
                     repeats: int) -> dict:
    """Every cell of one training: ``{n: {novel epsilon: {column: {"mean", "sem_over_pairs"}}}}``, a pair's noise
    draws averaged first; private cells also hold ``ledger_epsilon``, what one client's ledger says it spent."""
    run = config.run_config(epsilon)
    runtime = build_runtime(run, run_federation(run))
    checkpoint = RunDirectory(train_directory(out, epsilon)).load_checkpoint()
    if checkpoint is None:
        raise ConfigError(f"{train_directory(out, epsilon)} holds no checkpoint: the sweep's training did not finish")
    runtime.load_state_dict(checkpoint["runtime"])
    strategy = runtime.strategy
    mean = torch.stack([strategy.descriptors[k] for k in sorted(strategy.descriptors)]).mean(dim=0)
    model = runtime.client.model_from(strategy.generated_weights(mean)).eval()
    with torch.no_grad():
        logits = model(features)
    classes = int(labels.max()) + 1
    rng = np.random.default_rng(config.seed)
    largest, halves = max(sizes), []
    for a, b in itertools.combinations(range(classes), 2):
        index = torch.nonzero((labels == a) | (labels == b)).flatten().numpy()
        rng.shuffle(index)
        if len(index) - largest < MIN_SCORED:
            raise ConfigError(f"n = {largest} leaves fewer than {MIN_SCORED} of the {len(index)} held-out images "
                              f"of classes {a} and {b} to score on; choose smaller --sizes")
        halves.append(((a, b), index[:largest], index[largest:]))
    cells: dict = {}
    for n in sizes:
        for eps in novel_epsilons:
            cell: dict = cells.setdefault(str(n), {}).setdefault("inf" if eps is None else f"{eps:g}", {})
            scores: dict[str, list[list[float]]] = {c: [[] for _ in halves] for c in COLUMNS}
            for repeat in range(1 if eps is None else repeats):
                generator = torch.Generator().manual_seed(1000 * repeat + n)
                ledgers = [PrivacyLedger(p) for p in range(len(halves))]
                releases = [release_histogram(model, features[own[:n]], eps, config.delta, ledgers[p], generator)
                            for p, (_, own, _) in enumerate(halves)]
                if eps is not None:     # what one novel client's ledger says its release spent
                    cell["ledger_epsilon"] = ledgers[0].spent(config.delta).epsilon
                for p, ((a, b), _, scored) in enumerate(halves):
                    pair_logits, pair_labels = logits[scored], labels[scored]
                    only_pair = torch.full_like(pair_logits, -math.inf)
                    only_pair[:, [a, b]] = pair_logits[:, [a, b]]
                    other = releases[(p + 1) % len(releases)]
                    for column, column_logits in zip(COLUMNS, (pair_logits, only_pair,
                                                               prior_logits(pair_logits, releases[p]),
                                                               prior_logits(pair_logits, other))):
                        scores[column][p].append(score(column_logits, pair_labels))
            for column, per_pair in scores.items():
                mean, sem = mean_sem([float(np.mean(draws)) for draws in per_pair])
                cell[column] = {"mean": mean, "sem_over_pairs": sem}
    return cells


def summarise(per_seed: dict[str, dict]) -> dict:
    """Over seeds: per (training, n, novel epsilon, column) the mean +- SEM of the seeds' means; per (training, n)
    the margin of ``label_prior`` (no noise) over the better control, and the verdict over every n."""
    trainings = next(iter(per_seed.values())).keys()
    out: dict = {}
    for training in trainings:
        cells = {}
        for n, by_eps in per_seed[next(iter(per_seed))][training]["cells"].items():
            for eps in by_eps:
                seeds = [per_seed[s][training]["cells"][n][eps] for s in per_seed]
                cell = cells.setdefault(n, {}).setdefault(eps, {})
                for column in COLUMNS:
                    mean, sem = mean_sem([seed[column]["mean"] for seed in seeds])
                    cell[column] = {"mean": mean, "sem": sem}
                if eps != "inf":
                    cell["ledger_epsilon"] = max(seed["ledger_epsilon"] for seed in seeds)
        margins = {n: cells[n]["inf"]["label_prior"]["mean"]
                   - max(cells[n]["inf"]["control"]["mean"], cells[n]["inf"]["wrong_prior"]["mean"]) for n in cells}
        out[training] = {"cells": cells, "margin_over_better_control": margins,
                         "informative": all(m >= SweepConfig.min_margin for m in margins.values())}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path, default=[Path("runs/main_seed0")],
                        help="sweep directories (privfl sweep --out DIR --seed S)")
    parser.add_argument("--sizes", type=lambda t: [int(v) for v in t.split(",")], default=[50, 500, 1000])
    parser.add_argument("--novel-epsilons", type=lambda t: [float(v) for v in t.split(",")], default=[1.0, 0.3])
    parser.add_argument("--repeats", type=int, default=3, help="noise draws per private release")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = {str(out): sweep_config(out) for out in args.runs}
    first = next(iter(configs.values()))
    x, y = held_out_pool(first.federation(), seed=first.seed)
    features = torch.from_numpy(map_inputs(load_stage(first.features, tuple(x.shape[1:])), x)) \
        if first.features else x.flatten(1)
    labels = torch.as_tensor(y)
    per_seed: dict[str, dict] = {}
    jobs = [(out, config, e) for out, config in configs.items() for e in config.train_epsilons]
    for out, config, epsilon in tqdm(jobs, desc="trainings"):
        if (config.features, config.dataset) != (first.features, first.dataset):
            raise ConfigError(f"{out} was made with other features or data than {next(iter(configs))}")
        cells = measure_training(config, Path(out), epsilon, features, labels, args.sizes,
                                 [None, *args.novel_epsilons], args.repeats)
        summary = RunDirectory(train_directory(Path(out), epsilon)).read_json(RunDirectory.SUMMARY)
        per_seed.setdefault(f"seed{config.seed}", {})[train_key(epsilon)] = {
            "run": str(train_directory(Path(out), epsilon)), "trained_numerics": summary.get("numerics"),
            "cells": cells}
    result = {"seeds": per_seed, "over_seeds": summarise(per_seed), "floor": FLOOR, "sizes": args.sizes,
              "novel_epsilons": args.novel_epsilons, "repeats": args.repeats,
              "command": " ".join(["benchmarks/descriptor_headroom.py", *sys.argv[1:]]), "numerics": numerics()}
    for training, row in result["over_seeds"].items():
        cells = row["cells"]
        print(f"training {training}: " + "; ".join(
            f"n={n}: " + ", ".join(f"{c} {cells[n]['inf'][c]['mean']:.2f}" for c in COLUMNS)
            + ", private " + ", ".join(f"eps {e} {cells[n][e]['label_prior']['mean']:.2f}"
                                       for e in cells[n] if e != "inf") for n in cells)
            + f"; informative: {row['informative']}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    update_json(args.results, lambda old: result)
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
