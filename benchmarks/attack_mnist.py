"""Reconstruction attack on MNIST: raw features vs FedPFT vs DP-FedPFT (epsilon 10, 4, 1) vs prior only, the diffusion
reconstructor against decoder baselines, with 95 % bootstrap intervals over three disjoint defender sets.

The FedPFT paper's Tables 3, 6 and 7 (PSNR up, LPIPS down, SSIM up) at CPU scale: ``privfl attack reconstruct
--preset benchmark`` (``attacks/reconstruct_cli.py``):

- backbone: the ImageNet MobileNetV2 (offline weights) at 64 x 64 input (grey repeated to RGB), 1280-d features,
  L2-normalised; features cached outside the repository (``$PRIVFL_CACHE_DIR``, default ``~/.cache/privfl``);
- attacker: all 60,000 images of the MNIST training split (1,000 held out to choose sampling settings and the
  decoders' hyperparameters); defender: for each of the seeds 0, 1, 2 a disjoint set of 500 test images, of which
  the 10 % most similar (SSIM) to an attacker image are not scored (450 per seed);
- reconstructor: diffusers UNet2DModel at 28 x 28 (32-64-128 channels, two residual blocks per level, scale-shift
  norm, mid-block attention, 3.97 M parameters), v-prediction, reading beside x_t the kNN-average decoder's estimate
  (leave-one-out for its training pairs), 8,000 steps at batch 32 in bfloat16 autocast on one CPU thread; DDIM 10
  steps; guidance (scale, interval, rescale) and decoder-guided initialisation chosen on 256
  held-out attacker pairs; 8 samples per raw feature and 4 per mixture feature (medoid for LPIPS and SSIM, mean as
  a posterior-mean estimate for PSNR), and the network's one-step posterior mean (its x_0 prediction from pure noise
  at t = T - 1, averaged over 8 noise draws in antithetic pairs, at the guidance scale w with the best PSNR on the
  held-out pairs);
- baselines on the same pairs: ridge, MLP (1280-1024-1024-784), kNN average, nearest attacker image by feature,
  class-mean image; the oracle nearest attacker image by SSIM;
- releases made by FedPFT's client procedure and recorded by the wire in the defender's ledger, all from the same
  500 defender images per seed: raw; FedPFT diag, K = 10 per class; DP-FedPFT K = 1, diag, public counts, delta 1e-5,
  seeded noise, read with the full-covariance LMMSE post-processing, and the prior-only reading (release ignored).

Beside the rows, the run computes **paired** comparisons (the same defender images scored by two attacks or two
releases; a stratified bootstrap of the per-image differences) and states which differences the intervals separate.

Run (about 2 hours of training on one CPU thread plus about an hour of evaluation; resumable: the reconstructor
checkpoints every 250 steps in ``--work`` and an interrupted run continues):

    OMP_NUM_THREADS=1 python benchmarks/attack_mnist.py --threads 1

Options after ``--`` go to ``privfl attack reconstruct``: e.g. ``-- --guide-decoder mlp --init-weights w.pt --steps
600 --batch-size 64`` fine-tunes trained weights ``w.pt`` to read the (cross-fitted) MLP decoder's estimate instead
of the kNN average's, the run ``benchmarks/README.md`` reports first.

``--preset reduced`` evaluates the same reconstructor (its checkpoint in ``--work`` is reused) on three defender
sets of 250 with fewer samples (``attacks/reconstruct_settings.py``, ``PRESETS``). ``--render-only`` rewrites the
markdown from the JSON and the CSV. Results in ``benchmarks/results/`` under ``attack_mnist`` (``--preset
benchmark``) or ``attack_mnist_reduced``: ``.json`` / ``.md``, ``.csv`` (rows), ``_metrics.png`` and ``_grid.png``;
every scored image in ``--work`` (``per_image_scores.csv`` and ``<stem>_scores.csv.gz``). The JSON and the markdown
name the reconstructor's weights exactly (``reconstructor.weights_sha256``, the sha256 of the checkpoint or exported
file as it was read, and ``made_by``, the command that trained them, which exported weights carry with them) and the
code that made the figures (``numerics``: torch, CPU kernel, threads, code revision).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import platform
import shlex
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attacks.decoders import DECODERS  # noqa: E402
from attacks.reconstruct_cli import settings_from_args  # noqa: E402
from attacks.reconstruct_outputs import ATTACK_NAMES  # noqa: E402
from attacks.reconstruct_run import run_reconstruction_attack  # noqa: E402
from attacks.statistics import bootstrap_cell, separated  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
METRICS = ("psnr", "lpips", "ssim")
HIGHER = {"psnr": True, "lpips": False, "ssim": True}
#: The decoder every other reconstruction is also compared with: the project's first MLP.
REFERENCE = "mlp"


# -- paired comparisons from the per-image scores -------------------------------------------------------------------

def load_scores(path: Path) -> dict[tuple, dict[int, dict[str, np.ndarray]]]:
    """``{(source, epsilon, attack, estimate, level, unit): {seed: {"index": ..., "psnr": ..., ...}}}``."""
    opener = gzip.open if path.suffix == ".gz" else open
    columns: dict[tuple, dict[int, dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    with opener(path, "rt", newline="") as stream:
        for row in csv.DictReader(stream):
            key = (row["source"], row["epsilon"], row["attack"], row["estimate"], row["level"], row["unit"])
            cell = columns[key][int(row["seed"])]
            cell["index"].append(int(row["index"]))
            for m in METRICS:
                value = float(row[m])
                cell[m].append(100.0 if m == "psnr" and math.isinf(value) else value)
    return {k: {s: {m: np.asarray(v) for m, v in c.items()} for s, c in by_seed.items()}
            for k, by_seed in columns.items()}


def write_scores(source: Path, target: Path) -> Path:
    """``source`` (a ``per_image_scores.csv``) gzipped to ``target``, byte-for-byte the same for the same scores (no
    file name or time in the gzip header)."""
    with open(source, "rb") as stream, open(target, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as packed:
        shutil.copyfileobj(stream, packed)
    return target


def paired(scores: dict, a: tuple, b: tuple, *, n_boot: int, seed: int) -> dict[str, dict[str, float]]:
    """Mean of (a - b) over the same defender images, pooled over seeds, with its stratified bootstrap interval."""
    groups = []
    for s in sorted(set(scores[a]) & set(scores[b])):
        x, y = scores[a][s], scores[b][s]
        if not np.array_equal(x["index"], y["index"]):
            raise ValueError(f"{a} and {b} score different images in seed {s}")
        groups.append((np.stack([x[m] - y[m] for m in METRICS], axis=1), None))
    estimate, low, high = bootstrap_cell(groups, n_boot=n_boot, seed=seed)
    return {m: {"mean": float(estimate[i]), "low": float(low[i]), "high": float(high[i])}
            for i, m in enumerate(METRICS)}


def comparisons(scores: dict, rows: list[dict], *, n_boot: int, seed: int) -> dict:
    """The headline (raw, per feature, all images: diffusion against every decoder) and the release ordering
    (set-level, oracle-matched, all images: raw > FedPFT > DP 10 > DP 4 > DP 1 vs prior only)."""
    pooled = "all" if any(r["seed"] == "all" for r in rows) else min(r["seed"] for r in rows)
    cell = {(r["source"], str(r["epsilon"]), r["attack"], r["estimate"], r["level"], r["selection"], r["top"]): r
            for r in rows if r["seed"] == pooled}
    estimates = sorted({r["estimate"] for r in rows if r["attack"] == "diffusion" and r["source"] == "raw"})
    headline = []
    for estimate in estimates:
        for decoder in DECODERS:
            a = ("raw", "inf", "diffusion", estimate, "per-feature", "target")
            b = ("raw", "inf", decoder, "-", "per-feature", "target")
            if a not in scores or b not in scores:
                continue
            ra = cell[("raw", "inf", "diffusion", estimate, "per-feature", "all", "all")]
            rb = cell[("raw", "inf", decoder, "-", "per-feature", "all", "all")]
            difference = paired(scores, a, b, n_boot=n_boot, seed=seed)
            headline.append({"diffusion": estimate, "decoder": decoder, "difference": difference,
                             "cells_separated": {m: separated((ra[f"{m}_low"], ra[f"{m}_high"]),
                                                              (rb[f"{m}_low"], rb[f"{m}_high"])) for m in METRICS},
                             "diffusion_better": {m: (ra[m] > rb[m]) == HIGHER[m] for m in METRICS}})
    order = [("raw", "inf"), ("fedpft, post-processed", "inf")]
    order += sorted({(r["source"], str(r["epsilon"])) for r in rows if r["source"] == "dp-fedpft, post-processed"},
                    key=lambda k: -float(k[1]))
    order += sorted({(r["source"], str(r["epsilon"])) for r in rows if r["source"].startswith("prior only")})
    ordering = []
    kinds = [("diffusion", kind) for kind in ("medoid", "mean", "one-step")] + [(d, "-") for d in DECODERS]
    for attack, kind in kinds:
        for first, second in zip(order, order[1:]):
            a, b = _key(scores, *first, attack, kind), _key(scores, *second, attack, kind)
            if a is None or b is None:
                continue
            ordering.append({"attack": attack, "estimate": (a[3], b[3]), "first": f"{first[0]} ε {_eps(first[1])}",
                             "second": f"{second[0]} ε {_eps(second[1])}",
                             "difference": paired(scores, a, b, n_boot=n_boot, seed=seed)})
    raw = [k for k in scores if k[0] == "raw" and k[4:] == ("per-feature", "target")
           and k[2] not in ("nearest image by SSIM",)]
    reference = ("raw", "inf", REFERENCE, "-", "per-feature", "target")
    against_reference = [{"attack": k[2], "estimate": k[3],
                          "difference": paired(scores, k, reference, n_boot=n_boot, seed=seed)}
                         for k in raw if k != reference and reference in scores]
    return {"headline": headline, "against_reference": against_reference,
            "leaders": leaders(scores, raw, n_boot=n_boot, seed=seed), "ordering": ordering, "seed_scope": pooled}


def _mean(scores: dict, key: tuple, metric: str) -> float:
    """A reconstruction's cell mean: the mean over seeds of its per-seed means (as :func:`bootstrap_cell`)."""
    return float(np.mean([cell[metric].mean() for cell in scores[key].values()]))


