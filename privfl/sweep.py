"""``privfl sweep``: train ODPFL-HN once, then serve novel clients at several privacy levels and dataset sizes.

The privacy-utility experiment of the ODPFL-HN paper (digest 5.4-5.5 and 7.7, with the corrections of 5.7):

1. **Train** ODPFL-HN on the federation with the DP-ready encoder (``dp_deepset``: phi clipped to the L2 ball of
   radius ``bound`` in training, mean pooling, psi), so the hypernetwork sees descriptors of the kind a private
   release produces. The run directory is ``OUT/train`` (a normal run: config, metrics, ledger, summary).
2. **Novel clients of chosen sizes.** ``novel_mixes`` label mixes are drawn (``classes_per_client`` random classes,
   equal weights, like the pathological training clients). For each mix an evaluation set of ``eval_size`` images and
   a descriptor set of the largest size are drawn, disjointly, from images no training client holds; the client of
   size n holds the first n images of the latter (nested sets)
   (:mod:`privfl.evaluation.novel_pool`; the federation caps its training pool at ``max_samples``).
3. **Serve.** For every (mix, n, epsilon, repeat) a fresh novel client runs the real protocol: encoder down, one
   descriptor release up (through :func:`privfl.privacy.privatize` at (epsilon, delta), replace-one, n public; or
   without privacy), generated model down. Each release is recorded in the client's ledger, and the epsilon the
   ledger reports is written beside the one asked for.
4. **Report.** Mean accuracy (+- SEM over mixes and repeats) per (epsilon, n), the smallest n from which every
   larger size is within ``tolerance`` points of the non-private accuracy at the same size, a printed table,
   ``sweep.csv``, ``sweep.json`` and ``sweep.png`` in ``OUT``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from privfl.data import FederationSpec, NovelClient, build_federation
from privfl.errors import ConfigError
from privfl.evaluation.metrics import mean_sem, score_model
from privfl.evaluation.novel_pool import NovelPool, held_out_pool
from privfl.experiment import RunConfig, build_runtime, train
from privfl.federation import RunDirectory

#: ODPFL-HN settings of the sweep's training run (DP-ready encoder, clipped phi; everything else the method's
#: defaults; phi on the unit sphere). A deeper, narrow phi keeps the noise (which lives in phi's output space) small.
#: The encoder learning rate is raised (0.5) because its averaged gradients are tiny (about 5e-3).
DEFAULT_METHOD = {"encoder": "dp_deepset", "encoder_hidden": 32, "encoder_phi_hidden": 200, "encoder_clip": 1.0,
                  "lr": 0.05, "local_steps": 10, "batch_size": 64, "hn_lr": 0.05, "encoder_lr": 0.5,
                  "train_mean_noise": 0.01}


@dataclass(frozen=True)
class SweepConfig:
    """What a sweep trains and serves (defaults: MNIST, about 5 minutes of training on one free core)."""

    dataset: str = "mnist"
    data_root: str | None = None
    clients: int = 50
    shards_per_client: int = 2
    max_samples: int = 20000
    rounds: int = 100
    client_fraction: float = 0.2
    method_config: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_METHOD))
    epsilons: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0)
    delta: float = 1e-5
    bound: float = 1.0
    sizes: tuple[int, ...] = (50, 150, 500, 1500, 5000)
    novel_mixes: int = 5
    classes_per_client: int = 2
    eval_size: int = 500
    repeats: int = 2
    tolerance: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.epsilons or any(not (isinstance(e, (int, float)) and math.isfinite(e) and e > 0)
                                    for e in self.epsilons):
            raise ConfigError(f"epsilons must be finite numbers > 0, got {list(self.epsilons)}")
        if not self.sizes or any(not isinstance(n, int) or n < 2 for n in self.sizes):
            raise ConfigError(f"sizes must be integers >= 2, got {list(self.sizes)}")
        for name in ("novel_mixes", "eval_size", "repeats", "classes_per_client", "clients", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not (0 < self.delta < 1):
            raise ConfigError(f"delta must be a probability in (0, 1), got {self.delta!r}")
        if self.method_config.get("encoder", "dp_deepset") != "dp_deepset":
            raise ConfigError(f"a privacy sweep needs encoder='dp_deepset' (the only privatizable one), got "
                              f"{self.method_config['encoder']!r}")

    def federation(self) -> FederationSpec:
        """Training clients from the train split (capped at ``max_samples``), 5 novel clients from the test split."""
        return FederationSpec(source=self.dataset, data_root=self.data_root, num_clients=self.clients,
                              partition="pathological", shards_per_client=self.shards_per_client, split="train_test",
                              novel_clients=5, max_samples=self.max_samples)

    def run_config(self) -> RunConfig:
        method_config = {**self.method_config, "novel_bound": self.bound, "novel_delta": self.delta}
        return RunConfig(federation=self.federation(), method="odpflhn", method_config=method_config,
                         rounds=self.rounds, client_fraction=self.client_fraction, eval_every=max(1, self.rounds // 5),
                         checkpoint_every=max(1, self.rounds // 2), select="last", seed=self.seed, delta=self.delta)


def run_sweep(config: SweepConfig, out: str | Path, *, progress: bool = True, overwrite: bool = False
              ) -> dict[str, Any]:
    """Train, serve and report (see the module docstring); returns the JSON written to ``OUT/sweep.json``."""
    out = Path(out)
    started = time.perf_counter()
    run = config.run_config()
    train_dir = out / "train"
    held_out = held_out_pool(run.federation, seed=run.seed)    # fails fast, before training, if there is none
    summary_path = train_dir / RunDirectory.SUMMARY
    reuse = summary_path.exists() and not overwrite and json.loads(
        (train_dir / RunDirectory.CONFIG).read_text()) == json.loads(json.dumps(run.to_dict()))
    if reuse:
        summary = json.loads(summary_path.read_text())
    else:
        summary = train(run, str(train_dir), overwrite=True, progress=progress)
    train_s = time.perf_counter() - started

    # 1. the trained server and client, as the run left them (select="last": the final checkpoint)
    federation = build_federation(run.federation, seed=run.seed)
    runtime = build_runtime(run, federation)
    runtime.load_state_dict(RunDirectory(train_dir).load_checkpoint()["runtime"])
    base_client = runtime.client

    # 2. novel clients from images no training client holds
    pool = NovelPool(*held_out)
    rng = np.random.default_rng([config.seed, 2024])
    mixes = _label_mixes(federation.num_classes, config.classes_per_client, config.novel_mixes, rng)
    levels: list[float | None] = [None, *sorted(config.epsilons)]
    rows = []
    client_id = 10_000
    spent: dict[tuple, float] = {}
    bar = tqdm(total=len(mixes) * len(config.sizes) * len(levels) * config.repeats, desc="serving novel clients",
               disable=not progress, dynamic_ncols=True)
    for mix_index, mix in enumerate(mixes):
        proportions = {c: 1.0 for c in mix}
        x_eval, y_eval = pool.draw(proportions, config.eval_size, rng)
        # the descriptor sets are nested: the first n of one draw of the largest size, with the mix's proportions
        # (the draw is stratified, so its prefixes follow them up to sampling noise); labels are never used
        x_all, _ = pool.draw(proportions, max(config.sizes), rng)
        for n in config.sizes:
            x = x_all[:n]
            for eps in levels:
                for repeat in range(config.repeats):
                    # 3. one novel client, the real protocol; its ledger records the single release
                    runtime.client = type(base_client)(model_factory=base_client.model_factory,
                                                       config=dataclasses.replace(base_client.config,
                                                                                  novel_epsilon=eps,
                                                                                  novel_noise="seeded",
                                                                                  novel_noise_seed=repeat))
                    client_id += 1
                    model = runtime.novel_client_model(NovelClient(client_id, x))
                    score = score_model(model, x_eval, y_eval)
                    ledger = runtime.wire.ledgers[client_id]
                    if ledger.events not in spent:   # the same events give the same epsilon (PLD takes ~1 s)
                        spent[ledger.events] = ledger.spent(config.delta).epsilon
                    rows.append({"mix": mix_index, "classes": json.dumps(mix), "n": n,
                                 "epsilon": "inf" if eps is None else eps, "repeat": repeat,
                                 "accuracy": 100.0 * score.accuracy,
                                 "ledger_epsilon": spent[ledger.events],
                                 "releases": len(ledger.records)})
                    bar.update(1)
                    if eps is None:
                        break                        # no noise: repeats would be identical
    bar.close()
    runtime.client = base_client
    result = _summarise(config, rows, summary, train_s, time.perf_counter() - started)
    _write(out, config, rows, result)
    return result


def _label_mixes(num_classes: int, per_client: int, count: int, rng: np.random.Generator) -> list[list[int]]:
    """``count`` label sets of ``per_client`` classes; consecutive sets use disjoint classes while classes last
    (a fresh permutation after that), so the held-out pool is shared as little as possible."""
    if per_client > num_classes:
        raise ConfigError(f"classes_per_client={per_client} exceeds the {num_classes} classes of the dataset")
    mixes, order = [], []
    while len(mixes) < count:
        if len(order) < per_client:
            order = rng.permutation(num_classes).tolist()
        mixes.append(sorted(order[:per_client]))
        order = order[per_client:]
    return mixes


def _summarise(config: SweepConfig, rows: list[dict], summary: dict, train_s: float, wall_s: float) -> dict:
    """Mean +- SEM per (epsilon, n) and the smallest n within ``tolerance`` of the non-private accuracy."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for eps in ["inf", *sorted(config.epsilons)]:
        key = _key(eps)
        table[key] = {}
        for n in config.sizes:
            accs = [r["accuracy"] for r in rows if r["epsilon"] == eps and r["n"] == n]
            mean, sem = mean_sem(accs)
            table[key][str(n)] = {"accuracy": mean, "sem": sem, "count": len(accs)}
    smallest = {}
    for key, cells in table.items():
        if key == "inf":
            continue
        smallest[key] = smallest_size_without_loss(cells, table["inf"], config.tolerance)
    return {"config": {**dataclasses.asdict(config), "epsilons": list(config.epsilons), "sizes": list(config.sizes)},
            "training": {"novel_accuracy": summary["novel"]["accuracy_mean"],
                         "training_val_accuracy": summary["training_val"]["accuracy_mean"],
                         "rounds": summary["rounds_completed"], "train_wall_s": train_s},
            "table": table, "smallest_n_without_loss": smallest, "tolerance_points": config.tolerance,
            "ledger_epsilon_max": {key: max((r["ledger_epsilon"] for r in rows if _key(r["epsilon"]) == key),
                                            default=float("nan")) for key in table},
            "wall_s": wall_s}


