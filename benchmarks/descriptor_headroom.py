"""How much room a personalised part has in the main job: the seed-0 non-private training's model for the mean
training descriptor (the sweep's first control), scored over every class pair of the held-out pool, unrestricted and
with each prediction restricted to the pair's two classes. The second is an upper bound on what a descriptor-dependent
bias could add on two-class novel clients; the sweep's descriptor verdict asks for ``min_margin`` = 2 points over the
control.

Needs the trained run ``runs/main_seed0/train`` of ``privfl sweep --out runs/main_seed0 --seed 0 --threads 1``.

    python benchmarks/descriptor_headroom.py [--run runs/main_seed0/train]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch

from privfl.config import run_federation
from privfl.evaluation.novel_pool import held_out_pool
from privfl.experiment import build_runtime
from privfl.federation import RunDirectory
from privfl.models.features import load_stage, map_inputs
from privfl.sweep import SweepConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/main_seed0/train", help="the sweep's non-private training directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = SweepConfig(seed=0)
    run = config.run_config(None)
    runtime = build_runtime(run, run_federation(run))
    runtime.load_state_dict(RunDirectory(args.run).load_checkpoint()["runtime"])
    strategy = runtime.strategy
    mean = torch.stack([strategy.descriptors[k] for k in sorted(strategy.descriptors)]).mean(dim=0)
    model = runtime.client.model_from(strategy.generated_weights(mean)).eval()
    x, y = held_out_pool(config.federation(), seed=config.seed)
    features = torch.from_numpy(map_inputs(load_stage("scatter", tuple(x.shape[1:])), x))
    with torch.no_grad():
        logits = model(features)
    labels = torch.as_tensor(y)
    plain, restricted = [], []
    for a, b in itertools.combinations(range(int(labels.max()) + 1), 2):
        mask = (labels == a) | (labels == b)
        pair_logits, pair_labels = logits[mask], labels[mask]
        plain.append((pair_logits.argmax(1) == pair_labels).float().mean().item())
        only_pair = torch.full_like(pair_logits, -float("inf"))
        only_pair[:, [a, b]] = pair_logits[:, [a, b]]
        restricted.append((only_pair.argmax(1) == pair_labels).float().mean().item())
    print(f"{len(plain)} class pairs, {len(labels)} held-out images: unrestricted {100 * np.mean(plain):.2f}%, "
          f"restricted to each pair {100 * np.mean(restricted):.2f}%")


if __name__ == "__main__":
    main()