def leaders(scores: dict, keys: list[tuple], *, n_boot: int, seed: int) -> dict[str, dict]:
    """For each metric, the reconstruction with the best mean among ``keys`` and its paired difference (leader minus
    other, same images) with every other: ``separated_from`` lists those whose interval excludes 0 in the leader's
    favour, ``not_separated_from`` the others (the claim "X leads on this metric" holds only against the first)."""
    out: dict[str, dict] = {}
    if len(keys) < 2:
        return out
    for m in METRICS:
        sign = 1.0 if HIGHER[m] else -1.0
        best = max(keys, key=lambda k: sign * _mean(scores, k, m))
        separated_from, not_separated = [], []
        for other in keys:
            if other == best:
                continue
            d = paired(scores, best, other, n_boot=n_boot, seed=seed)[m]
            entry = {"attack": other[2], "estimate": other[3], **d}
            (separated_from if sign * d["low"] > 0 and sign * d["high"] > 0 else not_separated).append(entry)
        out[m] = {"attack": best[2], "estimate": best[3], "mean": _mean(scores, best, m),
                  "separated_from": separated_from, "not_separated_from": not_separated}
    return out


def _key(scores: dict, source: str, epsilon: str, attack: str, kind: str) -> tuple | None:
    """The set-level target scores of (source, epsilon, attack) whose estimate is of ``kind`` (medoid, mean,
    one-step, -)."""
    for key in scores:
        if key[:3] == (source, epsilon, attack) and key[4:] == ("set-level", "target") and key[3].startswith(kind):
            return key
    return None


