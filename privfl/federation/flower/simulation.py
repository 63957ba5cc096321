"""``privfl train --engine flower-sim``: a whole run on Flower's simulation engine, in one command.

One virtual SuperNode per client, or per ``clients_per_node`` clients (training clients, then novel clients when the
method serves them), Ray actors
as client processes (:class:`~privfl.federation.flower.protocol.FlowerOptions` sets how many and their resources),
the privfl ServerApp in this process. The nodes keep their ledgers under ``RUN_DIR/nodes/partition-<i>/``.

:func:`serve_simulation` serves novel clients of a finished training run in a simulated run of their own.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from privfl.errors import ConfigError
from privfl.federation.flower import protocol as p
from privfl.federation.rundir import RunDirectory


def num_clients(config, federation=None) -> int:
    """Partitions of a simulation of ``config``: every training client, and every novel one if the method serves
    them (the ServerApp then waits for all of them, and for no other)."""
    from privfl.data import build_federation
    from privfl.methods import get_method

    federation = federation or build_federation(config.federation, seed=config.seed)
    novel = len(federation.novel_clients) if get_method(config.method).client.serves_novel_clients else 0
    return len(federation.training_clients) + novel


def num_nodes(config, federation=None, clients_per_node: int = 1) -> int:
    """Virtual SuperNodes of a simulation of ``config``, ``clients_per_node`` clients each (the last may hold
    fewer)."""
    return p.simulated_nodes(num_clients(config, federation), clients_per_node)


def grouping(clients: int, options: p.FlowerOptions) -> dict[str, Any]:
    """The run-config keys that tell each virtual node which partitions it holds (nothing for one per node)."""
    if options.clients_per_node == 1:
        return {}
    return {p.CLIENTS_PER_NODE: options.clients_per_node, p.NUM_CLIENTS: clients}


def _simulate(server_app, client_app, nodes: int, options: p.FlowerOptions) -> None:
    from flwr.simulation import run_simulation

    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not options.verbose:
        flwr_logger.setLevel(logging.WARNING)
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                       backend_config=options.backend_config(), verbose_logging=options.verbose)
    finally:
        flwr_logger.setLevel(level)


def _result(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        raise result["error"]
    if "summary" not in result:
        raise RuntimeError("the Flower simulation ended without a summary (see Flower's log above)")
    return result["summary"]


def train_simulation(config, out: str, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
                     stop_after_round: int | None = None, options: p.FlowerOptions | None = None) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine into run directory ``out``; return the summary."""
    import json

    from privfl.federation.flower.client_app import make_client_app
    from privfl.federation.flower.server_app import make_server_app

    if resume:
        raise ConfigError("--resume is not supported with --engine flower-sim yet; resume with --engine inprocess")
    options = options or p.FlowerOptions()
    run_dir = RunDirectory(out)
    if run_dir.path(RunDirectory.CONFIG).exists() and not overwrite:
        raise ConfigError(f"run directory {run_dir.root} already holds a run; choose another --out, "
                          "or pass --overwrite")
    nodes_root = Path(out) / "nodes"
    if overwrite and nodes_root.exists():
        shutil.rmtree(nodes_root)           # the ledgers of the run being replaced
    clients = num_clients(config)
    run_config = {p.RUN_CONFIG: json.dumps(config.to_dict()), p.OUT: str(out), p.OVERWRITE: overwrite,
                  p.NODES_ROOT: str(nodes_root), p.THREADS: options.threads, **grouping(clients, options)}
    result: dict[str, Any] = {}
    server_app = make_server_app(run_config, options=options, progress=progress, stop_after_round=stop_after_round,
                                 result=result)
    _simulate(server_app, make_client_app(run_config), p.simulated_nodes(clients, options.clients_per_node), options)
    return _result(result)


def serve_simulation(train_dir: str, out: str, *, clients: list[int] | None = None, nodes_root: str | None = None,
                     overwrite: bool = False, options: p.FlowerOptions | None = None) -> dict[str, Any]:
    """Serve novel clients of the finished training run ``train_dir`` on Flower's simulation engine, in a run of
    their own (see :func:`privfl.federation.flower.server_app.serve_novel_clients`); results go to ``out``.

    The simulation has a virtual node per partition (training and novel); only the novel clients to serve are sent
    anything beyond the hello. Their nodes keep their ledgers under ``nodes_root`` (default: the training run's
    ``nodes`` directory, so a novel client served again records its new release beside its earlier ones).
    """
    import json

    from privfl.data import build_federation
    from privfl.experiment import RunConfig
    from privfl.federation.flower.client_app import make_client_app
    from privfl.federation.flower.server_app import make_server_app

    options = options or p.FlowerOptions()
    config = RunConfig.from_dict(RunDirectory(train_dir).read_json(RunDirectory.CONFIG))
    federation = build_federation(config.federation, seed=config.seed)
    partitions = len(federation.training_clients) + len(federation.novel_clients)
    run_config = {p.RUN_CONFIG: json.dumps(config.to_dict()), p.OUT: str(out), p.OVERWRITE: overwrite,
                  p.NODES_ROOT: str(nodes_root or Path(train_dir) / "nodes"), p.THREADS: options.threads,
                  p.SERVE_FROM: str(train_dir), p.SERVE_CLIENTS: ",".join(str(c) for c in clients or []),
                  **grouping(partitions, options)}
    result: dict[str, Any] = {}
    server_app = make_server_app(run_config, options=options, result=result)
    _simulate(server_app, make_client_app(run_config), p.simulated_nodes(partitions, options.clients_per_node),
              options)
    return _result(result)
