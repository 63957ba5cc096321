"""One run, end to end: data -> method -> a runtime's rounds -> evaluation -> run directory.

This module sits above the engines: :func:`train` runs any :class:`~privfl.federation.runtime.Runtime` it is given
(by default the in-process one, :func:`build_runtime`); :mod:`privfl.engines.choice` picks the engine (in-process, or
Flower's simulation and deployment engines) and hands the matching runtime here. A run is fully described by a
:class:`~privfl.config.RunConfig`, which is written to ``config.json`` so ``privfl train --resume RUN_DIR`` can rebuild
the same run and continue it. Model selection uses the validation splits of training clients only; novel clients are
served once, at the end, with the selected model, and scored with labels the methods never see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from accounting import ClientId, JournalDamaged, JournalMismatch, JournalPosition, LedgerBook, ReleaseJournal
from accounting.budget import BUDGET_RTOL
from privfl.config import (
    RunConfig,
    build_client,
    build_method,
    check_participations,
    model_name_for,
    participations,
    run_device,
    run_federation,
    run_plan,
)
from privfl.data import FederatedDataset, label_shift_kl
from privfl.errors import ConfigError, InternalError, StorageError, is_storage_fault, storage_message
from privfl.evaluation.central import evaluate_central
from privfl.evaluation.plots import plot_run
from privfl.federation.lock import hold
from privfl.federation.rundir import RunDirectory, dumps, to_json_safe
from privfl.federation.runtime import InProcessRuntime, Runtime, how_to_continue
from privfl.federation.spend import NOVEL_SERVED, run_summary
from privfl.federation.timing import EVALUATION, TIMING_KEY
from privfl.metrics import ClientScore, score_model, summarize_scores
from privfl.modes.plan import Plan, projected_spend, round_event
from privfl.privacy.training import CENTRAL, DISTRIBUTED, LOCAL, RECORD, RELATIONS, delta_meaning
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


#: The checkpoint format :func:`train` writes and resumes: 2 records the journal position it saw.
CHECKPOINT_FORMAT = 2



def train(config: RunConfig | None, out: str, *, resume: bool = False, overwrite: bool = False,
          progress: bool = True, stop_after_round: int | None = None,
          runtime_factory: RuntimeFactory = build_runtime, engine: str = "inprocess",
          allow_overshoot: bool = False, run_id: str | None = None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) ``config`` in run directory ``out``; return the summary.

    ``runtime_factory(config, federation)`` builds the runtime that runs the rounds: :func:`build_runtime`
    (in-process) by default; :mod:`privfl.engines.choice` passes Flower's, and names its ``engine`` (``flower-sim``,
    ``flower-deployment``), which the messages of a run that stops early name the command to continue it by
    (:func:`~privfl.federation.runtime.how_to_continue`). With ``resume`` the run's ``config.json`` is the config
    (``config`` may be ``None``). ``stop_after_round`` stops the run as an interruption would, after that many
    completed rounds (for tests). Resuming a finished run (its ``summary.json`` written) returns that summary and runs
    nothing. A ``KeyboardInterrupt`` saves a checkpoint of the last completed round and raises
    :class:`RunInterrupted`.

    Everything that can refuse a run does so before its first release: the directory (another run or a sweep in it,
    unless ``overwrite``), the config, the data (validation samples for ``select="best_val"``), the method and its
    privacy settings, and the disk, which must take a first checkpoint (written at round 0) and have room for the
    next. A resumed run first checks that its release journal is the one its checkpoint saw (never shorter, never
    different), so no release it made can go unreported, and that finishing it keeps every training client within
    the target epsilon: the rounds after the checkpoint were released once already and are run again, so a resume
    that would end above the target is refused, saying by how much, unless ``allow_overshoot``
    (:func:`check_overshoot`). A disk that fills mid-run stops it with :class:`~privfl.errors.StorageError`; it
    resumes from its last checkpoint. The run directory has one writer: this call holds its lock
    (:func:`privfl.federation.lock.hold`, naming ``engine`` and the engine's ``run_id``) from its first check to its
    end, and refuses a directory another live process holds, naming the command that stops it.
    """
    if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
        raise ConfigError(f"out must name a run directory, got {out!r} (an empty name would write the run into the "
                          "current directory)")
    run_dir = RunDirectory(out)
    journal = ReleaseJournal(run_dir.path(RunDirectory.RELEASES))
    if resume and not run_dir.path(RunDirectory.CONFIG).exists():
        raise ConfigError(f"{run_dir.path(RunDirectory.CONFIG)} does not exist; is {run_dir.root} a privfl run "
                          "directory?")
    if not resume and config is None:
        raise ConfigError("train needs a RunConfig for a new run (config=None is for resume=True only)")
    created = not run_dir.root.exists()
    try:
        with hold(run_dir.root, engine=engine, run_id=run_id):    # one writer: a second one is refused, named
            if resume:
                if run_dir.path(RunDirectory.SUMMARY).exists():
                    # A finished run has nothing to continue; serving its novel clients again would release their
                    # data again. Its three records are cross-checked (a damaged journal is refused by name, a
                    # mismatch warned of).
                    return finished_summary(run_dir)
                config = read_config(run_dir)
            else:
                run_dir.check_free(overwrite=overwrite)
            assert config is not None
            try:
                return _train(config, run_dir, journal, resume=resume, overwrite=overwrite, progress=progress,
                              stop_after_round=stop_after_round, runtime_factory=runtime_factory, engine=engine,
                              allow_overshoot=allow_overshoot)
            except OSError as error:
                if not is_storage_fault(error):
                    raise
                released = journal.path.exists() and journal.path.stat().st_size > 0
                fix = (f"free space (or make it writable), then {how_to_continue(engine, run_dir.root)}"
                       if released else "free space (or make it writable, or choose another --out), then run it "
                       "again: nothing was released")
                raise StorageError(f"cannot write the run directory {run_dir.root}: {storage_message(error)}; "
                                   f"{fix}") from None
    finally:
        if created:   # a run refused before it wrote anything leaves no folder behind (rmdir: only an empty one)
            with contextlib.suppress(OSError):
                run_dir.root.rmdir()


