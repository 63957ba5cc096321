"""PeFLL against pFedHN, FedAvg and ODPFL-HN on MNIST, for clients seen in training and unseen clients.

Protocol (the PeFLL paper's and its released code's; docs/papers.md, PeFLL, "Protocol"), moved to MNIST because CIFAR
and FEMNIST are not available offline: MNIST train + test merged (70,000 images), N clients (100: about 700 images each;
1000: about 70), 90% seen / 10% unseen (``novel_fraction=0.1``), partition pathological (2 shards per client) or
Dirichlet(alpha=0.1); seen clients split 85/15 train/validation; MNIST 2NN client model for every method; the final
round's model (``select="last"``: no selection at all).

Scoring, the same data for every method:

* seen clients: accuracy on each client's validation split (never trained on). PeFLL's model comes from the full
  protocol (embedding network down, descriptor of the client's whole training split up, generated model down);
  the other methods' from their own evaluation message (``runtime.training_client_model``).
* unseen clients: the federation's novel clients, each split by
  :func:`privfl.methods.pefll.unseen_clients_with_labels` into a labelled descriptor part (85%, PeFLL only) and a
  disjoint scoring part (15%). PeFLL serves them with the two-down/one-up protocol on the labelled part; the other
  methods get the scoring inputs as an unlabelled :class:`~privfl.data.NovelClient` (their own novel protocol).

Accuracy: mean over clients per seed; reported as the mean over seeds +- SEM over seeds (and the mean SEM over
clients). Per-round communication: bytes per sampled client per round, each way, measured on the wire over one
training round of a fresh run.

    nice python benchmarks/pefll_mnist.py --clients 100 --partitions pathological dirichlet --seeds 0 1 2 \
        --rounds 200 [--methods pefll pfedhn fedavg odpflhn] [--out runs/pefll_mnist]

Writes ``benchmarks/results/pefll_mnist_<clients>.json`` (merged across invocations) and prints Markdown tables.
Methods not registered when it runs (pfedhn, odpflhn are written in parallel) are recorded as "not run".
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from privfl.config import RunConfig
from privfl.data import FederationSpec, NovelClient, build_federation
from privfl.errors import ConfigError
from privfl.experiment import build_runtime, train_once
from privfl.federation.rundir import RunDirectory, update_json
from privfl.memory import reuse_freed_memory
from privfl.methods import METHODS
from privfl.methods.pefll import unseen_clients_with_labels
from privfl.metrics import mean_sem, score_model
from privfl.models.hypernetwork import embedding_dim
from privfl.provenance import numerics

CLIENTS_PER_ROUND = 5  # the PeFLL code's default (``--clients-per-step``; docs/papers.md, PeFLL, U3), for every method


#: Tags that run a registered method under other settings: ``pefll_l2`` is PeFLL with the paper's objective, the L2
#: terms lambda_h ||eta_h||^2 + lambda_v ||eta_v||^2 on the hypernetwork and embedding network at the method's
#: registered 1e-3 (pFedHN's weight decay; docs/papers.md, PeFLL, U2), which the authors' default Adam path leaves
#: out; the paper reports that moderate lambda_h reduces overfitting to the training clients (its Table 6).
TAGS = {"pefll_l2": "pefll"}


def registered(tag: str) -> str:
    """The registered method behind a tag of ``--methods``."""
    return TAGS.get(tag, tag)


def method_settings(method: str, num_clients: int) -> dict:
    """Each method's settings: its authors' defaults where they exist, 50 local steps of batch 32 throughout."""
    d = embedding_dim(num_clients, rule="pfedhn")  # N = all clients, seen and unseen (the PeFLL code's rule)
    if method == "pefll_l2":
        return {**method_settings("pefll", num_clients), "lambda_h": 1e-3, "lambda_v": 1e-3}
    if method == "pefll":
        # The code's defaults, except a 5x larger server learning rate (1e-3): our runs are 20-50x shorter than the
        # paper's 5000 rounds.
        return {"embed_dim": d, "server_lr": 1e-3, "lambda_h": 0.0, "lambda_v": 0.0, "eval_descriptor_samples": 256}
    if method == "fedavg":
        return {"lr": 0.05, "local_steps": 50, "batch_size": 32}
    if method == "odpflhn":
        # The privacy sweep's encoder (DP DeepSet, prototype-histogram phi, standardised descriptors). Its server
        # learning rates were tuned for its 10 local steps; the weight change of 50 steps, which drives both server
        # steps, is up to 5x larger, so both rates are scaled by 10/50. With the sweep's rates unscaled (0.1 and 1.0)
        # one of three 1000-client pathological seeds diverged (round 24 loss 6.5, round 26 1e7, then NaN weights).
        from fedtta_mnist import ODPFLHN_PIXELS  # this script's folder is on sys.path

        scale = ODPFLHN_PIXELS["local_steps"] / 50
        return {**ODPFLHN_PIXELS, "local_steps": 50, "batch_size": 32, "hn_lr": ODPFLHN_PIXELS["hn_lr"] * scale,
                "encoder_lr": ODPFLHN_PIXELS["encoder_lr"] * scale}
    return {}  # pfedhn: its registered defaults


def _spec(num_clients: int, partition: str) -> FederationSpec:
    return FederationSpec(source="mnist", num_clients=num_clients, partition=partition, shards_per_client=2,
                          alpha=0.1, novel_fraction=0.1, split="merged", val_fraction=0.15)


#: Rounds between checkpoints: an interrupted run resumes from the last one (``train_once``).
CHECKPOINT_EVERY = 50


def _config(method: str, num_clients: int, partition: str, seed: int, rounds: int, num_training: int) -> RunConfig:
    return RunConfig(federation=_spec(num_clients, partition), method=registered(method),
                     method_config=method_settings(method, num_clients), model="mlp2nn", rounds=rounds,
                     client_fraction=min(1.0, CLIENTS_PER_ROUND / num_training), eval_every=rounds,
                     checkpoint_every=min(rounds, CHECKPOINT_EVERY), select="last", seed=seed)


def score_run(config: RunConfig, out: Path, max_seen: int | None = None) -> dict:
    """Rebuild the trained run from its checkpoint and score seen and unseen clients (module docstring)."""
    federation = build_federation(config.federation, seed=config.seed)
    runtime = build_runtime(config, federation)
    runtime.load_state_dict(RunDirectory(str(out)).load_checkpoint()["runtime"])
    seen, unseen = [], []
    training = federation.training_clients
    if max_seen is not None and len(training) > max_seen:  # a seeded subset, the same for every method
        chosen = torch.randperm(len(training), generator=torch.Generator().manual_seed(config.seed))[:max_seen]
        training = [training[i] for i in sorted(chosen.tolist())]
    for client in training:
        if config.method == "pefll":
            model = runtime.novel_client_model(client)
        else:
            model = runtime.training_client_model(client.client_id)
        seen.append(100 * score_model(model, client.x_val, client.y_val).accuracy)
    note = None
    for client in unseen_clients_with_labels(federation, min_samples=7):  # >= 1 scoring sample at 15%
        try:
            if config.method == "pefll":
                model = runtime.novel_client_model(client)
            else:
                model = runtime.novel_client_model(NovelClient(client.client_id, client.x_val))
        except ConfigError as error:  # pfedhn serves no novel client (it has no encoder)
            note = f"unseen clients not served: {error}"
            break
        unseen.append(100 * score_model(model, client.x_val, client.y_val).accuracy)
    (seen_mean, seen_sem), (unseen_mean, unseen_sem) = mean_sem(seen), mean_sem(unseen)
    return {"seen": seen_mean, "seen_sem_clients": seen_sem, "unseen": unseen_mean, "unseen_sem_clients": unseen_sem,
            "num_seen": len(seen), "num_unseen": len(unseen), **({"note": note} if note else {})}


@functools.cache
def communication(method: str, num_clients: int, partition: str) -> dict:
    """Bytes per sampled client in one training round of a fresh run (seed 0), each way, from the wire's counters
    (the same for every seed, so measured once per method and partition in a process)."""
    federation = build_federation(_spec(num_clients, partition), seed=0)
    config = _config(method, num_clients, partition, 0, 1, len(federation.training_clients))
    runtime = build_runtime(config, federation)
    metrics = runtime.run_round(0)
    clients = metrics["clients"]
    return {"up_bytes_per_client_round": sum(runtime.wire.bytes_up.values()) / clients,
            "down_bytes_per_client_round": sum(runtime.wire.bytes_down.values()) / clients}


def _strict(value):
    """``value`` with every NaN / infinity replaced by ``None`` (strict JSON: ``null``)."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return None
    return value


