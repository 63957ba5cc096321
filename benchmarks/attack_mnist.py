"""Reconstruction attack on MNIST: raw features vs FedPFT vs DP-FedPFT (eps 1 and 8) vs the nearest attacker image.

The FedPFT paper's Tables 3 and 7 layout (PSNR up, LPIPS down, SSIM up; selections all / attacker / oracle) at CPU
scale (digest ``papers/fedpft.md`` 8.3):

- backbone: the ImageNet MobileNetV2 (offline weights) at 64 x 64 input (grey repeated to RGB), 1280-d features,
  L2-normalised; features cached outside the repository (``~/.cache/privfl``);
- attacker: 5,000 images of the MNIST training split; defender: 250 images of the test split, of which the 10 % most
  similar (SSIM) to an attacker image are removed (225 evaluated);
- reconstructor: diffusers UNet2DModel (32-64-64 channels, scale-shift norm, about 1.3 M parameters) at 16 x 16,
  trained ``--steps`` steps at batch 32 with condition dropout 0.1; DDIM 10 steps, guidance 2;
  4 samples per feature for the attacker selection (the paper: 10), top 1 % (the paper) and 5 % (1 % of 225 is 3
  images);
- FedPFT: diag covariance, K = 10 per class; DP-FedPFT: K = 1, diag, public class counts, delta 1e-5, analytic
  Gaussian; the reconstruction set of a mixture release has as many features as the defender set (250).

Run: ``nice .venv/bin/python benchmarks/attack_mnist.py`` (5,000 steps: about 0.35 s/step on an idle 2-core CPU,
0.5 to 2 s/step on a busy one, plus about 5 minutes of sampling and scoring; the reconstructor is checkpointed every
250 steps and resumed, so ``--steps 2500`` then ``--steps 5000`` trains once). Results:
``benchmarks/results/attack_mnist.json``, ``attack_mnist.md`` and ``attack_mnist_grid.png``; the committed
``attack_mnist_steps2500.*`` are the same protocol after 2,500 steps.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--attacker-images", type=int, default=5000)
    parser.add_argument("--defender-images", type=int, default=250)
    parser.add_argument("--work", default=str(default_cache_dir() / "attack_mnist"),
                        help="scratch folder (checkpoint, raw outputs), outside the repository")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = AttackSettings(
        out=args.work, dataset="mnist", backbone="mobilenet_v2", input_size=64,
        schemes=("raw", "fedpft", "dp-fedpft"), eps=(1.0, 8.0), delta=1e-5, components=10, covariance="diag",
        attacker_images=args.attacker_images, defender_images=args.defender_images, image_size=16,
        block_channels=(32, 64, 64), steps=args.steps, batch_size=32, learning_rate=2e-4, cond_dropout=0.1,
        guidance=2.0, ddim_steps=10, samples_per_feature=4, top_fractions=(0.01, 0.05),
        near_duplicate_fraction=0.1, checkpoint_every=250, seed=0, progress=not args.no_progress)
    started = time.perf_counter()
    summary = run_reconstruction_attack(settings)
    summary.pop("table", None)
    summary["wall_seconds"] = time.perf_counter() - started
    summary["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attack_mnist.json").write_text(json.dumps(summary, indent=2, default=str))
    shutil.copyfile(Path(args.work) / "attack_results.md", RESULTS / "attack_mnist.md")
    shutil.copyfile(Path(args.work) / "attack_grid.png", RESULTS / "attack_mnist_grid.png")
    print((RESULTS / "attack_mnist.md").read_text())
    print(f"reconstructor: {summary['reconstructor']['parameters']:,} parameters, "
          f"{summary['reconstructor']['steps']} steps, {summary['reconstructor']['train_seconds']:.0f} s of training; "
          f"whole run {summary['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
