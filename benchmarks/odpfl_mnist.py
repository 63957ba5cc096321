"""ODPFL-HN on MNIST: six benchmarks, each a ``--part`` (results in benchmarks/results/odpfl_<part>.json,
plots beside them as PNG).

1. ``fedtta``: the FedTTA paper's MNIST protocol (as benchmarks/fedtta_mnist.py: merged MNIST, 100 clients, 2 shards,
   50% novel, MNIST 2NN, best validation round): ODPFL-HN and PFL-sampled / PFL-ensemble beside the FedTTA paper's
   ODPFL-HN 95.67, PFL-sampled 9.43, PFL-ensemble 44.82 and FedAvg 94.69.
2. ``splits``: the ODPFL-HN paper's protocol on MNIST (Amosy et al., section 6.1 and App. C): 100 clients, 10% novel,
   10% of training clients per round, pathological K=2 and Dirichlet alpha in {0.1, 1, 10}; FedAvg, FedProx,
   PFL-sampled/nearest/ensemble, ODPFL-HN per encoder, two-phase IT-PFL-HN; mean +- SEM over novel clients. The paper's
   500 rounds write odpfl_splits.json, other round counts odpfl_splits_rounds<R>.json (part 1 likewise, at 200 rounds
   with every training client per round); each finished row is written at once.
3. ``shift``: covariate shift (Amosy et al., section 6.8 and Fig. 4, with blur and rotation levels of our choice, since
   the paper lists none): the models of part 2's pathological split serve novel clients blurred and rotated at several
   strengths (no retraining: the training clients are the same, only novel inputs change).
4. ``kl``: novel-client accuracy against the KL divergence of its labels to the nearest training client, per method,
   from part 2's runs (a plot).
5. ``privacy``: descriptor DP through privatize at delta 1e-5, eps in {0.1, 0.3, 1, 3}, novel clients of 50 to 5000
   images from a held-out pool (:mod:`privfl.sweep`); the smallest size within 1 point of non-private, per eps.
6. ``speed``: rounds per second of ODPFL-HN, pFedHN and FedAvg on the FedTTA MNIST protocol (1 torch thread), with
   user and system time and page faults; ``--default-allocator`` measures them without ``reuse_freed_memory``. Time
   one method per process (``--methods``) to compare allocators: glibc adapts to what ran before in the process.

    python benchmarks/odpfl_mnist.py --part fedtta [--rounds 200] [--client-fraction 1.0] [--methods ...]
    python benchmarks/odpfl_mnist.py --part splits [--rounds 500] [--splits pathological dir0.1 dir1 dir10]
    python benchmarks/odpfl_mnist.py --part shift   # after --part splits (pathological)
    python benchmarks/odpfl_mnist.py --part kl      # after --part splits
    python benchmarks/odpfl_mnist.py --part privacy [--rounds 200]
    python benchmarks/odpfl_mnist.py --part speed [--rounds 3]

A method that is not registered is recorded as "not run". Every run directory is under ``--out``
(runs/odpfl_mnist by default) and resumes if interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fedtta_mnist import ODPFLHN_PIXELS  # noqa: E402
from fedtta_mnist import PAPER as FEDTTA_PAPER_BASELINES  # noqa: E402

from privfl.config import RunConfig  # noqa: E402
from privfl.data import FederationSpec, build_federation  # noqa: E402
from privfl.experiment import build_runtime, train_once  # noqa: E402
from privfl.federation import RunDirectory  # noqa: E402
from privfl.federation.rundir import update_json  # noqa: E402
from privfl.memory import reuse_freed_memory  # noqa: E402
from privfl.methods import METHODS  # noqa: E402
from privfl.metrics import score_model, summarize_scores  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = Path(__file__).parent / "results"
#: The FedTTA paper's MNIST Table 1 ("Test") for the personalised baselines; FedAvg from benchmarks/fedtta_mnist.py.
FEDTTA_PAPER = {"odpflhn": 95.67, "pfl_sampled": 9.43, "pfl_ensemble": 44.82,
                "fedavg": FEDTTA_PAPER_BASELINES["fedavg"]}

_HN = {"lr": 0.05, "local_steps": 20, "batch_size": 64}
#: ODPFL-HN with the pixel benchmarks' encoder and server settings (fedtta_mnist.ODPFLHN_PIXELS) and this file's local
#: training
_ODPFL = {**ODPFLHN_PIXELS, **_HN}
SETTINGS = {
    "fedavg": {"lr": 0.1, "local_steps": 20, "batch_size": 64, "weight_decay": 1e-4, "grad_clip": 10.0},
    "fedprox": {"lr": 0.1, "mu": 0.01, "local_steps": 20, "batch_size": 64, "weight_decay": 1e-4, "grad_clip": 10.0},
    "pfedhn": dict(_HN), "pfl_sampled": dict(_HN), "pfl_nearest": dict(_HN), "pfl_ensemble": dict(_HN),
    "itpflhn": dict(_HN),
    "odpflhn": dict(_ODPFL),
    "odpflhn_deepset": {**_HN, "encoder": "deepset", "encoder_hidden": 100, "hn_lr": 0.05, "encoder_lr": 0.05},
    "odpflhn_dss": {**_HN, "encoder": "dss", "encoder_hidden": 100, "hn_lr": 0.05, "encoder_lr": 0.05},
    "odpflhn_set_transformer": {**_HN, "encoder": "set_transformer", "encoder_hidden": 64, "hn_lr": 0.05,
                                "encoder_lr": 0.05},
}
SPLITS = {"pathological": {"partition": "pathological", "shards_per_client": 2},
          "dir0.1": {"partition": "dirichlet", "alpha": 0.1}, "dir1": {"partition": "dirichlet", "alpha": 1.0},
          "dir10": {"partition": "dirichlet", "alpha": 10.0}}


def method_name(tag: str) -> str:
    """The registered method behind a settings tag (``odpflhn_dss`` -> ``odpflhn``)."""
    return "odpflhn" if tag.startswith("odpflhn") else tag


#: Model selection per settings tag (default ``best_val``). IT-PFL-HN scores training clients with its pre-fine-tune
#: hypernetwork, so their validation accuracy cannot improve in phase 2 and ``best_val`` would never select a phase-2
#: round: its fine-tuned hypernetwork, the one meant for novel clients, would never be served.
SELECT = {"itpflhn": "last"}


def run_method(tag: str, spec: FederationSpec, out: Path, args, *, select: str | None = None) -> dict:
    """Train ``tag`` on ``spec`` (resuming an interrupted run); ``{"status": "not run", ...}`` if not registered.
    ``select``: ``None`` takes the tag's entry of :data:`SELECT` (``"best_val"`` if it has none)."""
    select = select or SELECT.get(tag, "best_val")
    method = method_name(tag)
    if method not in METHODS:
        return {"status": "not run", "reason": f"method {method!r} is not registered"}
    settings = dict(SETTINGS[tag])
    if method == "itpflhn":
        # the paper does not give its split of the 500 rounds; 400 + 100, scaled to the rounds run (phase 2 = the last
        # fifth; docs/papers.md, ODPFL-HN, U9)
        settings.setdefault("phase1_rounds", max(1, (4 * args.rounds) // 5))
    config = RunConfig(federation=spec, method=method, method_config=settings, model="mlp2nn",
                       rounds=args.rounds, client_fraction=args.client_fraction, eval_every=args.eval_every,
                       checkpoint_every=args.eval_every, select=select, seed=args.seed)
    summary = train_once(config, str(out))
    return {"status": "ran", "select": select, "novel_accuracy_mean": summary["novel"]["accuracy_mean"],
            "novel_accuracy_sem": summary["novel"]["accuracy_sem"], "selected_round": summary["selected_round"],
            "rounds": summary["rounds_completed"], "wall_time_s": summary["wall_time_s"], "run_dir": str(out),
            "numerics": summary.get("numerics")}   # the training's own: a finished run reused keeps its revision


#: each protocol's (rounds, client fraction) for parts ``splits`` (the ODPFL-HN paper) and ``fedtta`` (the FedTTA
#: paper); a run at other settings goes to its own file, so a shorter run never replaces the protocol's table
PROTOCOLS = {"splits": (500, 0.1), "fedtta": (200, 1.0)}


def results_path(part: str, payload: dict) -> Path:
    """``results/odpfl_<part>.json``; parts of :data:`PROTOCOLS` at other rounds get ``_rounds<R>`` appended, at
    another client fraction ``_fraction<f>`` (``odpfl_splits_rounds200.json``,
    ``odpfl_fedtta_rounds100_fraction0.2.json``)."""
    rounds, fraction = PROTOCOLS.get(part, (payload.get("rounds"), payload.get("client_fraction")))
    suffix = "" if payload.get("rounds") == rounds else f"_rounds{payload['rounds']}"
    suffix += "" if payload.get("client_fraction") == fraction else f"_fraction{payload['client_fraction']:g}"
    suffix += "" if payload.get("reuse_freed_memory", True) else "_default_allocator"
    return RESULTS / f"odpfl_{part}{suffix}.json"


def save(part: str, payload: dict) -> Path:
    """Write ``payload`` to the part's results file; for parts ``fedtta``, ``splits`` and ``speed`` under the same
    protocol settings, rows stored by other processes (one per core) are kept, and for ``splits`` merged per split."""
    path = results_path(part, payload)

    def merge(stored: dict) -> dict:
        same = all(stored.get(k) == payload.get(k) for k in ("rounds", "client_fraction", "timed_rounds"))
        if part in ("fedtta", "splits", "speed") and same:
            for key, value in stored.get("results", {}).items():
                if isinstance(value, dict) and isinstance(payload["results"].get(key), dict) and part == "splits":
                    payload["results"][key] = {**value, **payload["results"][key]}
                else:
                    payload["results"].setdefault(key, value)
        return payload

    update_json(path, merge)
    return path


# -- parts ------------------------------------------------------------------------------------------------------------


def part_fedtta(args) -> dict:
    spec = FederationSpec(source="mnist", num_clients=100, partition="pathological", shards_per_client=2,
                          novel_fraction=0.5, split="merged", val_fraction=0.15)
    results = {}

    def payload() -> dict:
        return {"protocol": "FedTTA MNIST (merged, 100 clients, 2 shards, 50% novel, MNIST 2NN, best validation round)",
                "rounds": args.rounds, "client_fraction": args.client_fraction, "seed": args.seed,
                "paper": FEDTTA_PAPER, "target": "odpflhn >= 95.67", "results": dict(results)}

    for tag in args.methods or ["odpflhn", "pfl_sampled", "pfl_ensemble"]:
        results[tag] = run_method(tag, spec, Path(args.out) / "fedtta" / tag, args)
        results[tag]["paper"] = FEDTTA_PAPER.get(tag)
        print(tag, results[tag], flush=True)
        save("fedtta", payload())   # an interrupted invocation keeps its finished rows
    return payload()


def _split_spec(split: str, **shift) -> FederationSpec:
    return FederationSpec(source="mnist", num_clients=100, novel_fraction=0.1, split="merged", val_fraction=0.15,
                          max_samples=args_max_samples, **SPLITS[split], **shift)


args_max_samples = None


def part_splits(args) -> dict:
    tags = args.methods or ["fedavg", "fedprox", "pfl_sampled", "pfl_nearest", "pfl_ensemble", "odpflhn",
                            "odpflhn_deepset", "odpflhn_dss", "odpflhn_set_transformer", "itpflhn"]
    results = {}
    for split in args.splits:
        results[split] = {}
        for tag in tags:
            results[split][tag] = run_method(tag, _split_spec(split), Path(args.out) / "splits" / split / tag, args)
            print(split, tag, results[split][tag], flush=True)
            save("splits", _splits_payload(args, results))   # an interrupted invocation keeps its finished rows
    return _splits_payload(args, results)


def _splits_payload(args, results: dict) -> dict:
    return {"protocol": "ODPFL-HN paper on MNIST: 100 clients, 10% novel, 10% of training clients per round",
            "rounds": args.rounds, "client_fraction": args.client_fraction, "max_samples": args_max_samples,
            "results": {split: dict(rows) for split, rows in results.items()}}


def serve_shifted(run_dir: Path, **shift) -> dict:
    """Serve the novel clients of a finished run again with shifted inputs, from the server state the run selected:
    the last round's (``select="last"``) or the best validation round's (``select="best_val"``; its snapshot is
    kept in the checkpoint's ``best`` entry, as :func:`privfl.experiment.finish` restores it)."""
    config = RunConfig.from_dict(RunDirectory(run_dir).read_json(RunDirectory.CONFIG))
    config = dataclasses.replace(config, federation=dataclasses.replace(config.federation, **shift))
    federation = build_federation(config.federation, seed=config.seed)
    runtime = build_runtime(config, federation)
    checkpoint = RunDirectory(run_dir).load_checkpoint()
    runtime.load_state_dict(checkpoint["runtime"])
    best = checkpoint.get("best") or {}
    if config.select == "best_val" and best.get("snapshot") is not None:
        runtime.restore(best["snapshot"])
    scores = [score_model(runtime.novel_client_model(n), n.x, federation.novel_labels.labels(n.client_id))
              for n in federation.novel_clients]
    return summarize_scores(scores)


def _run_numerics(run_dir: Path) -> dict | None:
    """The numerics (code revision included) a finished run recorded in its ``summary.json``: parts ``shift`` and
    ``kl`` read runs that part ``splits`` trained, so their figures depend on that revision as well as this one."""
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()).get("numerics") if summary.exists() else None


def part_shift(args) -> dict:
    levels = [("blur_sigma", b, {"novel_blur_sigma": b, "novel_blur_kernel": 7}) for b in (0.0, 1.0, 2.0)]
    levels += [("rotation", r, {"novel_rotation": r}) for r in (15.0, 30.0, 60.0)]
    base = Path(args.out) / "splits" / "pathological"
    results, trained = {}, {}
    for tag_dir in sorted(base.glob("*")):
        if not (tag_dir / "summary.json").exists():
            continue
        results[tag_dir.name] = {f"{kind}={value:g}": serve_shifted(tag_dir, **shift)["accuracy_mean"]
                                 for kind, value, shift in levels}
        trained[tag_dir.name] = _run_numerics(tag_dir)
        print(tag_dir.name, results[tag_dir.name], flush=True)
    _plot_shift(results)
    return {"note": "the selected server state (best validation round, or the last for itpflhn) of each part-2 "
                    "pathological run serves blurred / rotated novel clients",
            "results": results, "numerics": numerics(), "trained_numerics": trained}


def _plot_shift(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for tag, cells in results.items():
        for ax, kind in zip(axes, ("blur_sigma", "rotation")):
            keys = [k for k in cells if k.startswith(kind)]
            ax.plot([float(k.split("=")[1]) for k in keys], [cells[k] for k in keys], marker="o", label=tag)
            ax.set(xlabel=kind, ylabel="novel accuracy (%)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "odpfl_shift.png", dpi=110)
    plt.close(fig)


def part_kl(args) -> dict:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, list[tuple[float, float]]] = {}
    trained: dict[str, dict | None] = {}
    for clients in sorted((Path(args.out) / "splits").glob("*/*/clients.csv")):
        tag = clients.parent.name
        trained[f"{clients.parent.parent.name}/{tag}"] = _run_numerics(clients.parent)
        for row in csv.DictReader(open(clients)):
            if row["role"] == "novel" and math.isfinite(float(row["accuracy"])):
                points.setdefault(tag, []).append((float(row["label_shift_kl"]), float(row["accuracy"])))
    fig, ax = plt.subplots(figsize=(6, 4))
    for tag, pts in points.items():
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=tag)
    ax.set(xlabel="KL(novel labels || nearest training client's), nats", ylabel="novel accuracy (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "odpfl_kl.png", dpi=110)
    plt.close(fig)
    return {"points": points, "numerics": numerics(), "trained_numerics": trained}


#: The descriptor-privacy protocol of benchmarks/README.md ("ODPFL-HN descriptor privacy"), pinned here: the main
#: job's defaults (privfl/sweep.py) moved to ScatterNet features, every training image and private training, whose
#: held-out pool (the test split) has too few images of a class for novel clients of 5,000. This is the earlier
#: sweep: a 2NN on pixels, 20,000 training images, one training without DP, ODPFL-HN's server rates 0.1 / 1.0.
PRIVACY_PROTOCOL = {
    "max_samples": 20000, "train_epsilons": (None,), "features": None, "model": "auto",
    "method_config": dict(ODPFLHN_PIXELS),
}


def part_privacy(args) -> dict:
    from privfl.sweep import SweepConfig, format_table, run_sweep

    config = SweepConfig(rounds=args.rounds, epsilons=(0.1, 0.3, 1.0, 3.0), delta=1e-5,
                         sizes=(50, 150, 500, 1500, 5000), seed=args.seed, **PRIVACY_PROTOCOL)
    result = run_sweep(config, Path(args.out) / "privacy", progress=True)
    print(format_table(result))
    import shutil

    shutil.copy(Path(args.out) / "privacy" / "sweep.png", RESULTS / "odpfl_privacy.png")
    training = result["trainings"]["inf"]               # the one training, without DP
    smallest = training["smallest_n_without_loss"].get("0.3")
    result["target"] = ("no loss (within 1 point of non-private) at eps = 0.3 with at most 1500 samples, and the "
                        "descriptor informative (non-private beats both uninformative-descriptor controls by at "
                        f"least {config.min_margin:g} points at every n; otherwise the curve says nothing)")
    result["target_met"] = bool(training["descriptor_informative"] and smallest is not None and smallest <= 1500)
    return result


def part_speed(args) -> dict:
    spec = FederationSpec(source="mnist", num_clients=100, partition="pathological", shards_per_client=2,
                          novel_fraction=0.5, split="merged", val_fraction=0.15)
    federation = build_federation(spec, seed=0)
    results = {}
    for tag in args.methods or ["odpflhn", "pfedhn", "fedavg"]:
        if method_name(tag) not in METHODS:
            results[tag] = {"status": "not run"}
            continue
        config = RunConfig(federation=spec, method=method_name(tag), method_config=SETTINGS[tag], model="mlp2nn",
                           rounds=args.rounds, client_fraction=args.client_fraction, seed=0)
        runtime = build_runtime(config, federation)
        runtime.run_round(0)                                  # warm-up (allocations, first optimizer state)
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for r in range(1, args.rounds + 1):
            runtime.run_round(r)
        seconds = (time.perf_counter() - started) / args.rounds
        after = resource.getrusage(resource.RUSAGE_SELF)
        clients = max(1, round(args.client_fraction * len(federation.training_clients)))
        # user and system CPU time apart: page faults on freshly mapped memory are system time
        results[tag] = {"seconds_per_round": seconds, "rounds_per_second": 1 / seconds,
                        "clients_per_round": clients, "seconds_per_client": seconds / clients,
                        "user_seconds_per_round": (after.ru_utime - before.ru_utime) / args.rounds,
                        "system_seconds_per_round": (after.ru_stime - before.ru_stime) / args.rounds,
                        "minor_page_faults_per_round": (after.ru_minflt - before.ru_minflt) / args.rounds,
                        "peak_resident_mib": after.ru_maxrss / 1024,   # the process's peak, so far in it
                        # glibc's allocator adapts to what ran before in the process: a method timed after another
                        # can be spared page faults it pays in a process of its own
                        "timed_after_in_process": [t for t, r in results.items() if "seconds_per_round" in r],
                        "numerics": numerics()}   # per row: rows from several processes share one file
        print(tag, results[tag], flush=True)
    return {"protocol": "FedTTA MNIST, MNIST 2NN, 20 local steps x batch 64, 1 torch thread, shared 2-core CPU",
            "timed_rounds": args.rounds, "reuse_freed_memory": args.reuse_freed_memory, "results": results}


PARTS = {"fedtta": part_fedtta, "splits": part_splits, "shift": part_shift, "kl": part_kl, "privacy": part_privacy,
         "speed": part_speed}


def main() -> None:
    global args_max_samples
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=sorted(PARTS))
    parser.add_argument("--rounds", type=int, default=None, help="default: 200 fedtta, 500 splits, 200 privacy, "
                                                                 "3 speed")
    parser.add_argument("--client-fraction", type=float, default=None, help="default: 1.0 fedtta/speed, 0.1 splits")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=None, help="settings tags: " + ", ".join(SETTINGS))
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    parser.add_argument("--max-samples", type=int, default=None, help="splits: subsample MNIST first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/odpfl_mnist")
    parser.add_argument("--default-allocator", action="store_true",
                        help="speed: leave glibc's allocator as it is (no reuse_freed_memory), to measure what the "
                             "call saves; written to odpfl_speed_default_allocator.json")
    args = parser.parse_args()
    if args.default_allocator and args.part != "speed":
        parser.error(f"--default-allocator is for --part speed only, not --part {args.part}")
    torch.set_num_threads(1)
    args.reuse_freed_memory = False if args.default_allocator else reuse_freed_memory()
    defaults = {"fedtta": (200, 1.0), "splits": (500, 0.1), "privacy": (200, 0.2), "speed": (3, 1.0)}
    rounds, fraction = defaults.get(args.part, (None, None))
    args.rounds = args.rounds or rounds
    args.client_fraction = args.client_fraction or fraction
    args_max_samples = args.max_samples
    payload = PARTS[args.part](args)
    payload["command"] = " ".join(sys.argv)
    print(f"wrote {save(args.part, payload)}")


if __name__ == "__main__":
    main()