def _summary(per_seed: list[dict], key: str) -> tuple[float | None, float | None]:
    """Mean over seeds and SEM over seeds; ``(None, None)`` when a seed has no score (pFedHN serves no unseen client),
    so the file holds JSON ``null`` rather than a bare NaN."""
    values = [r[key] for r in per_seed]
    if not values or any(v is None or v != v for v in values):
        return None, None
    return statistics.mean(values), (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--partitions", nargs="+", default=["pathological", "dirichlet"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--methods", nargs="+", default=["pefll", "pfedhn", "fedavg", "odpflhn"],
                        help="registered methods, or a tag of TAGS (pefll_l2: PeFLL with lambda_h = lambda_v = 1e-3)")
    parser.add_argument("--out", default="runs/pefll_mnist")
    parser.add_argument("--max-seen-scored", type=int, default=None,
                        help="score a seeded subset of this many seen clients (the same for every method)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on the shared 2-core machine)")
    parser.add_argument("--results", default=None,
                        help="results file name under benchmarks/results (default pefll_mnist_<clients>.json); an "
                             "entry run at other rounds or settings replaces the stored one, so give other round "
                             "counts their own file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_memory()

    path = Path(__file__).parent / "results" / (args.results or f"pefll_mnist_{args.clients}.json")
    if path.suffix != ".json" or path.parent.name != "results":
        parser.error(f"--results {args.results!r}: give a file name ending in .json (it is written under "
                     "benchmarks/results)")
    path.parent.mkdir(exist_ok=True)
    header = {"clients": args.clients, "clients_per_round": CLIENTS_PER_ROUND, "model": "mlp2nn",
              "max_seen_scored": args.max_seen_scored}
    # Seed-major order: every (partition, method) gets seed 0 before any gets seed 1, so a run cut short by the
    # slow shared machine still covers every setting; each finished seed is merged into the results file at once.
    for seed in args.seeds:
        for partition in args.partitions:
            for method in args.methods:
                key = f"{partition}/{method}"
                if registered(method) not in METHODS:
                    _merge(path, header, key, None, args, method)
                    continue
                config = _config(method, args.clients, partition, seed, args.rounds, round(args.clients * 0.9))
                out = Path(args.out) / f"n{args.clients}-{partition}-{method}-seed{seed}"
                started = time.perf_counter()
                train_once(config, str(out), progress=False)
                scores = score_run(config, out, args.max_seen_scored)
                scores = {"seed": seed, **scores, "wall_time_s": time.perf_counter() - started}
                print(f"{key} seed {seed}: seen {scores['seen']:.2f}, unseen {scores['unseen']:.2f} "
                      f"({scores['wall_time_s']:.0f} s)", flush=True)
                _merge(path, header, key, scores, args, method)
    print_tables(json.loads(path.read_text()))


def _merge(path: Path, header: dict, key: str, scores: dict | None, args, method: str) -> None:
    """Add one seed's scores (or a "not run" mark) to the results file, recomputing the summary over seeds; under the
    file's lock, so seeds or partitions run in parallel processes (one per core) keep one another's rows. The
    communication figures (a one-round run) and the code revision are taken before the lock, so other writers never
    wait on them."""
    settings = method_settings(method, args.clients)
    comm = None if scores is None else communication(method, args.clients, key.split("/")[0])
    stamp = numerics()   # git runs in a subprocess: outside the lock too

    def merge(stored: dict) -> dict:
        stored.update(header)
        results = stored.setdefault("results", {})
        if scores is None:
            results.setdefault(key, {"status": "not run: method not registered when the benchmark ran"})
            return _strict(stored)
        entry = results.get(key, {})
        if entry.get("status") != "run" or entry.get("rounds") != args.rounds \
                or entry.get("settings") != settings:   # other settings: a fresh entry
            entry = {"status": "run", "rounds": args.rounds, "settings": settings, "per_seed": [],
                     "communication": comm}
        entry["per_seed"] = sorted([r for r in entry["per_seed"] if r["seed"] != scores["seed"]]
                                   + [{**scores, "numerics": stamp}],
                                   key=lambda r: r["seed"])
        entry["seeds"] = [r["seed"] for r in entry["per_seed"]]
        entry["seen_mean"], entry["seen_sem_seeds"] = _summary(entry["per_seed"], "seen")
        entry["unseen_mean"], entry["unseen_sem_seeds"] = _summary(entry["per_seed"], "unseen")
        results[key] = entry
        return _strict(stored)

    update_json(path, merge)


def print_tables(stored: dict) -> None:
    """Markdown: accuracy (seen, unseen, gap) and per-round communication, one row per partition and method."""
    print("\n| clients | partition | method | rounds | seeds | seen acc. (%) | unseen acc. (%) | unseen - seen | "
          "bytes up / client / round | bytes down / client / round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in stored["results"].items():
        partition, method = key.split("/")
        if r["status"] != "run":
            print(f"| {stored['clients']} | {partition} | {method} | - | - | {r['status']} | | | | |")
            continue
        c = r["communication"]
        def num(value, spec=".2f"):
            return "n/a" if value is None else format(value, spec)

        gap = None if r["unseen_mean"] is None or r["seen_mean"] is None else r["unseen_mean"] - r["seen_mean"]
        print(f"| {stored['clients']} | {partition} | {method} | {r['rounds']} | {r['seeds']} | "
              f"{num(r['seen_mean'])} +- {num(r['seen_sem_seeds'])} | "
              f"{num(r['unseen_mean'])} +- {num(r['unseen_sem_seeds'])} | "
              f"{num(gap, '+.2f')} | {c['up_bytes_per_client_round']:,.0f} | "
              f"{c['down_bytes_per_client_round']:,.0f} |")


if __name__ == "__main__":
    main()
