"""``privfl attack reconstruct``: train (or reuse) a diffusion reconstructor and attack raw / FedPFT / DP-FedPFT
releases, beside decoder baselines, with per-image scores and bootstrap confidence intervals.

The protocol of the FedPFT paper, App. E: the attacker's images and the defenders' disjoint sets, the frozen
embedding, the reconstructor (:mod:`attacks.reconstructor`) and decoder baselines (:mod:`attacks.decoders`),
sampling settings chosen on held-out pairs, releases through each scheme (:mod:`attacks.schemes`), bootstrap
statistics (:mod:`attacks.statistics`) and the outputs in ``--out``. Entry points: :func:`reconstruct_main`,
:func:`build_parser`, :func:`run_reconstruction_attack`, :class:`AttackSettings`.

Presets: ``--preset quick`` (a few minutes on a laptop CPU), ``--preset benchmark`` and ``--preset reduced``; options
on the command line override the preset's. Example::

    privfl attack reconstruct --preset quick --out runs/attack-quick

The protocol step by step: docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attacks.decoders import DECODERS
from privfl.errors import ConfigError, PrivflError

__all__ = ["PRESETS", "AttackSettings", "build_parser", "format_markdown", "reconstruct_main",
           "run_reconstruction_attack", "save_grid", "save_metrics_plot", "settings_from_args"]

READINGS = ("post", "naive", "both")


@dataclass
class AttackSettings:
    """Every setting of one attack run (all saved in ``attack_results.json``).

    ``seed`` seeds everything the attacker trains (held-out split, reconstructor, decoders, sampling selection);
    ``seeds`` are the evaluation replicates: each draws its own disjoint defender set, release noise and samples.
    """

    out: str
    preset: str | None = None
    dataset: str = "mnist"
    data_root: str | None = None
    backbone: str = "mobilenet_v2"
    input_size: int = 64
    schemes: tuple[str, ...] = ("raw", "fedpft", "dp-fedpft")
    eps: tuple[float, ...] = (1.0, 4.0, 10.0)
    delta: float = 1e-5
    components: int = 10
    covariance: str = "diag"
    readings: str = "post"
    prior_covariance: str = "full"
    attacker_images: int | None = None
    defender_images: int = 500
    validation_images: int = 1000
    image_size: int = 28
    block_channels: tuple[int, ...] = (32, 64, 128)
    layers_per_block: int = 2
    mid_attention: bool = True
    condition_dims: int | None = None
    prediction_type: str = "v_prediction"
    steps: int = 8000
    batch_size: int = 32
    learning_rate: float = 3e-4
    cond_dropout: float = 0.1
    guidance: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    guidance_intervals: tuple[tuple[float, float], ...] = ((0.0, 1.0), (0.0, 0.5), (0.5, 1.0))
    guidance_rescales: tuple[float, ...] = (0.0, 0.7)
    init_strengths: tuple[float, ...] = (0.5, 0.8)
    selection_images: int = 256
    ddim_steps: int = 10
    samples_per_feature: int = 8
    set_samples_per_feature: int = 4
    one_step_draws: int = 8
    one_step_guidance: tuple[float, ...] = (1.0, 1.1, 1.25, 1.5)
    baselines: tuple[str, ...] = DECODERS
    guide_decoder: str | None = "knn"
    guide_folds: int = 5
    mlp_hidden: int = 1024
    mlp_epochs: int = 30
    tuned_epochs: int = 10
    random_features: int = 4096
    decoders_only: bool = False
    top_fractions: tuple[float, ...] = (0.05,)
    near_duplicate_fraction: float = 0.1
    bootstrap: int = 1000
    checkpoint: str | None = None
    init_weights: str | None = None
    checkpoint_every: int = 250
    train_only: bool = False
    device: str = "auto"
    precision: str = "auto"
    dp_noise: str = "seeded"
    seed: int = 0
    seeds: tuple[int, ...] = (0,)
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        from attacks.reconstructor import PRECISIONS, ReconstructorConfig, SamplingSettings, resolve_device
        from attacks.schemes import SCHEMES
        from privfl.privacy.mechanisms import NOISE_SOURCES

        bad = [s for s in self.schemes if s not in SCHEMES]
        if not self.schemes or bad:
            raise ConfigError(f"--schemes: unknown scheme(s) {bad or '(none given)'}; valid: {', '.join(SCHEMES)}")
        if "dp-fedpft" in self.schemes and not self.eps:
            raise ConfigError("--eps: scheme dp-fedpft needs at least one epsilon, e.g. --eps 1,4,10")
        if any(not math.isfinite(e) or e <= 0 for e in self.eps):
            raise ConfigError(f"--eps: every epsilon must be a finite number > 0, got {list(self.eps)}")
        if self.covariance not in ("full", "diag", "spherical"):
            raise ConfigError(f"--covariance must be full, diag or spherical, got {self.covariance!r}")
        if self.readings not in READINGS:
            raise ConfigError(f"--readings must be one of {', '.join(READINGS)}, got {self.readings!r}")
        if self.prior_covariance not in ("full", "diag"):
            raise ConfigError(f"--prior-covariance must be full or diag, got {self.prior_covariance!r}")
        resolve_device(self.device)  # cuda without CUDA is an error here, before any work
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta must be in (0, 1), got {self.delta}")
        for name in ("defender_images", "steps", "batch_size", "ddim_steps", "components", "checkpoint_every",
                     "input_size", "selection_images", "mlp_hidden", "mlp_epochs", "layers_per_block",
                     "tuned_epochs", "random_features"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")
        if self.attacker_images is not None and self.attacker_images < 2:
            raise ConfigError(f"--attacker-images must be an integer >= 2 or 'all', got {self.attacker_images}")
        if isinstance(self.one_step_draws, bool) or not isinstance(self.one_step_draws, int) \
                or self.one_step_draws < 0:
            raise ConfigError(f"--one-step-draws must be an integer >= 0 (noise draws the one-step posterior mean "
                              f"averages; 0: not scored), got {self.one_step_draws!r}")
        if self.one_step_draws and self.prediction_type == "epsilon":
            raise ConfigError("--one-step-draws needs --prediction-type v_prediction (an eps-prediction gives the "
                              "one-step x_0 only by dividing by sqrt(abar_T), about 0); use v_prediction or "
                              "--one-step-draws 0")
        for name in ("samples_per_feature", "set_samples_per_feature"):
            if getattr(self, name) < 2:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 2 (the attacker selection and the medoid "
                                  f"compare samples), got {getattr(self, name)}")
        if self.image_size < 11:
            raise ConfigError(f"--image-size must be >= 11 (SSIM's 11 x 11 window), got {self.image_size}")
        if not self.top_fractions or any(not 0 < f <= 1 for f in self.top_fractions):
            raise ConfigError(f"--top-fractions must be fractions in (0, 1], got {list(self.top_fractions)}")
        if not 0 <= self.near_duplicate_fraction < 1:
            raise ConfigError(f"--near-duplicate-fraction must be in [0, 1), got {self.near_duplicate_fraction}")
        if not self.guidance or any(not math.isfinite(w) or w < 0 for w in self.guidance):
            raise ConfigError(f"--guidance must be one or more finite scales >= 0, got {list(self.guidance)}")
        if not self.one_step_guidance or any(not math.isfinite(w) or w < 0 for w in self.one_step_guidance):
            raise ConfigError(f"--one-step-guidance must be one or more finite scales >= 0, got "
                              f"{list(self.one_step_guidance)}")
        for interval in self.guidance_intervals:
            SamplingSettings(guidance_interval=interval)   # its error names the bad interval
        for phi in self.guidance_rescales:
            SamplingSettings(guidance_rescale=phi)
        for s in self.init_strengths:
            SamplingSettings(init_strength=s)
        if self.validation_images < 1:
            raise ConfigError(f"--validation-images must be >= 1 (held-out attacker pairs choose the sampling "
                              f"settings and the decoders' hyperparameters), got {self.validation_images}")
        if self.attacker_images is not None and self.validation_images >= self.attacker_images:
            raise ConfigError(f"--validation-images ({self.validation_images}) must leave training pairs out of "
                              f"--attacker-images ({self.attacker_images})")
        bad = [b for b in self.baselines if b not in DECODERS]
        if bad:
            raise ConfigError(f"--baselines: unknown baseline(s) {bad}; valid: {', '.join(DECODERS)}")
        if self.decoders_only and not self.baselines:
            raise ConfigError("--decoders-only needs at least one decoder in --baselines")
        if self.guide_decoder not in GUIDE_DECODERS:
            raise ConfigError(f"--guide-decoder must be knn, nn, mlp, mlp-tuned or none (decoders with a "
                              f"leave-one-out or out-of-fold estimate for the training pairs), got "
                              f"{self.guide_decoder!r}")
        if self.guide_folds < 2:
            raise ConfigError(f"--guide-folds must be >= 2 (the cross-fitted MLPs of --guide-decoder mlp), got "
                              f"{self.guide_folds}")
        if self.init_weights is not None and not Path(self.init_weights).is_file():
            raise ConfigError(f"--init-weights {self.init_weights!r} is not a file (a reconstructor checkpoint or "
                              f"exported weights)")
        if self.bootstrap < 100:
            raise ConfigError(f"--bootstrap must be >= 100 resamples, got {self.bootstrap}")
        if self.dp_noise not in NOISE_SOURCES:
            raise ConfigError(f"--dp-noise must be one of {', '.join(NOISE_SOURCES)}, got {self.dp_noise!r}")
        if self.condition_dims is not None and self.condition_dims < 1:
            raise ConfigError(f"--condition-dims must be an integer >= 1 or none, got {self.condition_dims}")
        if not self.seeds or any(s < 0 for s in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"--seeds must be distinct integers >= 0, got {list(self.seeds)}")
        ReconstructorConfig(feature_dim=max(1, self.condition_dims or 1), image_size=self.image_size,
                            block_channels=self.block_channels, layers_per_block=self.layers_per_block,
                            batch_size=self.batch_size, learning_rate=self.learning_rate,
                            cond_dropout=self.cond_dropout, mid_attention=self.mid_attention,
                            condition_dims=self.condition_dims, prediction_type=self.prediction_type,
                            guide_image=self.guide_decoder is not None)
        # (its errors name the setting, before any work)


#: What ``--guide-decoder`` accepts (``None``: no estimate read).
GUIDE_DECODERS = (None, "knn", "nn", "mlp", "mlp-tuned")

#: Settings each preset changes (everything else keeps the defaults of :class:`AttackSettings`).
PRESETS: dict[str, dict[str, Any]] = {
    # A small end-to-end run: every row, table, CSV and figure, a few minutes on one CPU thread; the numbers show
    # the protocol works, not what the attack can do.
    "quick": dict(attacker_images=2000, validation_images=100, defender_images=150, seeds=(0,),
                  block_channels=(16, 32, 32), layers_per_block=1, steps=200, batch_size=32, learning_rate=1e-3,
                  guidance=(1.0, 2.0), guidance_intervals=((0.0, 1.0),), guidance_rescales=(0.0,),
                  init_strengths=(0.6,), selection_images=50, ddim_steps=4, samples_per_feature=4,
                  set_samples_per_feature=2, mlp_hidden=256, mlp_epochs=5, tuned_epochs=3, random_features=512,
                  top_fractions=(0.15,), bootstrap=200),
    # benchmarks/attack_mnist.py: all 60,000 MNIST training images for the attacker (1,000 held out), three
    # disjoint defender sets of 500 test images, the 28 px UNet (32-64-128, two blocks per level) for 8,000 steps
    # (about two hours on one CPU thread in bfloat16 autocast; minutes on a GPU).
    "benchmark": dict(attacker_images=None, validation_images=1000, defender_images=500, seeds=(0, 1, 2),
                      precision="bf16"),
    # The benchmark's attacker, reconstructor and checkpoint (the same training data and model: a trained
    # benchmark checkpoint is reused) with an evaluation about five times cheaper: three disjoint defender sets of
    # 250 images, 4 / 2 samples per raw / mixture feature, three sampling candidates on 128 held-out pairs, the MLP
    # decoder for at most 15 epochs; about 25 minutes of one CPU thread once the reconstructor is trained.
    "reduced": dict(attacker_images=None, validation_images=1000, defender_images=250, seeds=(0, 1, 2),
                    precision="bf16", samples_per_feature=4, set_samples_per_feature=2, guidance=(1.0, 1.5),
                    guidance_intervals=((0.5, 1.0),), guidance_rescales=(0.0,), init_strengths=(0.5,),
                    selection_images=128, mlp_epochs=15, top_fractions=(0.05, 0.1)),
}


# -- data -----------------------------------------------------------------------------------------------------------

@dataclass
class AttackData:
    """The attacker's pairs and the defender pools of one run (images on [0, 1] at the reconstruction size)."""

    attacker_images: torch.Tensor
    attacker_labels: np.ndarray
    attacker_features: torch.Tensor
    held_out: torch.Tensor
    train: torch.Tensor
    defender_images: dict[int, torch.Tensor]
    defender_labels: dict[int, np.ndarray]
    defender_features: dict[int, torch.Tensor]
    defender_indices: dict[int, np.ndarray]
    num_classes: int
    attacker_split: str
    defender_split: str


