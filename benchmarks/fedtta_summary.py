"""Summarise the stored FedTTA-family runs: per-seed accuracies, paired differences and one plot.

Nothing is trained here: it reads what ``benchmarks/fedtta_mnist.py`` stored and derives the tables of
``benchmarks/README.md`` from it, so every mean, SEM and p-value there can be regenerated.

* ``family``: ``results/fedtta_family_code.json``, one federation per seed (all 50 training clients per round,
  selection every 10 rounds); differences are TENT minus each method, paired by seed.
* ``partition<P>``: ``results/fedtta_family_partition<P>_code.json``, one fixed federation, training seeds varying
  (every round from 100 evaluated); the best-validation figure and the oracle best test over rounds.
* ``rotated``: ``results/fedtta_rotated_code.json``, concept shift; differences are each method minus FedAvg, paired by
  seed, beside the paper's gaps to its best baseline (FedTTA +1.4, FedTTA++ +1.6, read from its prose).
* ``rotated_factorial``: the same file's mu x eta_ad ablation (FedTTA-Prox's two settings that differ from FedTTA's):
  each setting's effect on the one-step accuracy at either level of the other, paired by seed.
* ``rotated_early_stopping``: FedTTA++ minus one step on the same training, for three of those four trainings;
  ``rotated_repeat`` compares FedTTA's training run again (to serve FedTTA++) with the stored FedTTA runs.

Writes ``results/fedtta_summary.json`` and ``results/fedtta_summary.png`` and prints Markdown tables.

    python benchmarks/fedtta_summary.py
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from scipy import stats

from privfl.metrics import mean_sem
from privfl.provenance import numerics

RESULTS = Path(__file__).parent / "results"
KEY = re.compile(r"^(?P<training>[a-z0-9_]+)-seed(?P<seed>\d+)-rounds(?P<rounds>\d+)-fraction(?P<fraction>[\d.]+)"
                 r"(?P<extra>.*)$")
FAMILY = ("fedtta", "fedtta_prox", "fedtta_pp", "tent", "fedtta_prox_no_tta")
ROTATED = ("fedtta", "fedtta_prox", "fedtta_pp", "fedtta_pp_adapted_only", "fedtta_prox_no_tta", "fedavg", "tent",
           "odpflhn")
# The paper gives the concept-shift results only as gaps to its best baseline, in the prose of section 4.5.
ROTATED_PAPER_GAP = {"fedtta": 1.4, "fedtta_pp": 1.6}
# FedTTA-Prox differs from FedTTA in two MNIST Table-4 settings, mu (0.01 against 0) and eta_ad (0.001 against 0.01):
# two ablation trainings complete the 2 x 2, (mu, eta_ad) -> the one-step variant trained so.
ROTATED_FACTORIAL = {(0.0, 0.01): "fedtta", (0.01, 0.001): "fedtta_prox", (0.01, 0.01): "fedtta_prox_adlr01",
                     (0.0, 0.001): "fedtta_adlr001"}
ROTATED_ABLATION = ("fedtta_prox_adlr01", "fedtta_pp_adlr01", "fedtta_pp_adapted_only_adlr01", "fedtta_adlr001",
                    "fedtta_repeat", "fedtta_pp_mu0", "fedtta_pp_adapted_only_mu0")
# FedTTA++ against one test-time step on the same training, which isolates early stopping from the training:
# (mu, eta_ad) of the training -> (its one-step variant, its early-stopped variants). fedtta_repeat is FedTTA's
# training run again to serve FedTTA++ too; the summary checks it against the stored FedTTA runs.
ROTATED_EARLY_STOPPING = {(0.0, 0.01): ("fedtta_repeat", ("fedtta_pp_mu0", "fedtta_pp_adapted_only_mu0")),
                          (0.01, 0.01): ("fedtta_prox_adlr01", ("fedtta_pp_adlr01", "fedtta_pp_adapted_only_adlr01")),
                          (0.01, 0.001): ("fedtta_prox", ("fedtta_pp", "fedtta_pp_adapted_only"))}
LABEL = {"fedtta": "FedTTA", "fedtta_prox": "FedTTA-Prox", "fedtta_pp": "FedTTA++",
         "fedtta_pp_adapted_only": "FedTTA++ (Alg. 1)", "fedtta_prox_no_tta": "no adaptation", "tent": "TENT",
         "fedavg": "FedAvg", "odpflhn": "ODPFL-HN",
         "fedtta_prox_adlr01": "FedTTA-Prox, eta_ad 0.01", "fedtta_pp_adlr01": "FedTTA++, eta_ad 0.01",
         "fedtta_pp_adapted_only_adlr01": "FedTTA++ (Alg. 1), eta_ad 0.01", "fedtta_adlr001": "FedTTA, eta_ad 0.001",
         "fedtta_repeat": "FedTTA, repeated", "fedtta_pp_mu0": "FedTTA++, mu 0, eta_ad 0.01",
         "fedtta_pp_adapted_only_mu0": "FedTTA++ (Alg. 1), mu 0, eta_ad 0.01"}


def per_seed(path: Path, *, rounds: int = 200, fraction: str = "1", extra: str = "") -> dict:
    """``{variant: {seed: {"accuracy", "oracle", "paper"}}}`` for the runs of ``path`` with these settings.

    A training serves several variants (FedTTA-Prox serves FedTTA++ and the no-adaptation ablation), so the variant,
    not the training, is the row. ``oracle`` is the best novel accuracy over evaluated rounds where it was tracked.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run benchmarks/fedtta_mnist.py for it first")
    table: dict[str, dict[int, dict]] = {}
    for key, run in json.loads(path.read_text()).items():
        match = KEY.match(key)
        if not match:   # a key this script cannot read must not vanish from the tables unseen
            raise ValueError(f"{path.name}: key {key!r} does not read as <training>-seed<S>-rounds<R>-fraction<F>")
        if (int(match["rounds"]), match["fraction"], match["extra"]) != (rounds, fraction, extra):
            continue
        for variant, result in run["variants"].items():
            oracle = result.get("best_test_over_rounds")
            table.setdefault(variant, {})[int(match["seed"])] = {
                "accuracy": result["novel"]["accuracy_mean"], "paper": result.get("paper"),
                "oracle": oracle["accuracy"] if oracle else None, "selected_round": result["selected_round"],
                "adaptations": result.get("novel_adaptations"), "settings": run["settings"],
                "train_losses": [h.get("train_loss") for h in run["history"]]}
    return table


