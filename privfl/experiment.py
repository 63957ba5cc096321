"""One run, end to end: data -> method -> in-process runtime -> evaluation -> run directory.

This module sits at the top of the library (beside the CLI) because it ties every layer together. A run is fully
described by a :class:`RunConfig`, which is written to ``config.json`` so ``privfl train --resume RUN_DIR`` can rebuild
the same run and continue it. Model selection uses the validation splits of training clients only; novel clients are
served once, at the end, with the selected model, and scored with labels the methods never see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import resource
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from accounting import ReleaseJournal
from privfl.data import FederatedDataset, FederationSpec, build_federation, label_shift_kl
from privfl.errors import ConfigError
from privfl.evaluation.metrics import ClientScore, score_model, summarize_scores
from privfl.evaluation.plots import plot_run
from privfl.federation.rundir import RunDirectory, dumps
from privfl.federation.runtime import InProcessRuntime, sample_clients
from privfl.federation.wire import Wire
from privfl.methods import ModelFactory, get_method
from privfl.provenance import numerics

SELECTIONS = ("best_val", "last")


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers (written to ``config.json``).

    ``method_config`` holds the method's own settings (``lr``, ``local_steps``, ``batch_size``, ``mu``, ...); names
    the method does not have are refused. ``model="auto"`` picks LeNet for 3-channel images and the 2NN otherwise.
    ``select="best_val"`` serves novel clients with the server state of the evaluation round with the best mean
    validation accuracy over training clients (each report is a recorded release); ``"last"`` uses the final round.
    ``delta`` is the delta at which epsilon is reported.
    """

    federation: FederationSpec = field(default_factory=FederationSpec)
    method: str = "fedavg"
    method_config: dict[str, Any] = field(default_factory=dict)
    model: str = "auto"
    rounds: int = 200
    client_fraction: float = 1.0
    eval_every: int = 10
    checkpoint_every: int = 10
    select: str = "best_val"
    seed: int = 0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        method_config = get_method(self.method).make_config(**self.method_config)
        checks = [
            ("rounds", self.rounds, isinstance(self.rounds, int) and self.rounds >= 1, "an integer >= 1"),
            ("client_fraction", self.client_fraction,
             isinstance(self.client_fraction, (int, float)) and 0 < self.client_fraction <= 1, "in (0, 1]"),
            ("eval_every", self.eval_every, isinstance(self.eval_every, int) and self.eval_every >= 1,
             "an integer >= 1"),
            ("checkpoint_every", self.checkpoint_every,
             isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 1, "an integer >= 1"),
            ("select", self.select, self.select in SELECTIONS, f"one of {', '.join(SELECTIONS)}"),
            ("seed", self.seed, isinstance(self.seed, int) and self.seed >= 0, "an integer >= 0"),
            ("delta", self.delta, isinstance(self.delta, float) and 0 < self.delta < 1, "a probability in (0, 1)"),
        ]
        for name, value, ok, valid in checks:
            if not ok:
                raise ConfigError(f"{name} must be {valid}, got {value!r}")
        private = getattr(method_config, "training_dp", None)   # what protects training clients' releases, if any
        if private and self.select == "best_val":
            raise ConfigError(f"select='best_val' with {private}: choosing the round on validation makes every "
                              "training client report its validation accuracy, a release no mechanism covers, so "
                              "its epsilon would be infinite; use select='last'")
        if self.select == "best_val" and self.federation.val_fraction == 0:
            raise ConfigError("select='best_val' picks the round on training clients' validation splits, but "
                              "val_fraction=0 gives them none; use select='last' or a val_fraction > 0")

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["federation"] = self.federation.to_dict()
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """The inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys raise ConfigError."""
        values = dict(values)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError(f"unknown run setting(s) {', '.join(unknown)}; valid settings: {', '.join(names)}")
        values["federation"] = FederationSpec.from_dict(values.get("federation", {}))
        return cls(**values)


class RunInterrupted(Exception):
    """A run stopped before its last round; its checkpoint holds every completed round."""


