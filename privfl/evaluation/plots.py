"""Plots of a run, written beside its numbers: the learning curve and novel-client accuracy against label shift."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on these machines
import matplotlib.pyplot as plt  # noqa: E402


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def plot_run(metrics: list[dict[str, Any]], clients: list[dict[str, Any]], out: Path, *, title: str) -> Path:
    """Write ``out`` (PNG): left, mean validation accuracy of training clients (+- SEM) per evaluated round;
    right, each novel client's accuracy against the KL divergence of its label distribution from the nearest
    training client's (the accuracy-versus-shift view of the ODPFL-HN paper)."""
    fig, (curve, shift) = plt.subplots(1, 2, figsize=(10, 4))
    rounds = [r["round"] for r in metrics]
    mean = [_float(r.get("val_accuracy_mean")) for r in metrics]
    sem = [_float(r.get("val_accuracy_sem")) for r in metrics]
    curve.plot(rounds, mean, marker="o", markersize=3)
    curve.fill_between(rounds, [m - (s if math.isfinite(s) else 0) for m, s in zip(mean, sem)],
                       [m + (s if math.isfinite(s) else 0) for m, s in zip(mean, sem)], alpha=0.25)
    curve.set(xlabel="round", ylabel="validation accuracy (%), training clients", title="learning curve")
    curve.grid(alpha=0.3)
    novel = [c for c in clients if c["role"] == "novel" and math.isfinite(_float(c["accuracy"]))]
    if novel:
        shift.scatter([_float(c["label_shift_kl"]) for c in novel], [_float(c["accuracy"]) for c in novel], s=14)
        shift.set(xlabel="KL(novel labels || nearest training client's), nats", ylabel="accuracy (%)",
                  title="novel clients")
    else:
        shift.text(0.5, 0.5, "this method serves no novel clients", ha="center", va="center")
        shift.set_axis_off()
    shift.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
