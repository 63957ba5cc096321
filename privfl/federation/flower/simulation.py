"""``privfl train --engine flower-sim``: a whole run on Flower's simulation engine, in one command.

One virtual SuperNode per client (training clients, then novel clients when the method serves them), Ray actors
as client processes (:class:`~privfl.federation.flower.protocol.FlowerOptions` sets how many and their resources),
the privfl ServerApp in this process. The nodes keep their ledgers under ``RUN_DIR/nodes/partition-<i>/``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from privfl.errors import ConfigError
from privfl.federation.flower import protocol as p
from privfl.federation.rundir import RunDirectory


def num_nodes(config) -> int:
    """Nodes of a simulation of ``config``: every training client, and every novel one if the method serves them."""
    from privfl.data import build_federation
    from privfl.methods import get_method

    federation = build_federation(config.federation, seed=config.seed)
    novel = len(federation.novel_clients) if get_method(config.method).client.serves_novel_clients else 0
    return len(federation.training_clients) + novel


def train_simulation(config, out: str, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
                     stop_after_round: int | None = None, options: p.FlowerOptions | None = None) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine into run directory ``out``; return the summary."""
    import json

    from flwr.simulation import run_simulation

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
    run_config = {p.RUN_CONFIG: json.dumps(config.to_dict()), p.OUT: str(out), p.OVERWRITE: overwrite,
                  p.NODES_ROOT: str(nodes_root), p.THREADS: options.threads}
    result: dict[str, Any] = {}
    server_app = make_server_app(run_config, options=options, progress=progress, stop_after_round=stop_after_round,
                                 result=result)
    client_app = make_client_app(run_config)
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not options.verbose:
        flwr_logger.setLevel(logging.WARNING)
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_nodes(config),
                       backend_config=options.backend_config(), verbose_logging=options.verbose)
    finally:
        flwr_logger.setLevel(level)
    if "error" in result:
        raise result["error"]
    if "summary" not in result:
        raise RuntimeError("the Flower simulation ended without a summary (see Flower's log above)")
    return result["summary"]