class FinishRoundOnInterrupt:
    """While installed, a first Ctrl-C (SIGINT) lets the round in progress finish and the run stop after it
    (:attr:`requested`); a second one stops at once.

    A round stopped in the middle has made some of its releases (journaled, so they stay in the ledgers); a resumed
    run runs the round again and its clients release again. Finishing the round makes a clean interruption cost no
    privacy. Installed only in the main thread (the only one that receives signals); the handler before is restored.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nprivfl: finishing the round in progress, then saving; Ctrl-C again stops now (the clients of a round "
              "stopped midway release again when it is run again)", file=sys.stderr)


def model_name_for(config: RunConfig, federation: FederatedDataset) -> str:
    if config.model != "auto":
        return config.model
    shape = federation.input_shape
    return "lenet" if len(shape) == 3 and shape[0] == 3 else "mlp2nn"


def build_runtime(config: RunConfig, federation: FederatedDataset) -> InProcessRuntime:
    """The method's strategy and client procedure for ``federation``, wired into an in-process runtime."""
    spec = get_method(config.method)
    method_config = spec.make_config(**config.method_config)
    factory = ModelFactory(model_name_for(config, federation), tuple(federation.input_shape), federation.num_classes)
    strategy = spec.strategy(model_factory=factory, config=method_config, seed=config.seed,
                             num_training_clients=len(federation.training_clients))
    client = spec.client(model_factory=factory, config=method_config)
    training_ids = [c.client_id for c in federation.training_clients]
    check_participations(config, getattr(method_config, "participation_cap", None), training_ids)
    check_shares(config, getattr(method_config, "shares_per_round", None), training_ids)
    return InProcessRuntime(strategy=strategy, client=client, training_clients=federation.training_clients,
                            seed=config.seed, client_fraction=config.client_fraction)


def check_shares(config: RunConfig, shares: int | None, client_ids: list[int]) -> None:
    """Refuse distributed noise with more shares than a round samples clients (their sum would be short of noise)."""
    per_round = len(sample_clients(sorted(client_ids), config.client_fraction, seed=config.seed, round=0))
    if shares is not None and shares > per_round:
        raise ConfigError(f"dp_shares={shares} noise shares make up each round's sum, but a round samples "
                          f"{per_round} training clients: their sum would carry less noise than its calibration; set "
                          f"dp_shares to at most {per_round}")


def check_participations(config: RunConfig, cap: int | None, client_ids: list[int], *, from_round: int = 0,
                         made: Mapping[int, int] | None = None) -> None:
    """Refuse a run whose client sampling would have a training client release more than ``cap`` times.

    The schedule is public (seeded by the run seed), so it is checked before anything runs, rather than ending the
    run at the round where a client's ledger refuses its release over the budget its noise was calibrated for. A
    resumed run passes ``from_round`` (the rounds its checkpoint holds) and ``made`` (each client's private releases
    in its ledger, those made after the checkpoint included: re-running their rounds releases again).
    """
    if cap is None:
        return
    counts = {cid: (made or {}).get(cid, 0) for cid in client_ids}
    for round_index in range(from_round, config.rounds):
        for cid in sample_clients(sorted(client_ids), config.client_fraction, seed=config.seed, round=round_index):
            counts[cid] += 1
    most = max(counts.values(), default=0)
    if most <= cap:
        return
    over = sorted(cid for cid, n in counts.items() if n > cap)
    if from_round == 0 and not made:
        raise ConfigError(f"with rounds={config.rounds}, client_fraction={config.client_fraction} and seed="
                          f"{config.seed}, training clients {over} take part in up to {most} rounds, more than "
                          f"dp_participations={cap} (the releases each client's noise is calibrated for); set "
                          f"dp_participations to {most} or more, or run fewer rounds")
    raise ConfigError(f"this run cannot be resumed within its privacy budget: its checkpoint holds {from_round} "
                      f"rounds, but its clients' ledgers (releases.jsonl) also hold the releases of the rounds run "
                      f"after it, and running those rounds again releases again; training clients {over} would make "
                      f"up to {most} releases, more than dp_participations={cap}. Releases made cannot be taken "
                      "back: start the run again, with checkpoint_every=1 (an interruption then costs the round in "
                      "progress) and a dp_participations that leaves room for the rounds an interruption repeats")