def read_config(run_dir: RunDirectory) -> RunConfig:
    """The run's ``config.json`` as a :class:`RunConfig`; a file that is not one is named in one line."""
    values = run_dir.read_json(RunDirectory.CONFIG)
    if not isinstance(values, dict):
        raise ConfigError(f"{run_dir.path(RunDirectory.CONFIG)} is damaged: it holds a JSON "
                          f"{type(values).__name__}, not a run config")
    try:
        return RunConfig.from_dict(values)
    except ConfigError as error:
        raise ConfigError(f"{run_dir.path(RunDirectory.CONFIG)}: {error}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as error:
        raise ConfigError(f"{run_dir.path(RunDirectory.CONFIG)} is damaged: a value has the wrong type "
                          f"({type(error).__name__}: {error})") from None


def preflight(config: RunConfig, federation: FederatedDataset) -> Plan:
    """The checks of ``config`` against the data that would otherwise refuse the run after releases were made, and
    the run's :class:`~privfl.modes.plan.Plan`: every client's spend priced before the first release
    (:func:`~privfl.config.run_plan`), refused where the accountant cannot price it."""
    if config.select == "best_val" and not any(len(c.y_val) for c in federation.training_clients):
        raise ConfigError(f"select='best_val' needs validation samples, but no training client has any at "
                          f"val_fraction={config.federation.val_fraction} (each keeps floor(val_fraction * n)); use "
                          "select='last' or a larger val_fraction")
    if config.privacy.mode == RECORD:
        small = sorted(c.client_id for c in federation.training_clients if c.num_train < config.privacy.min_samples)
        if small:
            raise ConfigError(f"record-level privacy min_samples={config.privacy.min_samples} is the public lower "
                              f"bound on every training client's records, but training clients {small[:10]} hold "
                              f"fewer (down to {min(c.num_train for c in federation.training_clients)}); lower "
                              "min_samples, or give the clients more data (fewer clients, a larger source)")
    check_delta_meaning(config, federation)
    return run_plan(config, federation)


def check_delta_meaning(config: RunConfig, federation: FederatedDataset) -> None:
    """Refuse a delta at least one over what each guarantee of the run protects (:func:`delta_meaning`), unless
    ``config.allow_large_delta``; then say what it means, once, on stderr."""
    units = []
    if config.privacy.mode == RECORD and federation.training_clients:
        units.append((min(c.num_train for c in federation.training_clients), "records of the smallest training client"))
    elif config.privacy.client_level:
        units.append((len(federation.training_clients), "training clients"))
    if config.novel_privacy.private and federation.novel_clients:
        units.append((min(c.num_samples for c in federation.novel_clients), "records of the smallest novel client"))
    for count, what in units:
        meaning = delta_meaning(config.delta, count, what)
        if meaning is None:
            continue
        if not config.allow_large_delta:
            raise ConfigError(f"{meaning}; choose a delta well below 1/{count}, or pass --allow-large-delta "
                              "(RunConfig.allow_large_delta) to run with it as stated")
        print(f"privfl: warning: {meaning} (--allow-large-delta)", file=sys.stderr)


def _train(config: RunConfig, run_dir: RunDirectory, journal: ReleaseJournal, *, resume: bool, overwrite: bool,
           progress: bool, stop_after_round: int | None, runtime_factory: RuntimeFactory,
           engine: str, allow_overshoot: bool) -> dict[str, Any]:
    federation = run_federation(config)
    plan = preflight(config, federation)
    runtime = runtime_factory(config, federation)
    best: dict[str, Any] = {"round": None, "score": float("-inf"), "snapshot": None}
    served, elapsed = None, 0.0
    digest = hashlib.sha256(dumps(run_identity(config)).encode()).hexdigest()   # ties each checkpoint to its config
    if resume:
        served, best, elapsed = _restore(run_dir, journal, runtime, digest, best, elapsed)
    else:
        run_dir.create(config.to_dict(), overwrite=overwrite)
    try:   # on resume, releases made after the checkpoint, by a process that was killed, stay recorded
        runtime.use_journal(journal, replay=resume)
    except ValueError as error:   # malformed, or of another run
        raise ConfigError(f"cannot resume: {error}") from None
    if resume:
        _check_resumed_spend(config, federation, runtime, run_dir, served=served, allow_overshoot=allow_overshoot)

    def checkpoint_now(state: dict[str, Any]) -> int:
        journal.sync()                       # the lines the checkpoint names are on disk before it is
        return run_dir.save_checkpoint({
            "format": CHECKPOINT_FORMAT, "runtime": state, "best": share_equal_tensors(best, state),
            "config_digest": digest, "elapsed_s": elapsed + time.perf_counter() - started,
            "journal": journal.position().to_dict()})

    started = time.perf_counter()
    # before this attempt's first release (a new run's, or a resumed run's next round): a checkpoint is written now
    # and the disk must hold the next beside it, so a full or read-only disk refuses the attempt while it has released
    # nothing (a resume that failed mid-round would release the rounds since the checkpoint again, for nothing)
    check_room(run_dir, checkpoint_now(runtime.committed_state_dict()))
    bar = tqdm(total=config.rounds, initial=runtime.completed_rounds, desc=config.method, unit="round",
               disable=not progress or served is not None, dynamic_ncols=True)
    interrupt = FinishRoundOnInterrupt()
    timed_rounds = 0     # the rounds since the last metrics line (its "time" field: privfl.federation.timing)
    runtime.timer.reset()
    try:
        interrupt.install()
        for round in range(runtime.completed_rounds, config.rounds):
            metrics = runtime.run_round(round)
            done = round + 1
            timed_rounds += 1
            if done % config.eval_every == 0 or done == config.rounds:
                with runtime.timer.part(EVALUATION):
                    scores = runtime.evaluate_training_clients(score_model,
                                                               report_to_server=config.select == "best_val",
                                                               round=round)
                    central = (evaluate_central(runtime.strategy, runtime.client, federation)
                               if config.central_eval else {})
                val = summarize_scores(list(scores.values()))
                if config.select == "best_val" and val["accuracy_mean"] is None:
                    raise InternalError("no validation score although preflight found validation samples")
                if config.select == "best_val" and val["accuracy_mean"] > best["score"]:
                    best = {"round": done, "score": val["accuracy_mean"], "snapshot": runtime.serving_snapshot()}
                record = {"round": done, **metrics, **{f"val_{k}": v for k, v in val.items()}, **central,
                          TIMING_KEY: runtime.timer.lap(rounds=timed_rounds)}
                timed_rounds = 0
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
            f"{how_to_continue(engine, run_dir.root)}") from None
    finally:
        interrupt.restore()
        bar.close()
        runtime.close()
    wall = elapsed + time.perf_counter() - started
    return finish(config, federation, runtime, run_dir, best, wall, journal=journal, served=served, plan=plan)