# -- rendering ------------------------------------------------------------------------------------------------------

def _eps(value) -> str:
    value = math.inf if value == "inf" else float(value)
    return "∞" if math.isinf(value) else "ignored" if value == 0 else f"{value:.3g}"


def _ci(row: dict, metric: str) -> str:
    d = 2 if metric == "psnr" else 3
    return f"{row[metric]:.{d}f} [{row[f'{metric}_low']:.{d}f}, {row[f'{metric}_high']:.{d}f}]"


def _diff(d: dict, metric: str) -> str:
    digits = 2 if metric == "psnr" else 3
    x = d[metric]
    mark = "" if x["low"] <= 0 <= x["high"] else " *"
    return f"{x['mean']:+.{digits}f} [{x['low']:+.{digits}f}, {x['high']:+.{digits}f}]{mark}"


def _table(rows: list[dict], title: bool = True) -> list[str]:
    lines = ["| release | attack | estimate | ε (ledger) | level | selection | top | seed | n | ground truth | "
             "PSNR ↑ [95% CI] | LPIPS ↓ [95% CI] | SSIM ↑ [95% CI] |", "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['source']} | {ATTACK_NAMES.get(r['attack'], r['attack'])} | {r['estimate']} | "
                     f"{_eps(r['epsilon'])} | {r['level']} | {r['selection']} | {r['top']} | {r['seed']} | {r['n']} | "
                     f"{r['ground_truth']} | {_ci(r, 'psnr')} | {_ci(r, 'lpips')} | {_ci(r, 'ssim')} |")
    return lines