ENGINES = ("inprocess", "flower-sim")


def train(config: RunConfig, out: str, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
          stop_after_round: int | None = None, engine: str = "inprocess", flower_options=None,
          runtime_factory=None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) ``config`` in run directory ``out``; return the summary.

    ``stop_after_round`` stops the run as an interruption would, after that many completed rounds (for tests). Resuming
    a finished run (its ``summary.json`` written) returns that summary and runs nothing.
    A ``KeyboardInterrupt`` saves a checkpoint of the last completed round and raises :class:`RunInterrupted`.
    ``engine="flower-sim"`` runs the same loop on Flower's simulation engine (``flower_options``: a
    :class:`privfl.federation.flower.FlowerOptions`); ``runtime_factory(config, federation)`` replaces
    :func:`build_runtime` (the Flower ServerApp passes one that drives its Grid).
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if resume and RunDirectory(out).path(RunDirectory.SUMMARY).exists():
        # A finished run has nothing to continue; serving its novel clients again would release their data again.
        return RunDirectory(out).read_json(RunDirectory.SUMMARY)
    if engine == "flower-sim":
        from privfl.federation.flower.simulation import train_simulation

        return train_simulation(config, out, resume=resume, overwrite=overwrite, progress=progress,
                                stop_after_round=stop_after_round, options=flower_options)
    run_dir = RunDirectory(out)
    if resume:
        config = RunConfig.from_dict(run_dir.read_json(RunDirectory.CONFIG))
    federation = build_federation(config.federation, seed=config.seed)
    runtime = (runtime_factory or build_runtime)(config, federation)
    best: dict[str, Any] = {"round": None, "score": float("-inf"), "snapshot": None}
    elapsed = 0.0
    digest = hashlib.sha256(dumps(config.to_dict()).encode()).hexdigest()   # ties each checkpoint to its config
    if resume:
        checkpoint = run_dir.load_checkpoint()
        if checkpoint is not None:
            if checkpoint.get("config_digest", digest) != digest:
                raise ConfigError(f"{run_dir.path(RunDirectory.CHECKPOINT)} was saved by a run with another "
                                  f"{RunDirectory.CONFIG} (the file was edited, or the checkpoint comes from another "
                                  "run): resuming would mix them; start the run again")
            try:
                runtime.load_state_dict(checkpoint["runtime"])
            except KeyError as missing:
                raise ConfigError(f"{run_dir.path(RunDirectory.CHECKPOINT)} does not hold the state of the run "
                                  f"{RunDirectory.CONFIG} describes (no {missing}): the checkpoint or the config "
                                  "was replaced; start the run again") from None
            best, elapsed = checkpoint["best"], float(checkpoint["elapsed_s"])
        run_dir.truncate_metrics(runtime.completed_rounds)
    else:
        run_dir.create(config.to_dict(), overwrite=overwrite)
    if isinstance(runtime.wire, Wire):   # Flower's nodes keep their ledgers on disk themselves
        runtime.wire.journal = ReleaseJournal(run_dir.path(RunDirectory.RELEASES))
        if resume:   # releases made after the checkpoint, by a process that was killed, stay recorded
            try:
                runtime.wire.journal.replay_into(runtime.wire.ledgers)
            except ValueError as error:   # malformed, or of another run
                raise ConfigError(f"cannot resume: {error}") from None
            ledgers = runtime.wire.ledgers
            made = {cid: sum(r.event.relation is not None for r in ledgers[cid].records)
                    for cid in runtime.clients if cid in ledgers}
            check_participations(config, getattr(runtime.client.config, "participation_cap", None),
                                 sorted(runtime.clients), from_round=runtime.completed_rounds, made=made)

    def checkpoint_now(state: dict[str, Any]) -> None:
        run_dir.save_checkpoint({"format": 1, "runtime": state, "best": best, "config_digest": digest,
                                 "elapsed_s": elapsed + time.perf_counter() - started})

    started = time.perf_counter()
    bar = tqdm(total=config.rounds, initial=runtime.completed_rounds, desc=config.method, unit="round",
               disable=not progress, dynamic_ncols=True)
    interrupt = FinishRoundOnInterrupt()
    try:
        interrupt.install()
        for round in range(runtime.completed_rounds, config.rounds):
            metrics = runtime.run_round(round)
            done = round + 1
            if done % config.eval_every == 0 or done == config.rounds:
                scores = runtime.evaluate_training_clients(score_model, report_to_server=config.select == "best_val",
                                                           round=round)
                val = summarize_scores(list(scores.values()))
                if config.select == "best_val" and val["accuracy_mean"] is None:
                    raise ConfigError(f"select='best_val' needs validation samples, but no training client has any "
                                      f"at val_fraction={config.federation.val_fraction} (each keeps "
                                      "floor(val_fraction * n)); use select='last' or a larger val_fraction")
                if config.select == "best_val" and val["accuracy_mean"] > best["score"]:
                    best = {"round": done, "score": val["accuracy_mean"], "snapshot": runtime.snapshot()}
                record = {"round": done, **metrics, **{f"val_{k}": v for k, v in val.items()}}
                run_dir.append_metrics(record)
                bar.set_postfix(loss=f"{metrics.get('train_loss', float('nan')):.3f}",
                                val_acc=f"{val['accuracy_mean']:.2f}")
            if done % config.checkpoint_every == 0 or done == config.rounds:
                checkpoint_now(runtime.committed_state_dict())
            bar.update(1)
            if interrupt.requested and done < config.rounds:
                raise KeyboardInterrupt
            if stop_after_round is not None and done >= stop_after_round and done < config.rounds:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        checkpoint_now(runtime.committed_state_dict())
        raise RunInterrupted(
            f"run interrupted after {runtime.completed_rounds} of {config.rounds} rounds; "
            f"continue it with: privfl train --resume {run_dir.root}") from None
    finally:
        interrupt.restore()
        bar.close()
    wall = elapsed + time.perf_counter() - started
    return finish(config, federation, runtime, run_dir, best, wall)


