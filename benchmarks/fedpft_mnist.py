"""FedPFT and DP-FedPFT on MNIST through the ImageNet MobileNetV2 backbone (1280-d features), 50 clients, Dirichlet.

Parts (``--parts``):

- ``main``: accuracy against bytes sent for FedPFT (K in {1, 5, 10, 20}, diag and spherical; full at K = 1), FedAvg of
  the linear head (1..50 rounds), the one-shot max-probability ensemble of local heads, local heads and centralized
  training on the real features (upper bound), for each Dirichlet alpha.
- ``dp``: DP-FedPFT (K = 1, public counts, replace-one within the public class histogram, delta = 1e-5) at
  eps in {0.5, 1, 2, 4, 8} for spherical, diag and full covariance (``--dp-covariances``), beside non-private
  FedPFT and centralized. Rows already in ``--out`` for the same data are kept (``--fresh`` runs them again).
- ``throughput``: feature extraction images/second at input sizes 64, 96 and 224, and the centralized accuracy of a
  linear head at each size on a small subset.

CPU budget: extracting 70k MNIST images at 224x224 takes hours on 2 cores, so the main runs use a random subset
(``--train``/``--test`` images of MNIST's train and test splits) at ``--input-size`` 64, and features are cached under
``--cache-dir`` (default ``~/.cache/privfl``, never inside the repository). Full covariance of 1280-d features costs
(d^2 + 3d + 2)/2 = 820,481 floats per component and class (1.6 MB in float16), so it is run at K = 1 only; DP with
full covariance costs, per client and class, 820,481 noisy coordinates and an eigendecomposition of a 1280 x 1280
matrix to project the noisy covariance onto the PSD cone (about 0.75 s on one core), about an hour for its 10 rows.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/fedpft_mnist.py              # all parts, about 90 minutes
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/fedpft_mnist.py --quick      # smoke run, about a minute
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from privfl.config import RunConfig
from privfl.data import FederationSpec, build_federation, load_source
from privfl.experiment import build_runtime
from privfl.federation.rundir import to_json_safe
from privfl.methods import get_method
from privfl.methods.fedpft_baselines import (
    MaxProbabilityEnsemble,
    accuracy,
    centralized_head,
    fedavg_head_curve,
    head_bytes,
    local_heads,
    mean_local_accuracy,
)
from privfl.metrics import score_model
from privfl.models.backbones import cache_key_sha256, default_cache_dir, extract_features, mobilenet_v2
from privfl.privacy.training import TrainingPrivacy
from privfl.provenance import numerics

RESULTS = Path(__file__).parent / "results"
HEAD = {"head_lr": 20.0, "head_epochs": 50.0, "head_batch_size": 256}


def mnist_features(args, input_size: int, num_train: int, num_test: int) -> Path:
    """Extract (or read from the cache) MobileNetV2 features of a seeded MNIST subset; write the features .npz.

    The .npz is named by the subset and by a sha256 of the backbone's cache key (its weights' sha256 and
    preprocessing), so a changed backbone never reads features another one made.
    """
    source = load_source("mnist")
    rng = np.random.default_rng(args.seed)
    train_idx = np.sort(rng.choice(len(source.train), num_train, replace=False))
    test_idx = np.sort(rng.choice(len(source.test), num_test, replace=False))
    backbone = mobilenet_v2(input_size=input_size)
    tag = f"mnist-s{args.seed}-{num_train}-{num_test}-px{input_size}-{cache_key_sha256(backbone)[:16]}"
    path = Path(args.cache_dir) / f"fedpft_{tag}.npz"
    if not path.is_file():
        x = extract_features(backbone, source.train.x[train_idx], dataset=f"mnist-train-{num_train}-s{args.seed}",
                             cache_dir=args.cache_dir, batch_size=128)
        x_test = extract_features(backbone, source.test.x[test_idx], dataset=f"mnist-test-{num_test}-s{args.seed}",
                                  cache_dir=args.cache_dir, batch_size=128)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, x=x, y=source.train.y[train_idx], x_test=x_test, y_test=source.test.y[test_idx])
    return path


def federation_for(path: Path, alpha: float, clients: int, seed: int):
    spec = FederationSpec(source="features", source_options={"path": str(path)}, num_clients=clients,
                          partition="dirichlet", alpha=alpha, split="train_test", novel_clients=1,
                          novel_partition="iid", val_fraction=0.0)
    return build_federation(spec, seed=seed)


def test_set(federation):
    novel = federation.novel_clients[0]
    return novel.x, federation.novel_labels.labels(novel.client_id)


def run_fedpft(federation, seed: int, dp_epsilon: float | None = None, dp_delta: float = 1e-5,
               **method_config) -> dict:
    """One FedPFT run; with ``dp_epsilon``, DP-FedPFT (record-level privacy at (dp_epsilon, dp_delta))."""
    started = time.perf_counter()
    privacy = TrainingPrivacy() if dp_epsilon is None else TrainingPrivacy(mode="record", epsilon=dp_epsilon,
                                                                         delta=dp_delta)
    config = RunConfig(federation=federation.spec, method="fedpft", method_config={**HEAD, **method_config},
                       rounds=1, select="last", seed=seed, privacy=privacy)
    runtime = build_runtime(config, federation)
    runtime.run_round(0)
    x, y = test_set(federation)
    acc = 100 * score_model(runtime.novel_client_model(federation.novel_clients[0]), x, y).accuracy
    epsilons = [e for cid, e in runtime.wire.ledgers.epsilons(1e-5).items()
                if cid in {c.client_id for c in federation.training_clients}]
    dp = {} if dp_epsilon is None else {"dp_epsilon": dp_epsilon, "dp_delta": dp_delta}
    return {"method": "fedpft", **method_config, **dp, "accuracy": acc,
            "bytes_up_total": int(sum(runtime.wire.bytes_up.values())),
            "epsilon_max": max(epsilons), "seconds": time.perf_counter() - started}


def cell_sizes(federation) -> list[int]:
    """n_c of every non-empty (training client, class) cell."""
    return [int(n) for c in federation.training_clients
            for n in torch.bincount(c.y_train, minlength=federation.num_classes) if n > 0]


def raw_fractions(cells: list[int], k: int) -> dict:
    """K_eff = min(K, n_c): a (client, class) cell with n_c <= K sends its raw features as the mixture's means. The
    fraction of cells that do, and of training samples whose features leave their client that way."""
    raw = [n for n in cells if n <= k]
    return {"cells_raw_fraction": len(raw) / len(cells), "samples_raw_fraction": sum(raw) / sum(cells)}


def target_check(rows: list[dict], curve: list[dict], *, gap: float) -> dict:
    """The issue's target for one alpha: some FedPFT setting within ``gap`` points of centralized that sends fewer
    bytes than FedAvg of the head needs to reach the same accuracy.

    Among the settings within the gap, the one with the fewest bytes is checked; FedAvg's cost is the cumulative
    upload at the first round whose accuracy reaches it, or ``None`` when no round of the curve does (FedAvg then needs
    more than the whole curve's bytes, a lower bound recorded as ``fedavg_bytes_lower_bound``).
    """
    central = next(r["accuracy"] for r in rows if r["method"] == "centralized")
    within = [r for r in rows if r["method"] == "fedpft" and central - r["accuracy"] <= gap]
    best = max((r for r in rows if r["method"] == "fedpft"), key=lambda r: r["accuracy"])
    out = {"centralized": central, "gap_allowed": gap, "best_fedpft_gap": best["accuracy"] - central,
           "best_fedpft": f"{best['covariance']} K={best['components']}"}
    if not within:
        return {**out, "met": False, "why": "no FedPFT setting within the gap"}
    cheapest = min(within, key=lambda r: r["bytes_up_total"])
    reach = next((p for p in curve if p["accuracy"] >= cheapest["accuracy"]), None)
    fedavg_bytes = None if reach is None else reach["bytes_up_total"]
    bound = curve[-1]["bytes_up_total"]
    met = cheapest["bytes_up_total"] < (bound if fedavg_bytes is None else fedavg_bytes)
    return {**out, "met": bool(met), "setting": f"{cheapest['covariance']} K={cheapest['components']}",
            "accuracy": cheapest["accuracy"], "gap": cheapest["accuracy"] - central,
            "bytes_up_total": cheapest["bytes_up_total"], "fedavg_round_reaching": None if reach is None
            else reach["round"], "fedavg_bytes_reaching": fedavg_bytes,
            "fedavg_bytes_lower_bound": bound if fedavg_bytes is None else None}


def part_main(args, path: Path) -> dict:
    results = {}
    settings = get_method("fedpft").make_config(**HEAD).head_settings()
    grid = [(k, c) for c in ("spherical", "diag") for k in args.components] + [(1, "full")] * (not args.no_full)
    for alpha in args.alphas:
        federation = federation_for(path, alpha, args.clients, args.seed)
        x, y = test_set(federation)
        d, classes = federation.input_shape[0], federation.num_classes
        rows = []
        cells = cell_sizes(federation)
        head, nbytes = centralized_head(federation, settings=settings, seed=args.seed)
        rows.append({"method": "centralized", "accuracy": accuracy(head, x, y), "bytes_up_total": nbytes})
        heads = local_heads(federation, settings=settings, seed=args.seed)
        rows.append({"method": "local", "accuracy": mean_local_accuracy(heads, x, y), "bytes_up_total": 0})
        rows.append({"method": "ensemble", "accuracy": accuracy(MaxProbabilityEnsemble(list(heads.values())), x, y),
                     "bytes_up_total": head_bytes(d, classes) * len(heads)})
        curve = fedavg_head_curve(federation, rounds=args.fedavg_rounds, lr=HEAD["head_lr"], local_steps=20,
                                  batch_size=64, seed=args.seed, evaluate=lambda m: accuracy(m, x, y))
        rows += [{"method": "fedavg_head", **point} for point in curve]
        for k, covariance in grid:
            row = run_fedpft(federation, args.seed, components=k, covariance=covariance)
            row.update(raw_fractions(cells, k))
            print(f"alpha={alpha} fedpft K={k} {covariance}: {row['accuracy']:.2f}% "
                  f"{row['bytes_up_total'] / 2**20:.2f} MiB ({row['seconds']:.0f} s)", flush=True)
            rows.append(row)
        sizes = [c.num_train for c in federation.training_clients]
        results[str(alpha)] = {"rows": rows, "clients": len(sizes), "train_samples": int(sum(sizes)),
                               "classes_held_mean": float(np.mean([int((torch.bincount(c.y_train, minlength=classes)
                                                                       > 0).sum())
                                                                   for c in federation.training_clients]))}
        central = rows[0]["accuracy"]
        results[str(alpha)]["target"] = target_check(rows, curve, gap=4.0)
        print(f"alpha={alpha}: centralized {central:.2f}, local {rows[1]['accuracy']:.2f}, ensemble "
              f"{rows[2]['accuracy']:.2f}, fedavg@{args.fedavg_rounds} {curve[-1]['accuracy']:.2f}", flush=True)
    return results


def part_dp(args, path: Path, previous: dict | None = None, checkpoint=None) -> dict:
    """DP-FedPFT rows per alpha, covariance and epsilon. A row already in ``previous`` (the results file's ``dp``
    part, same data settings) is kept instead of being run again, so a new covariance type or epsilon adds its rows
    only; pass ``--fresh`` to run everything. ``checkpoint(partial)`` is called after every row run with the ``dp``
    part as it stands (rows not yet reached kept from ``previous``), so an interrupted run loses one row at most."""
    results = dict(previous or {})
    for alpha in args.alphas:
        federation = federation_for(path, alpha, args.clients, args.seed)
        kept = (previous or {}).get(str(alpha), {}).get("rows", [])
        rows = []

        def save() -> None:
            if checkpoint is not None:
                results[str(alpha)] = {**(previous or {}).get(str(alpha), {}),
                                       "rows": rows + [old for old in kept if old not in rows]}
                checkpoint(results)

        def row(covariance: str, **dp) -> dict:
            for old in kept:
                if old["covariance"] == covariance and old.get("dp_epsilon") == dp.get("dp_epsilon") \
                        and old.get("components") == 1:
                    return old
            new = run_fedpft(federation, args.seed, components=1, covariance=covariance, **dp)
            if dp:
                print(f"alpha={alpha} DP {covariance} eps={dp['dp_epsilon']}: {new['accuracy']:.2f}% "
                      f"(ledger eps {new['epsilon_max']:.3f}, {new['seconds']:.0f} s)", flush=True)
            return new

        for covariance in args.dp_covariances:
            for dp in [{}] + [dict(dp_epsilon=eps, dp_delta=1e-5, dp_counts="public") for eps in args.epsilons]:
                rows.append(row(covariance, **dp))
                if not any(rows[-1] is old for old in kept):
                    save()
        counts = np.asarray(cell_sizes(federation))
        results[str(alpha)] = {"rows": rows, "n_c_quantiles": {q: float(np.quantile(counts, q))
                                                               for q in (0.1, 0.25, 0.5, 0.75, 0.9)}}
    return results


def part_throughput(args) -> dict:
    source = load_source("mnist")
    rows = []
    settings = get_method("fedpft").make_config(**HEAD).head_settings()
    for size in args.sizes:
        backbone = mobilenet_v2(input_size=size)
        batch = torch.from_numpy(np.asarray(source.train.x[:args.throughput_images]))
        backbone(batch[:8])
        started = time.perf_counter()
        extract_features(backbone, batch, use_cache=False, batch_size=64, progress=False)
        rate = len(batch) / (time.perf_counter() - started)
        path = mnist_features(args, size, args.size_train, args.size_test)
        federation = federation_for(path, 0.5, 10, args.seed)
        x, y = test_set(federation)
        head, _ = centralized_head(federation, settings=settings, seed=args.seed)
        rows.append({"input_size": size, "images_per_second": rate, "centralized_accuracy": accuracy(head, x, y),
                     "train": args.size_train, "test": args.size_test})
        print(f"input {size}: {rate:.1f} images/s, centralized {rows[-1]['centralized_accuracy']:.2f}%", flush=True)
    return {"rows": rows, "threads": torch.get_num_threads()}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "main" in results:
        alphas = list(results["main"])
        fig, axes = plt.subplots(1, len(alphas), figsize=(6 * len(alphas), 4.5), squeeze=False)
        for ax, alpha in zip(axes[0], alphas):
            rows = results["main"][alpha]["rows"]
            curve = [r for r in rows if r["method"] == "fedavg_head"]
            ax.plot([r["bytes_up_total"] for r in curve], [r["accuracy"] for r in curve], "-", color="grey",
                    label="FedAvg of head (1..R rounds)")
            markers = {"spherical": "o", "diag": "s", "full": "^"}
            for r in rows:
                if r["method"] == "fedpft":
                    ax.scatter(r["bytes_up_total"], r["accuracy"], marker=markers[r["covariance"]],
                               label=f"FedPFT {r['covariance']} K={r['components']}")
                    ax.annotate(f"K={r['components']}", (r["bytes_up_total"], r["accuracy"]), fontsize=7)
            for name, style in (("ensemble", "kx"), ("centralized", "r*")):
                r = next(r for r in rows if r["method"] == name)
                ax.plot(r["bytes_up_total"], r["accuracy"], style, markersize=10, label=name)
            local = next(r for r in rows if r["method"] == "local")
            ax.axhline(local["accuracy"], color="k", linestyle=":", label="local (mean)")
            ax.set_xscale("log")
            ax.set_xlabel("bytes sent by all clients")
            ax.set_ylabel("test accuracy (%)")
            ax.set_title(f"MNIST / MobileNetV2, 50 clients, Dir({alpha})")
            handles, labels = ax.get_legend_handles_labels()
            unique = dict(zip(labels, handles))
            ax.legend(unique.values(), unique.keys(), fontsize=6, loc="lower right")
        fig.tight_layout()
        fig.savefig(out.with_name(out.stem + "_accuracy_bytes.png"), dpi=120)
        plt.close(fig)
    if "dp" in results:
        alphas = list(results["dp"])
        fig, axes = plt.subplots(1, len(alphas), figsize=(6 * len(alphas), 4.5), squeeze=False)
        for ax, alpha in zip(axes[0], alphas):
            rows = results["dp"][alpha]["rows"]
            for covariance, color in (("spherical", "C0"), ("diag", "C1"), ("full", "C2")):
                dp = [r for r in rows if r["covariance"] == covariance and r.get("dp_epsilon")]
                if not dp:
                    continue
                ax.plot([r["dp_epsilon"] for r in dp], [r["accuracy"] for r in dp], "o-", color=color,
                        label=f"DP-FedPFT {covariance} K=1")
                plain = next(r for r in rows if r["covariance"] == covariance and not r.get("dp_epsilon"))
                ax.axhline(plain["accuracy"], color=color, linestyle="--", label=f"FedPFT {covariance} K=1 (no DP)")
            if "main" in results and alpha in results["main"]:
                central = next(r for r in results["main"][alpha]["rows"] if r["method"] == "centralized")
                ax.axhline(central["accuracy"], color="r", linestyle=":", label="centralized")
            epsilons = sorted({r["dp_epsilon"] for r in rows if r.get("dp_epsilon")})
            ax.set_xscale("log")
            ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
            ax.minorticks_off()
            ax.set_xlabel("epsilon per client (delta = 1e-5)")
            ax.set_ylabel("test accuracy (%)")
            ax.set_title(f"DP-FedPFT, 50 clients, Dir({alpha})")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        fig.savefig(out.with_name(out.stem + "_dp.png"), dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["main", "dp", "throughput"], choices=["main", "dp", "throughput"])
    p.add_argument("--cache-dir", default=str(default_cache_dir()), help="feature cache (outside the repository)")
    p.add_argument("--out", default=str(RESULTS / "fedpft_mnist.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-size", type=int, default=64)
    p.add_argument("--train", type=int, default=12000, help="MNIST train images used (of 60,000)")
    p.add_argument("--test", type=int, default=3000, help="MNIST test images used (of 10,000)")
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument("--components", type=int, nargs="+", default=[1, 5, 10, 20])
    p.add_argument("--no-full", action="store_true", help="skip full covariance (K = 1)")
    p.add_argument("--fedavg-rounds", type=int, default=50)
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    p.add_argument("--dp-covariances", nargs="+", default=["spherical", "diag", "full"],
                   choices=["spherical", "diag", "full"])
    p.add_argument("--fresh", action="store_true", help="run every DP row again (default: keep rows in --out)")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 224])
    p.add_argument("--throughput-images", type=int, default=256)
    p.add_argument("--size-train", type=int, default=1000)
    p.add_argument("--size-test", type=int, default=500)
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    p.add_argument("--plot-only", action="store_true", help="redraw the plots from --out and stop")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out))
        return 0
    if args.quick:
        args.train, args.test, args.clients, args.fedavg_rounds = 2000, 500, 10, 5
        args.alphas, args.components, args.epsilons, args.sizes = [0.5], [1, 5], [1.0, 8.0], [64]
        args.dp_covariances = ["spherical", "diag"]
        args.throughput_images, args.size_train, args.size_test, args.no_full = 64, 500, 200, True
        args.out = str(Path(args.out).with_name("fedpft_mnist_quick.json"))
    torch.set_num_threads(1)
    out = Path(args.out)
    results: dict = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "cache_dir")},
                     "machine": platform.platform(),
                     "python": sys.version.split()[0], "torch": torch.__version__,
                     "note": (f"MNIST subset: {args.train} train / {args.test} test images (seeded), MobileNetV2 at "
                              f"{args.input_size}x{args.input_size}; features cached in --cache-dir")}
    previous: dict = {}
    if out.is_file():
        previous = json.loads(out.read_text())
        results.update({k: v for k, v in previous.items()
                        if k.removesuffix("_seconds").removesuffix("_numerics") in ("main", "dp", "throughput")})
    same_data = all(previous.get("config", {}).get(k) == getattr(args, k)
                    for k in ("seed", "input_size", "train", "test", "clients"))
    kept_dp = previous.get("dp") if same_data and not args.fresh else None
    if {"main", "dp"} & set(args.parts):
        path = mnist_features(args, args.input_size, args.train, args.test)
        print(f"features: {path} ({args.train} train / {args.test} test MNIST images at {args.input_size}px)")
    for part in args.parts:
        started = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)

        def checkpoint(partial: dict) -> None:
            out.write_text(json.dumps(to_json_safe({**results, "dp": partial}), indent=1, allow_nan=False))

        results[part] = part_main(args, path) if part == "main" \
            else part_dp(args, path, kept_dp, checkpoint) if part == "dp" else part_throughput(args)
        results[f"{part}_seconds"] = time.perf_counter() - started
        results[f"{part}_numerics"] = numerics()
        out.write_text(json.dumps(to_json_safe(results), indent=1, allow_nan=False))
        plot(results, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