def read_rows(path: Path) -> list[dict]:
    """The rows of a results CSV (``attack_results.csv``), numbers as floats."""
    numeric = {f"{m}{end}" for m in METRICS for end in ("", "_low", "_high")}
    with open(path, newline="") as stream:
        return [{k: (float(v) if k in numeric and v != "" else v) for k, v in row.items()}
                for row in csv.DictReader(stream)]


def render_markdown(summary: dict, rows: list[dict]) -> str:
    """The results page of one run: ``summary`` without its rows, ``rows`` as :func:`read_rows` gives them."""
    stem = results_stem(summary["settings"].get("preset") or "benchmark", summary["settings"].get("decoders_only"))
    scope = summary["comparisons"]["seed_scope"]
    out = _intro_lines(summary, stem)
    out += _headline_lines(summary["comparisons"], rows, scope)
    out += _release_ordering_lines(summary["comparisons"], rows, scope)
    out += _top_fraction_lines(rows, scope)
    out += _sampling_lines(summary)
    out += ["", "## Decoders (hyperparameters chosen on the held-out attacker pairs, never the defender's images)",
            ""] + _decoder_lines(summary["decoders"])
    out += _release_lines(summary)
    out += ["", f"Every row (attacker and oracle top fractions per seed, every decoder): `{stem}.csv`.", ""]
    return "\n".join(out) + "\n"


def _intro_lines(summary: dict, stem: str) -> list[str]:
    """The page's title, what produced it and the files beside it, and the protocol, reconstructor and run time."""
    p, rec = summary["protocol"], summary["reconstructor"]
    sampling, device = summary["sampling"], summary["device"]
    seeds = [s["seed"] for s in p["seeds"]]
    out = ["# Reconstruction attack on MNIST (MobileNetV2 features): raw vs FedPFT vs DP-FedPFT vs prior only", "",
           f"Produced by `{summary.get('command', 'python benchmarks/attack_mnist.py')}` (`privfl attack "
           f"reconstruct --preset {summary['settings'].get('preset') or 'benchmark'}`); rows in `{stem}.csv`, "
           f"every scored image in `{stem}_scores.csv.gz` (the paired comparisons below are computed from it), "
           f"figures `{stem}_metrics.png` and `{stem}_grid.png`.", "",
           f"- Attacker: {p['attacker']}. Defender: {p['defender']}; per seed "
           + ", ".join(f"{s['evaluated']} scored ({s['near_duplicates_removed']} near-duplicates of attacker images "
                       f"not scored)" for s in p["seeds"][:1]) + f"; seeds {seeds}.",
           f"- Embedding: {p['embedding']}. Images: {p['images']}. Metrics: {p['metrics']}.",
           f"- Intervals: {p['intervals']}; `seed all` rows pool the seeds (stratified).",
           f"- Device: {device['device']} ({device['precision']}, {device['threads']} thread(s), torch "
           f"{device['torch']})."]
    if rec is None:
        out += ["- **No diffusion reconstructor in this run** (`--decoders-only`): the decoders alone, on the "
                "benchmark's attacker pairs, defender images and metric functions. The reconstructor's rows and its "
                "paired comparisons with these decoders come from a run with its weights (`benchmarks/README.md`)."]
    else:
        out += [_reconstructor_line(rec), weights_line(rec),
                f"- Sampling chosen on {sampling['held_out_pairs']} held-out attacker pairs: **{sampling['label']}** "
                f"(decoder-guided start from the {sampling['init_decoder']} decoder when `init` is shown)"
                + (f"; the one-step posterior mean's guidance scale **w = {sampling['one_step_guidance']:g}** (by "
                   f"mean PSNR)." if sampling.get("one_step_candidates") else ".")]
    return out + [f"- Whole run: {summary['timings_s']['wall_s'] / 60:.0f} min.", ""]


