"""One run, end to end: data -> method -> a runtime's rounds -> evaluation -> run directory.

This module sits above the engines: :func:`train` runs any :class:`~privfl.federation.runtime.Runtime` it is given
(by default the in-process one, :func:`build_runtime`); :mod:`privfl.engine` picks the engine (in-process, or
Flower's simulation and deployment engines) and hands the matching runtime here. A run is fully described by a
:class:`~privfl.config.RunConfig`, which is written to ``config.json`` so ``privfl train --resume RUN_DIR`` can rebuild
the same run and continue it. Model selection uses the validation splits of training clients only; novel clients are
served once, at the end, with the selected model, and scored with labels the methods never see.
"""

from __future__ import annotations

import hashlib
import json
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from accounting import ReleaseJournal
from privfl.config import RunConfig, build_method, check_participations, model_name_for, participations, run_device
from privfl.data import FederatedDataset, build_federation, label_shift_kl
from privfl.errors import ConfigError
from privfl.evaluation.metrics import ClientScore, score_model, summarize_scores
from privfl.evaluation.plots import plot_run
from privfl.federation.rundir import RunDirectory, dumps
from privfl.federation.runtime import InProcessRuntime, Runtime
from privfl.privacy.training import CENTRAL, DISTRIBUTED, LOCAL, RELATIONS
from privfl.provenance import numerics

RuntimeFactory = Callable[[RunConfig, FederatedDataset], Runtime]


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


def build_runtime(config: RunConfig, federation: FederatedDataset) -> InProcessRuntime:
    """The method's strategy and client procedure for ``federation``, wired into an in-process runtime."""
    strategy, client = build_method(config, federation)
    return InProcessRuntime(strategy=strategy, client=client, training_clients=federation.training_clients,
                            seed=config.seed, client_fraction=config.client_fraction, workers=config.workers)