def _resize(images: np.ndarray, size: int) -> torch.Tensor:
    x = torch.as_tensor(images, dtype=torch.float32)
    if tuple(x.shape[2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                                            antialias=True)
    return x.clamp(0, 1)


def _embed(settings: AttackSettings, images: np.ndarray, name: str) -> torch.Tensor:
    from attacks.schemes import unit_features
    from privfl.models.backbones import extract_features, load_backbone

    options = {"input_size": settings.input_size} if settings.backbone == "mobilenet_v2" else {}
    backbone = load_backbone(settings.backbone, **options)
    return unit_features(lambda x: extract_features(backbone, x, dataset=name, progress=settings.progress))(images)


def load_attack_data(settings: AttackSettings) -> AttackData:
    """The attacker's pairs (with the held-out split) and one defender set per evaluation seed (protocol 1-3)."""
    from privfl.data import load_source

    source = load_source(settings.dataset, data_root=settings.data_root)
    if len(source.input_shape) != 3:
        raise ConfigError(f"dataset {settings.dataset!r} holds vectors {source.input_shape}, not images; the "
                          "reconstruction attack needs an image source (e.g. mnist)")
    if source.test is not None:
        attacker_pool, defender_pool = source.train, source.test
        a_all, d_all = np.arange(len(attacker_pool.x)), np.arange(len(defender_pool.x))
        splits = ("training split", "test split")
    else:  # two disjoint halves of the only split
        attacker_pool = defender_pool = source.train
        order = np.random.default_rng([settings.seed, 1]).permutation(len(source.train.x))
        a_all, d_all = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2:])
        splits = ("first half of the only split", "second half")
    whole = settings.attacker_images is None or settings.attacker_images >= len(a_all)
    if settings.attacker_images is not None and settings.attacker_images > len(a_all):
        raise ConfigError(f"--attacker-images {settings.attacker_images}: {settings.dataset} has {len(a_all)} "
                          f"attacker images (use 'all')")
    a_idx = a_all if whole else np.sort(np.random.default_rng(settings.seed).permutation(a_all)[
        :settings.attacker_images])
    blocks = max(settings.seeds) + 1
    if blocks * settings.defender_images > len(d_all):
        raise ConfigError(f"--seeds {list(settings.seeds)} x --defender-images {settings.defender_images} need "
                          f"{blocks * settings.defender_images} disjoint defender images; {settings.dataset} has "
                          f"{len(d_all)}")
    permutation = np.random.default_rng([settings.seed, 3]).permutation(d_all)
    d_idx = {s: np.sort(permutation[s * settings.defender_images:(s + 1) * settings.defender_images])
             for s in settings.seeds}
    xa = np.asarray(attacker_pool.x[a_idx])
    tag = "all" if whole else f"{len(a_idx)}-seed{settings.seed}"
    features_a = _embed(settings, xa, f"{settings.dataset}-train-{tag}")
    union = np.sort(np.concatenate(list(d_idx.values())))
    features_union = _embed(settings, np.asarray(defender_pool.x[union]),
                            f"{settings.dataset}-test-{len(union)}-seed{settings.seed}")
    position = {int(i): k for k, i in enumerate(union)}
    order = np.random.default_rng([settings.seed, 2]).permutation(len(xa))
    if settings.validation_images >= len(xa):
        raise ConfigError(f"--validation-images ({settings.validation_images}) must leave training pairs out of the "
                          f"{len(xa)} attacker images")
    defender_images, defender_labels, defender_features = {}, {}, {}
    for s, idx in d_idx.items():
        rows = torch.as_tensor([position[int(i)] for i in idx])
        defender_images[s] = _resize(np.asarray(defender_pool.x[idx]), settings.image_size)
        defender_labels[s] = np.asarray(defender_pool.y[idx])
        defender_features[s] = features_union[rows]
    return AttackData(
        attacker_images=_resize(xa, settings.image_size), attacker_labels=np.asarray(attacker_pool.y[a_idx]),
        attacker_features=features_a, held_out=torch.as_tensor(np.sort(order[:settings.validation_images])),
        train=torch.as_tensor(np.sort(order[settings.validation_images:])), defender_images=defender_images,
        defender_labels=defender_labels, defender_features=defender_features, defender_indices=d_idx,
        num_classes=source.num_classes, attacker_split=splits[0], defender_split=splits[1])