def _headline_lines(comparisons_: dict, rows: list[dict], scope) -> list[str]:
    """The headline section: raw features, per feature, all scored images; its leaders and paired differences."""
    out = ["## Headline: raw features, per feature, all scored images (no ground truth used)", "",
           f"Seeds pooled ({scope}); each cell a mean over the scored images with its 95% interval.", ""]
    head = [r for r in rows if r["source"] == "raw" and r["level"] == "per-feature" and r["selection"] == "all"
            and r["seed"] == scope]
    out += _table(head) + [""]
    if comparisons_.get("leaders"):
        out += ["Which reconstruction leads on each metric (best mean; leader minus other over the same images, "
                "seeds pooled, 95% paired interval):", ""] + _leader_lines(comparisons_["leaders"]) + [""]
    if comparisons_.get("against_reference"):
        out += [f"Paired differences against the project's first {ATTACK_NAMES[REFERENCE]} (row minus it, same "
                f"images; `*`: excludes 0):", "", "| reconstruction | PSNR | LPIPS (negative = better) | SSIM |",
                "|---|---|---|---|"]
        for c in comparisons_["against_reference"]:
            out.append(f"| {_name(c['attack'], c['estimate'])} | {_diff(c['difference'], 'psnr')} | "
                       f"{_diff(c['difference'], 'lpips')} | {_diff(c['difference'], 'ssim')} |")
        out += [""]
    return out + _diffusion_against_decoder_lines(comparisons_["headline"])


def _diffusion_against_decoder_lines(headline: list[dict]) -> list[str]:
    """The paired differences, diffusion minus each decoder, over the same images (nothing but a blank line when the
    run has no diffusion reconstructor)."""
    out = []
    if headline:
        out += ["Paired differences, diffusion minus decoder, over the same images (95% interval; `*`: excludes "
                "0):", "", "| diffusion estimate | decoder | PSNR | LPIPS (negative = diffusion better) | SSIM | "
                "cell intervals separate (PSNR / LPIPS / SSIM) |", "|---|---|---|---|---|---|"]
    for c in headline:
        sep = " / ".join(("yes" if c["cells_separated"][m] else "no") + (
            "" if c["diffusion_better"][m] else " (decoder better)") for m in METRICS)
        out.append(f"| {c['diffusion']} | {ATTACK_NAMES.get(c['decoder'], c['decoder'])} | "
                   f"{_diff(c['difference'], 'psnr')} | {_diff(c['difference'], 'lpips')} | "
                   f"{_diff(c['difference'], 'ssim')} | {sep} |")
    return out + [""]


