"""At which class size does a DP-FedPFT release tell the attacker more than its own data? (MNIST, MobileNetV2.)

A DP-FedPFT release (K = 1, diag, public counts; :func:`attacks.schemes.make_release`) carries one noisy mean and
variance per class. The attacker knows the class means of in-distribution data from its own images (its prior), so
the release can only add what the defender's class mean says beyond them: the deviation of n_c particular images
from the population mean, of size ``sqrt(lambda / n_c)`` along a class direction with variance lambda. The
mechanism's noise on the mean is ``sigma_sum / n_c`` per coordinate, with sigma_sum fixed by epsilon. The
post-processed estimate (:func:`attacks.schemes.postprocess_release`) weighs the release by
``w = (lambda / n_c) / (lambda / n_c + sigma_sum^2 / n_c^2) = lambda n_c / (lambda n_c + sigma_sum^2)``: the release
matters once ``n_c`` approaches ``sigma_sum^2 / lambda``.

Measured here for n_c per class in ``--sizes`` and epsilon in ``--eps`` (``--repeats`` draws of the defender's images
from the MNIST test split and of the noise each):

- ``error_ratio``: the squared error of the attacker's estimate of the defender's class means, post-processed,
  divided by that of its prior (the release ignored), averaged over classes: 1 = the release adds nothing, 0 = the
  attacker learns the defender's class means exactly. For the full-covariance and the per-dimension post-processing.
- ``image_psnr_gain``: in image space, through a ridge decoder fitted on the attacker's pairs (linear, so it maps a
  mean feature to the mean of the decoded images): PSNR of the decoded estimated class mean against the defender's
  actual class-mean image, minus the same for the prior's class mean (dB; > 0: the release shows the attacker the
  defender's class averages better than its own data does).
- ``top_weight``: the release weight w along each class's first principal direction.

Intervals are percentile-bootstrap 95 % over the repeats. A size "matters" for an epsilon when the error ratio's
upper bound is below 0.95 (the release removes at least 5 % of the prior's error).

Run: ``OMP_NUM_THREADS=1 python benchmarks/attack_dp_class_size.py`` (a few minutes; MobileNetV2 features of the
whole MNIST are extracted once and cached). Results: ``benchmarks/results/attack_dp_class_size.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attacks.decoders import RidgeDecoder  # noqa: E402
from attacks.reconstruct_data import embed_images  # noqa: E402
from attacks.reconstruct_settings import AttackSettings  # noqa: E402
from attacks.schemes import AttackerPrior, make_release, postprocess_release  # noqa: E402
from attacks.statistics import bootstrap_cell  # noqa: E402
from privfl.data import load_source  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _psnr(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    mse = ((a.double() - b.double()) ** 2).flatten(1).mean(1)
    return (10 * torch.log10(1 / mse)).numpy()


@dataclass
class _Setting:
    """The defender's pool (the MNIST test split and its features) and what the attacker knows: its priors (full
    covariance and per dimension), its ridge decoder and the decoded prior class means."""

    xd: np.ndarray
    yd: np.ndarray
    fd: torch.Tensor
    classes: int
    priors: dict[str, AttackerPrior]
    ridge: RidgeDecoder
    prior_images: torch.Tensor


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", default="5,10,20,50,100,200,500,850", help="defender images per class")
    parser.add_argument("--eps", default="1,4,10", help="DP-FedPFT epsilons")
    parser.add_argument("--repeats", type=int, default=10, help="draws of the defender's images and noise per cell")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "attack_dp_class_size"), help="output path without suffix")
    return parser.parse_args()


def _setting(sizes: list[int]) -> _Setting:
    """MNIST's features (cached), the attacker's priors from its training split and its ridge decoder (1,000 images
    held out for its penalty); stops if a class of the test split is smaller than the largest of ``sizes``."""
    source = load_source("mnist")
    settings = AttackSettings(out="", progress=False)
    xa, ya = np.asarray(source.train.x), np.asarray(source.train.y)
    xd, yd = np.asarray(source.test.x), np.asarray(source.test.y)
    fa = embed_images(settings, xa, "mnist-train-all")
    fd = embed_images(settings, xd, "mnist-test-all")
    classes = source.num_classes
    if max(sizes) > min(np.bincount(yd)):
        raise SystemExit(f"--sizes: the test split has only {min(np.bincount(yd))} images of its smallest class")
    priors = {"full": AttackerPrior.fit(fa, ya, num_classes=classes, full_covariance=True),
              "diag": AttackerPrior.fit(fa, ya, num_classes=classes)}
    held = np.random.default_rng(0).permutation(len(xa))[:1000]
    train = np.setdiff1d(np.arange(len(xa)), held)
    ridge = RidgeDecoder().fit(fa[train], torch.as_tensor(xa[train]), ya[train], fa[held], torch.as_tensor(xa[held]),
                               ya[held])
    return _Setting(xd, yd, fd, classes, priors, ridge, ridge.decode(priors["full"].class_means.float()))


def _measure_cell(s: _Setting, n_c: int, eps: float, repeats: int, delta: float) -> dict:
    """One (class size, epsilon) cell: ``repeats`` draws of the defender's images and of the release's noise, the
    error ratio of each prior, the image PSNR gain and the top release weight, with their bootstrap intervals."""
    ratios = {name: [] for name in s.priors}
    gains, weights, sigmas = [], [], []
    for repeat in range(repeats):
        rng = np.random.default_rng([n_c, repeat])
        index = np.concatenate([rng.choice(np.flatnonzero(s.yd == c), n_c, replace=False)
                                for c in range(s.classes)])
        true_means = torch.stack([s.fd[index][s.yd[index] == c].double().mean(0) for c in range(s.classes)])
        true_images = torch.stack([torch.as_tensor(s.xd[index][s.yd[index] == c]).mean(0)
                                   for c in range(s.classes)])
        release = make_release("dp-fedpft", s.fd[index], s.yd[index], num_classes=s.classes, epsilon=eps,
                               delta=delta, seed=1000 * repeat + n_c)
        sigmas.append(release.details["ledger"]["metadata"]["sigmas"]["sum"])
        for name, prior in s.priors.items():
            post = postprocess_release(release, prior, seed=repeat)
            estimate = torch.stack([torch.as_tensor(m.means[0]) for m in
                                    sorted(post.mixtures, key=lambda m: m.label)])
            error = ((estimate - true_means) ** 2).sum(1)
            base = ((prior.class_means - true_means) ** 2).sum(1)
            ratios[name].append(float((error / base).mean()))
            if name == "full":
                weights.append(post.details["postprocessing"]["top_direction_mean_weight"])
                decoded = s.ridge.decode(estimate.float())
                gains.append(float(np.mean(_psnr(decoded, true_images) - _psnr(s.prior_images, true_images))))
    cell = {"class_size": n_c, "epsilon": eps, "sigma_sum": float(np.mean(sigmas)),
            "top_weight": float(np.mean(weights))}
    for key, values in (("error_ratio_full", ratios["full"]), ("error_ratio_diag", ratios["diag"]),
                        ("image_psnr_gain", gains)):
        estimate, low, high = bootstrap_cell([(np.asarray(values)[:, None], None)], n_boot=2000, seed=0)
        cell[key] = {"mean": float(estimate[0]), "low": float(low[0]), "high": float(high[0])}
    return cell


def _print_cell(cell: dict) -> None:
    print(f"n_c {cell['class_size']:4d} eps {cell['epsilon']:4g}: error ratio {cell['error_ratio_full']['mean']:.3f} "
          f"[{cell['error_ratio_full']['low']:.3f}, {cell['error_ratio_full']['high']:.3f}] (diag "
          f"{cell['error_ratio_diag']['mean']:.3f}), top weight {cell['top_weight']:.3f}, image PSNR gain "
          f"{cell['image_psnr_gain']['mean']:+.3f} dB", flush=True)


def _smallest_sizes_that_matter(cells: list[dict], epsilons: list[float]) -> dict[str, int | None]:
    """For each epsilon, the smallest class size whose error ratio's upper bound is below 0.95 (None: none)."""
    matters = {}
    for eps in epsilons:
        sizes_that_matter = [c["class_size"] for c in cells if c["epsilon"] == eps and
                             c["error_ratio_full"]["high"] < 0.95]
        matters[f"{eps:g}"] = min(sizes_that_matter) if sizes_that_matter else None
    return matters