def reconstructor_config(settings: AttackSettings, feature_dim: int, channels: int) -> Any:
    from attacks.reconstructor import ReconstructorConfig

    return ReconstructorConfig(feature_dim=feature_dim, image_size=settings.image_size, channels=channels,
                               block_channels=settings.block_channels, layers_per_block=settings.layers_per_block,
                               mid_attention=settings.mid_attention, condition_dims=settings.condition_dims,
                               prediction_type=settings.prediction_type, batch_size=settings.batch_size,
                               learning_rate=settings.learning_rate, cond_dropout=settings.cond_dropout,
                               guide_image=settings.guide_decoder is not None)


# -- output ---------------------------------------------------------------------------------------------------------

_COLUMNS = ("source", "attack", "estimate", "epsilon", "level", "selection", "top", "seed", "n", "ground_truth",
            "psnr", "psnr_low", "psnr_high", "lpips", "lpips_low", "lpips_high", "ssim", "ssim_low", "ssim_high",
            "set_size")
_SCORE_COLUMNS = ("seed", "source", "epsilon", "attack", "estimate", "level", "unit", "index", "matched",
                  "defender_image", "psnr", "lpips", "ssim", "confidence")
#: How the tables and figures name each attack.
ATTACK_NAMES = {"diffusion": "diffusion", "ridge": "ridge decoder", "mlp": "MLP decoder", "knn": "kNN average",
                "nn": "nearest attacker image by feature", "class-mean": "class-mean image",
                "mlp-tuned": "tuned MLP decoder", "conv": "convolutional decoder",
                "mlp-ensemble": "MLP seed ensemble", "random-features": "random-features ridge",
                "nearest image by SSIM": "nearest attacker image by SSIM (oracle)"}


def _eps(value: Any) -> str:
    value = math.inf if value == "inf" else float(value)
    return "∞" if math.isinf(value) else "0 (ignored)" if value == 0 else f"{value:.3g}"