def _release_ordering_lines(comparisons_: dict, rows: list[dict], scope) -> list[str]:
    """The release ordering section: set-level, oracle-matched, all images, and the paired differences between
    consecutive releases."""
    out = ["## Release ordering: set-level, every defender image matched to its most similar reconstruction "
           "(oracle-matched), all images", ""]
    order = [r for r in rows if r["level"] == "set-level" and r["selection"] == "all" and r["seed"] == scope
             and r["attack"] in ("diffusion", "nearest image by SSIM", "mlp", "nn")]
    out += _table(order) + [""]
    out += ["Paired differences between consecutive releases (first minus second, same images; `*`: excludes 0):",
            "", "| attack | first | second | PSNR | LPIPS | SSIM |", "|---|---|---|---|---|---|"]
    for c in comparisons_["ordering"]:
        if c["attack"] in ("diffusion", "mlp", "nn"):
            out.append(f"| {ATTACK_NAMES.get(c['attack'], c['attack'])} ({c['estimate'][0]}) | {c['first']} | "
                       f"{c['second']} | {_diff(c['difference'], 'psnr')} | {_diff(c['difference'], 'lpips')} | "
                       f"{_diff(c['difference'], 'ssim')} |")
    return out + [""]


def _top_fraction_lines(rows: list[dict], scope) -> list[str]:
    """The top-fraction sections: set-level oracle (the paper's Table 3 selection), and raw per feature."""
    out = ["## Set-level oracle top fraction (the paper's Table 3 selection), seeds pooled", ""]
    out += _table([r for r in rows if r["level"] == "set-level" and r["selection"] == "oracle" and r["seed"] == scope
                   and r["attack"] in ("diffusion", "nearest image by SSIM", "mlp", "nn")]) + [""]
    out += ["## Raw features, per feature, attacker and oracle top fraction, seeds pooled", ""]
    return out + _table([r for r in rows if r["source"] == "raw" and r["level"] == "per-feature"
                         and r["selection"] != "all" and r["seed"] == scope]) + [""]


def _sampling_lines(summary: dict) -> list[str]:
    """The sampling settings tried on the attacker's held-out pairs (none without a reconstructor)."""
    sampling = summary["sampling"]
    out = []
    if sampling:
        out += ["## Sampling settings on the attacker's held-out pairs (one sample per pair, same starting noise)",
                "", "| candidate | mean SSIM | mean PSNR |", "|---|---|---|"]
        for c in sampling["guidance_candidates"] + sampling["init_candidates"]:
            out.append(f"| {c['label']} | {c['ssim']:.3f} | {c['psnr']:.2f} |")
    if sampling and sampling.get("one_step_candidates"):
        draws = summary["settings"]["one_step_draws"]
        out += ["", f"The one-step posterior mean's guidance scale on the same pairs ({draws} draws in antithetic "
                    f"pairs, the same for every scale; chosen by mean PSNR):", "",
                "| w | mean SSIM | mean PSNR |", "|---|---|---|"]
        for c in sampling["one_step_candidates"]:
            out.append(f"| {c['guidance_scale']:g} | {c['ssim']:.3f} | {c['psnr']:.2f} |")
    return out


def _release_lines(summary: dict) -> list[str]:
    """The releases of the first seed, as the wire recorded them."""
    seeds = [s["seed"] for s in summary["protocol"]["seeds"]]
    out = ["", "## Releases (seed 0, as the wire recorded them)", "",
           "| release | ε requested | ε (ledger) | bytes | set size | mean release weight (all / top direction) |",
           "|---|---|---|---|---|---|"]
    for r in summary["releases"]:
        if r["seed"] != seeds[0]:
            continue
        post = r.get("postprocessing", {})
        weights = "-" if "mean_release_weight" not in post else \
            f"{post['mean_release_weight']:.2g} / {post['top_direction_mean_weight']:.2g}"
        out.append(f"| {r['source']} | {_eps(r.get('requested_epsilon', 'inf'))} | {_eps(r['ledger']['epsilon'])} | "
                   f"{r['bytes']:,} | {r['set_size']} | {weights} |")
    return out


def _reconstructor_line(rec: dict) -> str:
    return (f"- Reconstructor: {rec['parameters']:,} parameters, {rec['steps']:,} steps, "
            f"**{rec['train_seconds'] / 60:.0f} min of training** "
            + ("(on another machine: its exported weights were loaded here)" if rec.get("exported")
               else "(shared 2-core machine)")
            + (f", fine-tuned from `{rec['initialised_from']['file']}` (trained {rec['initialised_from']['step']:,} "
               f"steps in {rec['initialised_from']['train_seconds'] / 60:.0f} min before)"
               if rec.get("initialised_from") else "") + "; training loss per 1,000 "
            "steps: " + ", ".join(f"{v:.4f}" for v in rec["loss_mean_per_1000_steps"]) + ".")


