"""Size of an ODPFL-HN checkpoint (``checkpoint.pt`` of a run directory) at 10 and 100 clients, and what fills it, in
the worst case: a best-validation snapshot of a round earlier than the round saved.

The run is ``privfl train --method odpflhn`` on MNIST as a user starts it (the method's default settings, the CLI's
``--select best_val``), cut to 2 rounds on 2000 images (the checkpoint's size does not depend on the rounds or the
images: it holds the model state, one descriptor per training client, the ledgers and the best-validation model).
It is interrupted after round 1 (a checkpoint of round 1), then resumed to round 2. The worst case is the checkpoint
of round 2 holding round 1's snapshot as its best-validation model; it is written, as ``train`` writes it
(``privfl.experiment.share_equal_tensors``, then ``torch.save``), with the snapshot taken two ways from the same
round-1 runtime:

* before: ``Runtime.snapshot()``, the whole state, server momentum included (what the best-validation snapshot held
  until the serving snapshot existed);
* after: ``Runtime.serving_snapshot()``, what ``train`` keeps now: no momentum or optimiser state, which scoring and
  serving never read.

Each part is counted once per tensor storage, as ``torch.save`` writes it.

    python benchmarks/checkpoint_size.py [--clients 10 100] [--out runs/checkpoint_size]

Prints a Markdown table (the one in benchmarks/README.md, "Checkpoint size").
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from privfl.config import RunConfig  # noqa: E402
from privfl.data import FederationSpec, build_federation  # noqa: E402
from privfl.experiment import RunInterrupted, build_runtime, share_equal_tensors, train  # noqa: E402


def parts(checkpoint: dict, depth: int = 3) -> dict[str, int]:
    """Bytes of the tensors under each key path of ``checkpoint`` (to ``depth`` keys), each storage counted once,
    where it first appears."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}

    def walk(value, path: tuple[str, ...]) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, path + (str(key),))
        elif isinstance(value, (list, tuple)):
            for inner in value:
                walk(inner, path)
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() in seen:
                return
            seen.add(storage.data_ptr())
            key = ".".join(path[:depth])
            sizes[key] = sizes.get(key, 0) + storage.nbytes()

    walk(checkpoint, ())
    return sizes


def saved_size(checkpoint: dict) -> int:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return len(buffer.getvalue())


def biggest(checkpoint: dict, count: int = 4) -> str:
    sizes = sorted(parts(checkpoint).items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name} {nbytes / 1e6:.1f}" for name, nbytes in sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--out", default="runs/checkpoint_size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for clients in args.clients:
        spec = FederationSpec(source="mnist", num_clients=clients, partition="pathological", shards_per_client=2,
                              novel_fraction=0.5, max_samples=2000 if clients <= 10 else 20 * clients)
        config = RunConfig(federation=spec, method="odpflhn", method_config={"local_steps": 1}, rounds=2,
                           eval_every=1, checkpoint_every=1, select="best_val", seed=0)
        out = Path(args.out) / f"clients{clients}"
        try:
            train(config, str(out), overwrite=True, progress=False, stop_after_round=1)
        except RunInterrupted:
            pass
        round1 = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
        train(None, str(out), resume=True, progress=False)
        round2 = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
        runtime = build_runtime(config, build_federation(config.federation, seed=config.seed))
        runtime.load_state_dict(round1["runtime"])
        for label, snapshot in (("before", runtime.snapshot()), ("after", runtime.serving_snapshot())):
            best = share_equal_tensors({"round": 1, "score": 0.0, "snapshot": snapshot}, round2["runtime"])
            worst = {**round2, "best": best}
            rows.append((clients, label, saved_size(worst), biggest(worst)))
        rows.append((clients, f"this run (best round {round2['best']['round']})",
                     (out / "checkpoint.pt").stat().st_size, biggest(round2)))
    print("| clients | best-validation snapshot | checkpoint.pt (MB) | largest parts (MB) |")
    print("|---:|---|---:|---|")
    for clients, label, size, listed in rows:
        print(f"| {clients} | {label} | {size / 1e6:.1f} | {listed} |")


if __name__ == "__main__":
    main()