def main() -> int:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(v) for v in args.sizes.split(",")]
    epsilons = [float(v) for v in args.eps.split(",")]
    started = time.perf_counter()
    setting = _setting(sizes)
    cells = []
    for n_c in sizes:
        for eps in epsilons:
            cells.append(_measure_cell(setting, n_c, eps, args.repeats, args.delta))
            _print_cell(cells[-1])
    matters = _smallest_sizes_that_matter(cells, epsilons)
    summary = {"protocol": {"attacker": "all 60,000 MNIST training images (prior moments; ridge decoder on 59,000, "
                                        "1,000 held out for its penalty)",
                            "defender": "n_c images per class drawn from the MNIST test split, per repeat",
                            "release": "DP-FedPFT K = 1, diag, public counts, delta = 1e-5, seeded noise",
                            "embedding": "mobilenet_v2 (input 64 px), L2-normalised",
                            "repeats": args.repeats, "ridge_alpha_over_n": setting.ridge.alpha},
               "smallest_class_size_where_the_release_matters": matters,
               "cells": cells, "seconds": time.perf_counter() - started,
               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads()},
               "numerics": numerics()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    _plot(out.with_suffix(".png"), cells, epsilons)
    print(f"smallest class size where the release removes >= 5 % of the prior's error: {matters}")
    print(f"{out.with_suffix('.json')}, {out.with_suffix('.png')} ({summary['seconds']:.0f} s)")
    return 0


def _plot(path: Path, cells: list[dict], epsilons: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for eps, colour in zip(epsilons, ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple")):
        mine = [c for c in cells if c["epsilon"] == eps]
        x = [c["class_size"] for c in mine]
        for ax, key, style in ((axes[0], "error_ratio_full", "-"), (axes[0], "error_ratio_diag", ":"),
                               (axes[1], "image_psnr_gain", "-")):
            y = [c[key]["mean"] for c in mine]
            ax.plot(x, y, style, color=colour, marker="o", ms=3,
                    label=f"ε {eps:g}" + (" (per-dimension prior)" if key.endswith("diag") else ""))
            ax.fill_between(x, [c[key]["low"] for c in mine], [c[key]["high"] for c in mine], color=colour,
                            alpha=0.15)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylabel("error of the attacker's class-mean estimate\n(post-processed / prior only)")
    axes[1].axhline(0.0, color="grey", lw=0.8)
    axes[1].set_ylabel("PSNR gain of the decoded class mean (dB)\nover the prior's")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("defender images per class (n_c)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("DP-FedPFT (K = 1, diag): when does the release tell the attacker more than its own data? "
                 "(95% bootstrap bands over repeats)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
