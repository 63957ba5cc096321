"""Client-level DP-FedAvg on MNIST at scale: central mode (trusted aggregator, Poisson client sampling, one noise
draw on the clipped sum, adaptive clipping after Andrew et al. 2021), user-level delta, accuracy against epsilon.

Two federations of the merged MNIST (70,000 images):

* ``--clients 1000``: Dirichlet(0.5) label skew, about 70 images a client;
* ``--clients 10000``: IID, about 7 images a client.

10% of the clients are novel: they receive the global model and are scored on their own images (what a client that
never took part gets). Each epsilon of ``--epsilons`` (``inf``: FedAvg without DP on the same schedule) is one run,
``RunConfig(privacy=TrainingPrivacy(mode="central", epsilon=..., clip="adaptive"))``: the noise multiplier is
calibrated so that ``--rounds`` Poisson-subsampled rounds at ``--client-fraction`` compose to (epsilon, delta) by PLD
(:mod:`privfl.privacy.training`), and every training client's ledger records every round's aggregate.

    python benchmarks/client_dp_mnist.py --clients 1000 [--rounds 40] [--client-fraction 0.5] [--server-momentum 0.9]
    python benchmarks/client_dp_mnist.py --clients 10000 [--rounds 50] [--client-fraction 0.2] [--server-momentum 0.9]
    python benchmarks/client_dp_mnist.py --plot      # the figure of both from the stored results

Writes ``benchmarks/results/client_dp_mnist_<clients>.json`` (one row per epsilon, written as each run ends; a run
directory under ``--out`` resumes if interrupted) and ``benchmarks/results/client_dp_mnist.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from privfl.config import RunConfig  # noqa: E402
from privfl.data import FederationSpec  # noqa: E402
from privfl.experiment import train_once  # noqa: E402
from privfl.federation.rundir import update_json  # noqa: E402
from privfl.privacy.training import TrainingPrivacy  # noqa: E402
from privfl.provenance import numerics  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DELTA = 1e-5
#: Per federation: partition, default rounds and client sampling rate q.
#: The schedules that met or came nearest the targets (benchmarks/README.md lists every schedule tried): half of the
#: 1,000 clients per round for 40 rounds with server momentum 0.9 (FedAvgM, McMahan et al. 2018, Andrew et al. 2021;
#: at q = 0.1 it diverged), and a fifth of the 10,000 for 50 rounds, also with momentum 0.9: with few clients per
#: round the noise on each round's mean swamps the clipped updates.
SETTINGS = {1000: {"partition": "dirichlet", "alpha": 0.5, "rounds": 40, "client_fraction": 0.5,
                   "server_momentum": 0.9},
            10000: {"partition": "iid", "alpha": 0.5, "rounds": 50, "client_fraction": 0.2, "server_momentum": 0.9}}
TARGETS = {1000: (8.0, 90.0), 10000: (2.0, 95.0)}     # (epsilon, accuracy %) the issue sets


def run_config(clients: int, epsilon: float | None, rounds: int, fraction: float, seed: int,
               momentum: float = 0.0, count_noise: float | None = None) -> RunConfig:
    s = SETTINGS[clients]
    federation = FederationSpec(source="mnist", num_clients=clients, partition=s["partition"], alpha=s["alpha"],
                                novel_fraction=0.1, split="merged", val_fraction=0.0)
    privacy = TrainingPrivacy() if epsilon is None else TrainingPrivacy(
        mode="central", epsilon=epsilon, delta=DELTA, clip="adaptive", clip_initial=0.1, clip_quantile=0.5,
        clip_lr=0.2, clip_count_noise=count_noise)
    return RunConfig(federation=federation, method="fedavg", model="mlp2nn",
                     method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16, "server_lr": 1.0,
                                    "server_momentum": momentum},
                     rounds=rounds, client_fraction=fraction, eval_every=rounds, checkpoint_every=max(1, rounds // 4),
                     select="last", seed=seed, delta=DELTA, privacy=privacy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, choices=sorted(SETTINGS), default=1000)
    p.add_argument("--epsilons", default="0.5,1,2,4,8,inf", help="user-level epsilons; inf = without DP")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--client-fraction", type=float, default=None, help="Poisson sampling rate q")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-momentum", type=float, default=None,
                   help="FedAvgM's server momentum (0: plain FedAvg; default: the federation's setting, 0.9)")
    p.add_argument("--clip-count-noise", type=float, default=None,
                   help="std of the noised clip count (default: expected clients per round / 20, Andrew et al.)")
    p.add_argument("--tag", default="", help="suffix of the results file and run directories (a variant)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/client_dp_mnist")
    p.add_argument("--plot", action="store_true", help="only draw the figure from the stored results")
    args = p.parse_args(argv)
    if args.plot:
        plot()
        return 0
    torch.set_num_threads(args.threads)
    rounds = args.rounds or SETTINGS[args.clients]["rounds"]
    fraction = args.client_fraction or SETTINGS[args.clients]["client_fraction"]
    momentum = SETTINGS[args.clients]["server_momentum"] if args.server_momentum is None else args.server_momentum
    epsilons = [None if e.strip() == "inf" else float(e) for e in args.epsilons.split(",")]
    path = RESULTS / f"client_dp_mnist_{args.clients}{args.tag}.json"
    for epsilon in epsilons:
        key = "inf" if epsilon is None else f"{epsilon:g}"
        config = run_config(args.clients, epsilon, rounds, fraction, args.seed, momentum,
                            args.clip_count_noise)
        started = time.perf_counter()
        summary = train_once(config, str(Path(args.out) / f"clients{args.clients}{args.tag}-eps{key}"), progress=True)
        row = {"epsilon": key, "accuracy": summary["novel"]["accuracy_mean"], "sem": summary["novel"]["accuracy_sem"],
               "novel_clients": summary["novel"]["num_clients"],
               "epsilon_max_training": summary["privacy"]["epsilon_max_training"],
               "rounds": rounds, "client_fraction": fraction, "delta": DELTA, "seed": args.seed,
               "server_momentum": momentum, "clip_count_noise": config.privacy.clip_count_noise,
               "wall_s": time.perf_counter() - started, "numerics": numerics()}
        update_json(path, lambda stored, row=row: {**stored, "rows": {**stored.get("rows", {}), row["epsilon"]: row},
                                                   "target": dict(zip(("epsilon", "accuracy"),
                                                                      TARGETS[args.clients], strict=True))})
        print(f"{args.clients} clients, epsilon {key}: {row['accuracy']:.2f} +- {row['sem']:.2f}% "
              f"(spent {row['epsilon_max_training']}, {row['wall_s']:.0f} s)", flush=True)
    plot()
    return 0


def plot() -> Path | None:
    """Accuracy against epsilon for both federations, with each target marked."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for clients in sorted(SETTINGS):
        path = RESULTS / f"client_dp_mnist_{clients}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())["rows"]
        private = sorted((float(k), r) for k, r in rows.items() if k != "inf")
        line = ax.errorbar([e for e, _ in private], [r["accuracy"] for _, r in private],
                           yerr=[r["sem"] for _, r in private], marker="o", capsize=3, label=f"{clients} clients")
        if "inf" in rows:
            ax.axhline(rows["inf"]["accuracy"], linestyle="--", color=line[0].get_color(), alpha=0.6,
                       label=f"{clients} clients, without DP")
        eps, acc = TARGETS[clients]
        ax.plot([eps], [acc], marker="*", markersize=12, color=line[0].get_color(), linestyle="none",
                label=f"target: {acc:g}% at epsilon {eps:g}")
        drawn = True
    if not drawn:
        return None
    ax.set(xscale="log", xlabel=f"user-level epsilon (delta = {DELTA:g})", ylabel="novel-client accuracy (%)",
           title="Central client-level DP-FedAvg on MNIST (adaptive clipping)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "client_dp_mnist.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    sys.exit(main())
