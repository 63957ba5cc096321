"""``privfl attack reconstruct``: train (or reuse) a diffusion reconstructor and attack raw / FedPFT / DP-FedPFT releases.

Protocol (FedPFT paper, App. E; digest ``papers/fedpft.md`` 7 and 8.3 for the CPU scale):

1. Data: the attacker's images ``D_a`` are drawn from the source's training split, the defender's ``D_d`` from its
   test split (disjoint; a source without a test split is cut into two disjoint halves).
2. Embedding ``E``: the frozen backbone (e.g. the ImageNet MobileNetV2 at ``--input-size`` pixels, features cached
   on disk) followed by L2 normalisation.
3. The reconstructor is trained on ``(E(x), x)`` for ``x`` in ``D_a`` at ``--image-size`` (images resized with
   antialiasing), checkpointed to ``OUT/reconstructor.pt`` (``--checkpoint``) and resumed from there when it exists.
4. Near-duplicate filter: the ``--near-duplicate-fraction`` of ``D_d`` most similar (SSIM) to some image of ``D_a``
   is removed from evaluation (the paper: 10 %).
5. Each scheme releases ``E(D_d)`` (:func:`attacks.schemes.make_release`); the reconstructions are scored with
   PSNR / LPIPS (AlexNet) / SSIM under the selections all / attacker / oracle
   (:func:`attacks.schemes.evaluate_release`), beside the nearest-attacker-image baseline (over all of ``D_a`` and
   over a random subset of ``|D_d|`` images, the size of the set-level reconstruction sets).
6. Outputs in ``--out``: ``attack_results.csv``, ``attack_results.md``, ``attack_results.json`` (settings, rows,
   timings) and ``attack_grid.png`` (original / reconstruction per scheme / nearest attacker image).

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
    image_size: int = 16
    block_channels: tuple[int, ...] = (32, 64, 64)
    steps: int = 2000
    batch_size: int = 64
    learning_rate: float = 2e-4
    cond_dropout: float = 0.1
    guidance: float = 2.0
    ddim_steps: int = 20
    samples_per_feature: int = 5
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
        if self.guidance < 0:
            raise ConfigError(f"--guidance must be >= 0, got {self.guidance}")
        from attacks.reconstructor import ReconstructorConfig

        ReconstructorConfig(feature_dim=1, image_size=self.image_size, block_channels=self.block_channels,
                            batch_size=self.batch_size, learning_rate=self.learning_rate,
                            cond_dropout=self.cond_dropout)  # its errors name the setting, before any work


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

_COLUMNS = ("source", "epsilon", "selection", "top", "n", "psnr", "lpips", "ssim", "set_size")


def format_markdown(rows: Sequence[Any]) -> str:
    """The table in the paper's layout (PSNR up, LPIPS down, SSIM up)."""
    lines = ["| source | epsilon | selection | top | n | PSNR ↑ | LPIPS ↓ | SSIM ↑ | set size |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eps = "∞" if math.isinf(r.epsilon) else f"{r.epsilon:g}"
        lines.append(f"| {r.source} | {eps} | {r.selection} | {r.top} | {r.n} | {r.psnr:.2f} | {r.lpips:.3f} | "
                     f"{r.ssim:.3f} | {r.set_size} |")
    return "\n".join(lines) + "\n"


def save_grid(path: Path, panels: Sequence[tuple[str, torch.Tensor]], columns: int = 10) -> Path:
    """A PNG with one row per panel (name, ``[n, C, H, W]`` images on [0, 1]) and ``columns`` images per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(columns, min(len(images) for _, images in panels))
    fig, axes = plt.subplots(len(panels), columns, figsize=(1.1 * columns + 1.6, 1.15 * len(panels)), squeeze=False)
    for row, (name, images) in enumerate(panels):
        for col in range(columns):
            ax = axes[row][col]
            image = images[col].numpy()
            if image.shape[0] == 1:
                ax.imshow(image[0], cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            else:
                ax.imshow(image.transpose(1, 2, 0).clip(0, 1), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle("defender images (top row) and what each attacker gets", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the run --------------------------------------------------------------------------------------------------------

def run_reconstruction_attack(settings: AttackSettings) -> dict[str, Any]:
    """Run the whole attack (see the module docstring); returns the JSON-able summary it also writes."""
    from attacks.metrics import LPIPS
    from attacks.reconstructor import ReconstructorConfig, train_or_resume
    from attacks.schemes import evaluate_release, make_release, nearest_image_baseline
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

    config = ReconstructorConfig(feature_dim=features_a.shape[1], image_size=settings.image_size,
                                 channels=images_a.shape[1], block_channels=settings.block_channels,
                                 batch_size=settings.batch_size, learning_rate=settings.learning_rate,
                                 cond_dropout=settings.cond_dropout)
    checkpoint = Path(settings.checkpoint) if settings.checkpoint else out / "reconstructor.pt"
    started = time.perf_counter()
    reconstructor = train_or_resume(config, features_a, images_a, steps=settings.steps, checkpoint=checkpoint,
                                    device=settings.device, seed=settings.seed,
                                    checkpoint_every=settings.checkpoint_every, progress=settings.progress)
    timings["reconstructor_call_s"] = time.perf_counter() - started
    timings["reconstructor_train_s"] = reconstructor.train_seconds

    started = time.perf_counter()
    kept, max_ssim = near_duplicate_filter(images_d, images_a, fraction=settings.near_duplicate_fraction)
    timings["near_duplicate_filter_s"] = time.perf_counter() - started
    targets = images_d[torch.as_tensor(kept)]

    rows = []
    panels: list[tuple[str, torch.Tensor]] = [("original", targets)]
    releases = []
    for scheme in settings.schemes:
        if scheme == "raw":
            releases.append(make_release("raw", features_d[torch.as_tensor(kept)], yd[kept], num_classes=num_classes))
        elif scheme == "fedpft":
            releases.append(make_release("fedpft", features_d, yd, num_classes=num_classes,
                                         components=settings.components, covariance=settings.covariance,
                                         seed=settings.seed))
        else:
            for eps in settings.eps:
                releases.append(make_release("dp-fedpft", features_d, yd, num_classes=num_classes, epsilon=eps,
                                             delta=settings.delta, covariance=settings.covariance,
                                             seed=settings.seed))
    release_details = []
    for release in releases:
        started = time.perf_counter()
        evaluation = evaluate_release(release, reconstructor, targets, lpips=lpips,
                                      samples_per_feature=settings.samples_per_feature,
                                      top_fractions=settings.top_fractions, guidance_scale=settings.guidance,
                                      num_inference_steps=settings.ddim_steps, seed=settings.seed,
                                      progress=settings.progress)
        rows.extend(evaluation.rows)
        panels.append((release.label, evaluation.matched))
        release_details.append({"source": release.label, "set_level": release.set_level,
                                "features": len(release.features), **release.details,
                                "sampling_s": evaluation.seconds_sampling,
                                "total_s": time.perf_counter() - started})
        if settings.progress:
            print(f"{release.label}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    started = time.perf_counter()
    baseline, matched = nearest_image_baseline(targets, images_a, lpips=lpips, top_fractions=settings.top_fractions)
    rows.extend(baseline)
    panels.append(("nearest attacker image", matched))
    subset = np.random.default_rng(settings.seed + 1).choice(len(images_a), size=min(len(images_a), len(xd)),
                                                             replace=False)
    subset_rows, _ = nearest_image_baseline(targets, images_a[torch.as_tensor(np.sort(subset))], lpips=lpips,
                                            top_fractions=settings.top_fractions,
                                            source=f"nearest attacker image (subset of {len(subset)})")
    rows.extend(subset_rows)
    timings["baseline_s"] = time.perf_counter() - started

    summary = {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
        "protocol": {
            "attacker": f"{len(xa)} images of the {settings.dataset} training split",
            "defender": f"{len(xd)} images of the {settings.dataset} test split",
            "evaluated_defender_images": int(len(kept)),
            "near_duplicates_removed": int(len(xd) - len(kept)),
            "max_ssim_to_attacker_quartiles": [float(q) for q in np.quantile(max_ssim, [0.25, 0.5, 0.75, 1.0])],
            "embedding": f"{settings.backbone} (input {settings.input_size} px), L2-normalised",
            "images": f"{settings.image_size} x {settings.image_size}, antialiased resize, [0, 1]",
            "metrics": "PSNR (data range 1), SSIM (Gaussian window sigma 1.5, population covariances), LPIPS "
                       "v0.1 AlexNet (pretrained; images upsampled to 64 px)",
        },
        "reconstructor": {"parameters": reconstructor.num_parameters, "config": config.to_dict(),
                          "steps": reconstructor.step, "final_loss_mean_100": float(np.mean(reconstructor.losses[-100:])),
                          "first_loss_mean_100": float(np.mean(reconstructor.losses[:100])),
                          "train_seconds": reconstructor.train_seconds, "checkpoint": str(checkpoint)},
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


def build_parser() -> argparse.ArgumentParser:
    d = AttackSettings(out="")
    p = argparse.ArgumentParser(prog="privfl attack reconstruct",
                                description="Diffusion reconstruction attack on raw features, FedPFT and DP-FedPFT "
                                            "releases; PSNR / LPIPS / SSIM table and an image grid.")
    p.add_argument("--out", required=True, help="output folder (tables, grid, reconstructor checkpoint)")
    p.add_argument("--dataset", default=d.dataset, help="an image source of `privfl datasets` (mnist)")
    p.add_argument("--data-root", default=None)
    p.add_argument("--backbone", default=d.backbone, help="frozen feature extractor (mobilenet_v2)")
    p.add_argument("--input-size", type=int, default=d.input_size, help="backbone input pixels (224 in ImageNet)")
    p.add_argument("--schemes", type=_names, default=d.schemes, help="comma-separated: raw,fedpft,dp-fedpft")
    p.add_argument("--eps", type=_floats, default=d.eps, help="DP-FedPFT epsilons, e.g. 1,8")
    p.add_argument("--delta", type=float, default=d.delta, help="DP-FedPFT delta (public)")
    p.add_argument("--components", type=int, default=d.components, help="FedPFT mixture components K")
    p.add_argument("--covariance", default=d.covariance, help="full, diag or spherical")
    p.add_argument("--attacker-images", type=int, default=d.attacker_images)
    p.add_argument("--defender-images", type=int, default=d.defender_images)
    p.add_argument("--image-size", type=int, default=d.image_size, help="reconstruction resolution (16 or 28)")
    p.add_argument("--block-channels", type=_ints, default=d.block_channels, help="U-Net channels per level")
    p.add_argument("--steps", type=int, default=d.steps, help="reconstructor training steps (total)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.learning_rate)
    p.add_argument("--cond-dropout", type=float, default=d.cond_dropout, help="condition dropout probability")
    p.add_argument("--guidance", type=float, default=d.guidance, help="classifier-free guidance scale w")
    p.add_argument("--ddim-steps", type=int, default=d.ddim_steps)
    p.add_argument("--samples-per-feature", type=int, default=d.samples_per_feature,
                   help="reconstructions per feature for the attacker selection (the paper: 10)")
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
            defender_images=args.defender_images, image_size=args.image_size, block_channels=args.block_channels,
            steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, cond_dropout=args.cond_dropout,
            guidance=args.guidance, ddim_steps=args.ddim_steps, samples_per_feature=args.samples_per_feature,
            top_fractions=args.top_fractions, near_duplicate_fraction=args.near_duplicate_fraction,
            checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every, device=args.device, seed=args.seed,
            progress=not args.no_progress)
        summary = run_reconstruction_attack(settings)
    except PrivflError as error:
        print(f"privfl: error: {error}", file=sys.stderr)
        return 2
    print(summary["table"], end="")
    print(f"reconstructor: {summary['reconstructor']['parameters']:,} parameters, "
          f"{summary['reconstructor']['steps']} steps, trained {summary['reconstructor']['train_seconds']:.0f} s")
    print(f"results: {Path(args.out) / 'attack_results.md'} (.csv, .json), grid: {Path(args.out) / 'attack_grid.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(reconstruct_main())
