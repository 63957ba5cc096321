"""Which engine runs a run: the in-process runtime, or Flower's simulation or deployment engine.

The engines share one training loop (:func:`privfl.experiment.train`) and one round loop
(:class:`privfl.federation.runtime.Runtime`); they differ in where the clients compute. This module sits above both
the loop and the Flower adapter, so neither imports the other: it hands :func:`~privfl.experiment.train` the runtime
of the chosen engine, and gives Flower's ServerApp the loop to run.

* ``inprocess``: :func:`privfl.experiment.build_runtime`, every client in this process;
* ``flower-sim``: Flower's simulation engine on this machine (:func:`train_simulation`);
* deployment (``privfl flower run``): ``flwr run`` starts the ServerApp of :mod:`privfl.engines.flower.server` on the
  SuperLink's machine, whose :func:`flower_main` trains the run its run config names, or serves novel clients of a
  finished run.

Flower is imported only when a Flower engine is used (``pip install 'privfl[flower]'``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from privfl.config import RunConfig, build_method
from privfl.errors import ConfigError
from privfl.experiment import train
from privfl.federation.lock import RunBusyError
from privfl.federation.rundir import RunDirectory
from privfl.federation.runtime import how_to_continue

if TYPE_CHECKING:
    from flwr.serverapp import Grid

    from privfl.engines.flower.protocol import FlowerOptions

ENGINES = ("inprocess", "flower-sim")


def run(config: RunConfig | None, out: str, *, engine: str = "inprocess", resume: bool = False,
        overwrite: bool = False, progress: bool = True, stop_after_round: int | None = None,
        flower_options: FlowerOptions | None = None, allow_overshoot: bool = False) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) ``config`` into run directory ``out`` on ``engine``; return the summary.

    ``flower_options`` (a :class:`privfl.engines.flower.FlowerOptions`) set the simulation's resources and limits.
    ``allow_overshoot``: resume even where finishing the run takes a client past its target epsilon
    (:func:`privfl.experiment.check_overshoot`).
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "inprocess":
        if flower_options is not None:
            raise ConfigError("flower_options apply to engine='flower-sim' only, got them with engine='inprocess'")
        return train(config, out, resume=resume, overwrite=overwrite, progress=progress,
                     stop_after_round=stop_after_round, allow_overshoot=allow_overshoot)
    if resume:
        raise ConfigError(f"--resume is not supported with --engine flower-sim yet: for a run of the in-process "
                          f"engine in {out}, {how_to_continue('inprocess', out)}; for one of the simulation engine, "
                          f"{how_to_continue('flower-sim', out)}")
    if config is None:
        raise ConfigError("a Flower run needs a RunConfig")
    _one_worker(config)
    return train_simulation(config, out, overwrite=overwrite, progress=progress, stop_after_round=stop_after_round,
                            options=flower_options)


def _one_worker(config: RunConfig) -> None:
    """Refuse ``workers > 1`` on a Flower engine, whose nodes are its processes."""
    if config.workers != 1:
        raise ConfigError(f"workers={config.workers} spreads clients over processes of the in-process engine; "
                          "on Flower the nodes are the processes (--flower-actors, --flower-clients-per-node): "
                          "use workers=1, or engine 'inprocess'")


def flower_runtime_factory(grid: Grid, options: FlowerOptions | None = None, *, run_id: str = "",
                           engine: str = "flower-deployment"):
    """A ``runtime_factory`` for :func:`privfl.experiment.train` whose runtime runs each exchange on the nodes
    behind ``grid`` (the same strategy and procedure objects as in-process). ``run_id`` names the run in every
    message (the nodes tag their ledger records with it); ``engine`` (``flower-deployment`` or ``flower-sim``) is
    recorded in its checkpoints, whose messages name how the run continues."""
    from privfl.engines.flower.runtime import FlowerRuntime

    def factory(config: RunConfig, federation) -> FlowerRuntime:
        _one_worker(config)
        strategy, client = build_method(config, federation)
        return FlowerRuntime(grid, strategy=strategy, client=client, federation=federation, config=config,
                             options=options, run_id=run_id, engine=engine)

    return factory


def flower_main(grid: Grid, run_config: Mapping[str, Any], *, options: FlowerOptions | None = None,
                progress: bool = False, stop_after_round: int | None = None,
                engine: str = "flower-deployment") -> dict[str, Any]:
    """The ServerApp's work: train the run that ``run_config`` describes (``privfl-config``, ``out``, ``overwrite``)
    on ``grid``, or, with ``serve-from``, serve novel clients of that finished run. ``engine``: the Flower engine
    this runs on (``flower-deployment``, ``flower-sim``), named by the messages that say how to continue a run that
    stopped early."""
    from privfl.engines.flower import protocol as p
    from privfl.engines.flower.server_app import options_from_run_config, serve_from_run_config

    options = options or options_from_run_config(run_config)
    if run_config.get(p.SERVE_FROM):
        return serve_from_run_config(grid, run_config, options=options)
    text, out = run_config.get(p.RUN_CONFIG) or "", run_config.get(p.OUT) or ""
    if not text or not out:
        raise ConfigError(f"run config needs {p.RUN_CONFIG!r} (the RunConfig as JSON) and {p.OUT!r} (the run "
                          f"directory on the SuperLink's machine); got {sorted(k for k, v in run_config.items() if v)}")
    config = RunConfig.from_dict(json.loads(text))
    run_dir = RunDirectory(out)
    resume = bool(run_config.get(p.RESUME))
    if resume:
        run_id = _resumed_run_id(run_dir, config)
    elif run_dir.path(RunDirectory.CONFIG).exists() and not run_config.get(p.OVERWRITE):
        # before waiting for any node: an operator hears of it at once
        raise ConfigError(f"run directory {out} already holds a run; {how_to_continue(engine, out)}; or choose "
                          "another --out, or pass --overwrite")
    else:
        run_id = uuid.uuid4().hex[:12]
    try:
        return train(None if resume else config, out, resume=resume, overwrite=bool(run_config.get(p.OVERWRITE)),
                     progress=progress, stop_after_round=stop_after_round,
                     runtime_factory=flower_runtime_factory(grid, options, run_id=run_id, engine=engine),
                     engine=engine, run_id=run_id)
    except RunBusyError:
        raise           # another process writes the run directory: this one wrote nothing and must not
    except BaseException:
        _keep_ledger(run_dir)
        raise


def _resumed_run_id(run_dir: RunDirectory, config: RunConfig) -> str:
    """The run id of the run in ``run_dir`` that a resumed run continues (from its checkpoint, else from its release
    journal; a run that made no release and saved no checkpoint gets a new one)."""
    from accounting import ReleaseJournal
    from privfl.engines.flower import protocol as p

    if not run_dir.path(RunDirectory.CONFIG).exists():
        raise ConfigError(f"cannot resume: {run_dir.root} holds no run ({RunDirectory.CONFIG} is missing); start it "
                          "without --resume")
    stored = RunConfig.from_dict(run_dir.read_json(RunDirectory.CONFIG))
    if stored.to_dict() != config.to_dict():
        raise ConfigError(f"cannot resume: the RunConfig given differs from {run_dir.path(RunDirectory.CONFIG)}; "
                          f"resume with --config {run_dir.path(RunDirectory.CONFIG)}")
    checkpoint = run_dir.load_checkpoint()
    if checkpoint is not None:
        run_id = ((checkpoint.get("runtime") or {}).get("wire") or {}).get("run_id")
        if not run_id:
            raise ConfigError(f"cannot resume {run_dir.root} on Flower: its checkpoint was not saved by a run on "
                              f"Flower nodes that names its run; if it ran in-process, "
                              f"{how_to_continue('inprocess', run_dir.root)}; otherwise start it again")
        return str(run_id)
    try:
        entries = ReleaseJournal(run_dir.path(RunDirectory.RELEASES)).entries()
    except ValueError as error:
        raise ConfigError(f"cannot resume: {error}") from None
    for _, record in entries:
        if record.metadata.get(p.RUN_KEY):
            return str(record.metadata[p.RUN_KEY])
    return uuid.uuid4().hex[:12]


def _keep_ledger(run_dir: RunDirectory) -> None:
    """A run that stopped early still leaves its ``ledger.json``: this run's releases whose replies reached the
    server (its release journal, every attempt of a resumed run), with the server's own records; the nodes' ledgers
    hold the rest."""
    from accounting import LedgerBook, ReleaseJournal

    if not run_dir.path(RunDirectory.CONFIG).exists() or run_dir.path(RunDirectory.SUMMARY).exists():
        return          # the run directory was never created, or the run finished
    book = LedgerBook()
    try:
        ReleaseJournal(run_dir.path(RunDirectory.RELEASES)).replay_into(book)
    except ValueError:
        return          # a damaged journal: the error being raised is the one to report
    book.save(run_dir.path(RunDirectory.LEDGER))


def train_simulation(config: RunConfig, out: str, *, overwrite: bool = False, progress: bool = True,
                     stop_after_round: int | None = None, options: FlowerOptions | None = None) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine into run directory ``out``; return the summary."""
    from privfl.engines.flower import protocol as p
    from privfl.engines.flower.simulation import num_clients, simulate, simulation_run_config

    options = options or p.FlowerOptions()
    run_config = simulation_run_config(config, out, overwrite=overwrite)

    def main(grid: Grid, values: Mapping[str, Any]) -> dict[str, Any]:
        return flower_main(grid, values, options=options, progress=progress, stop_after_round=stop_after_round,
                           engine="flower-sim")

    return simulate(main, run_config, num_clients(config), options)