def _restore(run_dir: RunDirectory, journal: ReleaseJournal, runtime: Runtime, digest: str, best: dict[str, Any],
             elapsed: float) -> tuple[Any, dict[str, Any], float]:
    """A resumed run's state: leftovers removed, the checkpoint checked against the journal and loaded, the metrics
    cut back to it; returns the novel service already made (if any), the best snapshot and the elapsed seconds."""
    run_dir.remove_leftovers()
    checkpoint = run_dir.load_checkpoint()
    check_journal(run_dir, journal, checkpoint, digest)
    served = novel_service(run_dir, journal)
    journal.repair()                     # a line a kill cut short: its release was never delivered
    if checkpoint is not None:
        try:
            runtime.load_state_dict(checkpoint["runtime"])
        except KeyError as missing:
            raise ConfigError(f"{run_dir.path(RunDirectory.CHECKPOINT)} does not hold the state of the run "
                              f"{RunDirectory.CONFIG} describes (no {missing}): the checkpoint or the config "
                              "was replaced; start the run again") from None
        best, elapsed = checkpoint["best"], float(checkpoint["elapsed_s"])
    run_dir.truncate_metrics(runtime.completed_rounds)
    return served, best, elapsed


def _check_resumed_spend(config: RunConfig, federation: FederatedDataset, runtime: Runtime, run_dir: RunDirectory,
                         *, served: Any, allow_overshoot: bool) -> None:
    """Before a resumed run's next release: the rounds run again after the checkpoint fit the calibration, and the
    run will not pass its target epsilon unless allowed."""
    if config.privacy.mode in (LOCAL, DISTRIBUTED):
        # each release's noise is calibrated for a number of rounds: rounds run again after the checkpoint count too
        ledgers = runtime.ledgers()
        made = {cid: len({r.round for r in ledgers[cid].records if r.event.relation is not None})
                for cid in runtime.training_ids if cid in ledgers}
        check_participations(config, participations(config, len(runtime.training_ids)), runtime.training_ids,
                             from_round=runtime.completed_rounds, made=made)
    if served is None:
        check_overshoot(config, federation, runtime, run_dir, allow=allow_overshoot)


