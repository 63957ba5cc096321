"""Flower overhead: FedAvg rounds on the in-process runtime, Flower's simulation engine and Flower's deployment engine.

Setting: the MNIST protocol of ``runtime_overhead.py`` (MNIST 2NN, 20 local SGD steps x batch 64, pathological 2
shards), with 200 clients (100 training, 100 novel) so that a round can hold 10 or 100 training clients
(``client_fraction`` 0.1 or 1.0). Timed: ``--rounds`` training rounds after one warm-up round (which includes each
client process building or loading its data); evaluation excluded. Every engine runs ``--repeats`` times, interleaved
(one run of each engine per repeat, in a rotating order), so a load change on the shared machine hits all of them;
ratios are of medians, and per repeat to the in-process run of the same repeat.

* in-process: :func:`privfl.experiment.build_runtime`, this process, 1 torch thread;
* simulation: ``--actors`` Ray client processes with 1 torch thread each, and virtual SuperNodes holding as many
  clients as the run chooses when ``--flower-clients-per-node`` is not given
  (:func:`~privfl.engines.flower.protocol.auto_clients_per_node`: 50 with 1 actor, so 4 nodes), reported as
  ``simulation``; ``simulation_kK`` for each ``--clients-per-node`` K: virtual SuperNodes holding K consecutive
  clients each (200 / K nodes; K = 1, a node per client, was the default before), one packed Flower message per node
  and round;
* deployment: a SuperLink and 2 SuperNodes on loopback (TLS, node authentication), each SuperNode holding 50
  training clients (``partition-range``), ``flwr run`` of the privfl app; round times come from the run's summary
  (``summary["flower"]["round_seconds"]``). ``deployment``: ``privfl flower supernode``'s defaults, process isolation
  with one long-lived ClientApp process per SuperNode (:mod:`privfl.engines.flower.worker`) and an idle poll of
  0.25 s (:mod:`privfl.engines.flower.supernode`); ``deployment_subprocess``: Flower's own behaviour, as before,
  ``--isolation subprocess --poll-s 3``: a fresh ClientApp process per message, the SuperLink asked every 3 s.
  Two SuperNodes train in parallel (one ClientApp process each, 1 thread), so on a 2-core machine this engine may
  use 2 cores where the others use 1.

    nice python benchmarks/flower_overhead.py [--rounds 2] [--per-round 10 100] [--repeats 3] [--actors 1]
        [--engines inprocess simulation deployment deployment_subprocess] [--clients-per-node default 1 10]
        [--profile]

``--profile`` adds one profiled simulation run per setting (not timed): the ServerApp's profile, and the ClientApp's
profile inside the Ray actor. Targets (issue 30): simulation with the default settings within 1.5x, deployment
within 3x of in-process at 100 clients per round. Writes benchmarks/results/flower_overhead.json (paths relative to
the repository and the Python installation).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "flower_overhead.json"
TRAINING_CLIENTS = 100


def spec(num_clients: int = 2 * TRAINING_CLIENTS):
    from privfl.data import FederationSpec

    return FederationSpec(source="mnist", num_clients=num_clients, partition="pathological", shards_per_client=2,
                          novel_fraction=0.5)


def run_config(per_round: int, rounds: int):
    from privfl.config import RunConfig

    return RunConfig(federation=spec(), method="fedavg", model="mlp2nn", rounds=rounds + 1, seed=0,
                     method_config={"lr": 0.1, "local_steps": 20, "batch_size": 64},
                     client_fraction=per_round / TRAINING_CLIENTS, select="last", eval_every=10_000,
                     checkpoint_every=10_000)


def _strip(text: str) -> str:
    """Profile text with the repository's and the Python installations' paths removed (no machine names)."""
    for prefix in sorted({str(ROOT), sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}, key=len,
                         reverse=True):
        text = text.replace(prefix + "/", "")
    return text


def _stats_text(stats: pstats.Stats, limit: int = 22) -> str:
    buffer = io.StringIO()
    stats.stream = buffer
    stats.sort_stats("cumulative").print_stats(limit)
    # drop the header lines naming each profile file (temporary paths), keep the table
    lines = [line for line in buffer.getvalue().splitlines() if not line.rstrip().endswith(".prof")]
    return _strip("\n".join(lines) + "\n")


def time_rounds(runtime, rounds: int, profile: bool = False) -> tuple[float, str]:
    runtime.run_round(0)                                   # warm-up: data built in every client process
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for round in range(1, rounds + 1):
        runtime.run_round(round)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    return elapsed, _stats_text(pstats.Stats(profiler)) if profiler else ""


# -- in-process -----------------------------------------------------------------------------------------------------


def in_process(config, rounds: int) -> dict:
    """``rounds`` timed rounds of ``config`` (a RunConfig) on the in-process runtime, after a warm-up round."""
    from privfl.data import build_federation
    from privfl.experiment import build_runtime

    seconds, _ = time_rounds(build_runtime(config, build_federation(config.federation, seed=0)), rounds)
    return {"seconds": seconds}


# -- simulation -----------------------------------------------------------------------------------------------------


def _timed_client_app(defaults: dict, log_dir: str, profile: bool):
    """The privfl ClientApp, timing each message's handling (and, with ``profile``, profiling the timed rounds')
    into files under ``log_dir``, one per client process."""
    from flwr.clientapp import ClientApp

    from privfl.engines.flower import protocol as p
    from privfl.engines.flower.client_app import handle

    app = ClientApp()

    def run(message, context):
        import uuid

        timed = message.metadata.group_id not in ("", "0")             # rounds >= 1; not hello, not warm-up
        profiler = cProfile.Profile() if profile and timed else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        try:
            return handle(message, context, defaults)
        finally:
            if profiler:                    # one file per message (the app is unpickled afresh for each one)
                profiler.disable()
                profiler.dump_stats(os.path.join(log_dir, f"client-{uuid.uuid4().hex}.prof"))
            if timed:
                with open(os.path.join(log_dir, f"client-{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps({"type": message.metadata.message_type,
                                        "seconds": time.perf_counter() - start}) + "\n")

    for message_type in set(p.MESSAGE_TYPES.values()):
        category, _, action = message_type.partition(".")
        register = getattr(app, category)
        register(action)(run) if action else register()(run)
    return app


def simulation(config, rounds: int, actors: int, profile: bool = False,
               clients_per_node: int | None = None) -> dict:
    """``rounds`` timed rounds of ``config`` on Flower's simulation engine with ``actors`` Ray actors, after a
    warm-up round."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from privfl.data import build_federation
    from privfl.engines.choice import flower_runtime_factory
    from privfl.engines.flower import FlowerOptions
    from privfl.engines.flower import protocol as p
    from privfl.engines.flower.simulation import grouping, num_clients, num_nodes, run_apps

    federation = build_federation(config.federation, seed=0)
    options = FlowerOptions(max_actors=actors, threads=1, clients_per_node=clients_per_node).for_clients(
        num_clients(config, federation))
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            runtime = flower_runtime_factory(grid, options)(config, federation)
            out["connect_s"] = runtime.directory.connect_seconds
            out["seconds"], out["server_profile"] = time_rounds(runtime, rounds, profile)
        except BaseException as error:
            out["error"] = repr(error)

    work = Path(tempfile.mkdtemp(prefix="privfl-flower-sim-"))
    logs = work / "logs"
    logs.mkdir()
    clients = num_clients(config, federation)
    client = _timed_client_app({p.RUN_CONFIG: json.dumps(config.to_dict()), p.NODES_ROOT: str(work / "nodes"),
                                p.THREADS: 1, **grouping(clients, options)}, str(logs), profile)
    nodes = num_nodes(config, federation, options.clients_per_node)
    started = time.perf_counter()
    try:
        run_apps(app, client, nodes, options)     # privfl's: Ray's workers at this process's niceness
        out["total_with_startup_s"] = time.perf_counter() - started
        if "error" in out:
            raise RuntimeError(out["error"])
        handled = [json.loads(line) for f in logs.glob("*.jsonl") for line in f.read_text().splitlines()]
        out["client_handle_s"] = sum(h["seconds"] for h in handled)
        out["client_messages"] = len(handled)
        out["nodes"] = nodes
        out["clients_per_node"] = options.clients_per_node
        profiles = sorted(logs.glob("*.prof"))
        if profile and profiles:
            out["client_profile"] = _stats_text(pstats.Stats(*map(str, profiles)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# -- deployment -----------------------------------------------------------------------------------------------------


_TIMED_APP = '''"""The privfl ClientApp, timing each message: when its process started, when privfl was imported, and
how long the message's handling took (benchmark only; written to $PRIVFL_BENCH_TIMINGS)."""
import json
import os
import time

IMPORTING = time.time()
from flwr.clientapp import ClientApp  # noqa: E402

from privfl.engines.flower import protocol as p  # noqa: E402
from privfl.engines.flower.client_app import handle  # noqa: E402

IMPORTED = time.time()


def _process_started() -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
    boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + start


app = ClientApp()


def run(message, context):
    start = time.time()
    reply = handle(message, context)
    end = time.time()
    with open(os.path.join(os.environ["PRIVFL_BENCH_TIMINGS"], f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"type": message.metadata.message_type, "group": message.metadata.group_id,
                            "node": context.node_id, "pid": os.getpid(), "process_started": _process_started(),
                            "importing": IMPORTING, "imported": IMPORTED, "start": start, "end": end}) + "\\n")
    return reply


for message_type in set(p.MESSAGE_TYPES.values()):
    category, _, action = message_type.partition(".")
    register = getattr(app, category)
    register(action)(run) if action else register()(run)
'''


def _timed_app(directory: Path) -> Path:
    """The privfl Flower App with a ClientApp that times its messages (the App ships ``timed_app.py``)."""
    from privfl.engines.flower import launch

    directory.mkdir(parents=True, exist_ok=True)
    text = (launch.APP_DIR / "pyproject.toml").read_text()
    text = text.replace('clientapp = "privfl.engines.flower.client_app:app"', 'clientapp = "timed_app:app"')
    if 'clientapp = "timed_app:app"' not in text:
        raise RuntimeError("the privfl App's pyproject.toml no longer names its ClientApp as this benchmark expects")
    (directory / "pyproject.toml").write_text(text)
    (directory / "timed_app.py").write_text(_TIMED_APP)
    return directory


def _deployment_breakdown(timings: list[dict], round_seconds: list[float]) -> dict:
    """Per timed round (the train messages of groups >= 1): the round's wall time on the server, and on the nodes
    (the slowest node's): the ClientApp process's start to privfl imported, when the process was started for this
    message (a process per message; 0 where a long-lived process had handled an earlier message), handling (data,
    training, ledger), and what is left (SuperNode and ClientApp polling, transfers)."""
    first = {}
    for t in timings:
        first[t["pid"]] = min(first.get(t["pid"], t["start"]), t["start"])
    rows = []
    for round, wall in enumerate(round_seconds):
        if round == 0:
            continue
        messages = [t for t in timings if t["type"] == "train" and t["group"] == str(round)]
        if not messages:
            continue
        for t in messages:
            fresh = t["start"] == first[t["pid"]]
            t["import_s"] = t["imported"] - t["process_started"] if fresh else 0.0
            t["to_handle_s"] = t["start"] - t["imported"] if fresh else 0.0
        slowest = max(messages, key=lambda t: t["end"] - t["start"] + t["import_s"] + t["to_handle_s"])
        span = slowest["end"] - slowest["start"] + slowest["import_s"] + slowest["to_handle_s"]
        rows.append({"round": round, "server_round_s": wall, "messages": len(messages),
                     "fresh_processes": sum(t["import_s"] > 0 for t in messages),
                     "process_start_to_imported_s": slowest["import_s"],
                     "imported_to_handle_s": slowest["to_handle_s"],
                     "handle_s": slowest["end"] - slowest["start"], "rest_s": wall - span})
    return {"per_round": rows}


def deployment(config, rounds: int, work: Path, training_clients: int = TRAINING_CLIENTS, nodes: int = 2,
               isolation: str = "process", poll_s: float | None = None, database: str | None = None) -> dict:
    """One ``flwr run`` of ``config`` (``rounds`` timed rounds after a warm-up round) on a fresh SuperLink and
    ``nodes`` SuperNodes (``privfl flower supernode --isolation ISOLATION --poll-s POLL_S``, the launcher's default
    poll when None), each holding ``training_clients / nodes`` of the federation's training clients; the node
    directories under ``work`` persist across calls, so the data is built once (every call with one ``work`` must
    use one federation). ``database``: the SuperLink's state, a fresh SQLite file in the run's directory when None
    (as ``privfl flower superlink`` keeps it), or ``:memory:``."""
    from privfl.engines.flower import launch, supervisor

    run_dir = Path(tempfile.mkdtemp(prefix="privfl-flower-deploy-", dir=work))
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    certs = work / "certs"
    if not certs.exists():
        launch.generate_certificates(certs, nodes=nodes)
    timings = run_dir / "timings"
    timings.mkdir()
    env = {**launch.flower_env(certs), "OMP_NUM_THREADS": "1", "FLWR_HOME": str(run_dir / "flwr-home"),
           "PRIVFL_BENCH_TIMINGS": str(timings)}
    app_dir = _timed_app(run_dir / "app")
    address = f"127.0.0.1:{supervisor.free_port()}"
    command = [sys.executable, "-m", "privfl.engines.flower.launch"]
    log = open(run_dir / "flower.log", "w")
    processes: list[subprocess.Popen] = []
    out = run_dir / "run"
    share = training_clients // nodes
    started = time.perf_counter()
    try:
        processes.append(subprocess.Popen(command + ["superlink", "--certs", str(certs), "--address", address,
                                                     "--database", database or str(run_dir / "superlink.db")],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        register = command + ["register", "--certs", str(certs), "--superlink", address]
        register += [str(i) for i in range(nodes)]
        deadline = time.monotonic() + 300
        while subprocess.run(register, env=env, capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the SuperLink did not accept registrations within 300 s: "
                                   + (run_dir / "flower.log").read_text()[-3000:])
            time.sleep(1)
        for node in range(nodes):
            processes.append(subprocess.Popen(
                command + ["supernode", "--certs", str(certs), "--superlink", address, "--node", str(node),
                           "--partition-range", f"{node * share}-{(node + 1) * share - 1}",
                           "--num-partitions", str(training_clients), "--node-dir", str(work / f"node-{node}"),
                           "--port", str(supervisor.free_port()), "--isolation", isolation,
                           *([] if poll_s is None else ["--poll-s", str(poll_s)])],
                env=env, stdout=log, stderr=subprocess.STDOUT))
        launch.write_connection(env, address, certs)
        flwr_run = launch.run_command(str(run_dir / "config.json"), str(out), timeout_s=900)
        flwr_run[flwr_run.index(str(launch.APP_DIR))] = str(app_dir)
        submitted = subprocess.run(flwr_run, env=env, capture_output=True, text=True)
        if submitted.returncode != 0:
            raise RuntimeError(submitted.stdout + submitted.stderr)
        deadline = time.monotonic() + 1800
        while not (out / "summary.json").exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise RuntimeError((run_dir / "flower.log").read_text()[-3000:])
            time.sleep(1)
    finally:
        supervisor.end_processes(processes)
        log.close()
    total = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())["flower"]
    handled = [json.loads(line) for f in timings.glob("*.jsonl") for line in f.read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"seconds": sum(summary["round_seconds"][1:]), "warm_up_round_s": summary["round_seconds"][0],
            "connect_s": summary["connect_s"], "total_with_startup_s": total, "nodes": summary["nodes"],
            "clients_per_node": summary["clients_per_node_max"],
            "breakdown": _deployment_breakdown(handled, summary["round_seconds"])}


# -- the experiment -------------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-round", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--engines", nargs="+", default=["inprocess", "simulation", "deployment"],
                        choices=["inprocess", "simulation", "deployment", "deployment_subprocess"],
                        help="deployment: SuperNodes in process isolation with one long-lived ClientApp process each "
                             "(privfl's default); deployment_subprocess: Flower's default, a ClientApp process per "
                             "message")
    parser.add_argument("--clients-per-node", nargs="+", default=["default", "1", "10"],
                        help="simulation: clients per virtual SuperNode, one simulation engine per value: 'default' "
                             "(chosen by the run, reported as simulation) or K (reported as simulation_kK)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=str(RESULTS.relative_to(ROOT)),
                        help="results file, relative to the repository (default %(default)s)")
    args = parser.parse_args()
    if "inprocess" not in args.engines:
        parser.error("--engines must include inprocess (the ratios' denominator)")
    return args


def _run_engine(engine: str, config, args: argparse.Namespace, grouped: dict[str, int | None], work: Path) -> dict:
    """One timed run of ``config`` on ``engine`` (``grouped``: the simulation engines and their clients per node)."""
    if engine == "inprocess":
        return in_process(config, args.rounds)
    if engine in grouped:
        return simulation(config, args.rounds, args.actors, clients_per_node=grouped[engine])
    before = engine == "deployment_subprocess"     # Flower's own: a process per message, 3 s
    return deployment(config, args.rounds, work, isolation="subprocess" if before else "process",
                      poll_s=3 if before else None)


def _measure(args: argparse.Namespace, engines: list[str], grouped: dict[str, int | None]) -> tuple[dict, dict]:
    """Every engine ``args.repeats`` times per clients-per-round setting, interleaved in a rotating order (each run
    printed as it ends), and, with ``--profile``, one profiled simulation run per setting: ``(runs, profiles)``."""
    work = Path(tempfile.mkdtemp(prefix="privfl-flower-bench-"))
    runs: dict[int, dict[str, list[dict]]] = {n: {e: [] for e in engines} for n in args.per_round}
    try:
        for repeat in range(args.repeats):
            for per_round in args.per_round:
                order = engines[repeat % len(engines):] + engines[:repeat % len(engines)]
                for engine in order:
                    result = _run_engine(engine, run_config(per_round, args.rounds), args, grouped, work)
                    runs[per_round][engine].append(result)
                    print(json.dumps({"repeat": repeat, "clients_per_round": per_round, "engine": engine,
                                      **{k: v for k, v in result.items() if not k.endswith("profile")}}), flush=True)
        profiles = {(n, e): simulation(run_config(n, args.rounds), args.rounds, args.actors, profile=True,
                                       clients_per_node=k)
                    for n in args.per_round for e, k in grouped.items()} \
            if args.profile and "simulation" in args.engines else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs, profiles


def _setting(args: argparse.Namespace) -> str:
    return (f"FedAvg, MNIST 2NN, 20 local steps x batch 64, 200 clients (100 training), {args.rounds} "
            f"timed rounds after 1 warm-up, torch threads 1, Ray actors {args.actors}, simulation with "
            f"{' and '.join(map(str, args.clients_per_node))} clients per virtual node, "
            f"{args.repeats} interleaved repeats per engine; deployment: 2 SuperNodes x 50 clients, "
            "process isolation with a long-lived ClientApp process per SuperNode and a 0.25 s idle "
            "poll (deployment) or a ClientApp process per message and Flower's 3 s poll "
            "(deployment_subprocess)")


def _row(per_round: int, measured: dict[str, list[dict]], grouped: dict[str, int | None], profiles: dict) -> dict:
    """The results of one clients-per-round setting: each engine's seconds, medians and ratios to in-process, and
    what its runs report beside (simulation: nodes and client handling; deployment: warm-up round and breakdown)."""
    base = [r["seconds"] for r in measured["inprocess"]]
    row: dict = {"clients_per_round": per_round, "in_process_s": base, "in_process_median_s": _median(base)}
    for engine in [*grouped, "deployment", "deployment_subprocess"]:
        if engine not in measured:
            row[f"{engine}_note"] = "not measured in this invocation (--engines)"
            continue
        seconds = [r["seconds"] for r in measured[engine]]
        row[f"{engine}_s"] = seconds
        row[f"{engine}_median_s"] = _median(seconds)
        row[f"{engine}_ratio_of_medians"] = _median(seconds) / _median(base)
        row[f"{engine}_ratio_per_repeat"] = [s / b for s, b in zip(seconds, base)]
        row[f"{engine}_total_with_startup_s"] = [r["total_with_startup_s"] for r in measured[engine]]
        row[f"{engine}_connect_s"] = [r["connect_s"] for r in measured[engine]]
        if engine in grouped:
            sims = measured[engine]
            row[f"{engine}_nodes"] = sims[0]["nodes"]
            row[f"{engine}_clients_per_node"] = sims[0]["clients_per_node"]
            row[f"{engine}_client_handle_s"] = [r["client_handle_s"] for r in sims]
            row[f"{engine}_client_messages"] = sims[0]["client_messages"]
            row[f"{engine}_outside_client_s"] = [r["seconds"] - r["client_handle_s"] for r in sims]
        if (per_round, engine) in profiles:
            row[f"{engine}_server_profile"] = profiles[per_round, engine]["server_profile"]
            row[f"{engine}_client_profile"] = profiles[per_round, engine].get("client_profile", "")
    for engine in ("deployment", "deployment_subprocess"):
        if engine in measured:
            row[f"{engine}_warm_up_round_s"] = [r["warm_up_round_s"] for r in measured[engine]]
            row[f"{engine}_breakdown"] = [r["breakdown"]["per_round"] for r in measured[engine]]
    return row


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(1)
    grouped = {("simulation" if k == "default" else f"simulation_k{int(k)}"): (None if k == "default" else int(k))
               for k in args.clients_per_node}
    engines = [e for engine in args.engines for e in (grouped if engine == "simulation" else [engine])]
    runs, profiles = _measure(args, engines, grouped)
    from privfl.provenance import numerics
    results = {"setting": _setting(args),
               "command": "nice python benchmarks/flower_overhead.py " + " ".join(sys.argv[1:]),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs)",
               "runs": [_row(per_round, runs[per_round], grouped, profiles) for per_round in args.per_round],
               "numerics": numerics()}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps([{k: v for k, v in r.items() if not k.endswith("profile")} for r in results["runs"]], indent=1))


if __name__ == "__main__":
    main()
