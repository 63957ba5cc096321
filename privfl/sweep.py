"""``privfl sweep``: train a method at several training-client privacy levels, then serve novel clients at several
novel-client privacy levels and dataset sizes: privacy against utility on both sides of the federation.

The privacy-utility experiment of the ODPFL-HN paper (Amosy et al., section 7), with the corrections of
docs/papers.md, ODPFL-HN, E2-E9, and with the training clients private too: train once per training epsilon, serve
fresh novel clients of nested sizes at every novel epsilon through the real protocol (each release in its ledger),
serve two controls built without the client's own descriptor, and report accuracy per (novel epsilon, n).

Entry points: :class:`SweepConfig`, :func:`run_sweep`; reporting with :func:`summarise_training`,
:func:`descriptor_margin`, :func:`smallest_size_without_loss`, :func:`format_table`, :func:`cross_table` and
:func:`plot_sweep`.

The five steps, the controls and the output files: docs/methods/hypernetworks.md, "The privacy-utility sweep".
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from privfl.config import RunConfig, build_client, run_federation
from privfl.data import FederationSpec, NovelClient
from privfl.errors import ConfigError, PrivflError
from privfl.evaluation.novel_pool import NovelPool, held_out_pool
from privfl.evaluation.report import epsilon_source, trust_model
from privfl.experiment import build_runtime, check_reusable, preflight, train_once
from privfl.federation import RunDirectory
from privfl.federation.rundir import SWEEP_MARK, dumps, to_json_safe
from privfl.methods import get_method
from privfl.metrics import mean_sem, score_model
from privfl.models.features import load_stage, map_inputs
from privfl.privacy.mechanisms import NoiseSource
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy
from privfl.provenance import numerics

#: ODPFL-HN settings of the sweep's trainings, the same for every training epsilon (so the rows differ by privacy
#: only). The networks are heads on a frozen ScatterNet feature stage (``SweepConfig.features``, Tramer and Boneh 2021:
#: 81 x 7 x 7 features, a linear target, 39,700 weights instead of the 2NN's 199,210). The encoder is the DP-ready
#: phi -> mean -> psi made so that the served model depends on the descriptor ("Making the descriptor matter" in
#: :mod:`privfl.methods.odpflhn`: phi, a hidden layer of 200 then a softmax over 32 prototypes, so the mean is a soft
#: histogram; psi the identity; standardised descriptors; noise-aware training at std 0.03), kept at its seeded
#: initialisation (``encoder_lr=0``: no encoder-gradient release, the privacy budget goes to the descriptor and the
#: weight change). The hypernetwork generates only the target's last bias (``generated="head_bias"``: a per-client
#: label prior read from the descriptor); the weights are one shared part moved by FedAvg's step from the mean
#: weight change (``shared_momentum`` 0.5), so record-level noise on them averages over the round's clients. Local
#: training is one DP-SGD-shaped step a round at a large batch (512 of a client's 1,020 records, lr 4, no momentum),
#: with the per-record clip 0.1 (``SweepConfig.train_clip``), the settings of Tramer and Boneh's ScatterNet models
#: (clip 0.1, large batches, large steps). How they were chosen, and what it cost, is in benchmarks/README.md ("ODPFL-HN
#: with private training clients"): on seed 0's training runs (their validation and own novel clients), and the
#: tuning's privacy cost is not accounted (Papernot and Steinke 2022); the main job's figures are on other data
#: (label mixes drawn from MNIST's test split) and seeds 1 and 2 confirm them.
DEFAULT_METHOD = {"encoder": "dp_deepset", "encoder_hidden": 32, "encoder_phi_hidden": 200, "encoder_clip": 1.0,
                  "encoder_sphere": False, "encoder_phi_head": "softmax", "encoder_psi": "identity",
                  "standardize_descriptors": True, "lr": 4.0, "local_steps": 1, "batch_size": 512,
                  "local_momentum": 0.0, "hn_lr": 0.1, "encoder_lr": 0.0, "train_mean_noise": 0.03,
                  "generated": "head_bias", "shared_momentum": 0.5}


#: The training-client epsilons of the main job (``None``: without DP): 1, 3 and 8 at delta 1e-5, and without DP.
TRAIN_EPSILONS: tuple[float | None, ...] = (1.0, 3.0, 8.0, None)

#: Rounds of each private training by default (``None``: as many as the non-private one, ``SweepConfig.rounds``).
#: With the feature stage and the generated bias every training runs the same 100 rounds: at training epsilon 8,
#: 100 rounds came within 1.3 points of the non-private training on seed 0 (200 rounds: 0.4 points, 1.6 times the
#: cost); the whole main job then stays under 10 minutes of one core.
PRIVATE_ROUNDS: int | None = None

#: Novel-client sizes of the default grid and of ``--full-grid``. With every training image a training client's, the
#: novel clients' images come from MNIST's 10,000 test images (892 of the rarest class): each of the 5 label mixes
#: takes 250 evaluation images and up to half the largest size from each of its 2 classes, so 1,000 is the largest
#: size that fits every class.
SIZES = (50, 500, 1000)
FULL_SIZES = (20, 50, 150, 500, 1000)


@dataclass(frozen=True)
class SweepConfig:
    """What a sweep trains and serves (defaults: ODPFL-HN on MNIST).

    ``method``: any registered method; ``method_config`` its settings (ODPFL-HN's default is
    :data:`DEFAULT_METHOD`). ``train_epsilons``: the training clients' record-level epsilon per training (``None``:
    without DP), with ``train_clip`` (per-record L2 clip) and ``min_samples`` (a public lower bound on each training
    client's size); ``private_rounds``: rounds of each private training (``None``: ``rounds``, as the non-private
    one; see :data:`PRIVATE_ROUNDS`). ``epsilons``: the novel clients' epsilons (the method's novel release; a method
    whose novel clients send nothing is served without one). ``delta`` is the delta of both sides. ``device``: where
    the trainings compute (:attr:`privfl.config.RunConfig.device`). ``features`` and ``model``: the frozen feature
    stage and the target on it (:attr:`privfl.config.RunConfig.features`). ``noise``: the training clients' noise
    source (``"secure"``; ``"seeded"`` from the sweep's seed, for reproducible checks such as the golden test, whose
    epsilons hold only against whoever does not know the seed).
    """

    dataset: str = "mnist"
    data_root: str | None = None
    source_options: dict[str, Any] = field(default_factory=dict)
    clients: int = 50
    shards_per_client: int = 2
    max_samples: int | None = None
    rounds: int = 100
    client_fraction: float = 0.2
    method: str = "odpflhn"
    method_config: dict[str, Any] | None = None
    train_epsilons: tuple[float | None, ...] = TRAIN_EPSILONS
    private_rounds: int | None = PRIVATE_ROUNDS
    train_clip: float = 0.1
    min_samples: int = 1020
    epsilons: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0)
    delta: float = 1e-5
    bound: float = 1.0
    sizes: tuple[int, ...] = SIZES
    novel_mixes: int = 5
    classes_per_client: int = 2
    eval_size: int = 500
    repeats: int = 2
    tolerance: float = 1.0
    min_margin: float = 2.0
    seed: int = 0
    device: str = "cpu"
    features: str | None = "scatter"
    model: str = "linear"
    noise: NoiseSource = "secure"

    def __post_init__(self) -> None:
        if self.method_config is None:
            object.__setattr__(self, "method_config", dict(DEFAULT_METHOD) if self.method == "odpflhn" else {})
        get_method(self.method)                       # an unknown method is named with the valid ones
        if not self.epsilons or any(not (isinstance(e, (int, float)) and math.isfinite(e) and e > 0)
                                    for e in self.epsilons):
            raise ConfigError(f"epsilons must be finite numbers > 0, got {list(self.epsilons)}")
        if not self.train_epsilons or any(e is not None and not (isinstance(e, (int, float)) and math.isfinite(e)
                                                                 and e > 0) for e in self.train_epsilons):
            raise ConfigError(f"train_epsilons must be finite numbers > 0 or None (no DP), got "
                              f"{list(self.train_epsilons)}")
        if len(set(self.train_epsilons)) != len(self.train_epsilons):
            raise ConfigError(f"train_epsilons lists a level twice: {list(self.train_epsilons)}")
        if not self.sizes or any(not isinstance(n, int) or n < 2 for n in self.sizes):
            raise ConfigError(f"sizes must be integers >= 2, got {list(self.sizes)}")
        for name in ("novel_mixes", "eval_size", "repeats", "classes_per_client", "clients", "rounds", "min_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.private_rounds is not None and (not isinstance(self.private_rounds, int) or self.private_rounds < 1):
            raise ConfigError(f"private_rounds must be an integer >= 1 or None (as rounds), got "
                              f"{self.private_rounds!r}")
        if self.novel_mixes < 2:
            raise ConfigError(f"novel_mixes must be >= 2: the control_other_mix control serves each mix another mix's "
                              f"model, and with {self.novel_mixes} mix it would be its own; got {self.novel_mixes}")
        if not (isinstance(self.min_margin, (int, float)) and math.isfinite(self.min_margin)):
            raise ConfigError(f"min_margin must be a finite number of accuracy points, got {self.min_margin!r}")
        if not (0 < self.delta < 1):
            raise ConfigError(f"delta must be a probability in (0, 1), got {self.delta!r}")
        assert self.method_config is not None   # filled in above
        if self.method == "odpflhn" and self.method_config.get("encoder", "dp_deepset") != "dp_deepset":
            raise ConfigError(f"a privacy sweep needs encoder='dp_deepset' (the only privatizable one), got "
                              f"{self.method_config['encoder']!r}")
        for epsilon in self.train_epsilons:
            self.run_config(epsilon)                  # every training's settings are checked before any runs

    @property
    def novel_release(self) -> bool:
        """Whether the method's novel clients release something the novel epsilons protect."""
        return get_method(self.method).novel_privacy is None

    def federation(self) -> FederationSpec:
        """Training clients from the train split (capped at ``max_samples``), 5 novel clients from the test split."""
        return FederationSpec(source=self.dataset, source_options=dict(self.source_options),
                              data_root=self.data_root, num_clients=self.clients,
                              partition="pathological", shards_per_client=self.shards_per_client, split="train_test",
                              novel_clients=5, max_samples=self.max_samples)

    def run_config(self, train_epsilon: float | None = None) -> RunConfig:
        """The training run at ``train_epsilon`` (record-level DP for every training client; ``None``: without)."""
        privacy = TrainingPrivacy() if train_epsilon is None else TrainingPrivacy(
            mode="record", epsilon=float(train_epsilon), delta=self.delta, clip=self.train_clip,
            min_samples=self.min_samples, noise=self.noise, noise_seed=self.seed if self.noise == "seeded" else 0)
        rounds = self.rounds if train_epsilon is None or self.private_rounds is None else self.private_rounds
        assert self.method_config is not None   # __post_init__ fills it in
        return RunConfig(federation=self.federation(), method=self.method, method_config=dict(self.method_config),
                         rounds=rounds, client_fraction=self.client_fraction, eval_every=max(1, rounds // 20),
                         checkpoint_every=max(1, rounds // 2), select="last", seed=self.seed, delta=self.delta,
                         privacy=privacy, novel_privacy=NovelPrivacy(delta=self.delta, bound=self.bound),
                         device=self.device, features=self.features, model=self.model)


def train_key(epsilon: float | None) -> str:
    """The key of a training in tables and file names: ``"inf"`` without DP, else the epsilon (``"8"``)."""
    return "inf" if epsilon is None else f"{epsilon:g}"


def train_directory(out: Path, epsilon: float | None) -> Path:
    return out / ("train" if epsilon is None else f"train-eps{epsilon:g}")


def claim(config: SweepConfig, out: Path, *, overwrite: bool) -> str | None:
    """Refuse, before anything is trained, an ``out`` that holds something this sweep would write over (a run, runs
    in subdirectories other than this sweep's trainings, a sweep of other settings, a training directory of this
    sweep holding another training: :func:`~privfl.experiment.check_reusable`), unless ``overwrite``; then mark
    ``out`` as this sweep's (:data:`~privfl.federation.rundir.SWEEP_MARK`). Returns what the claim created
    (``"folder"``, ``"mark"``, or ``None`` when ``out`` was this sweep's already), for :func:`release_claim`."""
    folder = RunDirectory(out)
    settings = json.loads(dumps(dataclasses.asdict(config)))
    ours = {train_directory(out, e).name: e for e in config.train_epsilons}
    if not overwrite:
        if folder.path(RunDirectory.CONFIG).exists():
            raise ConfigError(f"{out} holds a training run, not a sweep: choose another --out, or pass --overwrite")
        stored = folder.read_json(SWEEP_MARK) if folder.path(SWEEP_MARK).exists() else settings
        if stored != settings:
            changed = sorted(k for k in set(stored) | set(settings) if stored.get(k) != settings.get(k))
            raise ConfigError(f"{out} holds a sweep of other settings ({', '.join(changed)} differ): choose another "
                              "--out, or pass --overwrite to replace its results")
        others = sorted(child.name for child in (out.iterdir() if out.is_dir() else ())
                        if child.name not in ours and (child / RunDirectory.CONFIG).exists())
        if others:
            raise ConfigError(f"{out} holds runs in {', '.join(others)}, which are not this sweep's trainings "
                              f"({', '.join(ours)}): choose another --out, or pass --overwrite")
    for name, epsilon in ours.items():
        check_reusable(config.run_config(epsilon), RunDirectory(out / name), overwrite=overwrite)
    created = not out.exists()
    fresh = not folder.path(SWEEP_MARK).exists()
    out.mkdir(parents=True, exist_ok=True)
    folder.write_json(SWEEP_MARK, settings)
    return "folder" if created else "mark" if fresh else None


def release_claim(out: Path, config: SweepConfig) -> None:
    """Undo :func:`claim` for a sweep refused before any of its trainings recorded anything: its mark is removed
    (and ``out``, when the claim made it and it holds nothing else), so that the corrected command is not refused as
    another sweep's. A training that recorded a release, a metric or a result keeps the mark."""
    if any(RunDirectory(train_directory(out, e)).occupant() for e in config.train_epsilons):
        return
    for e in config.train_epsilons:
        directory = train_directory(out, e)
        if directory.is_dir():
            for name in RunDirectory.FILES:
                (directory / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()
    RunDirectory(out).path(SWEEP_MARK).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        out.rmdir()                            # only when empty: whatever else is there stays


def run_sweep(config: SweepConfig, out: str | Path, *, progress: bool = True, overwrite: bool = False
              ) -> dict[str, Any]:
    """Train, serve and report (see the module docstring); returns the JSON written to ``OUT/sweep.json``.
    ``out`` is claimed first (:func:`claim`): nothing is written over without ``overwrite``."""
    out = Path(out)
    started = time.perf_counter()
    held_out = held_out_pool(config.federation(), seed=config.seed)   # fails fast, before training, if there is none
    # the novel clients of every training: the same mixes, evaluation and descriptor sets
    pool = NovelPool(*held_out)
    rng = np.random.default_rng([config.seed, 2024])
    federation = run_federation(config.run_config(None), progress=progress)
    mixes = _label_mixes(federation.num_classes, config.classes_per_client, config.novel_mixes, rng)
    sets = []
    for mix in mixes:
        proportions = {c: 1.0 for c in mix}
        x_eval, y_eval = pool.draw(proportions, config.eval_size, rng)
        # nested descriptor sets: the first n of one draw of the largest size (labels are never used)
        x_all, _ = pool.draw(proportions, max(config.sizes), rng)
        sets.append((x_eval, y_eval, x_all))
    if config.features is not None:    # the novel clients' inputs pass through the run's feature stage too
        stage = load_stage(config.features, tuple(held_out[0].shape[1:]))
        sets = [(torch.from_numpy(map_inputs(stage, x_eval)), y_eval, torch.from_numpy(map_inputs(stage, x_all)))
                for x_eval, y_eval, x_all in sets]
    for epsilon in config.train_epsilons:           # every training's own checks and plan, before anything is written
        preflight(config.run_config(epsilon), federation)
    claimed = claim(config, out, overwrite=overwrite)   # after every check of the settings and pool, before training
    try:
        result = _train_and_serve(config, out, federation, mixes, sets, progress=progress, overwrite=overwrite)
    except PrivflError:
        if claimed:
            release_claim(out, config)              # refused before any training wrote a run: leave nothing behind
        raise
    result["wall_s"] = time.perf_counter() - started
    _write(out, config, result.pop("rows"), result)
    return result


def _train_and_serve(config: SweepConfig, out: Path, federation, mixes: list[list[int]], sets: list[tuple], *,
                     progress: bool, overwrite: bool) -> dict[str, Any]:
    trainings, rows = {}, []
    started = time.perf_counter()
    for epsilon in config.train_epsilons:
        run = config.run_config(epsilon)
        train_dir = train_directory(out, epsilon)
        began = time.perf_counter()
        # this very training: read back when finished, continued from its checkpoint when interrupted; another
        # training's directory only with overwrite (claim refused it otherwise)
        summary = train_once(run, str(train_dir), progress=progress, overwrite=overwrite)
        trained = _serve(config, run, federation, train_dir, mixes, sets, progress=progress)
        for row in trained:
            row["train_epsilon"] = train_key(epsilon)
        rows += trained
        trainings[train_key(epsilon)] = {
            "directory": str(train_dir), "train_wall_s": time.perf_counter() - began,
            "epsilon_max_training": summary["privacy"]["epsilon_max_training"],
            "training_mode": summary["privacy"].get("training_mode"),
            "relations": summary["privacy"].get("relations", []),
            "secure_aggregation": summary["privacy"].get("secure_aggregation"),
            "epsilon_source": epsilon_source(summary["privacy"]),
            "training_val_accuracy": summary["training_val"]["accuracy_mean"],
            "novel_accuracy": summary["novel"]["accuracy_mean"], "rounds": summary["rounds_completed"],
            "numerics": summary.get("numerics")}   # of the training process (it may be an earlier one)
    return {**_summarise(config, rows, trainings, time.perf_counter() - started), "rows": rows}


def _serve(config: SweepConfig, run: RunConfig, federation, train_dir: Path, mixes: list[list[int]],
           sets: list[tuple], *, progress: bool) -> list[dict]:
    """Serve every (mix, n, novel epsilon, repeat) with the trained server of ``train_dir``, and the controls."""
    # 1. the trained server, as the run left it (select="last": the final checkpoint)
    runtime = build_runtime(run, federation)
    checkpoint = RunDirectory(train_dir).load_checkpoint()
    if checkpoint is None:
        raise ConfigError(f"{train_dir} holds no checkpoint of the trained server to serve novel clients from")
    runtime.load_state_dict(checkpoint["runtime"])
    if not runtime.serves_novel_clients:
        return []                             # its novel clients need labels or training: the run reports training
    base_client = runtime.client
    levels: list[float | None] = [None, *sorted(config.epsilons)] if config.novel_release else [None]
    rows = []
    client_id = 10_000
    spent: dict[tuple, float] = {}
    clean_models: dict[tuple[int, int], Any] = {}
    bar = tqdm(total=len(mixes) * len(config.sizes) * (1 + (len(levels) - 1) * config.repeats),
               desc=f"serving novel clients (training {train_key(run.privacy.epsilon)})",
               disable=not progress, dynamic_ncols=True)
    for mix_index, mix in enumerate(mixes):
        x_eval, y_eval, x_all = sets[mix_index]
        for n in config.sizes:
            x = x_all[:n]
            for eps in levels:
                for repeat in range(config.repeats):
                    # 2. one novel client, the real protocol; its ledger records its release (if it makes one)
                    novel = NovelPrivacy(epsilon=eps, delta=config.delta, bound=config.bound, noise="seeded",
                                         noise_seed=repeat)
                    runtime.client = build_client(dataclasses.replace(run, novel_privacy=novel),
                                                  federation.input_shape, federation.num_classes,
                                                  len(federation.training_clients))
                    client_id += 1
                    model = runtime.novel_client_model(NovelClient(client_id, x))
                    score = score_model(model, x_eval, y_eval)
                    ledger = runtime.wire.ledgers.get(client_id)
                    events = () if ledger is None else ledger.events
                    if events not in spent:   # the same events give the same epsilon (PLD takes ~1 s)
                        spent[events] = 0.0 if ledger is None else ledger.spent(config.delta).epsilon
                    rows.append({"mix": mix_index, "classes": json.dumps(mix), "n": n,
                                 "epsilon": "inf" if eps is None else eps, "repeat": repeat,
                                 "descriptor": "clean" if eps is None else "private",
                                 "accuracy": 100.0 * score.accuracy, "ledger_epsilon": spent[events],
                                 "releases": 0 if ledger is None else len(ledger.records),
                                 "relation": "; ".join(runtime.wire.ledgers.relations([client_id])) or "-"})
                    bar.update(1)
                    if eps is None:
                        clean_models[mix_index, n] = model
                        break                        # no noise: repeats would be identical
    bar.close()
    runtime.client = base_client
    if run.method == "odpflhn":
        rows += _control_rows(runtime, mixes, config.sizes, [(x, y) for x, y, _ in sets], clean_models)
    return rows


#: The columns of ``sweep.csv``: one row per served model.
ROW_FIELDS = ["train_epsilon", "mix", "classes", "n", "epsilon", "repeat", "descriptor", "accuracy", "ledger_epsilon",
              "releases", "relation"]

#: The uninformative descriptors every mix is also served with (module docstring, step 4).
CONTROLS = ("control_mean_training", "control_other_mix")


def _control_rows(runtime, mixes: list[list[int]], sizes: tuple[int, ...], evaluation: list[tuple],
                  clean_models: dict[tuple[int, int], Any]) -> list[dict]:
    """Score every (mix, n) with the two control models: the hypernetwork's model for the mean of the training
    clients' last released descriptors, and the model served non-privately to the next mix at the same n."""
    strategy = runtime.strategy
    if not strategy.descriptors:
        raise ConfigError("the trained server holds no training descriptor to build the mean-descriptor control from")
    mean_descriptor = torch.stack([strategy.descriptors[k] for k in sorted(strategy.descriptors)]).mean(dim=0)
    mean_model = runtime.client.model_from(strategy.generated_weights(mean_descriptor))
    rows = []
    for mix_index, mix in enumerate(mixes):
        x_eval, y_eval = evaluation[mix_index]
        for n in sizes:
            other = clean_models[(mix_index + 1) % len(mixes), n]
            for name, model in zip(CONTROLS, (mean_model, other)):
                rows.append({"mix": mix_index, "classes": json.dumps(mix), "n": n, "epsilon": name, "repeat": 0,
                             "descriptor": name, "accuracy": 100.0 * score_model(model, x_eval, y_eval).accuracy,
                             "ledger_epsilon": float("nan"), "releases": 0, "relation": "-"})
    return rows


def _label_mixes(num_classes: int, per_client: int, count: int, rng: np.random.Generator) -> list[list[int]]:
    """``count`` label sets of ``per_client`` classes; consecutive sets use disjoint classes while classes last
    (a fresh permutation after that), so the held-out pool is shared as little as possible."""
    if per_client > num_classes:
        raise ConfigError(f"classes_per_client={per_client} exceeds the {num_classes} classes of the dataset")
    mixes: list[list[int]] = []
    order: list[int] = []
    while len(mixes) < count:
        if len(order) < per_client:
            order = rng.permutation(num_classes).tolist()
        mixes.append(sorted(order[:per_client]))
        order = order[per_client:]
    return mixes


def _summarise(config: SweepConfig, rows: list[dict], trainings: dict[str, dict], wall_s: float) -> dict:
    """Per training: mean +- SEM per (novel epsilon, n), the smallest n within ``tolerance`` of the non-private
    accuracy, the descriptor margin (ODPFL-HN) and the ledgers' largest epsilons (see :func:`summarise_training`)."""
    per_training = {key: summarise_training(config, [r for r in rows if r.get("train_epsilon", "inf") == key])
                    for key in trainings}
    for key, summary in per_training.items():
        summary["training"] = trainings[key]
    return {"config": {**dataclasses.asdict(config), "epsilons": list(config.epsilons),
                       "train_epsilons": [train_key(e) for e in config.train_epsilons],
                       "sizes": list(config.sizes)},
            "trainings": per_training, "tolerance_points": config.tolerance, "min_margin_points": config.min_margin,
            "wall_s": wall_s, "numerics": numerics()}   # of the serving process


def summarise_training(config: SweepConfig, rows: list[dict]) -> dict:
    """One training's novel-client table: mean +- SEM per (novel epsilon, n) and per control.

    The mixes are the independent units: a mix's repeats are averaged first, and the SEM is over the mix means
    (``count`` mixes; ``rows`` served models). Treating repeats as independent would shrink the SEM with noise draws
    that add no new evaluation or descriptor data."""
    levels = ["inf", *sorted(config.epsilons)] if config.novel_release else ["inf"]
    controls = [c for c in CONTROLS if any(r["epsilon"] == c for r in rows)]
    table: dict[str, dict[str, dict[str, float]]] = {}
    for level in [*levels, *controls]:     # a row's "epsilon" is one of these
        table[_key(level)] = {}
        for n in config.sizes:
            by_mix: dict[int, list[float]] = {}
            for r in rows:
                if r["epsilon"] == level and r["n"] == n:
                    by_mix.setdefault(r["mix"], []).append(r["accuracy"])
            mean, sem = mean_sem([float(np.mean(accs)) for accs in by_mix.values()])
            table[_key(level)][str(n)] = {"accuracy": mean, "sem": sem, "count": len(by_mix),
                                          "rows": sum(len(accs) for accs in by_mix.values())}
    smallest = {key: smallest_size_without_loss(cells, table["inf"], config.tolerance)
                for key, cells in table.items() if key != "inf" and key not in CONTROLS}
    summary = {"table": table, "smallest_n_without_loss": smallest,
               "ledger_epsilon_max": {key: max((r["ledger_epsilon"] for r in rows if _key(r["epsilon"]) == key),
                                               default=float("nan")) for key in table if key not in CONTROLS},
               # what the novel epsilons hold under, as the novel clients' ledgers record it
               "novel_relations": sorted({r["relation"] for r in rows if r.get("relation", "-") not in ("-", "")})}
    if controls:
        margin = descriptor_margin(table, tuple(controls))
        summary.update(descriptor_margin=margin,
                       descriptor_informative=all(m >= config.min_margin for m in margin.values()))
    return summary


def descriptor_margin(table: dict[str, dict[str, dict]], controls: tuple[str, ...] = CONTROLS) -> dict[str, float]:
    """Per n: the non-private accuracy minus the best control's (accuracy points). Near 0 means the served model
    does not depend on the client's descriptor, and then no privacy-utility conclusion can be drawn."""
    return {n: cell["accuracy"] - max(table[c][n]["accuracy"] for c in controls) for n, cell in table["inf"].items()}


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
    return epsilon if isinstance(epsilon, str) else f"{epsilon:g}"


def format_table(result: dict) -> str:
    """The privacy-utility tables as Markdown: one per training (rows novel epsilon, columns n, cells mean +- SEM
    accuracy %), then novel-client accuracy at the largest n across trainings."""
    labels = {"inf": "non-private", "control_mean_training": "control: mean training descriptor",
              "control_other_mix": "control: another mix's descriptor"}
    delta = result["config"]["delta"]
    blocks = []
    for key, training in result["trainings"].items():
        info = training["training"]
        spent = info["epsilon_max_training"]
        side = ("training clients without DP" if key == "inf" else
                f"training clients record-level DP, epsilon {key} (delta {delta:g}; largest spent "
                f"{_number(spent)})")
        head = (f"### {side}: validation accuracy {info['training_val_accuracy']:.2f}%, "
                f"{info['rounds']} rounds\n"
                f"training epsilons: relation {'; '.join(info.get('relations') or []) or '-'}, trust "
                f"{trust_model(info.get('training_mode'), info.get('secure_aggregation'))}, from "
                f"{info.get('epsilon_source') or 'summary.json'}; novel epsilons: relation "
                f"{'; '.join(training.get('novel_relations') or []) or '-'}, trust untrusted server (each novel client "
                "noises its own descriptor), from each novel client's ledger")
        cells_of = training["table"]
        if not cells_of.get("inf", {}) or all(math.isnan(c["accuracy"]) for c in cells_of["inf"].values()):
            blocks.append(head + "\n(no novel clients served: the method serves none)")
            continue
        sizes = list(next(iter(cells_of.values())))
        lines = [head, "", "| novel epsilon \\ n | " + " | ".join(sizes) + " | smallest n within "
                 f"{result['tolerance_points']:g} pt |", "|---" * (len(sizes) + 2) + "|"]
        for level, cells in cells_of.items():
            label = labels.get(level, level)
            smallest = "-" if level in labels else (training["smallest_n_without_loss"][level] or "none")
            lines.append(f"| {label} | " + " | ".join(_cell(c) for c in cells.values()) + f" | {smallest} |")
        if "descriptor_margin" in training:
            margins = ", ".join(f"{m:+.2f}" for m in training["descriptor_margin"].values())
            verdict = ("the descriptor matters" if training["descriptor_informative"] else
                       "VACUOUS: the served model barely depends on the descriptor, so this table says nothing "
                       "about the cost of privacy")
            lines.append(f"\nnon-private minus best control, per n: {margins} points (needed: >= "
                         f"{result['min_margin_points']:g} at every n): {verdict}")
        blocks.append("\n".join(lines))
    blocks.append(cross_table(result))
    return "\n\n".join(blocks)


def cross_table(result: dict) -> str:
    """Novel-client accuracy at the largest n: rows training epsilon, columns novel epsilon."""
    trainings = result["trainings"]
    largest = str(max(result["config"]["sizes"]))
    levels = [k for k in next(iter(trainings.values()))["table"] if k not in CONTROLS]
    lines = [f"### novel-client accuracy (%) at n = {largest}: training epsilon (rows) against novel epsilon",
             "", "| training \\ novel | " + " | ".join("non-private" if k == "inf" else k for k in levels) + " |",
             "|---" * (len(levels) + 1) + "|"]
    for key, training in trainings.items():
        cells = [training["table"].get(level, {}).get(largest) for level in levels]
        lines.append(f"| {'non-private' if key == 'inf' else key} | "
                     + " | ".join(_cell(c) if c else "-" for c in cells) + " |")
    return "\n".join(lines)


def _cell(c: dict) -> str:
    if math.isnan(c["accuracy"]):
        return "-"
    return f"{c['accuracy']:.2f} +- {c['sem']:.2f}" if math.isfinite(c["sem"]) else f"{c['accuracy']:.2f}"


def _number(value: Any) -> str:
    return "inf" if value in ("inf", math.inf) else f"{float(value):.3g}"


def _write(out: Path, config: SweepConfig, rows: list[dict], result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "sweep.json").write_text(json.dumps(to_json_safe(result), indent=2, default=str, allow_nan=False) + "\n")
    plot_sweep(result, out / "sweep.png")


def plot_sweep(result: dict, path: Path) -> Path:
    """Novel-client accuracy (+- SEM) against its size, one panel per training epsilon, one line per novel epsilon
    (log x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trainings = result["trainings"]
    fig, axes = plt.subplots(1, len(trainings), figsize=(4.5 * len(trainings), 4), sharey=True, squeeze=False)
    styles = {"inf": ("no privacy", "--", "black"),
              "control_mean_training": ("control: mean training descriptor", ":", "grey"),
              "control_other_mix": ("control: another mix's descriptor", "-.", "silver")}
    for ax, (key, training) in zip(axes[0], trainings.items(), strict=True):
        for level, cells in training["table"].items():
            sizes = [int(n) for n in cells]
            mean = np.array([c["accuracy"] for c in cells.values()])
            sem = np.nan_to_num(np.array([c["sem"] for c in cells.values()]))
            label, linestyle, color = styles.get(level, (f"novel epsilon = {level}", "-", None))
            ax.errorbar(sizes, mean, yerr=sem, marker="o", capsize=3, label=label, linestyle=linestyle, color=color)
        spent = training["training"]["epsilon_max_training"]
        ax.set(xscale="log", xlabel="novel client's samples n",
               title="training without DP" if key == "inf" else f"training epsilon {key} (spent {_number(spent)})")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("novel-client accuracy (%)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{result['config']['method']}: privacy of training and novel clients "
                 f"(delta = {result['config']['delta']:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["CONTROLS", "DEFAULT_METHOD", "TRAIN_EPSILONS", "SweepConfig", "cross_table", "descriptor_margin",
           "format_table", "plot_sweep", "run_sweep", "smallest_size_without_loss", "summarise_training"]