def check_overshoot(config: RunConfig, federation: FederatedDataset, runtime: Runtime, run_dir: RunDirectory, *,
                    allow: bool) -> None:
    """Before a resumed run's first round: each training client's epsilon once the rounds left are run (its ledger,
    releases made after the checkpoint included, plus its rounds of the public schedule from the checkpoint on,
    :func:`~privfl.modes.plan.projected_spend`), against the target ``config.privacy.epsilon``. Above it (beyond
    the ledger's numerical slack), the resume is refused naming the clients and by how much, unless ``allow``; then
    the amount is printed on stderr."""
    privacy = config.privacy
    if privacy.epsilon is None or privacy.mode not in (RECORD, CENTRAL):
        return   # no target; or local and distributed, whose ledgers refuse a release past their calibration
    client = build_client(config, federation.input_shape, federation.num_classes, len(runtime.training_ids))
    event = round_event(client, privacy, rounds=config.rounds, client_fraction=config.client_fraction)
    if event is None:
        return
    ids = runtime.training_ids
    if privacy.mode == CENTRAL:
        left: dict[ClientId, int] = {cid: config.rounds - runtime.completed_rounds for cid in ids}
    else:
        left = dict.fromkeys(ids, 0)
        for r in range(runtime.completed_rounds, config.rounds):
            for cid in runtime.strategy.sample_clients(r, ids, config.client_fraction, config.seed):
                left[cid] += 1
    spend = projected_spend(runtime.ledgers(), left, event, config.delta)
    over = sorted(cid for cid, eps in spend.items() if eps > privacy.epsilon * (1 + BUDGET_RTOL))
    if not over:
        return
    most = max(spend.values())
    what = (f"resuming {run_dir.root} from round {runtime.completed_rounds} would take training clients {over[:10]} "
            f"to epsilon {most:.4f} at delta {config.delta:g}, {most - privacy.epsilon:.4f} above the target "
            f"{privacy.epsilon:g} (the releases made after the last checkpoint stay spent, and their rounds are run "
            "again)")
    if not allow:
        raise ConfigError(f"{what}; pass --allow-overshoot (allow_overshoot=True) to resume anyway, or keep the run "
                          f"as it stands (its spend: privfl ledger {run_dir.root})")
    print(f"privfl: warning: {what} (--allow-overshoot)", file=sys.stderr)


