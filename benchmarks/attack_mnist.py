"""Reconstruction attack on MNIST: raw features vs FedPFT vs DP-FedPFT (eps 1 and 8) vs non-diffusion baselines.

The FedPFT paper's Tables 3, 6 and 7 (PSNR up, LPIPS down, SSIM up; selections all / attacker / oracle) at CPU
scale (digest ``papers/fedpft.md`` 8.3):

- backbone: the ImageNet MobileNetV2 (offline weights) at 64 x 64 input (grey repeated to RGB), 1280-d features,
  L2-normalised; features cached outside the repository (``$PRIVFL_CACHE_DIR``, default ``~/.cache/privfl``);
- attacker: 10,000 images of the MNIST training split (200 held out of the reconstructor's training to choose the
  guidance scale); defender: 250 images of the test split, of which the 10 % most similar (SSIM) to an attacker image
  are removed (225 evaluated);
- reconstructor: diffusers UNet2DModel (32-64-64 channels, scale-shift norm, mid-block attention, 1.32 M
  parameters, per-dimension standardised features) at 16 x 16, ``--steps`` steps at batch 32, condition dropout
  0.1; DDIM 20 steps; guidance chosen among 1, 1.5, 2, 3 on the held-out attacker pairs; 4 samples per feature
  (medoid and agreement; the paper: 10); top 1 % (the paper; 3 of 225 images) and 5 % (12);
- releases made by FedPFT's client procedure and recorded by the wire in the defender's ledger: FedPFT diag, K = 10
  per class; DP-FedPFT K = 1, diag, public class counts, delta 1e-5, seeded noise (reproducible); the epsilon shown
  is the ledger's. Mixture releases are attacked as delivered (naive) and after the attacker's post-processing.

Run: ``nice .venv/bin/python benchmarks/attack_mnist.py`` (the reconstructor is checkpointed every 500 steps in the
scratch folder and resumed, so an interrupted run continues). ``--render-only`` rewrites ``attack_mnist.md`` from
``attack_mnist.json`` without running anything. Results: ``benchmarks/results/attack_mnist.json``, ``.md`` and
``attack_mnist_grid.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attacks.reconstruct_cli import AttackSettings, run_reconstruction_attack  # noqa: E402
from privfl.models.backbones import default_cache_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


# -- rendering ------------------------------------------------------------------------------------------------------

def _eps(value) -> str:
    return "∞" if value in ("inf", math.inf) else f"{float(value):.3g}"


def _table(rows: list[dict], columns: tuple[str, ...]) -> list[str]:
    names = {"source": "release", "attack": "attack", "epsilon": "ε (ledger)", "level": "level",
             "selection": "selection", "top": "top", "n": "n", "ground_truth": "ground truth used",
             "psnr": "PSNR ↑", "lpips": "LPIPS ↓", "ssim": "SSIM ↑", "set_size": "set size"}
    lines = ["| " + " | ".join(names[c] for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r[c]
            cells.append(_eps(v) if c == "epsilon" else f"{v:.2f}" if c == "psnr" else f"{v:.3f}"
                         if c in ("lpips", "ssim") else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _find(rows: list[dict], **match) -> dict | None:
    for r in rows:
        if all(r[k] == v for k, v in match.items()):
            return r
    return None


def _cmp(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return "n/a"
    return (f"PSNR {a['psnr'] - b['psnr']:+.2f} dB, LPIPS {a['lpips'] - b['lpips']:+.3f}, "
            f"SSIM {a['ssim'] - b['ssim']:+.3f}")


def render_markdown(summary: dict) -> str:
    """The results page: protocol, the Table 3 / 6 / 7 layouts, the releases, the reconstructor, and comparisons
    computed from the rows (each stating which rows it compares)."""
    rows = summary["rows"]
    p, rec, g = summary["protocol"], summary["reconstructor"], summary["guidance"]
    fractions = [f"{100 * f:g}%" for f in summary["settings"]["top_fractions"]]
    top1 = fractions[0]
    cols = ("source", "attack", "epsilon", "selection", "top", "n", "ground_truth", "psnr", "lpips", "ssim",
            "set_size")
    out = ["# Reconstruction attack on MNIST (MobileNetV2 features): raw vs FedPFT vs DP-FedPFT", "",
           "Produced by `benchmarks/attack_mnist.py` (numbers in `attack_mnist.json`, images in "
           "`attack_mnist_grid.png`).", "",
           f"- Attacker: {p['attacker']}. Defender: {p['defender']}; {p['near_duplicates_removed']} near-duplicates "
           f"of attacker images removed, **{p['evaluated_defender_images']} evaluated**.",
           f"- Embedding: {p['embedding']}. Images: {p['images']}. Metrics: {p['metrics']}.",
           f"- Reconstructor: {rec['parameters']:,} parameters, {rec['steps']:,} steps, "
           f"**{rec['train_seconds'] / 60:.1f} min of training** on one CPU thread (shared machine); guidance "
           f"w = {g['chosen']:g} chosen on {g['held_out_pairs']} held-out attacker pairs (mean SSIM per w: "
           + ", ".join(f"{w}: {v:.3f}" for w, v in g["held_out_mean_ssim"].items()) + "); training loss per 1,000 "
           "steps: " + ", ".join(f"{v:.4f}" for v in rec["loss_mean_per_1000_steps"]) + ".",
           f"- Whole run: {summary.get('wall_seconds', 0) / 60:.1f} min.", "",
           "**Row definitions** (the same for every release; `n` counts scored defender images everywhere, a top "
           f"fraction p scores ceil(p · {p['evaluated_defender_images']}) of them):", "",
           "- *per-feature* (raw only: one released feature per defender image): the attacker's reconstruction of "
           "an image is the medoid of the samples of its feature (diffusion) or the attacker image with the closest "
           "feature (feature NN). *all*: every image; *attacker*: top p by the attacker's own confidence "
           "(agreement among samples / feature similarity); *oracle*: top p by true SSIM.",
           "- *set-level* (every release): the attacker holds one reconstruction per released feature; *all*: each "
           "defender image matched to its most similar reconstruction by SSIM (the paper's Oracle-all); "
           "*attacker*: the attacker's ceil(p · N) most confident reconstructions, each paired with its most "
           "similar defender image; *oracle*: top p defender images by matched SSIM (the paper's Oracle, Table 3).",
           "- *ground truth used*: `none` = the attacker alone; `matching` = defender images only pair "
           "reconstructions with targets; `selection` = true similarity picks the scored pairs. The *nearest image "
           "by SSIM* baseline (no release) is an oracle: it needs the defender's images to choose.", ""]

    out += ["## Table 3 layout: set-level oracle (top fraction of defender images by SSIM to the attacker's set)", ""]
    oracle = [r for r in rows if r["level"] == "set-level" and r["selection"] == "oracle"]
    out += _table(oracle, cols) + [""]
    out += ["## Table 6 layout: raw features, per feature", ""]
    out += _table([r for r in rows if r["level"] == "per-feature"], cols) + [""]
    out += ["## Table 7 layout: set-level, all selections, every release", ""]
    out += _table([r for r in rows if r["level"] == "set-level"], cols) + [""]

    out += ["## Releases (as the wire recorded them)", "",
            "| release | ε requested | ε (ledger, accountant) | δ | noise | bytes | set size | feature z-RMS | "
            "negative share | release weight in the post-processed mean |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["releases"]:
        ledger = r["ledger"]
        meta = ledger.get("metadata", {})
        post = r.get("postprocessing", {})
        weight = post.get("mean_release_weight")
        out.append(f"| {r['source']} | {_eps(r.get('requested_epsilon', 'inf'))} | {_eps(ledger['epsilon'])} | "
                   f"{ledger['delta']:g} | {meta.get('noise', '-')} | {r['bytes']:,} | {r['set_size']} | "
                   f"{r['feature_diagnostics']['standardised_rms']:.2f} | "
                   f"{r['feature_diagnostics']['negative_fraction']:.2f} | "
                   f"{'-' if weight is None else f'{weight:.2g}'} |")
    out += ["", f"Attacker features: z-RMS {p['attacker_features']['standardised_rms']:.2f}; defender features: "
            f"{p['defender_features']['standardised_rms']:.2f} (per-dimension z-scores against the attacker's "
            "statistics; about 1 in distribution). Post-processing (DP): LMMSE estimates of each class's mean and "
            "variance under the attacker's in-distribution prior, using the mechanism's public noise scales from "
            "the ledger record; then draws clipped at 0 and L2-normalised (FedPFT: clipping and normalisation "
            "only).", ""]

    # Comparisons, computed from the rows.
    def pick(source, attack, level, selection, top):
        return _find(rows, source=source, attack=attack, level=level, selection=selection, top=top)

    base_all = _find(rows, source="no release", selection="all")
    base_oracle = _find(rows, source="no release", selection="oracle", top=top1)
    subset = next((r for r in rows if r["source"].startswith("no release (") and r["selection"] == "oracle"
                   and r["top"] == top1), None)
    out += ["## Comparisons (computed from the rows above; differences are first minus second)", ""]
    raw_pf = pick("raw", "diffusion", "per-feature", "all", "all")
    nn_pf = pick("raw", "feature NN", "per-feature", "all", "all")
    out.append(f"- Raw, per feature, no ground truth: diffusion vs feature-NN retrieval: {_cmp(raw_pf, nn_pf)}.")
    for selection in ("attacker", "oracle"):
        a = pick("raw", "diffusion", "per-feature", selection, top1)
        b = pick("raw", "feature NN", "per-feature", selection, top1)
        out.append(f"- Raw, per feature, {selection} top {top1}: diffusion vs feature NN: {_cmp(a, b)}.")
    for source in sorted({r["source"] for r in rows if r["source"] != "no release"
                          and not r["source"].startswith("no release (")}, key=lambda s: [r["source"] for r in
                                                                                           rows].index(s)):
        for eps in sorted({r["epsilon"] for r in rows if r["source"] == source}, key=str):
            a = _find(rows, source=source, attack="diffusion", level="set-level", selection="oracle", top=top1,
                      epsilon=eps)
            b = _find(rows, source=source, attack="feature NN", level="set-level", selection="oracle", top=top1,
                      epsilon=eps)
            out.append(f"- {source} (ε {_eps(eps)}), set-level oracle top {top1}: diffusion vs the oracle nearest "
                       f"image over all attacker images: {_cmp(a, base_oracle)}; vs the same over "
                       f"{subset['set_size'] if subset else '?'} attacker images: {_cmp(a, subset)}; vs feature NN "
                       f"on the same release: {_cmp(a, b)}.")
    a = pick("raw", "diffusion", "set-level", "all", "all")
    out.append(f"- Raw, set-level all (diffusion) vs the oracle nearest image, all: {_cmp(a, base_all)}.")
    out.append("")
    return "\n".join(out) + "\n"


# -- the run --------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--attacker-images", type=int, default=10000)
    parser.add_argument("--defender-images", type=int, default=250)
    parser.add_argument("--work", default=str(default_cache_dir() / "attack_mnist"),
                        help="scratch folder (checkpoint, raw outputs), outside the repository")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite attack_mnist.md from attack_mnist.json and stop")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.render_only:
        summary = json.loads((RESULTS / "attack_mnist.json").read_text())
        (RESULTS / "attack_mnist.md").write_text(render_markdown(summary) + _kept_notes())
        return 0
    torch.set_num_threads(args.threads)
    settings = AttackSettings(
        out=args.work, dataset="mnist", backbone="mobilenet_v2", input_size=64,
        schemes=("raw", "fedpft", "dp-fedpft"), eps=(1.0, 8.0), delta=1e-5, dp_noise="seeded", components=10,
        covariance="diag", attacker_images=args.attacker_images, validation_images=200,
        defender_images=args.defender_images, image_size=16, block_channels=(32, 64, 64), mid_attention=True,
        condition_dims=None, steps=args.steps, batch_size=32, learning_rate=2e-4, cond_dropout=0.1,
        guidance=(1.0, 1.5, 2.0, 3.0), ddim_steps=20, samples_per_feature=4, postprocess=True,
        top_fractions=(0.01, 0.05), near_duplicate_fraction=0.1, checkpoint_every=500, seed=0,
        progress=not args.no_progress)
    started = time.perf_counter()
    summary = run_reconstruction_attack(settings)
    summary.pop("table", None)
    summary["wall_seconds"] = time.perf_counter() - started
    summary["settings"]["out"] = "--work (scratch folder outside the repository)"
    summary["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attack_mnist.json").write_text(json.dumps(summary, indent=2, default=str))
    (RESULTS / "attack_mnist.md").write_text(render_markdown(summary))  # a new run: its interpretation is new too
    shutil.copyfile(Path(args.work) / "attack_grid.png", RESULTS / "attack_mnist_grid.png")
    print((RESULTS / "attack_mnist.md").read_text())
    return 0


NOTES_HEADING = "## Interpretation"


def _kept_notes() -> str:
    """The hand-written interpretation section of the current page, kept across re-renders of the same JSON."""
    page = RESULTS / "attack_mnist.md"
    if not page.is_file():
        return ""
    text = page.read_text()
    at = text.find(NOTES_HEADING)
    return "" if at < 0 else text[at:]


if __name__ == "__main__":
    sys.exit(main())
