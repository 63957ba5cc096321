"""The privfl ServerApp: what ``flwr run`` (deployment) and the simulation engine start on the server.

:func:`make_server_app` wraps a ``main(grid, run_config)`` in a Flower ``ServerApp``. What ``main`` does is decided
above this package, by the engine (:mod:`privfl.engines.choice`): train a run with :func:`privfl.experiment.train` on a
:class:`~privfl.engines.flower.runtime.FlowerRuntime`, or serve novel clients of a finished run
(:func:`serve_novel_clients`, here). Run-config keys are in :mod:`privfl.engines.flower.protocol`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from privfl.config import RunConfig, build_method, run_federation
from privfl.engines.flower import protocol as p
from privfl.engines.flower.runtime import FlowerRuntime
from privfl.engines.flower.transport import ids_text
from privfl.errors import ConfigError
from privfl.federation.rundir import RunDirectory, atomic_write_bytes, dumps
from privfl.federation.runtime import engine_of, how_to_continue
from privfl.metrics import summarize_scores

ServerMain = Callable[[Grid, Mapping[str, Any]], dict[str, Any]]


def options_from_run_config(run_config: Mapping[str, Any]) -> p.FlowerOptions:
    """The waiting limits a run config sets (``timeout-s`` > 0, ``node-wait-s`` >= 0; unset: the defaults)."""
    values: dict[str, Any] = {}   # FlowerOptions' float fields by name
    for key, name in ((p.TIMEOUT, "timeout_s"), (p.NODE_WAIT, "node_wait_s")):
        raw = run_config.get(key)
        if raw in (None, ""):
            continue
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"run config {key}={raw!r} must be a number")
        if key == p.TIMEOUT and raw <= 0:
            raise ConfigError(f"run config {key}={raw!r} must be > 0 seconds (a limit for one exchange's replies; "
                              f"the default is {p.DEFAULT_TIMEOUT_S:g}): without one a dead node hangs the run")
        values[name] = float(raw)
    return p.FlowerOptions(**values)


def serve_from_run_config(grid: Grid, run_config: Mapping[str, Any], *,
                          options: p.FlowerOptions | None = None) -> dict[str, Any]:
    """Serve novel clients of the finished run ``run_config`` names (``serve-from``, ``serve-clients``, ``out``,
    ``overwrite``; see :func:`serve_novel_clients`)."""
    out = run_config.get(p.OUT) or ""
    if not out:
        raise ConfigError(f"run config {p.OUT!r} is empty: serving needs a directory for its results")
    return serve_novel_clients(grid, run_config[p.SERVE_FROM], out, clients=_serve_clients(run_config),
                               options=options or options_from_run_config(run_config),
                               overwrite=bool(run_config.get(p.OVERWRITE)))


def _serve_clients(run_config: Mapping[str, Any]) -> list[int] | None:
    raw = run_config.get(p.SERVE_CLIENTS)
    if raw in (None, ""):
        return None
    try:
        return [int(v) for v in str(raw).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"run config {p.SERVE_CLIENTS}={raw!r} must be comma-separated novel client ids, "
                          "e.g. \"9,10\"") from None


SERVE_SUMMARY, SERVE_LEDGER = "serve.json", "ledger.json"


def serve_novel_clients(grid: Grid, train_dir: str | Path, out: str | Path, *, clients: list[int] | None = None,
                        options: p.FlowerOptions | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Serve novel clients of the finished training run in ``train_dir``, in a run of their own.

    The server loads the run's config and its selected server state from ``checkpoint.pt`` (``weights_only=True``):
    the best-validation snapshot for ``select="best_val"``, the final state otherwise. Each novel client's node
    (``num-partitions`` = training + novel clients) gets the method's request, sends its query (ODPFL-HN: a
    descriptor, recorded in that node's ledger first; FedAvg: nothing), and gets its model, which it scores with
    the labels it holds. ``clients``: the novel client ids to serve (default: all). Writes ``serve.json`` (scores,
    epsilons, bytes) and ``ledger.json`` (the served clients' ledgers as their nodes report them) into ``out``.
    """
    run = RunDirectory(train_dir)
    config = RunConfig.from_dict(run.read_json(RunDirectory.CONFIG))
    checkpoint = run.load_checkpoint()
    if checkpoint is None:
        raise ConfigError(f"{run.path(RunDirectory.CHECKPOINT)} does not exist: serve-from needs a training run "
                          "directory with its checkpoint")
    state = checkpoint["runtime"]
    if int(state["completed_rounds"]) != config.rounds:
        raise ConfigError(f"the run in {run.root} completed {state['completed_rounds']} of {config.rounds} rounds: "
                          f"finish it before serving its novel clients; {how_to_continue(engine_of(state), run.root)}")
    best = checkpoint.get("best") or {}
    if config.select == "best_val" and best.get("snapshot") is not None:
        selected, selected_round = best["snapshot"], int(best["round"])
    else:
        selected, selected_round = state, int(state["completed_rounds"])
    target = RunDirectory(out)
    if target.path(SERVE_SUMMARY).exists() and not overwrite:
        raise ConfigError(f"{target.path(SERVE_SUMMARY)} exists; choose another out directory or set overwrite")
    federation = run_federation(config)
    strategy, client = build_method(config, federation)
    if not client.serves_novel_clients:
        raise ConfigError(f"method {config.method!r} does not serve novel clients (its novel clients need labels "
                          "or training), so there is nothing to serve")
    strategy.load_state_dict(selected["strategy"])
    novel = sorted(c.client_id for c in federation.novel_clients)
    ids = novel if clients is None else sorted(set(clients))
    unknown = [cid for cid in ids if cid not in novel]
    if unknown or not ids:
        raise ConfigError(f"serve-clients {clients!r} must name novel clients of the run in {run.root}; valid: "
                          f"{ids_text(novel, 50)}")
    started = time.perf_counter()
    runtime = FlowerRuntime(grid, strategy=strategy, client=client, federation=federation, config=config,
                            options=options, serve=ids)
    scores = runtime.serve(ids)
    ledgers = runtime.ledgers(ids)
    epsilons = ledgers.epsilons(config.delta)
    rows = [{"client_id": cid, "num_samples": scores[cid].num_samples, "accuracy": 100.0 * scores[cid].accuracy,
             "loss": scores[cid].loss, "epsilon": float(epsilons.get(cid, 0.0)),
             "releases": len(ledgers[cid]) if cid in ledgers else 0,
             "bytes_up": runtime.bytes_up.get(cid, 0), "bytes_down": runtime.bytes_down.get(cid, 0)}
            for cid in ids]
    summary = {"mode": "serve", "train_dir": str(run.root), "method": config.method, "seed": config.seed,
               "select": config.select, "selected_round": selected_round,
               "novel": summarize_scores([scores[cid] for cid in ids]),
               "privacy": {"delta": config.delta, "epsilon_max_novel": max(r["epsilon"] for r in rows),
                           "epsilon_per_client": {str(r["client_id"]): r["epsilon"] for r in rows}},
               "clients": rows, "wall_time_s": time.perf_counter() - started, **runtime.summary()}
    target.root.mkdir(parents=True, exist_ok=True)
    ledgers.save(target.path(SERVE_LEDGER))
    atomic_write_bytes(target.path(SERVE_SUMMARY), (dumps(summary) + "\n").encode())
    return summary