def smallest_size_without_loss(cells: dict[str, dict], clean: dict[str, dict], tolerance: float) -> int | None:
    """The smallest n from which every larger size is within ``tolerance`` points of the non-private accuracy at
    the same size (``None`` if the largest size is not)."""
    smallest = None
    for n in sorted(cells, key=int, reverse=True):
        if cells[n]["accuracy"] < clean[n]["accuracy"] - tolerance:
            break
        smallest = int(n)
    return smallest


def _key(epsilon: float | str) -> str:
    return "inf" if epsilon == "inf" else f"{epsilon:g}"


def format_table(result: dict) -> str:
    """The privacy-utility table as Markdown: rows epsilon, columns n, cells mean +- SEM accuracy (%)."""
    sizes = list(next(iter(result["table"].values())))
    lines = ["| epsilon \\ n | " + " | ".join(sizes) + " | smallest n within "
             f"{result['tolerance_points']:g} pt |", "|---" * (len(sizes) + 2) + "|"]
    for key, cells in result["table"].items():
        label = "non-private" if key == "inf" else key
        smallest = "-" if key == "inf" else (result["smallest_n_without_loss"][key] or "none")
        lines.append(f"| {label} | " + " | ".join(f"{c['accuracy']:.2f} +- {c['sem']:.2f}"
                                                  if math.isfinite(c["sem"]) else f"{c['accuracy']:.2f}"
                                                  for c in cells.values()) + f" | {smallest} |")
    return "\n".join(lines)


def _write(out: Path, config: SweepConfig, rows: list[dict], result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot_sweep(result, out / "sweep.png")


def plot_sweep(result: dict, path: Path) -> Path:
    """Accuracy (+- SEM) against the novel client's size, one line per epsilon (log x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, cells in result["table"].items():
        sizes = [int(n) for n in cells]
        mean = np.array([c["accuracy"] for c in cells.values()])
        sem = np.nan_to_num(np.array([c["sem"] for c in cells.values()]))
        label = "no privacy" if key == "inf" else f"epsilon = {key}"
        ax.errorbar(sizes, mean, yerr=sem, marker="o", capsize=3, label=label,
                    linestyle="--" if key == "inf" else "-", color="black" if key == "inf" else None)
    delta = result["config"]["delta"]
    ax.set(xscale="log", xlabel="novel client's samples n", ylabel="accuracy (%)",
           title=f"ODPFL-HN novel clients, private descriptor (delta = {delta:g})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["DEFAULT_METHOD", "SweepConfig", "format_table", "plot_sweep", "run_sweep", "smallest_size_without_loss"]