def train_once(config: RunConfig, out: str, **kwargs: Any) -> dict[str, Any]:
    """The summary of ``config`` run in ``out``, computed at most once: read back when ``out`` holds this very run
    finished, continued from its checkpoint when it holds this run interrupted, trained afresh otherwise (replacing
    whatever ``out`` held). "This very run" means the stored ``config.json`` equals ``config``: a directory left by
    another configuration (other rounds, settings or seed) is retrained, never mistaken for this one. For scripts
    that rerun many settings and must lose nothing on interruption; ``kwargs`` go to :func:`train`."""
    run_dir = RunDirectory(out)
    stored = run_dir.path(RunDirectory.CONFIG)
    same = stored.exists() and run_dir.read_json(RunDirectory.CONFIG) == json.loads(dumps(config.to_dict()))
    if same and run_dir.path(RunDirectory.SUMMARY).exists():
        return run_dir.read_json(RunDirectory.SUMMARY)
    resume = same and run_dir.path(RunDirectory.CHECKPOINT).exists()
    return train(config, out, resume=resume, overwrite=not resume, **kwargs)


def finish(config: RunConfig, federation: FederatedDataset, runtime: InProcessRuntime, run_dir: RunDirectory,
           best: dict[str, Any], wall_time_s: float) -> dict[str, Any]:
    """Serve novel clients with the selected model, score everyone, write clients.csv, ledger.json, summary.json."""
    rounds_completed = runtime.completed_rounds
    if config.select == "best_val" and best["snapshot"] is not None:
        runtime.restore(best["snapshot"])
        selected_round = best["round"]
    else:
        selected_round = rounds_completed
    training_scores = runtime.evaluate_training_clients(score_model, report_to_server=False, round=None)
    novel_scores: dict[int, ClientScore] = {}
    if runtime.client.serves_novel_clients and hasattr(runtime, "score_novel_clients"):
        novel_scores = runtime.score_novel_clients(federation)   # Flower: each node scores its own model
    elif runtime.client.serves_novel_clients:
        for novel in federation.novel_clients:
            model = runtime.novel_client_model(novel)
            labels = federation.novel_labels.labels(novel.client_id)
            novel_scores[novel.client_id] = score_model(model, novel.x, labels)

    ledgers = runtime.wire.ledgers
    epsilons = ledgers.epsilons(config.delta)
    rows = client_rows(federation, training_scores, novel_scores, epsilons, runtime)
    run_dir.write_clients(rows)
    ledgers.save(run_dir.path(RunDirectory.LEDGER))
    eps_of = {row["client_id"]: row["epsilon"] for row in rows}
    summary = {
        "method": config.method,
        "model": model_name_for(config, federation),
        "dataset": config.federation.source,
        "seed": config.seed,
        "rounds_completed": rounds_completed,
        "select": config.select,
        "selected_round": selected_round,
        "novel": summarize_scores(list(novel_scores.values())),
        "training_val": summarize_scores(list(training_scores.values())),
        "privacy": {
            "delta": config.delta,
            "epsilon_max_training": max((eps_of[c.client_id] for c in federation.training_clients), default=0.0),
            "epsilon_max_novel": max((eps_of[c.client_id] for c in federation.novel_clients), default=0.0),
            "epsilon_per_client": {str(cid): eps for cid, eps in eps_of.items()},
            "relations": ledgers.relations(),   # what the epsilons hold under: the neighbours of each kind of release
            "noise_sources": (noise := ledgers.private_metadata_counts("noise")),
        },
        "communication": {"bytes_up_total": sum(runtime.wire.bytes_up.values()),
                          "bytes_down_total": sum(runtime.wire.bytes_down.values())},
        "wall_time_s": wall_time_s,
        "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "numerics": numerics(),   # of the process that finished the run (a resumed run may have begun elsewhere)
    }
    if noise.get("seeded"):
        summary["privacy"]["seeded_noise"] = (
            f"{noise['seeded']} private releases drew their noise from generators seeded from the run config, which "
            "the server holds: whoever knows the config can regenerate and subtract that noise, so their epsilons "
            "hold only against an observer without it (reproducible research runs; use noise 'secure' otherwise)")
    run_dir.write_json(RunDirectory.SUMMARY, summary)
    plot_run(run_dir.read_metrics(), rows, run_dir.path("plots.png"),
             title=f"{config.method} on {config.federation.source}, seed {config.seed}")
    return summary