def describe(values: list[float]) -> dict:
    """Mean, standard deviation and SEM over seeds (``None`` where one value cannot give them)."""
    mean, sem = mean_sem(values)
    sem = None if math.isnan(sem) else sem
    return {"n": len(values), "mean": mean, "sd": None if sem is None else sem * math.sqrt(len(values)), "sem": sem}


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """``a - b`` on the seeds both have: per seed, its description and a paired t-test's two-sided p-value."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    out = {"seeds": seeds, "per_seed": diffs, **describe(diffs)}
    out["p_value"] = float(stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue) \
        if len(seeds) > 1 else None
    return out


def summarise(table: dict, variants: tuple, *, references: tuple[str, ...], reference_first: bool) -> dict:
    """Per variant: accuracies per seed, their description, the oracle's, and paired differences to ``references``.

    ``reference_first`` gives ``reference - variant`` under ``<reference>_minus_it`` (TENT minus each, the order the
    FedTTA-family benchmark reads), otherwise ``variant - reference`` under ``minus_<reference>`` (each minus a
    baseline, as the paper's concept-shift gaps read).
    """
    out = {}
    for variant in variants:
        if variant not in table:
            continue
        acc = {s: r["accuracy"] for s, r in sorted(table[variant].items())}
        oracle = {s: r["oracle"] for s, r in sorted(table[variant].items()) if r["oracle"] is not None}
        entry = {"per_seed": acc, **describe(list(acc.values())),
                 "paper": next(iter(table[variant].values()))["paper"],
                 "selected_round": {s: r["selected_round"] for s, r in sorted(table[variant].items())}}
        if oracle:
            entry["oracle"] = {"per_seed": oracle, **describe(list(oracle.values()))}
        logs = [r["adaptations"] for r in table[variant].values() if r["adaptations"]]
        # Early stopping serves an iterate before its last step (patience); a fixed-step variant serves its last one.
        # (Testing for more than one step taken would miss an early-stopped run that kept the unadapted model.)
        if any(c != t for log in logs for c, t in zip(log["chosen_step"], log["steps_taken"], strict=True)):
            chosen = [step for log in logs for step in log["chosen_step"]]
            entry["served_iterate"] = {"clients": len(chosen),
                                       "count_by_step": {str(k): chosen.count(k) for k in sorted(set(chosen))},
                                       "most_steps_taken": max(max(log["steps_taken"]) for log in logs)}
        for reference in references:
            ref = accuracy_by_seed(table.get(reference, {}))
            if variant != reference and ref:
                entry[f"{reference}_minus_it" if reference_first else f"minus_{reference}"] = \
                    paired(ref, acc) if reference_first else paired(acc, ref)
        out[variant] = entry
    return out


def accuracy_by_seed(runs: dict[int, dict]) -> dict[int, float]:
    """``{seed: novel accuracy}`` of one variant's runs (a ``per_seed`` row)."""
    return {s: r["accuracy"] for s, r in runs.items()}


def require_settings(table: dict, variant: str, cell: tuple[float, float]) -> None:
    """Refuse a run of ``variant`` whose stored (mu, eta_ad) is not ``cell`` (mu defaults to 0, FedTTA's), so a
    hard-coded table of cells cannot drift from what was trained."""
    for seed, r in table.get(variant, {}).items():
        ran = (r["settings"].get("mu", 0.0), r["settings"]["adapt_lr"])
        if ran != cell:
            raise ValueError(f"{variant} seed {seed} ran with (mu, eta_ad) {ran}, not {cell}")


def factorial(table: dict) -> dict:
    """The effect of each of mu and eta_ad at either level of the other, paired by seed (rotated MNIST).

    ``mu_at_eta_ad_<e>`` is the one-step accuracy with mu = 0.01 minus with mu = 0, both trained with eta_ad = e;
    ``eta_ad_0.01_at_mu_<m>`` is eta_ad 0.01 minus 0.001, both with mu = m. Contrasts whose runs are missing are left
    out. Each cell's stored training settings must be the cell's (``require_settings``).
    """
    acc = {}
    for cell, v in ROTATED_FACTORIAL.items():
        require_settings(table, v, cell)
        if v in table:
            acc[cell] = accuracy_by_seed(table[v])
    contrasts = {f"mu_at_eta_ad_{e:g}": ((0.01, e), (0.0, e)) for e in (0.01, 0.001)}
    contrasts |= {f"eta_ad_0.01_at_mu_{m:g}": ((m, 0.01), (m, 0.001)) for m in (0.0, 0.01)}
    return {name: paired(acc[a], acc[b]) for name, (a, b) in contrasts.items() if a in acc and b in acc}


def early_stopping(table: dict) -> dict:
    """FedTTA++ minus one test-time step, both served from the same training, paired by seed (rotated MNIST).

    Keyed ``mu_<m>_eta_ad_<e>`` by the training's settings, then by the early-stopped variant. Every variant of a cell
    must have run with the cell's settings (``require_settings``). Cells whose runs are missing are left out.
    """
    out = {}
    for (mu, eta_ad), (one_step, stopped) in ROTATED_EARLY_STOPPING.items():
        for v in (one_step, *stopped):
            require_settings(table, v, (mu, eta_ad))
        base = accuracy_by_seed(table.get(one_step, {}))
        cell = {v: paired(accuracy_by_seed(table[v]), base) for v in stopped if v in table and base}
        if cell:
            out[f"mu_{mu:g}_eta_ad_{eta_ad:g}"] = cell
    return out


def repeat(again: dict[int, dict], stored: dict[int, dict]) -> dict:
    """A training run again against its stored runs: per seed, whether every logged training loss is the same to the
    last digit (a run without logged losses never counts as the same), and the accuracy difference (again minus
    stored), paired by seed."""
    seeds = sorted(set(again) & set(stored))
    same = [s for s in seeds if again[s]["train_losses"] == stored[s]["train_losses"]
            and any(loss is not None for loss in again[s]["train_losses"])]
    return {"identical_training": same, "different_training": [s for s in seeds if s not in same],
            **paired(accuracy_by_seed(again), accuracy_by_seed(stored))}


def fmt(d: dict | None, key: str = "sem") -> str:
    if d is None:
        return "-"
    spread = d.get(key)
    return f"{d['mean']:.2f}" + ("" if spread is None else f" +- {spread:.2f}")


def fmt_diff(diff: dict | None) -> str:
    if diff is None:
        return ""
    if diff["p_value"] is None:     # one common seed: no spread, no test
        return f"{diff['mean']:+.2f} (1 seed)"
    return f"{diff['mean']:+.2f} +- {diff['sem']:.2f} ({diff['n']} seeds, p = {diff['p_value']:.2g})"


def joined(values, spec: str) -> str:
    return " / ".join(format(x, spec) for x in values)


def markdown(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    for line in (header, ["---"] * len(header), *rows):
        print("| " + " | ".join(line) + " |")


def print_tables(summary: dict) -> None:
    if summary.get("family"):
        markdown("One partition per seed (mean +- SEM over seeds)",
                 ["method", "n", "mean +- SEM", "per seed", "TENT minus it, paired (p)", "paper"],
                 [[LABEL[v], str(e["n"]), fmt(e), joined(e["per_seed"].values(), ".2f"),
                   fmt_diff(e.get("tent_minus_it")), "" if e["paper"] is None else f"{e['paper']:.2f}"]
                  for v, e in summary["family"].items()])
    for name in sorted(k for k in summary if k.startswith("partition")):
        markdown(f"{name} (mean +- sd over training seeds)",
                 ["method", "best-validation round", "per seed", "oracle best test over rounds", "TENT minus it"],
                 [[LABEL[v], fmt(e, "sd"), joined(e["per_seed"].values(), ".2f"), fmt(e.get("oracle"), "sd"),
                   joined(e["tent_minus_it"]["per_seed"], "+.2f") if "tent_minus_it" in e else ""]
                  for v, e in summary[name].items()])
    if summary.get("rotated"):
        markdown("Rotated MNIST (mean +- SEM over seeds)",
                 ["method", "n", "mean +- SEM", "minus FedAvg, mean +- SEM (p)", "minus FedAvg per seed",
                  "minus ODPFL-HN (p)", "paper gap to its best baseline"],
                 [[LABEL[v], str(e["n"]), fmt(e), fmt_diff(e.get("minus_fedavg")),
                   joined(e["minus_fedavg"]["per_seed"], "+.1f") if "minus_fedavg" in e else "",
                   fmt_diff(e.get("minus_odpflhn")),
                   f"+{ROTATED_PAPER_GAP[v]}" if v in ROTATED_PAPER_GAP else ""]
                  for v, e in summary["rotated"].items()])
    per_variant = [name for name in summary if name in ("family", "rotated") or name.startswith("partition")]
    early = [(name, v, e["served_iterate"]) for name in per_variant
             for v, e in summary[name].items() if "served_iterate" in e]
    if early:
        markdown("Early-stopped adaptation: which iterate each novel client was served (0 = unadapted)",
                 ["runs", "method", "novel clients (seeds that stored the log)", "clients by served iterate",
                  "most steps taken"],
                 [[name, LABEL[v], str(it["clients"]), ", ".join(f"{k}: {c}" for k, c in it["count_by_step"].items()),
                   str(it["most_steps_taken"])] for name, v, it in early])
    if summary.get("rotated_factorial"):
        markdown("Rotated MNIST: mu and eta_ad, one test-time step (paired by seed)",
                 ["contrast", "mean +- SEM (seeds, p)", "per seed"],
                 [[name, fmt_diff(d), joined(d["per_seed"], "+.1f")]
                  for name, d in summary["rotated_factorial"].items()])
    if summary.get("rotated_early_stopping"):
        markdown("Rotated MNIST: FedTTA++ minus one test-time step on the same training (paired by seed)",
                 ["training", "variant", "mean +- SEM (seeds, p)", "per seed"],
                 [[cell, LABEL[v], fmt_diff(d), joined(d["per_seed"], "+.1f")]
                  for cell, ds in summary["rotated_early_stopping"].items() for v, d in ds.items()])
    if summary.get("rotated_repeat"):
        d = summary["rotated_repeat"]
        print(f"\nFedTTA's training run again (to serve FedTTA++): the same training to the last digit on seeds "
              f"{d['identical_training']}, a different one on seeds {d['different_training']}; accuracy repeated "
              f"minus stored, per seed {joined(d['per_seed'], '+.2f')}")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    partitions = sorted(k for k in summary if k.startswith("partition"))
    panels = [k for k in ("family", *partitions, "rotated") if summary.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        entries = summary[name]
        if name == "rotated":   # the ablation trainings are in the tables, not the plot
            shown = [v for v in entries if "minus_fedavg" in entries[v] and v not in ROTATED_ABLATION]
            values = {v: entries[v]["minus_fedavg"]["per_seed"] for v in shown}
            seeds = {v: entries[v]["minus_fedavg"]["seeds"] for v in shown}
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_ylabel("novel accuracy minus FedAvg's, same seed (points)")
            ax.set_title(f"rotated MNIST ({max(len(s) for s in seeds.values())} seeds)")
        else:
            shown = [v for v in entries if v != "fedtta_prox_no_tta"]   # 75-91%: it would flatten the axis
            values = {v: list(entries[v]["per_seed"].values()) for v in shown}
            seeds = {v: list(entries[v]["per_seed"]) for v in shown}
            ax.set_ylabel("novel-client accuracy (%)")
            ax.set_title(f"one partition per seed ({max(len(s) for s in seeds.values())} seeds)" if name == "family"
                         else f"fixed partition {name.removeprefix('partition')} (training seeds)")
        # thin lines join one seed across methods: the pairing the differences rest on
        for seed in sorted({s for v in shown for s in seeds[v]}):
            xs = [i for i, v in enumerate(shown) if seed in seeds[v]]
            ys = [values[shown[i]][seeds[shown[i]].index(seed)] for i in xs]
            ax.plot(xs, ys, color="tab:blue", alpha=0.25, lw=0.8)
        labelled = set()
        for i, v in enumerate(shown):
            ax.scatter([i] * len(values[v]), values[v], s=14, color="tab:blue", zorder=3)
            described = entries[v]["minus_fedavg"] if name == "rotated" else entries[v]
            ax.errorbar(i + 0.18, described["mean"], yerr=described["sem"] or 0.0, fmt="o", color="black", ms=4,
                        capsize=3, zorder=4)
            oracle = entries[v].get("oracle")
            if oracle and name != "rotated":
                ax.scatter([i + 0.32], [oracle["mean"]], marker="^", color="tab:green", s=22, zorder=4,
                           label=None if "oracle" in labelled else "oracle best test over rounds, mean")
                labelled.add("oracle")
            paper = ROTATED_PAPER_GAP.get(v) if name == "rotated" else entries[v].get("paper")
            if paper is not None:
                ax.scatter([i - 0.18], [paper], marker="x", color="tab:red", s=40, zorder=4,
                           label=None if "paper" in labelled else "paper")
                labelled.add("paper")
        ax.set_xticks(range(len(shown)), [LABEL[v] for v in shown], rotation=35, ha="right", fontsize=8)
    handles = {}
    for ax in axes[0]:
        handles.update({h.get_label(): h for h in ax.collections if not h.get_label().startswith("_")})
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("FedTTA family on MNIST: dots are seeds (lines join one seed), black is mean +- SEM", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, nargs="*", default=[24, 25],
                        help="fixed partitions to summarise (results/fedtta_family_partition<P>_code.json)")
    args = parser.parse_args()
    summary = {
        "family": summarise(per_seed(RESULTS / "fedtta_family_code.json"), FAMILY, references=("tent",),
                            reference_first=True),
        **{f"partition{p}": summarise(per_seed(RESULTS / f"fedtta_family_partition{p}_code.json",
                                               extra="-every1-from100"),
                                      FAMILY, references=("tent",), reference_first=True) for p in args.partitions},
    }
    rotated = per_seed(RESULTS / "fedtta_rotated_code.json")
    summary["rotated"] = summarise(rotated, ROTATED + ROTATED_ABLATION, references=("fedavg", "odpflhn"),
                                   reference_first=False)
    summary["rotated_factorial"] = factorial(rotated)
    summary["rotated_early_stopping"] = early_stopping(rotated)
    if "fedtta_repeat" in rotated:
        summary["rotated_repeat"] = repeat(rotated["fedtta_repeat"], rotated["fedtta"])
    summary["numerics"] = numerics()
    (RESULTS / "fedtta_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, RESULTS / "fedtta_summary.png")
    print_tables(summary)
    print(f"\n-> {RESULTS / 'fedtta_summary.json'}, {RESULTS / 'fedtta_summary.png'}")


if __name__ == "__main__":
    main()
