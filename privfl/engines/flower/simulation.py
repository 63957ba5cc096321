"""Flower's simulation engine: a whole run on virtual SuperNodes in one process tree (``--engine flower-sim``).

Virtual SuperNodes holding ``clients_per_node`` consecutive clients each (training clients, then novel clients when
the method serves them; chosen per run when not given,
:func:`~privfl.engines.flower.protocol.auto_clients_per_node`), Ray actors as client processes
(:class:`~privfl.engines.flower.protocol.FlowerOptions` sets how many and their resources), the privfl ServerApp
in this process. The nodes keep their ledgers under ``RUN_DIR/nodes/partition-<i>/``. :func:`simulate` runs a
ServerApp ``main`` against such nodes (:mod:`privfl.engines.choice` passes one that trains);
:func:`serve_simulation` serves novel clients of a finished training run in a simulated run of their own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfl.config import RunConfig, run_federation
from privfl.engines.flower import protocol as p
from privfl.errors import ConfigError, InternalError
from privfl.federation.rundir import RunDirectory
from privfl.privacy.training import DISTRIBUTED

if TYPE_CHECKING:
    from privfl.engines.flower.server_app import ServerMain


def num_clients(config, federation=None) -> int:
    """Partitions of a simulation of ``config``: every training client, and every novel one if the method serves
    them (the ServerApp then waits for all of them, and for no other)."""
    from privfl.methods import get_method

    federation = federation or run_federation(config)
    novel = len(federation.novel_clients) if get_method(config.method).client.serves_novel_clients else 0
    return len(federation.training_clients) + novel


def num_nodes(config, federation=None, clients_per_node: int = 1) -> int:
    """Virtual SuperNodes of a simulation of ``config``, ``clients_per_node`` clients each (the last may hold
    fewer)."""
    return p.simulated_nodes(num_clients(config, federation), clients_per_node)


def grouping(clients: int, options: p.FlowerOptions) -> dict[str, Any]:
    """The run-config keys that tell each virtual node which partitions it holds (nothing for one per node);
    ``options.clients_per_node`` must be chosen (:meth:`FlowerOptions.for_clients
    <privfl.engines.flower.protocol.FlowerOptions.for_clients>`)."""
    if options.clients_per_node is None:
        raise InternalError("grouping needs the clients per node chosen (FlowerOptions.for_clients)")
    if options.clients_per_node == 1:
        return {}
    return {p.CLIENTS_PER_NODE: options.clients_per_node, p.NUM_CLIENTS: clients}


#: Ray starts its worker processes at niceness 15 unless this variable says otherwise (Ray 2.x's ``worker_niceness``),
#: and the simulation's clients all train in Ray workers: on a machine with any other load (the ServerApp, another
#: job) they then get a sliver of the CPU. Measured on the shared 2-core machine under load: a 2NN SGD step took
#: 14.7 ms in a Ray worker against 0.5 ms in the parent, and 0.6 ms with this set to 0.
RAY_NICENESS = "RAY_worker_niceness"


def run_apps(server_app, client_app, nodes: int, options: p.FlowerOptions) -> None:
    """Run ``server_app`` against ``nodes`` virtual SuperNodes running ``client_app``: Flower's ``run_simulation``
    with the resources of ``options``, Flower's log quiet unless ``options.verbose``, and Ray's workers at the
    niceness of this process (:data:`RAY_NICENESS`; a value the user set is kept)."""
    from flwr.simulation import run_simulation

    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not options.verbose:
        flwr_logger.setLevel(logging.WARNING)
    niceness = os.environ.get(RAY_NICENESS)
    if niceness is None:
        os.environ[RAY_NICENESS] = "0"
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                       backend_config=options.backend_config(), verbose_logging=options.verbose)
    finally:
        flwr_logger.setLevel(level)
        if niceness is None:
            os.environ.pop(RAY_NICENESS, None)


def _result(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        raise result["error"]
    if "summary" not in result:
        raise InternalError("the Flower simulation ended without a summary (see Flower's log above)")
    return result["summary"]


def simulate(main: ServerMain, run_config: dict[str, Any], partitions: int, options: p.FlowerOptions) -> dict[str, Any]:
    """Run ``main(grid, run_config)`` as the ServerApp of a simulation whose virtual nodes hold ``partitions``
    partitions (``options.clients_per_node`` each; when ``None``, chosen from ``partitions`` and the client processes,
    :func:`~privfl.engines.flower.protocol.auto_clients_per_node`) and run the privfl ClientApp; return what
    ``main`` returned, or raise what it raised."""
    from privfl.engines.flower.client_app import make_client_app
    from privfl.engines.flower.server_app import make_server_app

    config = RunConfig.from_dict(json.loads(run_config[p.RUN_CONFIG]))
    options = options.for_clients(partitions, secure=config.privacy.mode == DISTRIBUTED)
    assert options.clients_per_node is not None   # for_clients chose it
    run_config = {**run_config, p.THREADS: options.threads, **grouping(partitions, options)}
    result: dict[str, Any] = {}
    server_app = make_server_app(main, run_config, result=result)
    run_apps(server_app, make_client_app(run_config), p.simulated_nodes(partitions, options.clients_per_node),
              options)
    return _result(result)


def simulation_run_config(config, out: str, *, overwrite: bool) -> dict[str, Any]:
    """The run config of a simulated training run of ``config`` into ``out``: its nodes keep their ledgers and states
    under ``out/nodes`` (removed first when ``overwrite`` replaces the run). Refuses an ``out`` that holds a run
    unless ``overwrite``."""
    run_dir = RunDirectory(out)
    if run_dir.path(RunDirectory.CONFIG).exists() and not overwrite:
        raise ConfigError(f"run directory {run_dir.root} already holds a run; choose another --out, "
                          "or pass --overwrite")
    nodes_root = Path(out) / "nodes"
    if overwrite and nodes_root.exists():
        shutil.rmtree(nodes_root)           # the ledgers of the run being replaced
    return {p.RUN_CONFIG: json.dumps(config.to_dict()), p.OUT: str(out), p.OVERWRITE: overwrite,
            p.NODES_ROOT: str(nodes_root)}


def serve_simulation(train_dir: str, out: str, *, clients: list[int] | None = None, nodes_root: str | None = None,
                     overwrite: bool = False, options: p.FlowerOptions | None = None) -> dict[str, Any]:
    """Serve novel clients of the finished training run ``train_dir`` on Flower's simulation engine, in a run of
    their own (see :func:`privfl.engines.flower.server_app.serve_novel_clients`); results go to ``out``.

    The simulation has a virtual node per partition (training and novel); only the novel clients to serve are sent
    anything beyond the hello. Their nodes keep their ledgers under ``nodes_root`` (default: the training run's
    ``nodes`` directory, so a novel client served again records its new release beside its earlier ones).
    """
    from privfl.engines.flower.server_app import serve_from_run_config

    options = options or p.FlowerOptions()
    config = RunConfig.from_dict(RunDirectory(train_dir).read_json(RunDirectory.CONFIG))
    federation = run_federation(config)
    partitions = len(federation.training_clients) + len(federation.novel_clients)
    run_config = {p.RUN_CONFIG: json.dumps(config.to_dict()), p.OUT: str(out), p.OVERWRITE: overwrite,
                  p.NODES_ROOT: str(nodes_root or Path(train_dir) / "nodes"),
                  p.SERVE_FROM: str(train_dir), p.SERVE_CLIENTS: ",".join(str(c) for c in clients or [])}
    return simulate(lambda grid, values: serve_from_run_config(grid, values, options=options), run_config,
                    partitions, options)