def _name(attack: str, estimate: str) -> str:
    name = ATTACK_NAMES.get(attack, attack)
    return name if estimate == "-" else f"{name} ({estimate})"


def _leader_lines(leading: dict) -> list[str]:
    """One line per metric: which reconstruction leads, and against which the paired interval separates it."""
    out = []
    for m in METRICS:
        if m not in leading:
            continue
        c = leading[m]
        digits = 2 if m == "psnr" else 3
        behind = "; ".join(f"{_name(o['attack'], o['estimate'])} {o['mean']:+.{digits}f} [{o['low']:+.{digits}f}, "
                           f"{o['high']:+.{digits}f}]" for o in c["not_separated_from"])
        out.append(f"- **{m.upper()}**: {_name(c['attack'], c['estimate'])} leads ({c['mean']:.{digits}f}); "
                   + ("its paired interval separates it from every other reconstruction." if not behind else
                      f"separated from {len(c['separated_from'])} other(s), **not separated** from: {behind}."))
    return out


def _decoder_lines(decoders: dict) -> list[str]:
    """The decoders' chosen settings, held-out MSE and CPU time, and every candidate of a tuned decoder's grid."""
    out = ["| decoder | chosen on the held-out pairs | held-out MSE | CPU min (fit, all candidates) |",
           "|---|---|---|---|"]
    grids = []
    for name, d in decoders.items():
        chosen = d.get("chosen") or {k: v for k, v in d.items() if k in ("alpha_over_n", "k", "hidden", "epochs_run",
                                                                            "best_epoch", "configuration", "seeds")}
        mse = d.get("held_out_mse")
        if isinstance(mse, dict):
            mse = min(mse.values())
        elif mse is None and d.get("held_out_mse_per_epoch"):
            mse = min(d["held_out_mse_per_epoch"])
        cpu = d.get("cpu_s")
        out.append(f"| {ATTACK_NAMES.get(name, name)} | {chosen or '-'} | "
                   f"{'-' if mse is None else f'{mse:.5f}'} | {'-' if cpu is None else f'{cpu / 60:.1f}'} |")
        for c in d.get("grid", []):
            details = c["details"]
            extra = {k: details[k] for k in ("bandwidth", "alpha", "best_epoch", "epochs_run") if k in details}
            grids.append(f"| {ATTACK_NAMES.get(name, name)} | {c['config']} | {extra or '-'} | "
                         f"{c['held_out_mse']:.5f} | {c['cpu_s'] / 60:.1f} |")
    if grids:
        out += ["", "Every candidate of the tuned decoders' grids (`attacks/decoders.py`, `TUNING_GRIDS`):", "",
                "| decoder | candidate | chosen inside it | held-out MSE | CPU min |", "|---|---|---|---|---|"] + grids
    return out


def weights_line(rec: dict) -> str:
    """The reconstructor's weights named exactly: their sha256, the file's, the command that made them, and the
    weights a fine-tuned one started from; what a result does not record is said."""
    sha, note = rec.get("weights_sha256"), rec.get("weights_sha256_note")
    line = "- Reconstructor weights: sha256 " + (
        f"`{sha}` (of the EMA tensors, `Reconstructor.weights_sha256`" + (f"; {note})" if note else ")") if sha
        else "not recorded" + (f" ({note})" if note else ""))
    if rec.get("checkpoint_sha256"):
        line += f"; file `{rec['checkpoint']}` sha256 `{rec['checkpoint_sha256']}`"
    if rec.get("exported"):
        line += "; exported weights trained on another machine, not in the repository"
    made = rec.get("made_by")
    line += (f"; made by `{made}`" if made else "; the command that made them is not recorded in the weights")
    source = rec.get("initialised_from")
    if source:
        line += (f"; fine-tuned from `{source['file']}` (not in the repository; weights sha256 "
                 f"`{source.get('weights_sha256')}`"
                 + (f", file sha256 `{source['file_sha256']}`" if source.get("file_sha256") else "")
                 + (f", made by `{source['made_by']}`" if source.get("made_by") else "") + ")")
    return line + "."