class OneLineErrors(logging.Filter):
    """On Flower's logger: the record of a ServerApp stopped by an error an operator acts on (a node failed or did
    not answer, a setting or file refused, a budget reached: :data:`OPERATOR_ERRORS`) keeps its message and drops
    its traceback (Flower logs one of about 35 lines), unless ``verbose`` (``privfl flower run --verbose``). A fault
    inside privfl or Flower keeps its traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and not self.verbose and isinstance(error, operator_errors()):
            record.msg, record.args = "ServerApp stopped: %s (its traceback: privfl flower run --verbose)", (error,)
            record.exc_info, record.exc_text = None, None
        return True


def operator_errors() -> tuple[type[BaseException], ...]:
    """The errors whose message says all an operator needs: privfl's user errors, a node's failure, a refused
    release."""
    from accounting import BudgetExceededError
    from privfl.engines.flower.transport import FlowerClientError
    from privfl.errors import PrivflError

    return (PrivflError, FlowerClientError, BudgetExceededError)


_ONE_LINE = OneLineErrors()


def make_server_app(main: ServerMain, run_config: Mapping[str, Any] | None = None, *,
                    result: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp that runs ``main(grid, values)``, ``values`` being ``run_config`` updated with the run config
    Flower gives it; the summary ``main`` returns, or the exception it raises, goes to ``result["summary"]`` /
    ``result["error"]`` when ``result`` is given (the simulation re-raises it outside Flower's thread). Without
    ``result`` the exception reaches Flower, which logs it: in one line (:class:`OneLineErrors`) unless the run
    config sets ``verbose``."""
    from flwr.common.logger import FLOWER_LOGGER

    app = ServerApp()

    @app.main()
    def run(grid: Grid, context: Context) -> None:
        values = {**(run_config or {}), **{k: v for k, v in context.run_config.items() if v not in ("", None)}}
        _ONE_LINE.verbose = bool(values.get(p.VERBOSE))
        if _ONE_LINE not in FLOWER_LOGGER.filters:
            FLOWER_LOGGER.addFilter(_ONE_LINE)
        try:
            summary = main(grid, values)
        except BaseException as error:
            if result is None:
                raise
            result["error"] = error
            return
        if result is not None:
            result["summary"] = summary

    return app
