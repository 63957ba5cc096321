"""Tables people read: one run's summary, or several runs side by side."""

from __future__ import annotations

import math
from typing import Any


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def format_mean_sem(block: dict[str, Any]) -> str:
    mean, sem = _num(block.get("accuracy_mean")), _num(block.get("accuracy_sem"))
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.2f} +- {sem:.2f}" if not math.isnan(sem) else f"{mean:.2f}"


def format_epsilon(value: Any) -> str:
    eps = _num(value)
    return "inf" if eps == float("inf") else ("n/a" if math.isnan(eps) else f"{eps:.3g}")


def comparison_table(summaries: list[dict[str, Any]]) -> str:
    """A fixed-width table: method, novel-client accuracy (mean +- SEM over clients, %), pooled accuracy,
    training-client validation accuracy, max epsilon per role, rounds and wall time."""
    header = ["method", "novel acc (mean +- SEM)", "novel pooled", "train val acc", "eps train", "eps novel",
              "round", "wall s"]
    rows = [header]
    for s in summaries:
        novel, val, privacy = s.get("novel", {}), s.get("training_val", {}), s.get("privacy", {})
        pooled = _num(novel.get("accuracy_pooled"))
        rows.append([
            str(s.get("method")), format_mean_sem(novel),
            "n/a" if math.isnan(pooled) else f"{pooled:.2f}",
            format_mean_sem(val), format_epsilon(privacy.get("epsilon_max_training")),
            format_epsilon(privacy.get("epsilon_max_novel")),
            f"{s.get('selected_round')}/{s.get('rounds_completed')}", f"{_num(s.get('wall_time_s')):.1f}",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