# -- the run --------------------------------------------------------------------------------------------------------

def results_stem(preset: str, decoders_only: bool = False) -> str:
    """The file names of a preset's results: ``attack_mnist`` for the benchmark preset, ``attack_mnist_<preset>``
    for another; ``_decoders`` after it for a run without the reconstructor (``--decoders-only``)."""
    return ("attack_mnist" if preset == "benchmark" else f"attack_mnist_{preset}") + (
        "_decoders" if decoders_only else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", default=None,
                        help="output folder of the run (checkpoint, full outputs; git-ignored); default runs/"
                             "attack_mnist, or runs/attack_mnist_decoders with --decoders-only")
    parser.add_argument("--decoders-only", action="store_true",
                        help="no diffusion reconstructor: the decoders alone, results under attack_mnist[_<preset>]"
                             "_decoders")
    parser.add_argument("--preset", default="benchmark", choices=("benchmark", "reduced"),
                        help="benchmark: the full evaluation; reduced: the same attacker and reconstructor (its "
                             "checkpoint is reused), three defender sets of 250 and fewer samples")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--results", default=str(RESULTS), help="where the result files go")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the preset's markdown from its JSON and CSV and stop")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("extra", nargs="*", help="more `privfl attack reconstruct` options after --, e.g. -- "
                                                 "--steps 100 (the results then describe that run)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    stem = results_stem(args.preset, args.decoders_only)
    work = Path(args.work or ROOT / "runs" / ("attack_mnist_decoders" if args.decoders_only else "attack_mnist"))
    if args.render_only:
        summary = json.loads((results / f"{stem}.json").read_text())
        (results / f"{stem}.md").write_text(render_markdown(summary, read_rows(results / f"{stem}.csv")))
        return 0
    torch.set_num_threads(args.threads)
    only = ["--decoders-only"] if args.decoders_only else []
    cli = ["--out", str(work), "--preset", args.preset, "--device", args.device, *only] + list(args.extra)
    if args.no_progress:
        cli.append("--no-progress")
    settings, _ = settings_from_args(cli)
    command = "python benchmarks/attack_mnist.py " + shlex.join(
        ["--preset", args.preset, *only, "--device", args.device, "--threads", str(args.threads)]
        + (["--"] + args.extra if args.extra else []))
    started = time.perf_counter()
    summary = run_reconstruction_attack(settings, command=command)
    summary.pop("table", None)
    scores = load_scores(work / "per_image_scores.csv")
    summary["comparisons"] = comparisons(scores, summary["rows"], n_boot=settings.bootstrap, seed=settings.seed)
    summary["command"] = command
    summary["numerics"] = numerics()     # torch, CPU kernel, threads and the code revision that made the figures
    summary["wall_seconds"] = time.perf_counter() - started
    summary["settings"]["out"] = "--work (git-ignored run folder)"
    summary["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}
    results.mkdir(parents=True, exist_ok=True)
    summary.pop("rows")   # every row is in the CSV beside the JSON
    (results / f"{stem}.json").write_text(json.dumps(summary, indent=1, default=str))
    shutil.copyfile(work / "attack_results.csv", results / f"{stem}.csv")
    # rendered from the JSON as stored, so that --render-only gives the same page
    stored = json.loads((results / f"{stem}.json").read_text())
    (results / f"{stem}.md").write_text(render_markdown(stored, read_rows(results / f"{stem}.csv")))
    # every scored image, gzipped, beside the results: the paired comparisons can be recomputed from the repository
    write_scores(work / "per_image_scores.csv", results / f"{stem}_scores.csv.gz")
    shutil.copyfile(work / "attack_grid.png", results / f"{stem}_grid.png")
    shutil.copyfile(work / "attack_metrics.png", results / f"{stem}_metrics.png")
    print((results / f"{stem}.md").read_text()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
