"""The outputs of ``privfl attack reconstruct`` in ``--out``: the table (:func:`format_markdown`), the image grid
(:func:`save_grid`), the metrics plot (:func:`save_metrics_plot`), and :func:`write_results`, which writes them with
``per_image_scores.csv``, ``attack_results.csv`` and ``attack_results.json`` (:func:`write_summary`).

What each file holds: docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

import csv
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["ATTACK_NAMES", "format_markdown", "save_grid", "save_metrics_plot", "write_results", "write_summary"]

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


def _write_csv(path: Path, columns: Sequence[str], records: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """``attack_results.json``: the run's summary."""
    (out / "attack_results.json").write_text(json.dumps(summary, indent=2, default=str))


def write_results(out: Path, summary: dict[str, Any], rows: Sequence[Any], records: Sequence[dict[str, Any]],
                  panels: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Every output of a run in ``out``: the per-image score ``records``, the ``rows`` as CSV and Markdown, the
    summary, the image grid of ``panels`` and the metrics plot."""
    _write_csv(out / "per_image_scores.csv", _SCORE_COLUMNS, records)
    _write_csv(out / "attack_results.csv", _COLUMNS, [r.to_dict() for r in rows])
    (out / "attack_results.md").write_text(format_markdown(rows))
    write_summary(out, summary)
    save_grid(out / "attack_grid.png", panels,
              title="defender images (top row) and what each attacker shows for them; per-feature rows are the "
                    "attacker's own reconstruction of that image, oracle-matched rows pick the most similar member "
                    "of the attacker's set with the defender's image (ground truth)")
    save_metrics_plot(out / "attack_metrics.png", rows)