def check_journal(run_dir: RunDirectory, journal: ReleaseJournal, checkpoint: dict[str, Any] | None,
                  digest: str) -> None:
    """Refuse to resume from ``checkpoint`` unless the run's release journal is the one it saw (never shorter, never
    different) and the checkpoint is of this config and format: otherwise releases made would go unreported."""
    fix = (f"restore {journal.path.name} from a copy if there is one; otherwise this run cannot be continued with "
           f"a complete account: start a new run in another directory and count this one's releases (privfl ledger "
           f"{run_dir.root}) toward its clients' privacy")
    try:
        position = journal.position()
    except JournalDamaged as error:
        raise ConfigError(f"cannot resume: {error}; {fix}") from None
    path = run_dir.path(RunDirectory.CHECKPOINT)
    if checkpoint is None:
        if position.lines:
            raise ConfigError(f"cannot resume: {path} is missing but {journal.path.name} records {position.lines} "
                              f"lines of releases: without the checkpoint the journal cannot be checked; restore "
                              f"{path.name}, or start a new run in another directory")
        return
    if checkpoint.get("format") != CHECKPOINT_FORMAT or "journal" not in checkpoint:
        raise ConfigError(f"cannot resume: {path} has checkpoint format {checkpoint.get('format')!r}, not "
                          f"{CHECKPOINT_FORMAT} (it was written by an earlier privfl, without the release journal's "
                          "position); continue it with that version, or start the run again")
    if checkpoint.get("config_digest") != digest:
        raise ConfigError(f"{path} was saved by a run with another {RunDirectory.CONFIG} (the file was edited, or the "
                          "checkpoint comes from another run): resuming would mix them; start the run again")
    try:
        journal.verify(JournalPosition.from_dict(checkpoint["journal"]))
    except (JournalMismatch, JournalDamaged) as error:
        raise ConfigError(f"cannot resume: {error}; {fix}") from None
    except ValueError as error:
        raise ConfigError(f"{path} is damaged: {error}; start the run again") from None


def novel_service(run_dir: RunDirectory, journal: ReleaseJournal) -> dict[str, Any] | None:
    """What the journal says of the run's novel clients: the scores of the :data:`NOVEL_SERVED` mark when they were
    served (the run then finishes without serving them again), ``None`` when they were not; refuses a run whose
    novel clients released something that no mark closes (killed while they were served: serving them again would
    release their data again)."""
    marks = [m for m in journal.marks() if m.get("mark") == NOVEL_SERVED]
    if marks:
        return marks[-1]
    novel = sorted({str(cid) for cid, record in journal.entries() if record.round is None})
    if novel:
        raise ConfigError(f"cannot resume: {journal.path} records releases of novel clients {novel[:10]} but not the "
                          f"end of their service (the run stopped while they were being served): serving them again "
                          f"would release their data again. Their spend is recorded (privfl ledger {run_dir.root}); "
                          "to serve novel clients, start a new run in another directory")
    return None