def client_rows(federation: FederatedDataset, training_scores: dict[int, ClientScore],
                novel_scores: dict[int, ClientScore], epsilons: dict, runtime: InProcessRuntime) -> list[dict]:
    """One row per client: role, sizes, label histogram, accuracy (%), loss, label shift, epsilon, bytes."""
    k = federation.num_classes
    training_histograms = [c.label_histogram(k) for c in federation.training_clients]
    rows = []
    for client in federation.training_clients:
        score = training_scores[client.client_id]
        rows.append(_row(client.client_id, "training", client.num_train + len(client.y_val), client.num_train,
                         len(client.y_val), client.label_histogram(k), score, float("nan"), epsilons, runtime))
    for novel in federation.novel_clients:
        histogram = federation.novel_labels.histogram(novel.client_id, k)
        score = novel_scores.get(novel.client_id)
        rows.append(_row(novel.client_id, "novel", novel.num_samples, 0, 0, histogram, score,
                         label_shift_kl(histogram, training_histograms), epsilons, runtime))
    return rows


def _row(client_id, role, size, num_train, num_val, histogram, score, shift, epsilons, runtime) -> dict:
    return {
        "client_id": client_id, "role": role, "num_samples": size, "num_train": num_train, "num_val": num_val,
        "label_histogram": json.dumps([int(v) for v in histogram]),
        "accuracy": 100.0 * score.accuracy if score else float("nan"),
        "loss": score.loss if score else float("nan"),
        "label_shift_kl": shift,
        "epsilon": float(epsilons.get(client_id, 0.0)),
        "bytes_up": runtime.wire.bytes_up.get(client_id, 0),
        "bytes_down": runtime.wire.bytes_down.get(client_id, 0),
    }