def _cell(row: Any, metric: str) -> str:
    digits = 2 if metric == "psnr" else 3
    value, low, high = (getattr(row, metric), *row.interval(metric)) if hasattr(row, "interval") else (
        row[metric], row[f"{metric}_low"], row[f"{metric}_high"])
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def format_markdown(rows: Sequence[Any]) -> str:
    """The table in the paper's layout (PSNR up, LPIPS down, SSIM up, each with its 95 % bootstrap interval), with
    the attack, its estimate, the row's level, seed and which rows use the defender's images (ground truth) to match
    or select; epsilon is the ledger's."""
    lines = ["| source | attack | estimate | ε (ledger) | level | selection | top | seed | n | ground truth used | "
             "PSNR ↑ [95% CI] | LPIPS ↓ [95% CI] | SSIM ↑ [95% CI] | set size |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        get = r.__getitem__ if isinstance(r, dict) else functools.partial(getattr, r)
        lines.append(f"| {get('source')} | {ATTACK_NAMES.get(get('attack'), get('attack'))} | {get('estimate')} | "
                     f"{_eps(get('epsilon'))} | {get('level')} | {get('selection')} | {get('top')} | {get('seed')} | "
                     f"{get('n')} | {get('ground_truth')} | {_cell(r, 'psnr')} | {_cell(r, 'lpips')} | "
                     f"{_cell(r, 'ssim')} | {get('set_size')} |")
    return "\n".join(lines) + "\n"


def save_grid(path: Path, panels: Sequence[tuple[str, torch.Tensor]], columns: int = 10,
              title: str = "defender images (top row) and what each attacker shows for them") -> Path:
    """A PNG with one row per panel (name, ``[n, C, H, W]`` images on [0, 1]) and ``columns`` images per row.

    The images are tiled into one mosaic (one ``imshow``, a 1-pixel white border around each image) so the file is
    quick to write however many panels there are.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(columns, min(len(images) for _, images in panels))
    c, h, w = panels[0][1].shape[1:]
    pad = 1
    mosaic = np.ones((len(panels) * (h + pad) + pad, columns * (w + pad) + pad, 3))
    for row, (_, images) in enumerate(panels):
        for col in range(columns):
            image = images[col].clamp(0, 1).numpy()
            image = np.repeat(image, 3, axis=0) if image.shape[0] == 1 else image
            top, left = pad + row * (h + pad), pad + col * (w + pad)
            mosaic[top:top + h, left:left + w] = image.transpose(1, 2, 0)
    scale = 0.06  # inches per pixel
    fig, ax = plt.subplots(figsize=(mosaic.shape[1] * scale + 3.0, mosaic.shape[0] * scale + 0.6))
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([pad + row * (h + pad) + h / 2 for row in range(len(panels))])
    ax.set_yticklabels([name for name, _ in panels], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")   # the whole row labels, however long
    plt.close(fig)
    return path


def _plot_groups(rows: Sequence[Any]) -> tuple[list[str], list[tuple[str, str]], dict]:
    """The "all" rows of the pooled seed scope by (column, attack + estimate)."""
    seeds = {r.seed for r in rows}
    scope = "all" if "all" in seeds else sorted(seeds)[0]
    columns: list[str] = []
    series: list[tuple[str, str]] = []
    cells = {}
    for r in rows:
        if r.seed != scope or r.selection != "all":
            continue
        column = f"{r.source}\n(per feature)" if r.level == "per-feature" else r.source
        if r.level == "set-level" and not math.isinf(r.epsilon) and r.epsilon > 0:
            column = f"{r.source}\nε {r.epsilon:.3g}"
        column = column.replace(", post-processed", "").replace(" (release ignored)", "")
        if r.level == "set-level":
            column += "\n(oracle-matched)"
        if column not in columns:
            columns.append(column)
        name = (ATTACK_NAMES.get(r.attack, r.attack), r.estimate.split(" of ")[0])
        if name not in series:
            series.append(name)
        cells[(column, name)] = r
    return columns, series, cells


def save_metrics_plot(path: Path, rows: Sequence[Any], title: str = "") -> Path:
    """Each metric per release (x) and attack (markers), the *all* rows with their 95 % bootstrap intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns, series, cells = _plot_groups(rows)
    metrics = (("psnr", "PSNR (dB) ↑"), ("lpips", "LPIPS ↓"), ("ssim", "SSIM ↑"))
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8.0, 1.25 * len(columns) + 3), 9.5), sharex=True)
    markers = "osD^v<>ph*X"
    width = 0.8 / max(1, len(series))
    for ax, (metric, label) in zip(axes, metrics):
        for j, name in enumerate(series):
            xs, ys, lo, hi = [], [], [], []
            for i, column in enumerate(columns):
                r = cells.get((column, name))
                if r is None:
                    continue
                low, high = r.interval(metric)
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(getattr(r, metric))
                lo.append(getattr(r, metric) - low)
                hi.append(high - getattr(r, metric))
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=markers[j % len(markers)], ms=4, capsize=2, lw=1,
                        label=name[0] if name[1] == "-" else f"{name[0]} ({name[1]})")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(columns)))
    axes[-1].set_xticklabels(columns, fontsize=7)
    axes[0].legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, 1.45))
    if title:
        fig.suptitle(title, fontsize=9, y=0.995)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# -- the run --------------------------------------------------------------------------------------------------------

def _releases(settings: AttackSettings, features_d: torch.Tensor, yd: np.ndarray, num_classes: int, prior: Any,
              seed: int) -> list[Any]:
    """Every release the run attacks, in table order: raw; FedPFT; DP-FedPFT per epsilon (largest first), each
    mixture release read as ``settings.readings`` says; then the prior-only reading of DP-FedPFT."""
    from attacks.schemes import make_release, postprocess_release, prior_only_release

    releases, prior_only = [], None
    for scheme in settings.schemes:
        if scheme == "raw":
            releases.append(make_release("raw", features_d, yd, num_classes=num_classes, delta=settings.delta))
            continue
        for eps in (sorted(settings.eps, reverse=True) if scheme == "dp-fedpft" else (None,)):
            release = make_release(scheme, features_d, yd, num_classes=num_classes, epsilon=eps,
                                   delta=settings.delta, components=settings.components,
                                   covariance=settings.covariance, seed=seed, dp_noise=settings.dp_noise)
            if settings.readings in ("naive", "both"):
                releases.append(release)
            if settings.readings in ("post", "both"):
                releases.append(postprocess_release(release, prior, seed=seed))
            if scheme == "dp-fedpft" and prior_only is None:
                prior_only = prior_only_release(release, prior, seed=seed)
    return releases + ([prior_only] if prior_only is not None else [])


def _sampling_candidates(settings: AttackSettings) -> list[Any]:
    from attacks.reconstructor import SamplingSettings

    out = []
    for w in settings.guidance:
        variants = [((0.0, 1.0), 0.0)] if w == 1.0 else [(i, phi) for i in settings.guidance_intervals
                                                         for phi in settings.guidance_rescales]
        for interval, phi in variants:
            candidate = SamplingSettings(guidance_scale=w, guidance_interval=interval, guidance_rescale=phi,
                                         num_inference_steps=settings.ddim_steps)
            if candidate not in out:
                out.append(candidate)
    return out