def train(config: RunConfig | None, out: str, *, resume: bool = False, overwrite: bool = False,
          progress: bool = True, stop_after_round: int | None = None,
          runtime_factory: RuntimeFactory = build_runtime) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) ``config`` in run directory ``out``; return the summary.

    ``runtime_factory(config, federation)`` builds the runtime that runs the rounds: :func:`build_runtime`
    (in-process) by
    default; :mod:`privfl.engine` passes Flower's. With ``resume`` the run's ``config.json`` is the config
    (``config`` may be ``None``). ``stop_after_round`` stops the run as an interruption would, after that many
    completed rounds (for tests). Resuming a finished run (its ``summary.json`` written) returns that summary and runs
    nothing. A ``KeyboardInterrupt`` saves a checkpoint of the last completed round and raises
    :class:`RunInterrupted`.
    """
    run_dir = RunDirectory(out)
    if resume and run_dir.path(RunDirectory.SUMMARY).exists():
        # A finished run has nothing to continue; serving its novel clients again would release their data again.
        return run_dir.read_json(RunDirectory.SUMMARY)
    if resume:
        config = RunConfig.from_dict(run_dir.read_json(RunDirectory.CONFIG))
    if config is None:
        raise ConfigError("train needs a RunConfig for a new run (config=None is for resume=True only)")
    federation = build_federation(config.federation, seed=config.seed)
    runtime = runtime_factory(config, federation)
    best: dict[str, Any] = {"round": None, "score": float("-inf"), "snapshot": None}
    elapsed = 0.0
    digest = hashlib.sha256(dumps(run_identity(config)).encode()).hexdigest()   # ties each checkpoint to its config
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
    try:   # on resume, releases made after the checkpoint, by a process that was killed, stay recorded
        runtime.use_journal(ReleaseJournal(run_dir.path(RunDirectory.RELEASES)), replay=resume)
    except ValueError as error:   # malformed, or of another run
        raise ConfigError(f"cannot resume: {error}") from None
    if resume and config.privacy.mode in (LOCAL, DISTRIBUTED):
        # each release's noise is calibrated for a number of rounds: rounds run again after the checkpoint count too
        ledgers = runtime.ledgers()
        made = {cid: len({r.round for r in ledgers[cid].records if r.event.relation is not None})
                for cid in runtime.training_ids if cid in ledgers}
        check_participations(config, participations(config, len(runtime.training_ids)), runtime.training_ids,
                             from_round=runtime.completed_rounds, made=made)

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
                accuracy = val["accuracy_mean"]      # None without validation samples (val_fraction=0)
                bar.set_postfix(loss=f"{metrics.get('train_loss', float('nan')):.3f}",
                                val_acc="-" if accuracy is None else f"{accuracy:.2f}")
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
        runtime.close()
    wall = elapsed + time.perf_counter() - started
    return finish(config, federation, runtime, run_dir, best, wall)


def run_identity(config: RunConfig) -> dict[str, Any]:
    """What makes two configs the same run: every setting but ``workers``, which changes no number, and ``device``
    left at ``"cpu"`` (so runs written before the setting existed stay the same runs)."""
    values = config.to_dict()
    values.pop("workers")
    if values["device"] == "cpu":
        values.pop("device")
    return values


def _stored_identity(run_dir: RunDirectory) -> dict[str, Any] | None:
    try:
        return json.loads(dumps(run_identity(RunConfig.from_dict(run_dir.read_json(RunDirectory.CONFIG)))))
    except ValueError:   # a config.json this version cannot read (a ConfigError) is another run
        return None


def train_once(config: RunConfig, out: str, **kwargs: Any) -> dict[str, Any]:
    """The summary of ``config`` run in ``out``, computed at most once: read back when ``out`` holds this very run
    finished, continued from its checkpoint when it holds this run interrupted, trained afresh otherwise (replacing
    whatever ``out`` held). "This very run" means the stored ``config.json`` is ``config`` (:func:`run_identity`: a
    run continued keeps its stored ``workers``): a directory left by another configuration (other rounds, settings
    or seed) is retrained, never mistaken for this one. For scripts that rerun many settings and must lose nothing
    on interruption; ``kwargs`` go to :func:`train`."""
    run_dir = RunDirectory(out)
    stored = run_dir.path(RunDirectory.CONFIG)
    same = stored.exists() and _stored_identity(run_dir) == json.loads(dumps(run_identity(config)))
    if same and run_dir.path(RunDirectory.SUMMARY).exists():
        return run_dir.read_json(RunDirectory.SUMMARY)
    resume = same and run_dir.path(RunDirectory.CHECKPOINT).exists()
    return train(config, out, resume=resume, overwrite=not resume, **kwargs)


def finish(config: RunConfig, federation: FederatedDataset, runtime: Runtime, run_dir: RunDirectory,
           best: dict[str, Any], wall_time_s: float) -> dict[str, Any]:
    """Serve novel clients with the selected model, score everyone, write clients.csv, ledger.json, summary.json."""
    rounds_completed = runtime.completed_rounds
    if config.select == "best_val" and best["snapshot"] is not None:
        runtime.restore(best["snapshot"])
        selected_round = best["round"]
    else:
        selected_round = rounds_completed
    training_scores = runtime.evaluate_training_clients(score_model, report_to_server=False, round=None)
    novel_scores = runtime.score_novel_clients(federation, score_model)
    ledgers = runtime.ledgers()
    epsilons = ledgers.epsilons(config.delta)
    rows = client_rows(federation, training_scores, novel_scores, epsilons, runtime)
    run_dir.write_clients(rows)
    ledgers.save(run_dir.path(RunDirectory.LEDGER))
    eps_of = {row["client_id"]: row["epsilon"] for row in rows}
    summary = {
        "method": config.method,
        "model": model_name_for(config, federation.input_shape),
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
            "training_mode": config.privacy.mode,
            "training_guarantee": RELATIONS.get(config.privacy.mode, "none: training clients release without DP"),
        },
        "communication": {"bytes_up_total": sum(runtime.bytes_up.values()),
                          "bytes_down_total": sum(runtime.bytes_down.values())},
        "wall_time_s": wall_time_s,
        "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        # of the process that finished the run (a resumed run may have begun elsewhere), and where its models computed
        "numerics": {**numerics(), "device": run_device(config)},
    }
    if config.privacy.mode == CENTRAL:
        against = ledgers.epsilons_against_aggregator(config.delta)
        summary["privacy"]["epsilon_max_training_against_aggregator"] = max(
            (against.get(c.client_id, 0.0) for c in federation.training_clients), default=0.0)
    if config.privacy.mode == DISTRIBUTED:
        summary["privacy"]["secure_aggregation"] = runtime.secure_aggregation()
    if noise.get("seeded"):
        summary["privacy"]["seeded_noise"] = (
            f"{noise['seeded']} private releases drew their noise from generators seeded from the run config, which "
            "the server holds: whoever knows the config can regenerate and subtract that noise, so their epsilons "
            "hold only against an observer without it (reproducible research runs; use noise 'secure' otherwise)")
    summary.update(runtime.summary())
    run_dir.write_json(RunDirectory.SUMMARY, summary)
    plot_run(run_dir.read_metrics(), rows, run_dir.path("plots.png"),
             title=f"{config.method} on {config.federation.source}, seed {config.seed}")
    return summary


def client_rows(federation: FederatedDataset, training_scores: dict[int, ClientScore],
                novel_scores: dict[int, ClientScore], epsilons: dict, runtime: Runtime) -> list[dict]:
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
        "bytes_up": runtime.bytes_up.get(client_id, 0),
        "bytes_down": runtime.bytes_down.get(client_id, 0),
    }
