"""``privfl attack reconstruct``: train (or reuse) a diffusion reconstructor and attack raw / FedPFT / DP-FedPFT
releases.

Protocol (FedPFT paper, App. E; digest ``papers/fedpft.md`` 7 and 8.3 for the CPU scale):

1. Data: the attacker's images ``D_a`` are drawn from the source's training split, the defender's ``D_d`` from its
   test split (disjoint; a source without a test split is cut into two disjoint halves).
2. Embedding ``E``: the frozen backbone (e.g. the ImageNet MobileNetV2 at ``--input-size`` pixels, features cached
   on disk) followed by L2 normalisation.
3. The reconstructor is trained on ``(E(x), x)`` for ``x`` in ``D_a`` minus ``--validation-images`` held-out pairs,
   at ``--image-size`` (images resized with antialiasing), checkpointed to ``OUT/reconstructor.pt``
   (``--checkpoint``) and resumed from there when it exists. Its features are standardised per dimension with the
   attacker's training statistics, or whitened to ``--condition-dims`` principal components of them.
4. Guidance: with several ``--guidance`` scales, the one whose reconstructions of the held-out attacker pairs have
   the highest mean SSIM is used (no defender data is involved in the choice).
5. Near-duplicate filter: the ``--near-duplicate-fraction`` of ``D_d`` most similar (SSIM) to some image of ``D_a``
   is removed from evaluation (the paper: 10 %).
6. Each scheme releases ``E(D_d)`` through the method's client procedure and the wire, which records it in the
   defender's ledger (:func:`attacks.schemes.make_release`); mixture releases are read naively and, with
   ``--postprocess`` (default), also after the attacker's post-processing (:func:`attacks.schemes.
   postprocess_release`). The diffusion reconstructions and the feature-space nearest attacker image of every
   released feature are scored with PSNR / LPIPS (AlexNet) / SSIM under the rows of :mod:`attacks.schemes`, beside
   the oracle nearest-attacker-image-by-SSIM baseline (over all of ``D_a`` and over a random subset of ``|D_d|``
   images, the size of the set-level reconstruction sets).
7. Outputs in ``--out``: ``attack_results.csv``, ``attack_results.md``, ``attack_results.json`` (settings, rows,
   releases with their ledger records, guidance scores, timings) and ``attack_grid.png`` (originals, then what
   each attacker shows for them).

Example:
    privfl attack reconstruct --dataset mnist --backbone mobilenet_v2 --schemes raw,fedpft,dp-fedpft --eps 1,8 \
        --out runs/attack
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfl.errors import ConfigError, PrivflError

__all__ = ["AttackSettings", "build_parser", "format_markdown", "reconstruct_main", "run_reconstruction_attack",
           "save_grid"]


@dataclass
class AttackSettings:
    """Every setting of one attack run (all saved in ``attack_results.json``)."""

    out: str
    dataset: str = "mnist"
    data_root: str | None = None
    backbone: str = "mobilenet_v2"
    input_size: int = 64
    schemes: tuple[str, ...] = ("raw", "fedpft", "dp-fedpft")
    eps: tuple[float, ...] = (1.0, 8.0)
    delta: float = 1e-5
    components: int = 10
    covariance: str = "diag"
    attacker_images: int = 5000
    defender_images: int = 250
    validation_images: int = 200
    image_size: int = 16
    block_channels: tuple[int, ...] = (32, 64, 64)
    mid_attention: bool = True
    condition_dims: int | None = None
    steps: int = 2000
    batch_size: int = 32
    learning_rate: float = 2e-4
    cond_dropout: float = 0.1
    guidance: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    ddim_steps: int = 20
    samples_per_feature: int = 4
    postprocess: bool = True
    dp_noise: str = "seeded"
    top_fractions: tuple[float, ...] = (0.01, 0.05)
    near_duplicate_fraction: float = 0.1
    checkpoint: str | None = None
    checkpoint_every: int = 250
    device: str = "cpu"
    seed: int = 0
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        from attacks.schemes import SCHEMES

        bad = [s for s in self.schemes if s not in SCHEMES]
        if not self.schemes or bad:
            raise ConfigError(f"--schemes: unknown scheme(s) {bad or '(none given)'}; valid: {', '.join(SCHEMES)}")
        if "dp-fedpft" in self.schemes and not self.eps:
            raise ConfigError("--eps: scheme dp-fedpft needs at least one epsilon, e.g. --eps 1,8")
        if self.covariance not in ("full", "diag", "spherical"):
            raise ConfigError(f"--covariance must be full, diag or spherical, got {self.covariance!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: no CUDA device is visible here; use --device cpu")
        if len(self.block_channels) < 1 or any(c < 1 for c in self.block_channels):
            raise ConfigError(f"--block-channels must be positive integers, got {list(self.block_channels)}")
        if any(not math.isfinite(e) or e <= 0 for e in self.eps):
            raise ConfigError(f"--eps: every epsilon must be a finite number > 0, got {list(self.eps)}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta must be in (0, 1), got {self.delta}")
        for name in ("attacker_images", "defender_images", "steps", "batch_size", "ddim_steps", "components",
                     "checkpoint_every", "input_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")
        if self.samples_per_feature < 2:
            raise ConfigError(f"--samples-per-feature must be >= 2 (the attacker selection compares samples), "
                              f"got {self.samples_per_feature}")
        if self.image_size < 11:
            raise ConfigError(f"--image-size must be >= 11 (SSIM's 11 x 11 window), got {self.image_size}")
        if not self.top_fractions or any(not 0 < f <= 1 for f in self.top_fractions):
            raise ConfigError(f"--top-fractions must be fractions in (0, 1], got {list(self.top_fractions)}")
        if not 0 <= self.near_duplicate_fraction < 1:
            raise ConfigError(f"--near-duplicate-fraction must be in [0, 1), got {self.near_duplicate_fraction}")
        if not self.guidance or any(not math.isfinite(w) or w < 0 for w in self.guidance):
            raise ConfigError(f"--guidance must be one or more finite scales >= 0, got {list(self.guidance)}")
        if self.validation_images < (1 if len(self.guidance) > 1 else 0):
            raise ConfigError(f"--validation-images must be >= 1 to choose among guidance scales "
                              f"{list(self.guidance)}, got {self.validation_images}")
        if self.validation_images >= self.attacker_images:
            raise ConfigError(f"--validation-images ({self.validation_images}) must leave training pairs out of "
                              f"--attacker-images ({self.attacker_images})")
        if self.dp_noise not in ("seeded", "secure"):
            raise ConfigError(f"--dp-noise must be seeded or secure, got {self.dp_noise!r}")
        if self.condition_dims is not None and self.condition_dims < 1:
            raise ConfigError(f"--condition-dims must be an integer >= 1 or none, got {self.condition_dims}")
        from attacks.reconstructor import ReconstructorConfig

        ReconstructorConfig(feature_dim=max(1, self.condition_dims or 1), image_size=self.image_size,
                            block_channels=self.block_channels, batch_size=self.batch_size,
                            learning_rate=self.learning_rate, cond_dropout=self.cond_dropout,
                            mid_attention=self.mid_attention, condition_dims=self.condition_dims)
        # (its errors name the setting, before any work)


# -- data -----------------------------------------------------------------------------------------------------------

def _split_sources(settings: AttackSettings) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    from privfl.data import load_source

    source = load_source(settings.dataset, data_root=settings.data_root)
    if len(source.input_shape) != 3:
        raise ConfigError(f"dataset {settings.dataset!r} holds vectors {source.input_shape}, not images; the "
                          "reconstruction attack needs an image source (e.g. mnist)")
    rng = np.random.default_rng(settings.seed)
    if source.test is not None:
        attacker_pool, defender_pool = source.train, source.test
        a_idx = rng.permutation(len(attacker_pool))
        d_idx = rng.permutation(len(defender_pool))
    else:  # two disjoint halves of the only split
        attacker_pool = defender_pool = source.train
        order = rng.permutation(len(source.train))
        a_idx, d_idx = order[: len(order) // 2], order[len(order) // 2:]
    if settings.attacker_images > len(a_idx) or settings.defender_images > len(d_idx):
        raise ConfigError(f"asked for {settings.attacker_images} attacker and {settings.defender_images} defender "
                          f"images; {settings.dataset} has {len(a_idx)} and {len(d_idx)}")
    a_idx = np.sort(a_idx[: settings.attacker_images])
    d_idx = np.sort(d_idx[: settings.defender_images])
    return (np.asarray(attacker_pool.x[a_idx]), np.asarray(attacker_pool.y[a_idx]),
            np.asarray(defender_pool.x[d_idx]), np.asarray(defender_pool.y[d_idx]), source.num_classes)


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


# -- output ---------------------------------------------------------------------------------------------------------

_COLUMNS = ("source", "attack", "epsilon", "level", "selection", "top", "n", "ground_truth", "psnr", "lpips", "ssim",
            "set_size")


def format_markdown(rows: Sequence[Any]) -> str:
    """The table in the paper's layout (PSNR up, LPIPS down, SSIM up), with the attack, the row's level and which
    rows use the defender's images (ground truth) to match or select; epsilon is the ledger's."""
    lines = ["| source | attack | ε (ledger) | level | selection | top | n | ground truth used | PSNR ↑ | LPIPS ↓ | "
             "SSIM ↑ | set size |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eps = "∞" if math.isinf(r.epsilon) else f"{r.epsilon:.3g}"
        lines.append(f"| {r.source} | {r.attack} | {eps} | {r.level} | {r.selection} | {r.top} | {r.n} | "
                     f"{r.ground_truth} | {r.psnr:.2f} | {r.lpips:.3f} | {r.ssim:.3f} | {r.set_size} |")
    return "\n".join(lines) + "\n"


def save_grid(path: Path, panels: Sequence[tuple[str, torch.Tensor]], columns: int = 10) -> Path:
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
    scale = 0.075  # inches per pixel
    fig, ax = plt.subplots(figsize=(mosaic.shape[1] * scale + 2.4, mosaic.shape[0] * scale + 0.5))
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([pad + row * (h + pad) + h / 2 for row in range(len(panels))])
    ax.set_yticklabels([name for name, _ in panels], fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title("defender images (top row) and what each attacker shows for them", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")   # the whole row labels, however long
    plt.close(fig)
    return path


# -- the run --------------------------------------------------------------------------------------------------------

def _releases(settings: AttackSettings, features_d: torch.Tensor, yd: np.ndarray, kept: np.ndarray,
              num_classes: int, prior: Any) -> list[Any]:
    """Every release the run attacks, in table order (raw; FedPFT; DP-FedPFT per epsilon), each mixture release
    naive and, with ``settings.postprocess``, post-processed."""
    from attacks.schemes import make_release, postprocess_release

    releases = []
    for scheme in settings.schemes:
        if scheme == "raw":
            releases.append(make_release("raw", features_d[torch.as_tensor(kept)], yd[kept], num_classes=num_classes,
                                         delta=settings.delta))
            continue
        for eps in (settings.eps if scheme == "dp-fedpft" else (None,)):
            release = make_release(scheme, features_d, yd, num_classes=num_classes, epsilon=eps,
                                   delta=settings.delta, components=settings.components,
                                   covariance=settings.covariance, seed=settings.seed, dp_noise=settings.dp_noise)
            releases.append(release)
            if settings.postprocess:
                releases.append(postprocess_release(release, prior, seed=settings.seed))
    return releases


def run_reconstruction_attack(settings: AttackSettings) -> dict[str, Any]:
    """Run the whole attack (see the module docstring); returns the JSON-able summary it also writes."""
    from attacks.metrics import LPIPS
    from attacks.reconstructor import ReconstructorConfig, select_guidance_scale, train_or_resume
    from attacks.schemes import (
        AttackerPrior,
        evaluate_release,
        feature_diagnostics,
        feature_retrieval,
        nearest_image_baseline,
    )
    from attacks.selection import near_duplicate_filter

    settings.validate()
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    lpips = LPIPS(device=settings.device)  # fail early (missing weights) before any training

    started = time.perf_counter()
    xa, ya, xd, yd, num_classes = _split_sources(settings)
    features_a = _embed(settings, xa, f"{settings.dataset}-attack-attacker-{settings.seed}")
    features_d = _embed(settings, xd, f"{settings.dataset}-attack-defender-{settings.seed}")
    images_a, images_d = _resize(xa, settings.image_size), _resize(xd, settings.image_size)
    timings["data_and_features_s"] = time.perf_counter() - started

    # The attacker holds some of its own pairs out of training to choose the guidance scale.
    order = np.random.default_rng([settings.seed, 2]).permutation(len(xa))
    held_out = torch.as_tensor(np.sort(order[:settings.validation_images]))
    train = torch.as_tensor(np.sort(order[settings.validation_images:]))
    config = ReconstructorConfig(feature_dim=features_a.shape[1], image_size=settings.image_size,
                                 channels=images_a.shape[1], block_channels=settings.block_channels,
                                 mid_attention=settings.mid_attention, condition_dims=settings.condition_dims,
                                 batch_size=settings.batch_size, learning_rate=settings.learning_rate,
                                 cond_dropout=settings.cond_dropout)
    checkpoint = Path(settings.checkpoint) if settings.checkpoint else out / "reconstructor.pt"
    started = time.perf_counter()
    reconstructor = train_or_resume(config, features_a[train], images_a[train], steps=settings.steps,
                                    checkpoint=checkpoint, device=settings.device, seed=settings.seed,
                                    checkpoint_every=settings.checkpoint_every, progress=settings.progress)
    timings["reconstructor_call_s"] = time.perf_counter() - started
    timings["reconstructor_train_s"] = reconstructor.train_seconds

    started = time.perf_counter()
    if len(settings.guidance) > 1:
        guidance, guidance_scores = select_guidance_scale(
            reconstructor, features_a[held_out], images_a[held_out], settings.guidance,
            num_inference_steps=settings.ddim_steps, seed=settings.seed, progress=settings.progress)
    else:
        guidance, guidance_scores = float(settings.guidance[0]), {}
    timings["guidance_selection_s"] = time.perf_counter() - started

    started = time.perf_counter()
    kept, max_ssim = near_duplicate_filter(images_d, images_a, fraction=settings.near_duplicate_fraction)
    timings["near_duplicate_filter_s"] = time.perf_counter() - started
    targets = images_d[torch.as_tensor(kept)]

    prior = AttackerPrior.fit(features_a, ya, num_classes=num_classes)
    releases = _releases(settings, features_d, yd, kept, num_classes, prior)
    rows = []
    panels: list[tuple[str, torch.Tensor]] = [("original", targets)]
    release_details = []
    for release in releases:
        started = time.perf_counter()
        diffusion = evaluate_release(release, reconstructor, targets, lpips=lpips,
                                     samples_per_feature=settings.samples_per_feature,
                                     top_fractions=settings.top_fractions, guidance_scale=guidance,
                                     num_inference_steps=settings.ddim_steps, seed=settings.seed,
                                     progress=settings.progress)
        retrieval = feature_retrieval(release, features_a, images_a, targets, lpips=lpips,
                                      top_fractions=settings.top_fractions)
        rows.extend(diffusion.rows + retrieval.rows)
        shown = release.label if math.isinf(release.epsilon) else f"{release.label}, ε {release.epsilon:.3g}"
        panels.append((f"{shown}: diffusion", diffusion.shown))
        if not release.set_level:
            panels.append((f"{shown}: feature NN", retrieval.shown))
        release_details.append({"source": release.label, "scheme": release.scheme, "set_level": release.set_level,
                                "epsilon": "inf" if math.isinf(release.epsilon) else release.epsilon,
                                "features": len(release.features), **release.details,
                                "feature_diagnostics": feature_diagnostics(release.features, prior),
                                "sampling_and_scoring_s": diffusion.seconds, "retrieval_s": retrieval.seconds,
                                "total_s": time.perf_counter() - started})
        if settings.progress:
            print(f"{release.label}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    started = time.perf_counter()
    baseline, matched = nearest_image_baseline(targets, images_a, lpips=lpips, top_fractions=settings.top_fractions)
    rows.extend(baseline)
    panels.append(("nearest image by SSIM (oracle)", matched))
    subset = np.random.default_rng(settings.seed + 1).choice(len(images_a), size=min(len(images_a), len(xd)),
                                                             replace=False)
    subset_rows, _ = nearest_image_baseline(targets, images_a[torch.as_tensor(np.sort(subset))], lpips=lpips,
                                            top_fractions=settings.top_fractions,
                                            source=f"no release ({len(subset)} attacker images)")
    rows.extend(subset_rows)
    timings["baseline_s"] = time.perf_counter() - started

    summary = {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
        "protocol": {
            "attacker": f"{len(xa)} images of the {settings.dataset} training split ({len(train)} train the "
                        f"reconstructor, {len(held_out)} held out to choose the guidance scale)",
            "defender": f"{len(xd)} images of the {settings.dataset} test split",
            "evaluated_defender_images": int(len(kept)),
            "near_duplicates_removed": int(len(xd) - len(kept)),
            "max_ssim_to_attacker_quartiles": [float(q) for q in np.quantile(max_ssim, [0.25, 0.5, 0.75, 1.0])],
            "embedding": f"{settings.backbone} (input {settings.input_size} px), L2-normalised",
            "images": f"{settings.image_size} x {settings.image_size}, antialiased resize, [0, 1]",
            "metrics": "PSNR (data range 1), SSIM (Gaussian window sigma 1.5, population covariances), LPIPS "
                       "v0.1 AlexNet (pretrained; images upsampled to 64 px)",
            "attacker_features": feature_diagnostics(features_a, prior),
            "defender_features": feature_diagnostics(features_d, prior),
        },
        "reconstructor": {"parameters": reconstructor.num_parameters, "config": config.to_dict(),
                          "steps": reconstructor.step,
                          "final_loss_mean_100": float(np.mean(reconstructor.losses[-100:])),
                          "first_loss_mean_100": float(np.mean(reconstructor.losses[:100])),
                          "loss_mean_per_1000_steps": [float(np.mean(reconstructor.losses[i:i + 1000]))
                                                       for i in range(0, len(reconstructor.losses), 1000)],
                          "train_seconds": reconstructor.train_seconds, "checkpoint": checkpoint.name},
        "guidance": {"chosen": guidance, "held_out_mean_ssim": {f"{w:g}": v for w, v in guidance_scores.items()},
                     "held_out_pairs": int(len(held_out))},
        "releases": release_details,
        "timings_s": timings,
        "rows": [r.to_dict() for r in rows],
    }
    with open(out / "attack_results.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=_COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: v for k, v in r.to_dict().items() if k in _COLUMNS})
    (out / "attack_results.md").write_text(format_markdown(rows))
    (out / "attack_results.json").write_text(json.dumps(summary, indent=2, default=str))
    save_grid(out / "attack_grid.png", panels)
    summary["table"] = format_markdown(rows)
    return summary


# -- command line ---------------------------------------------------------------------------------------------------

def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _dims(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = AttackSettings(out="")
    p = argparse.ArgumentParser(prog="privfl attack reconstruct",
                                description="Diffusion reconstruction attack on raw features, FedPFT and DP-FedPFT "
                                            "releases; PSNR / LPIPS / SSIM table and an image grid.")
    p.add_argument("--out", required=True, help="output folder (tables, grid, reconstructor checkpoint)")
    p.add_argument("--dataset", default=d.dataset, help="an image source of `privfl datasets` (mnist)")
    p.add_argument("--data-root", default=None)
    p.add_argument("--backbone", default=d.backbone, help="frozen feature extractor (mobilenet_v2)")
    p.add_argument("--input-size", type=int, default=d.input_size,
                   help="backbone input pixels (the ImageNet models were trained at 224)")
    p.add_argument("--schemes", type=_names, default=d.schemes, help="comma-separated: raw,fedpft,dp-fedpft")
    p.add_argument("--eps", type=_floats, default=d.eps, help="DP-FedPFT epsilons requested, e.g. 1,8")
    p.add_argument("--delta", type=float, default=d.delta, help="DP-FedPFT delta (public)")
    p.add_argument("--dp-noise", default=d.dp_noise,
                   help="seeded (reproducible simulation of the defender) or secure (OS randomness)")
    p.add_argument("--components", type=int, default=d.components, help="FedPFT mixture components K")
    p.add_argument("--covariance", default=d.covariance, help="full, diag or spherical")
    p.add_argument("--no-postprocess", action="store_true",
                   help="attack mixture releases only as delivered (no attacker post-processing rows)")
    p.add_argument("--attacker-images", type=int, default=d.attacker_images)
    p.add_argument("--validation-images", type=int, default=d.validation_images,
                   help="attacker pairs held out of training to choose the guidance scale")
    p.add_argument("--defender-images", type=int, default=d.defender_images)
    p.add_argument("--image-size", type=int, default=d.image_size, help="reconstruction resolution (16 or 28)")
    p.add_argument("--block-channels", type=_ints, default=d.block_channels, help="U-Net channels per level")
    p.add_argument("--no-mid-attention", action="store_true", help="no self-attention in the U-Net's middle block")
    p.add_argument("--condition-dims", type=_dims, default=d.condition_dims,
                   help="principal components the features are whitened to (none: per-dimension standardisation)")
    p.add_argument("--steps", type=int, default=d.steps, help="reconstructor training steps (total)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.learning_rate)
    p.add_argument("--cond-dropout", type=float, default=d.cond_dropout, help="condition dropout probability")
    p.add_argument("--guidance", type=_floats, default=d.guidance,
                   help="classifier-free guidance scale w, or several to choose from on the held-out pairs")
    p.add_argument("--ddim-steps", type=int, default=d.ddim_steps)
    p.add_argument("--samples-per-feature", type=int, default=d.samples_per_feature,
                   help="reconstructions per feature for the attacker selection and medoid (the paper: 10)")
    p.add_argument("--top-fractions", type=_floats, default=d.top_fractions,
                   help="attacker / oracle selection sizes (the paper: 0.01)")
    p.add_argument("--near-duplicate-fraction", type=float, default=d.near_duplicate_fraction)
    p.add_argument("--checkpoint", default=None, help="reconstructor checkpoint (default OUT/reconstructor.pt)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    return p


def reconstruct_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``privfl attack reconstruct``; returns the exit status (2 on a user error)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError(f"--threads must be an integer >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        settings = AttackSettings(
            out=args.out, dataset=args.dataset, data_root=args.data_root, backbone=args.backbone,
            input_size=args.input_size, schemes=args.schemes, eps=args.eps, delta=args.delta,
            components=args.components, covariance=args.covariance, attacker_images=args.attacker_images,
            validation_images=args.validation_images, defender_images=args.defender_images,
            image_size=args.image_size, block_channels=args.block_channels, mid_attention=not args.no_mid_attention,
            condition_dims=args.condition_dims, steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
            cond_dropout=args.cond_dropout, guidance=args.guidance, ddim_steps=args.ddim_steps,
            samples_per_feature=args.samples_per_feature, postprocess=not args.no_postprocess,
            dp_noise=args.dp_noise, top_fractions=args.top_fractions,
            near_duplicate_fraction=args.near_duplicate_fraction, checkpoint=args.checkpoint,
            checkpoint_every=args.checkpoint_every, device=args.device, seed=args.seed,
            progress=not args.no_progress)
        summary = run_reconstruction_attack(settings)
    except PrivflError as error:
        print(f"privfl: error: {error}", file=sys.stderr)
        return 2
    print(summary["table"], end="")
    rec = summary["reconstructor"]
    print(f"reconstructor: {rec['parameters']:,} parameters, {rec['steps']} steps, trained "
          f"{rec['train_seconds']:.0f} s; guidance w = {summary['guidance']['chosen']:g}")
    print(f"results: {Path(args.out) / 'attack_results.md'} (.csv, .json), grid: {Path(args.out) / 'attack_grid.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(reconstruct_main())
