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


def noise_label(privacy: dict[str, Any]) -> str:
    """The noise sources of a run's private releases (``secure``, ``seeded*``, ``hardened``, joined by ``+``), or
    ``-`` when it made none; ``*`` marks seeded noise, whose epsilon holds only against whoever lacks the config."""
    sources = privacy.get("noise_sources") or {}
    names = [f"{name}*" if name == "seeded" else name for name in sorted(sources) if sources[name]]
    return "+".join(names) or "-"


def trust_model(mode: str | None, secure_aggregation: dict[str, Any] | None = None) -> str:
    """Whom a training mode's epsilons hold against, in a table's words: ``untrusted server`` (record-level and local:
    each client noises its own release), ``trusted aggregator`` (central: the server sees each contribution),
    ``simulated secure aggregation`` (distributed in process: the server adds the releases itself; the epsilons
    hold against an observer of each round's sum) or ``SecAgg+ secure aggregation`` (distributed on Flower), ``not
    private`` (no DP: epsilon inf). A novel client's release is always noised on the client (untrusted server)."""
    if mode is None:
        return "not private"
    if mode == "central":
        return "trusted aggregator"
    if mode == "distributed":
        protocol = (secure_aggregation or {}).get("protocol") or "simulated"
        return f"{protocol} secure aggregation"
    return "untrusted server"


def relation_label(privacy: dict[str, Any]) -> str:
    """The neighbouring relations a run's epsilons hold under (``privacy.relations``, from its ledgers), or ``-``
    for a run that released nothing privately."""
    return "; ".join(privacy.get("relations") or []) or "-"


def epsilon_source(privacy: dict[str, Any]) -> str:
    """Where a table's epsilons come from: the run's records they were recomputed from by the accountant
    (``privacy.epsilon_source``); ``summary.json`` for a summary that does not say (written by an older privfl, its
    figures not recomputed)."""
    return str(privacy.get("epsilon_source") or "summary.json")


#: The caveat printed under a table with a seeded-noise run (see ``privacy.seeded_noise`` in a run's summary).
SEEDED_CAVEAT = ("* seeded noise: drawn from generators seeded from the run config, which the server holds; whoever "
                 "knows the config can regenerate and subtract it, so those epsilons hold only against an observer "
                 "without it (research runs; use noise 'secure' otherwise)")


def comparison_table(summaries: list[dict[str, Any]]) -> str:
    """A fixed-width table: method, novel-client accuracy (mean +- SEM over clients, %), pooled accuracy,
    training-client validation accuracy, max epsilon per role with the relation they hold under
    (:func:`relation_label`), the training mode's trust model (:func:`trust_model`) and the records the accountant
    computed them from (:func:`epsilon_source`), the noise source, rounds, wall time, and (for summaries that carry
    them, as ``privfl report`` gives) the run's status and directory. Seeded noise gets its caveat under the
    table."""
    header = ["method", "novel acc (mean +- SEM)", "novel pooled", "train val acc", "eps train", "eps novel",
              "relation", "trust", "eps from", "noise", "round", "wall s"]
    located = any("run_dir" in s for s in summaries)
    if located:
        header += ["status", "run"]
    rows = [header]
    for s in summaries:
        novel, val, privacy = s.get("novel", {}), s.get("training_val", {}), s.get("privacy", {})
        pooled = _num(novel.get("accuracy_pooled"))
        wall = _num(s.get("wall_time_s"))
        rounds = (f"{s.get('selected_round')}/{s.get('rounds_completed')}" if s.get("selected_round") is not None
                  else f"{s.get('rounds_completed')}/{s.get('rounds_planned', '?')}")
        row = [
            str(s.get("method")), format_mean_sem(novel),
            "n/a" if math.isnan(pooled) else f"{pooled:.2f}",
            format_mean_sem(val), format_epsilon(privacy.get("epsilon_max_training")),
            format_epsilon(privacy.get("epsilon_max_novel")), relation_label(privacy),
            trust_model(privacy.get("training_mode"), privacy.get("secure_aggregation")), epsilon_source(privacy),
            noise_label(privacy), rounds,
            "n/a" if math.isnan(wall) else f"{wall:.1f}",
        ]
        if located:
            row += [str(s.get("status", "finished")).split(":")[0], str(s.get("run_dir", "-"))]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if any("*" in row[header.index("noise")] for row in rows[1:]):
        lines.append(SEEDED_CAVEAT)
    return "\n".join(lines)