def _device_info(device: torch.device, reconstructor: Any) -> dict[str, Any]:
    info = {"device": str(device), "precision": reconstructor.precision_name, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _write_csv(path: Path, columns: Sequence[str], records: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)


def _choose_sampling(settings: AttackSettings, reconstructor: Any, features: torch.Tensor, images: torch.Tensor,
                     labels: np.ndarray, init_decoder: Any, guide_decoder: Any,
                     held_guides: dict[str, torch.Tensor]) -> tuple[Any, list, list, float, list]:
    """Sampling settings from the attacker's held-out pairs (protocol 5): guidance first, then decoder-guided
    initialisation, then the one-step posterior mean's guidance scale. Returns ``(chosen, guidance scores, init
    scores, one-step w, one-step scores)``."""
    from attacks.reconstructor import select_one_step_guidance, select_sampling

    best, guidance_scores = select_sampling(reconstructor, features, images, _sampling_candidates(settings),
                                            seed=settings.seed, progress=settings.progress, **held_guides)
    init_scores: list[dict[str, Any]] = []
    if init_decoder is not None and settings.init_strengths:
        candidates = [best] + [replace(best, init_strength=s) for s in settings.init_strengths]
        best, init_scores = select_sampling(reconstructor, features, images, candidates,
                                            init=held_guides["guide"] if init_decoder is guide_decoder else
                                            init_decoder.decode(features, labels), seed=settings.seed,
                                            progress=settings.progress, **held_guides)
    one_step_w = 1.0
    one_step_scores: list[dict[str, Any]] = []
    if settings.one_step_draws:
        one_step_w, one_step_scores = select_one_step_guidance(
            reconstructor, features, images, settings.one_step_guidance, draws=settings.one_step_draws,
            seed=settings.seed, **held_guides)
    return best, guidance_scores, init_scores, one_step_w, one_step_scores


def run_reconstruction_attack(settings: AttackSettings, *, command: str | None = None) -> dict[str, Any]:
    """Run the whole attack (see the module docstring); returns the JSON-able summary it also writes. ``command``
    (how this run was started) is recorded in the summary and, when this run trains the reconstructor, in its
    checkpoint, so exported weights name the command that made them."""
    from attacks.decoders import cross_fitted, fit_decoders, make_decoder
    from attacks.metrics import LPIPS
    from attacks.reconstructor import file_sha256, resolve_device, train_or_resume
    from attacks.schemes import (
        AttackerPrior,
        evaluate_decoder,
        evaluate_release,
        feature_diagnostics,
        nearest_image_baseline,
        rows_from_scores,
    )
    from attacks.selection import near_duplicate_filter, nearest

    settings.validate()
    device = resolve_device(settings.device)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    wall = time.perf_counter()
    lpips = LPIPS(device=device)  # fail early (missing weights) before any training

    started = time.perf_counter()
    data = load_attack_data(settings)
    fa, xa, ya = data.attacker_features, data.attacker_images, data.attacker_labels
    train, held = data.train, data.held_out
    timings["data_and_features_s"] = time.perf_counter() - started

    options: dict[str, Any] = dict(seed=settings.seed, device=device, mlp_hidden=settings.mlp_hidden,
                                   mlp_epochs=settings.mlp_epochs, tuned_epochs=settings.tuned_epochs,
                                   random_features=settings.random_features, progress=settings.progress)
    guide_decoder, guides = None, None
    if settings.guide_decoder is not None and not settings.decoders_only:
        # The reconstructor reads this decoder's estimate of each image; a training pair's estimate leaves the pair
        # out, as a defender's feature never finds its own image among the attacker's.
        started, cpu = time.perf_counter(), time.process_time()
        pairs = (fa[train], xa[train], ya[train], fa[held], xa[held], ya[held])
        if settings.guide_decoder == "mlp-tuned":
            # the tuned MLP's grid, then its chosen configuration again with the cross-fitted fold models
            tuned = make_decoder("mlp-tuned", **options).fit(*pairs)
            guide_decoder = cross_fitted(tuned.decoder, settings.guide_folds, name="mlp-tuned").fit(*pairs)
            guide_decoder.details = {**tuned.details, **guide_decoder.details}
        else:
            folds = settings.guide_folds if settings.guide_decoder == "mlp" else 0
            guide_decoder = make_decoder(settings.guide_decoder, **options, mlp_folds=folds).fit(*pairs)
        guide_decoder.details["cpu_s"] = time.process_time() - cpu
        guides = guide_decoder.decode(fa[train], exclude=np.arange(len(train)))
        timings["guide_decoder_s"] = time.perf_counter() - started
    reconstructor = None
    if settings.decoders_only:   # no diffusion reconstructor: the decoders alone, on the same images and metrics
        summary: dict[str, Any] = {
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
            "device": {"device": str(device), "precision": "float32", "torch": torch.__version__,
                       "threads": torch.get_num_threads()},
            "reconstructor": None, "timings_s": timings, "command": command}
    else:
        config = reconstructor_config(settings, fa.shape[1], xa.shape[1])
        checkpoint = Path(settings.checkpoint) if settings.checkpoint else out / "reconstructor.pt"
        started = time.perf_counter()
        reconstructor = train_or_resume(config, fa[train], xa[train], steps=settings.steps, checkpoint=checkpoint,
                                        guides=guides, device=device, precision=settings.precision, seed=settings.seed,
                                        checkpoint_every=settings.checkpoint_every, init_weights=settings.init_weights,
                                        made_by=command, progress=settings.progress)
        timings["reconstructor_call_s"] = time.perf_counter() - started
        losses = reconstructor.losses
        summary = {
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
            "device": _device_info(device, reconstructor),
            "reconstructor": {"parameters": reconstructor.num_parameters, "config": config.to_dict(),
                              "steps": reconstructor.step, "train_seconds": reconstructor.train_seconds,
                              "exported": reconstructor.exported,   # trained elsewhere, its exported weights loaded
                              "initialised_from": reconstructor.initialised_from,   # fine-tuned from these weights
                              "first_loss_mean_100": float(np.mean(losses[:100])) if losses else None,
                              "final_loss_mean_100": float(np.mean(losses[-100:])) if losses else None,
                              "loss_mean_per_1000_steps": [float(np.mean(losses[i:i + 1000]))
                                                           for i in range(0, len(losses), 1000)],
                              "checkpoint": checkpoint.name,
                              # what names these weights: their EMA tensors' sha256, the file's as it is on disk, and
                              # the command that trained them (None: weights that predate the record)
                              "weights_sha256": reconstructor.weights_sha256(),
                              "checkpoint_sha256": file_sha256(checkpoint) if checkpoint.is_file() else None,
                              "made_by": reconstructor.made_by},
            "timings_s": timings,
            "command": command,
        }
    if settings.train_only and reconstructor is not None:
        summary["table"] = ""
        (out / "attack_results.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary

    started = time.perf_counter()
    reused = settings.guide_decoder if guide_decoder is not None else None
    decoders = fit_decoders([b for b in settings.baselines if b != reused], fa[train], xa[train],
                            ya[train], fa[held], xa[held], ya[held], **options)
    if reused is not None and reused in settings.baselines:
        decoders = {name: guide_decoder if name == settings.guide_decoder else decoders[name]
                    for name in settings.baselines}
    timings["decoders_s"] = time.perf_counter() - started
    init_decoder = guide_decoder or decoders.get("mlp", decoders.get("ridge"))

    # Sampling settings from the attacker's held-out pairs: guidance first, then decoder-guided initialisation.
    started = time.perf_counter()
    chosen = held[:settings.selection_images]
    held_guides = {} if guide_decoder is None else {"guide": guide_decoder.decode(fa[chosen], ya[chosen])}
    best: Any = None
    guidance_scores: list[dict[str, Any]] = []
    init_scores: list[dict[str, Any]] = []
    one_step_scores: list[dict[str, Any]] = []
    one_step_w = 1.0
    if reconstructor is not None:
        best, guidance_scores, init_scores, one_step_w, one_step_scores = _choose_sampling(
            settings, reconstructor, fa[chosen], xa[chosen], ya[chosen], init_decoder, guide_decoder, held_guides)
    timings["sampling_selection_s"] = time.perf_counter() - started


    prior = AttackerPrior.fit(fa, ya, num_classes=data.num_classes,
                              full_covariance=settings.prior_covariance == "full")
    scored, release_details, protocol_seeds = [], [], []
    kept_by_seed: dict[int, np.ndarray] = {}
    panels: list[tuple[str, torch.Tensor]] = []
    for seed in settings.seeds:
        started = time.perf_counter()
        xd, fd, yd = data.defender_images[seed], data.defender_features[seed], data.defender_labels[seed]
        nearest_index, max_ssim = nearest(xd, xa, fast=True)
        kept, _ = near_duplicate_filter(xd, xa, fraction=settings.near_duplicate_fraction, max_ssim=max_ssim)
        timings[f"seed{seed}_near_duplicate_filter_s"] = time.perf_counter() - started
        targets = xd[torch.as_tensor(kept)]
        kept_by_seed[seed] = kept
        protocol_seeds.append({"seed": seed, "defender_images": int(len(xd)), "evaluated": int(len(kept)),
                               "near_duplicates_removed": int(len(xd) - len(kept)),
                               "class_counts": np.bincount(yd, minlength=data.num_classes).tolist(),
                               "max_ssim_to_attacker_quartiles": [float(q) for q in
                                                                  np.quantile(max_ssim, [0.25, 0.5, 0.75, 1.0])]})
        first = seed == settings.seeds[0]
        if first:
            panels.append(("defender image", targets))
        for release in _releases(settings, fd, yd, data.num_classes, prior, seed):
            started = time.perf_counter()
            index = None if release.set_level else kept
            k = settings.set_samples_per_feature if release.set_level else settings.samples_per_feature
            diffusion = None if reconstructor is None else evaluate_release(
                release, reconstructor, targets, lpips=lpips, seed=seed, samples_per_feature=k,
                one_step_draws=settings.one_step_draws, one_step_guidance=one_step_w, sampling=best,
                init_decoder=init_decoder, guide_decoder=guide_decoder, target_index=index,
                progress=settings.progress)
            scored += [] if diffusion is None else diffusion.scored
            baselines = {name: evaluate_decoder(release, decoder, targets, lpips=lpips, attacker_features=fa[train],
                                                seed=seed, target_index=index)
                         for name, decoder in decoders.items()}
            for evaluation in baselines.values():
                scored += evaluation.scored
            shown = release.label if math.isinf(release.epsilon) or release.epsilon == 0 else \
                f"{release.label}, ε {release.epsilon:.3g}"
            matched = "" if not release.set_level else ", oracle-matched"
            if first:
                for estimate, images in ({} if diffusion is None else diffusion.shown).items():
                    if release.set_level and not estimate.startswith("medoid"):
                        continue
                    panels.append((f"{shown}: diffusion, {estimate}{matched}", images))
                for name in ("mlp", "mlp-tuned", "nn"):
                    if name in baselines and not release.set_level:
                        panels.append((f"{shown}: {ATTACK_NAMES[name]}", baselines[name].shown["-"]))
            release_details.append({"seed": seed, "source": release.label, "scheme": release.scheme,
                                    "set_level": release.set_level,
                                    "epsilon": "inf" if math.isinf(release.epsilon) else release.epsilon,
                                    "features": len(release.features), **release.details,
                                    "feature_diagnostics": feature_diagnostics(release.features, prior),
                                    "diffusion_s": 0.0 if diffusion is None else diffusion.seconds,
                                    "decoders_s": sum(e.seconds for e in baselines.values()),
                                    "total_s": time.perf_counter() - started})
            if settings.progress:
                print(f"seed {seed}, {shown}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        baseline, matched_images = nearest_image_baseline(targets, xa, lpips=lpips, seed=seed,
                                                          nearest_index=nearest_index[kept])
        scored += baseline
        if first:
            panels.append(("no release: nearest attacker image by SSIM, oracle-matched", matched_images))
    started = time.perf_counter()
    rows = rows_from_scores(scored, top_fractions=settings.top_fractions, n_boot=settings.bootstrap,
                            boot_seed=settings.seed)
    timings["bootstrap_s"] = time.perf_counter() - started
    timings["wall_s"] = time.perf_counter() - wall

    top_sizes = {f"{100 * f:g}%": [s["evaluated"] and max(1, math.ceil(f * s["evaluated"] - 1e-9))
                                   for s in protocol_seeds] for f in settings.top_fractions}
    summary.update({
        "protocol": {
            "attacker": f"{len(xa)} images of the {settings.dataset} {data.attacker_split} ({len(train)} train the "
                        f"reconstructor and the decoders, {len(held)} held out to choose their settings)",
            "defender": f"{settings.defender_images} images of the {settings.dataset} {data.defender_split} per "
                        f"seed, disjoint across seeds {list(settings.seeds)}",
            "seeds": protocol_seeds,
            "top_k_sizes_per_seed": top_sizes,
            "embedding": f"{settings.backbone} (input {settings.input_size} px), L2-normalised",
            "images": f"{settings.image_size} x {settings.image_size}, [0, 1]",
            "metrics": "PSNR (data range 1), SSIM (Gaussian window sigma 1.5, population covariances), LPIPS "
                       "v0.1 AlexNet (pretrained; images upsampled to 64 px)",
            "intervals": f"percentile bootstrap, 95 %, {settings.bootstrap} resamples of the scored images within "
                         f"each seed, top-k selections redone per resample",
            "attacker_features": feature_diagnostics(fa, prior),
        },
        "decoders": {name: decoder.details for name, decoder in decoders.items()},
        "guide_decoder": None if guide_decoder is None else {"name": guide_decoder.name, **guide_decoder.details},
        "sampling": None if best is None else {
            "chosen": best.to_dict(), "label": best.label, "held_out_pairs": int(len(chosen)),
            "guidance_candidates": guidance_scores, "init_candidates": init_scores, "one_step_guidance": one_step_w,
            "one_step_candidates": one_step_scores,
            "init_decoder": None if init_decoder is None else init_decoder.name},
        "releases": release_details,
        "rows": [r.to_dict() for r in rows],
    })
    records = []
    for s in scored:   # the defender image of each line, as its index in the source's split
        images = data.defender_indices[s.seed][kept_by_seed[s.seed]]
        for record in s.records():
            target = record["index"] if record["unit"] == "target" else record["matched"]
            record["defender_image"] = int(images[target])
            records.append(record)
    _write_csv(out / "per_image_scores.csv", _SCORE_COLUMNS, records)
    _write_csv(out / "attack_results.csv", _COLUMNS, [r.to_dict() for r in rows])
    (out / "attack_results.md").write_text(format_markdown(rows))
    (out / "attack_results.json").write_text(json.dumps(summary, indent=2, default=str))
    save_grid(out / "attack_grid.png", panels,
              title="defender images (top row) and what each attacker shows for them; per-feature rows are the "
                    "attacker's own reconstruction of that image, oracle-matched rows pick the most similar member "
                    "of the attacker's set with the defender's image (ground truth)")
    save_metrics_plot(out / "attack_metrics.png", rows)
    summary["table"] = format_markdown(rows)
    return summary


# -- command line ---------------------------------------------------------------------------------------------------

def _floats(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (or 'none'), got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _intervals(text: str) -> tuple[tuple[float, float], ...]:
    try:
        pairs = [tuple(float(x) for x in v.split(":")) for v in text.split(",") if v.strip()]
    except ValueError:
        pairs = [()]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected comma-separated LOW:HIGH fractions of T, e.g. 0:1,0.5:1, got "
                                         f"{text!r}")
    return tuple((low, high) for low, high in pairs)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _dims(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _optional(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text.strip()


def _count(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {text!r}") from None


_FLAGS = {"learning_rate": "lr"}


def _preset_epilog() -> str:
    lines = ["presets (options given on the command line override them):"]
    for name, values in PRESETS.items():
        text = ", ".join(f"--{_FLAGS.get(k, k.replace('_', '-'))} {_show(v)}" for k, v in values.items())
        lines.append(f"  {name}: {text}")
    return "\n".join(lines)


def _show(value: Any) -> str:
    if value is None:
        return "all"
    if isinstance(value, tuple):
        return ",".join(":".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}" if isinstance(v, float)
                        else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_parser(*, suppress: bool = False) -> argparse.ArgumentParser:
    """The parser of ``privfl attack reconstruct``; ``suppress=True`` leaves out every default (to tell which options
    the command line gave, so that they override a preset)."""
    d = AttackSettings(out="")

    def default(name: str) -> Any:
        return argparse.SUPPRESS if suppress else getattr(d, name)

    p = argparse.ArgumentParser(
        prog="privfl attack reconstruct", formatter_class=_HelpFormatter, epilog=_preset_epilog(),
        description="Diffusion reconstruction attack on raw features, FedPFT and DP-FedPFT releases, beside decoder "
                    "baselines: PSNR / LPIPS / SSIM with bootstrap 95% intervals, per-image scores, an image grid "
                    "and a metrics plot. Defaults are shown without a preset.")
    p.add_argument("--out", required=True, help="output folder (tables, figures, reconstructor checkpoint)")
    p.add_argument("--preset", choices=tuple(PRESETS), default=argparse.SUPPRESS if suppress else None,
                   help="a set of defaults (listed below)")
    p.add_argument("--dataset", default=default("dataset"), help="an image source of `privfl datasets`")
    p.add_argument("--data-root", default=default("data_root"), help="folder of torchvision-format data")
    p.add_argument("--backbone", default=default("backbone"), help="frozen feature extractor")
    p.add_argument("--input-size", type=int, default=default("input_size"), help="backbone input pixels")
    p.add_argument("--schemes", type=_names, default=default("schemes"), help="comma-separated: raw,fedpft,dp-fedpft")
    p.add_argument("--eps", type=_floats, default=default("eps"), help="DP-FedPFT epsilons requested")
    p.add_argument("--delta", type=float, default=default("delta"), help="DP-FedPFT delta (public)")
    p.add_argument("--dp-noise", default=default("dp_noise"),
                   help="seeded (reproducible simulation of the defender), secure (OS randomness) or hardened "
                        "(secure, summed draws)")
    p.add_argument("--components", type=int, default=default("components"), help="FedPFT mixture components K")
    p.add_argument("--covariance", default=default("covariance"), help="full, diag or spherical")
    p.add_argument("--readings", default=default("readings"),
                   help="how mixture releases are read: post (the attacker's post-processing), naive (as "
                        "delivered) or both")
    p.add_argument("--prior-covariance", default=default("prior_covariance"),
                   help="the attacker's class covariance in the DP post-processing: full (principal directions) or "
                        "diag (per dimension)")
    p.add_argument("--attacker-images", type=_count, default=default("attacker_images"),
                   help="attacker images from the training split (an integer, or all)")
    p.add_argument("--validation-images", type=int, default=default("validation_images"),
                   help="attacker pairs held out of training to choose sampling settings and decoder hyperparameters")
    p.add_argument("--defender-images", type=int, default=default("defender_images"),
                   help="defender images from the test split, per evaluation seed")
    p.add_argument("--seeds", type=_ints, default=default("seeds"),
                   help="evaluation seeds: each draws a disjoint defender set, release noise and samples")
    p.add_argument("--seed", type=int, default=default("seed"),
                   help="seed of what the attacker trains (held-out split, reconstructor, decoders)")
    p.add_argument("--image-size", type=int, default=default("image_size"), help="reconstruction resolution")
    p.add_argument("--block-channels", type=_ints, default=default("block_channels"), help="U-Net channels per level")
    p.add_argument("--layers-per-block", type=int, default=default("layers_per_block"),
                   help="U-Net residual blocks per level")
    p.add_argument("--no-mid-attention", dest="mid_attention", action="store_false",
                   default=argparse.SUPPRESS if suppress else True,
                   help="no self-attention in the U-Net's middle block")
    p.add_argument("--condition-dims", type=_dims, default=default("condition_dims"),
                   help="principal components the features are whitened to (none: per-dimension standardisation)")
    p.add_argument("--prediction-type", default=default("prediction_type"), help="v_prediction or epsilon")
    p.add_argument("--steps", type=int, default=default("steps"), help="reconstructor training steps (total)")
    p.add_argument("--batch-size", type=int, default=default("batch_size"), help="reconstructor batch size")
    p.add_argument("--lr", dest="learning_rate", type=float, default=default("learning_rate"),
                   help="reconstructor learning rate (AdamW)")
    p.add_argument("--cond-dropout", type=float, default=default("cond_dropout"), help="condition dropout probability")
    p.add_argument("--checkpoint", default=default("checkpoint"),
                   help="reconstructor checkpoint (none: OUT/reconstructor.pt); resumed when it exists; or weights "
                        "exported elsewhere (Reconstructor.export: evaluated, not trained; --steps as trained)")
    p.add_argument("--init-weights", default=default("init_weights"),
                   help="start a new reconstructor from these weights (a checkpoint or exported weights of the same "
                        "architecture) and fine-tune them for --steps steps")
    p.add_argument("--checkpoint-every", type=int, default=default("checkpoint_every"),
                   help="save the checkpoint every this many steps")
    p.add_argument("--train-only", action="store_true", default=argparse.SUPPRESS if suppress else False,
                   help="stop after training the reconstructor")
    p.add_argument("--guidance", type=_floats, default=default("guidance"),
                   help="classifier-free guidance scales w to choose from on the held-out pairs")
    p.add_argument("--guidance-intervals", type=_intervals, default=default("guidance_intervals"),
                   help="LOW:HIGH fractions of T where w > 1 applies (w = 1 elsewhere), to choose from")
    p.add_argument("--guidance-rescales", type=_floats, default=default("guidance_rescales"),
                   help="guidance rescale phi values to choose from (0: none)")
    p.add_argument("--init-strengths", type=_floats, default=default("init_strengths"),
                   help="decoder-guided initialisation strengths to try against none ('none': never)")
    p.add_argument("--selection-images", type=int, default=default("selection_images"),
                   help="held-out pairs the sampling settings are chosen on")
    p.add_argument("--ddim-steps", type=int, default=default("ddim_steps"), help="DDIM steps")
    p.add_argument("--samples-per-feature", type=int, default=default("samples_per_feature"),
                   help="samples per raw feature (medoid, mean, agreement; the paper: 10)")
    p.add_argument("--set-samples-per-feature", type=int, default=default("set_samples_per_feature"),
                   help="samples per feature of a set-level (mixture) release")
    p.add_argument("--one-step-draws", type=int, default=default("one_step_draws"),
                   help="pure-noise draws averaged by the diffusion's one-step posterior mean (its x_0 prediction "
                        "at t = T - 1, antithetic pairs; scored beside the medoid and the mean of the samples; 0: "
                        "not scored)")
    p.add_argument("--one-step-guidance", type=_floats, default=default("one_step_guidance"),
                   help="guidance scales w of the one-step posterior mean to choose from on the held-out pairs (by "
                        "mean PSNR)")
    p.add_argument("--baselines", type=_names, default=default("baselines"),
                   help="decoder baselines: " + ",".join(DECODERS))
    p.add_argument("--guide-decoder", type=_optional, default=default("guide_decoder"),
                   help="the decoder whose estimate the reconstructor reads beside x_t: knn, nn, mlp, mlp-tuned (the "
                        "tuned MLP's chosen configuration, cross-fitted) or none")
    p.add_argument("--guide-folds", type=int, default=default("guide_folds"),
                   help="cross-fitted MLPs whose out-of-fold estimates the reconstructor trains on (--guide-decoder "
                        "mlp or mlp-tuned)")
    p.add_argument("--mlp-hidden", type=int, default=default("mlp_hidden"), help="MLP decoder width")
    p.add_argument("--mlp-epochs", type=int, default=default("mlp_epochs"), help="MLP decoder epochs (at most)")
    p.add_argument("--tuned-epochs", type=int, default=default("tuned_epochs"),
                   help="epochs (at most; cosine schedule) of the tuned MLP, convolutional and ensemble decoders")
    p.add_argument("--random-features", type=int, default=default("random_features"),
                   help="random Fourier features D of the random-features ridge decoder")
    p.add_argument("--decoders-only", action="store_true", default=argparse.SUPPRESS if suppress else False,
                   help="no diffusion reconstructor: fit and score the decoders only (same images and metrics)")
    p.add_argument("--top-fractions", type=_floats, default=default("top_fractions"),
                   help="attacker / oracle selection sizes per seed (the paper: 0.01)")
    p.add_argument("--near-duplicate-fraction", type=float, default=default("near_duplicate_fraction"),
                   help="share of defender images most similar to an attacker image left out of scoring")
    p.add_argument("--bootstrap", type=int, default=default("bootstrap"), help="bootstrap resamples per cell")
    p.add_argument("--device", default=default("device"),
                   help="auto (CUDA if visible, else CPU), cpu, cuda or cuda:N (an error if absent)")
    p.add_argument("--precision", default=default("precision"),
                   help="auto (mixed precision on CUDA, float32 on CPU), fp32, bf16 or fp16 (CUDA)")
    p.add_argument("--threads", type=int, default=argparse.SUPPRESS if suppress else None,
                   help="torch CPU threads (none: torch's own choice)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   default=argparse.SUPPRESS if suppress else True, help="no progress bars")
    return p


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help (lists as typed on the command line), and the preset list as written."""

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, tuple) or (action.default is None and action.option_strings):
            action = copy.copy(action)
            action.default = "all" if action.dest == "attacker_images" and action.default is None else \
                "none" if action.default is None else _show(action.default)
        return super()._expand_help(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return action.help or ""   # a flag's "default" is the opposite of what it does: not worth printing
        return super()._get_help_string(action)


def settings_from_args(argv: Sequence[str]) -> tuple[AttackSettings, argparse.Namespace]:
    """Settings from the command line: the defaults, then the preset's, then the options given."""
    args = build_parser().parse_args(list(argv))
    given = vars(build_parser(suppress=True).parse_args(list(argv)))
    names = {f.name for f in fields(AttackSettings)}
    values: dict[str, Any] = {}
    if args.preset is not None:
        values.update(PRESETS[args.preset])
    values.update({k: v for k, v in given.items() if k in names})
    return AttackSettings(**values), args


def reconstruct_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``privfl attack reconstruct``; returns the exit status (2 on a user error)."""
    settings, args = settings_from_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError(f"--threads must be an integer >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        command = "privfl attack reconstruct " + shlex.join(sys.argv[1:] if argv is None else list(argv))
        summary = run_reconstruction_attack(settings, command=command)
    except PrivflError as error:
        print(f"privfl: error: {error}", file=sys.stderr)
        return 2
    rec, dev = summary["reconstructor"], summary["device"]
    print(summary["table"], end="")
    print(f"device: {dev['device']} ({dev['precision']}); " + (
        "decoders only, no reconstructor" if rec is None else
        f"reconstructor: {rec['parameters']:,} parameters, {rec['steps']} steps, trained {rec['train_seconds']:.0f} s"
        + (f"; sampling: {summary['sampling']['label']}, one-step w {summary['sampling']['one_step_guidance']:g}"
           if summary.get("sampling") else "")))
    out = Path(settings.out)
    if settings.train_only and rec is not None:
        print(f"trained only: {out / 'attack_results.json'}, checkpoint {rec['checkpoint']}")
    else:
        print(f"results: {out / 'attack_results.md'} (.csv, .json), {out / 'per_image_scores.csv'}, figures: "
              f"{out / 'attack_grid.png'}, {out / 'attack_metrics.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(reconstruct_main())