def share_equal_tensors(best: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """``best`` with each tensor of its snapshot that equals the tensor at the same place in ``state`` replaced by
    that tensor: ``torch.save`` writes a storage once, so a best-validation snapshot of the round being saved (or the
    parts of it that have not changed since) costs no space in the checkpoint."""
    if best.get("snapshot") is None:
        return best

    def share(kept: Any, current: Any) -> Any:
        if isinstance(kept, dict) and isinstance(current, dict):
            return {k: share(v, current[k]) if k in current else v for k, v in kept.items()}
        if (isinstance(kept, torch.Tensor) and isinstance(current, torch.Tensor) and kept.dtype == current.dtype
                and kept.shape == current.shape and torch.equal(kept, current)):
            return current
        return kept

    return {**best, "snapshot": share(best["snapshot"], state)}


def check_room(run_dir: RunDirectory, checkpoint_bytes: int) -> None:
    """Refuse a run (or a resumed run) whose disk has not room for one more checkpoint beside the one just written
    (each is written whole beside the one it replaces) while this attempt has released nothing."""
    free = shutil.disk_usage(run_dir.root).free
    if free < checkpoint_bytes:
        raise StorageError(f"the disk holding {run_dir.root} has {free / 2**20:.1f} MiB free, but each checkpoint of "
                           f"this run ({checkpoint_bytes / 2**20:.1f} MiB) is written beside the one it replaces; "
                           "free space (or choose another --out), then run it again: this attempt released nothing")


def run_identity(config: RunConfig) -> dict[str, Any]:
    """What makes two configs the same run: every setting but ``workers``, which changes no number, and ``device``
    left at ``"cpu"`` and ``allow_large_delta`` and ``central_eval`` left off (so runs written before the settings
    existed stay the same runs)."""
    values = config.to_dict()
    values.pop("workers")
    for key, default in _IDENTITY_DEFAULTS.items():
        if values[key] == default:
            values.pop(key)
    return values


#: Settings added after runs were first written: at these values they are left out of a run's identity.
_IDENTITY_DEFAULTS: dict[str, Any] = {"device": "cpu", "allow_large_delta": False, "central_eval": False}


def _stored_identity(run_dir: RunDirectory) -> dict[str, Any] | None:
    try:
        return json.loads(dumps(run_identity(RunConfig.from_dict(run_dir.read_json(RunDirectory.CONFIG)))))
    except ValueError:   # a config.json this version cannot read (a ConfigError) is another run
        return None


def train_once(config: RunConfig, out: str, *, overwrite: bool = False, **kwargs: Any) -> dict[str, Any]:
    """The summary of ``config`` run in ``out``, computed at most once: read back when ``out`` holds this very run
    finished, continued from its checkpoint when it holds this run interrupted, trained afresh when it holds nothing.
    "This very run" means the stored ``config.json`` is ``config`` (:func:`run_identity`: a run continued keeps its
    stored ``workers``): a directory that holds another configuration
    (other rounds, settings or seed) is refused, never mistaken for this one, unless ``overwrite`` (it is then
    retrained). For scripts that rerun many settings and must lose nothing on interruption; ``kwargs`` go to
    :func:`train`."""
    run_dir = RunDirectory(out)
    same = check_reusable(config, run_dir, overwrite=overwrite)
    if same and run_dir.path(RunDirectory.SUMMARY).exists():
        return run_dir.read_json(RunDirectory.SUMMARY)
    if same and run_dir.path(RunDirectory.CHECKPOINT).exists():
        return train(config, out, resume=True, **kwargs)
    return train(config, out, overwrite=overwrite, **kwargs)


def check_reusable(config: RunConfig, run_dir: RunDirectory, *, overwrite: bool = False) -> bool:
    """Whether ``run_dir`` holds this very run (its ``config.json`` is ``config``: :func:`run_identity`), finished or
    not; refuses a
    directory holding another run or a sweep (:meth:`RunDirectory.occupant`) unless ``overwrite``. What
    :func:`train_once` checks, for commands that run several trainings to check every one before the first."""
    run_dir.check_not_foreign()
    stored = run_dir.path(RunDirectory.CONFIG)
    if stored.exists() and _stored_identity(run_dir) == json.loads(dumps(run_identity(config))):
        return True
    occupant = run_dir.occupant()
    if occupant is not None and not overwrite:
        what = "a run of another configuration" if stored.exists() else occupant
        raise ConfigError(f"{run_dir.root} holds {what}: choose another directory, remove it, or overwrite it "
                          "(--overwrite)")
    return False


def finish(config: RunConfig, federation: FederatedDataset, runtime: Runtime, run_dir: RunDirectory,
           best: dict[str, Any], wall_time_s: float, *, journal: ReleaseJournal | None = None,
           served: dict[str, Any] | None = None, plan: Plan | None = None) -> dict[str, Any]:
    """Serve novel clients with the selected model, score everyone, write clients.csv, ledger.json, summary.json.

    Once the novel clients are served, ``journal`` gets the :data:`NOVEL_SERVED` mark with their scores, so a run
    stopped after that finishes from the mark (``served``) without serving them again."""
    rounds_completed = runtime.completed_rounds
    if config.select == "best_val" and best["snapshot"] is not None:
        runtime.restore(best["snapshot"])
        selected_round = best["round"]
    else:
        selected_round = rounds_completed
    training_scores = runtime.evaluate_training_clients(score_model, report_to_server=False, round=None)
    if served is None:
        novel_scores = runtime.score_novel_clients(federation, score_model)
        if journal is not None:
            journal.mark(NOVEL_SERVED, scores={str(cid): to_json_safe(dataclasses.asdict(score))
                                               for cid, score in novel_scores.items()})
    else:
        novel_scores = {int(cid): ClientScore(num_samples=int(score["num_samples"]), correct=score["correct"],
                                              loss_sum=float(score["loss_sum"]))
                        for cid, score in served["scores"].items()}
    ledgers = runtime.ledgers()
    epsilons = ledgers.epsilons(config.delta)
    rows = client_rows(federation, training_scores, novel_scores, epsilons, runtime)
    run_dir.write_clients(rows)
    ledgers.save(run_dir.path(RunDirectory.LEDGER))
    lifetime = runtime.lifetime_ledgers()
    if lifetime is not None:
        lifetime.save(run_dir.path(RunDirectory.NODE_LEDGERS))
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
            "epsilon_source": RunDirectory.LEDGER,   # computed by the accountant from the ledgers saved there
            "noise_sources": (noise := ledgers.private_metadata_counts("noise")),
            "training_mode": config.privacy.mode,
            "training_guarantee": training_guarantee(config.privacy.mode, ledgers,
                                                     [c.client_id for c in federation.training_clients]),
            # what the accountant priced before the first release: the most each client could spend
            **({} if plan is None else {"planned": plan.to_dict()}),
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


def finished_summary(run_dir: RunDirectory) -> dict[str, Any]:
    """A finished run's summary, its epsilons cross-checked against the release journal and ``ledger.json``
    (:func:`~privfl.federation.spend.run_summary`): each disagreement is printed as a warning and the largest
    epsilon is reported; a damaged record raises :class:`ConfigError` naming it."""
    summary = run_summary(run_dir.root)
    for warning in summary.pop("warnings"):
        print(f"privfl: warning: {run_dir.root}: {warning}", file=sys.stderr)
    summary.pop("status", None)
    summary.pop("run_dir", None)
    return summary


def training_guarantee(mode: str | None, ledgers: LedgerBook, training_ids: list[int]) -> str:
    """What the training clients' epsilons hold under, in words. Record level: the relations the training clients'
    releases were recorded under (DP-FedPFT with public class counts holds under replace-one within the public class
    histogram, not add/remove-one), each once; client level: the mode's relation."""
    if mode is None:
        return "none: training clients release without DP"
    if mode == RECORD:
        found = ledgers.relations(training_ids)
        return "; ".join(found) if found else RELATIONS[RECORD]
    return RELATIONS[mode]


def client_rows(federation: FederatedDataset, training_scores: dict[int, ClientScore],
                novel_scores: dict[int, ClientScore], epsilons: dict, runtime: Runtime) -> list[dict]:
    """One row per client: role, sizes, label histogram, accuracy (%), loss, label shift, epsilon, bytes."""
    k = federation.num_classes
    training_histograms = [c.label_histogram(k) for c in federation.training_clients]
    rows = []
    for client in federation.training_clients:
        score: ClientScore | None = training_scores[client.client_id]
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
