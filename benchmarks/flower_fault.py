"""A deployment run that loses a SuperNode: time lost against an uninterrupted run, and the same final numbers.

Two deployment sessions of the same config on loopback (a SuperLink and 2 SuperNodes with TLS and node
authentication, ``privfl flower`` commands as the Flower README gives them), each on fresh node directories:

* uninterrupted: ``privfl flower run --config ... --out RUN`` to its end;
* interrupted: the same, but once SuperNode 1 has recorded a release of round ``--kill-round`` (0-based), its whole
  process tree is killed with SIGKILL; ``privfl flower run`` exits 1 when the SuperLink declares the node offline
  (Flower 1.41: two missed 30 s heartbeats); the node is started again on its key and node directory (``supernode``
  retries while the SuperLink refuses it), and ``privfl flower run --resume RUN`` continues from the last checkpoint
  (every round here) to the end.

Timed: from the first ``privfl flower run`` to the end of the last one (the SuperLink's and SuperNodes' first start
is outside both, and the same for both); time lost = interrupted minus uninterrupted, with its parts: kill to the
failed run's exit (detection), that exit to the resumed run's start (restarting the node: immediate here, as an
operator's script would do it), and the resumed run. The final numbers must be equal: every metrics row, the
summary's training validation, and the final server weights (``checkpoint.pt``), bit for bit. Each run's connect
time and round times (of the resumed attempt, for the interrupted run) and the machine's 1-minute load average at its
end are recorded beside the totals, since one run of each is timed on a shared machine.

Setting: the MNIST protocol of ``flower_overhead.py`` (MNIST 2NN, 20 local SGD steps x batch 64, pathological 2
shards, 200 clients of which 100 train), 10 training clients per round, ``--rounds`` rounds, a checkpoint every
round, one evaluation at the end; each SuperNode holds 50 training clients (``partition-range``).

    nice python benchmarks/flower_fault.py [--rounds 4] [--kill-round 2]

Writes benchmarks/results/flower_fault.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "flower_fault.json"
TRAINING_CLIENTS, NODES = 100, 2
LAUNCH = [sys.executable, "-m", "privfl.engines.flower.launch"]


def run_config(rounds: int):
    from privfl.config import RunConfig
    from privfl.data import FederationSpec

    spec = FederationSpec(source="mnist", num_clients=2 * TRAINING_CLIENTS, partition="pathological",
                          shards_per_client=2, novel_fraction=0.5)
    return RunConfig(federation=spec, method="fedavg", model="mlp2nn", rounds=rounds, seed=0,
                     method_config={"lr": 0.1, "local_steps": 20, "batch_size": 64}, client_fraction=0.1,
                     select="last", eval_every=rounds, checkpoint_every=1)


class Session:
    """A SuperLink and the SuperNodes on loopback, started with the project's commands; every process it starts is
    ended by :meth:`close`."""

    def __init__(self, work: Path) -> None:
        from privfl.engines.flower import launch, supervisor

        self.launch = launch
        self.supervisor = supervisor
        self.work = work
        self.certs = launch.generate_certificates(work / "certs", nodes=NODES)
        self.env = {**launch.flower_env(self.certs), "OMP_NUM_THREADS": "1", "FLWR_HOME": str(work / "flwr-home")}
        self.address = f"127.0.0.1:{supervisor.free_port()}"
        self.log = open(work / "flower.log", "w")
        self.processes: list[subprocess.Popen] = []
        self.nodes: dict[int, subprocess.Popen] = {}
        self._start(["superlink", "--certs", str(self.certs), "--address", self.address])
        registered = subprocess.run(LAUNCH + ["register", "--certs", str(self.certs), "--superlink", self.address,
                                              *map(str, range(NODES))], env=self.env, capture_output=True, text=True)
        if registered.returncode != 0:
            raise RuntimeError(registered.stdout + registered.stderr)
        for node in range(NODES):
            self.start_node(node)

    def _start(self, args: list[str]) -> subprocess.Popen:
        process = subprocess.Popen(LAUNCH + args, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def node_dir(self, node: int) -> Path:
        return self.work / f"node-{node}"

    def start_node(self, node: int) -> None:
        share = TRAINING_CLIENTS // NODES
        self.nodes[node] = self._start(
            ["supernode", "--certs", str(self.certs), "--superlink", self.address, "--node", str(node),
             "--partition-range", f"{node * share}-{(node + 1) * share - 1}", "--num-partitions",
             str(TRAINING_CLIENTS), "--node-dir", str(self.node_dir(node)), "--port", str(self.supervisor.free_port())])

    def kill_node(self, node: int) -> None:
        """SIGKILL the node's whole process tree (its supervisor, SuperNode, SuperExec and ClientApp processes)."""
        process = self.nodes.pop(node)
        for pid in [process.pid] + self.supervisor.descendants(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait(timeout=30)

    def flower_run(self, *how: str) -> subprocess.Popen:
        process = subprocess.Popen(LAUNCH + ["run", "--certs", str(self.certs), "--superlink", self.address, *how],
                                   env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.processes.append(process)
        return process

    def close(self) -> None:
        self.supervisor.end_processes(self.processes)
        self.log.close()

    def log_tail(self) -> str:
        return (self.work / "flower.log").read_text()[-3000:]


def _released_in(node_dir: Path, round: int) -> bool:
    """Whether a client of the node has recorded a model update of ``round`` in its ledger."""
    for path in node_dir.glob("ledger-client-*.json"):
        try:
            records = json.loads(path.read_text())["records"]
        except (OSError, ValueError, KeyError):
            continue                                    # being replaced (atomic write): look again
        if any(r["purpose"] == "model_update" and r["round"] == round for r in records):
            return True
    return False


def _finished(process: subprocess.Popen, timeout_s: float, session: Session) -> tuple[str, str]:
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"privfl flower run did not end within {timeout_s:g} s\n{session.log_tail()}") from None
    return stdout, stderr


def uninterrupted(work: Path, config_path: Path) -> dict:
    session = Session(work)
    out = work / "run"
    try:
        started = time.perf_counter()
        stdout, stderr = _finished(session.flower_run("--config", str(config_path), "--out", str(out)), 3600, session)
        total = time.perf_counter() - started
        if "completed" not in stdout:
            raise RuntimeError(stdout + stderr + session.log_tail())
    finally:
        session.close()
    return {"total_s": total, "run": out, **_attempt(out), "load_average_1min": os.getloadavg()[0]}


def interrupted(work: Path, config_path: Path, kill_round: int) -> dict:
    session = Session(work)
    out = work / "run"
    try:
        started = time.perf_counter()
        failing = session.flower_run("--config", str(config_path), "--out", str(out))
        while not _released_in(session.node_dir(1), kill_round):
            if failing.poll() is not None:
                raise RuntimeError("the run ended before the node was killed\n" + session.log_tail())
            time.sleep(0.1)
        killed = time.perf_counter()
        session.kill_node(1)
        stdout, failure = _finished(failing, 1800, session)
        failed = time.perf_counter()
        if failing.returncode != 1 or "--resume" not in failure:
            raise RuntimeError(f"the run with a killed node exited {failing.returncode}\n{stdout}{failure}")
        checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
        session.start_node(1)                              # the same key and node directory
        resumed_at = time.perf_counter()
        stdout, stderr = _finished(session.flower_run("--resume", str(out)), 3600, session)
        ended = time.perf_counter()
        if "completed" not in stdout:
            raise RuntimeError(stdout + stderr + session.log_tail())
    finally:
        session.close()
    return {"total_s": ended - started, "run": out, "killed_after_s": killed - started,
            "kill_to_failed_exit_s": failed - killed, "failed_exit_to_resume_s": resumed_at - failed,
            "resumed_run_s": ended - resumed_at,
            "failure": [_anonymous(line, work, session.address) for line in failure.splitlines()
                        if line.startswith("privfl flower")],
            "checkpoint_round_at_failure": int(checkpoint["runtime"]["completed_rounds"]),
            "resumed_attempt": _attempt(out), "load_average_1min": os.getloadavg()[0]}


def _attempt(run_dir: Path) -> dict:
    """What the summary of the run's last attempt says of it: connecting to the nodes, and each round's wall
    time (of the rounds that attempt ran)."""
    flower = json.loads((run_dir / "summary.json").read_text())["flower"]
    return {"connect_s": flower["connect_s"], "round_seconds": flower["round_seconds"]}


def _anonymous(text: str, work: Path, address: str) -> str:
    """``text`` without this machine's temporary directory and port."""
    return text.replace(str(work), "WORK").replace(address, "127.0.0.1:PORT")


def _model_updates(run_dir: Path) -> int:
    from accounting import LedgerBook

    book = LedgerBook.load(run_dir / "ledger.json")
    return sum(1 for ledger in book.values() for r in ledger.records if r.purpose == "model_update")


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def compare(a: Path, b: Path) -> dict:
    """Whether two run directories end with the same numbers: every metrics row (but its timing), the summary's training
    validation and selected round, and the final server state (weights), bit for bit."""
    from privfl.federation import RunDirectory
    from privfl.federation.timing import without_timing

    def server_state(run_dir: Path) -> dict:
        return torch.load(run_dir / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]

    summary_a, summary_b = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    metrics_a, metrics_b = (without_timing(RunDirectory(d).read_metrics()) for d in (a, b))
    return {"metrics_equal": metrics_a == metrics_b,
            "training_val_equal": summary_a["training_val"] == summary_b["training_val"],
            "selected_round_equal": summary_a["selected_round"] == summary_b["selected_round"],
            "server_state_equal": _equal(server_state(a), server_state(b)),
            "training_val_accuracy_mean": summary_a["training_val"]["accuracy_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kill-round", type=int, default=2,
                        help="kill SuperNode 1 once it has released in this round (0-based; < --rounds)")
    parser.add_argument("--out", default=str(RESULTS.relative_to(ROOT)),
                        help="results file, relative to the repository (default %(default)s)")
    args = parser.parse_args()
    if not 0 <= args.kill_round < args.rounds:
        parser.error(f"--kill-round must be in [0, {args.rounds - 1}], got {args.kill_round}")
    config = run_config(args.rounds)
    work = Path(tempfile.mkdtemp(prefix="privfl-flower-fault-"))
    try:
        config_path = work / "config.json"
        config_path.write_text(json.dumps(config.to_dict()))
        clean = uninterrupted(work / "uninterrupted", config_path)
        print(json.dumps({k: v for k, v in clean.items() if k != "run"}), flush=True)
        faulty = interrupted(work / "interrupted", config_path, args.kill_round)
        print(json.dumps({k: v for k, v in faulty.items() if k != "run"}, default=str), flush=True)
        same = compare(faulty["run"], clean["run"])
        updates = {"uninterrupted": _model_updates(clean["run"]), "interrupted": _model_updates(faulty["run"])}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from privfl.provenance import numerics
    results = {
        "setting": f"FedAvg, MNIST 2NN, 20 local steps x batch 64, 200 clients (100 training), 10 per round, "
                   f"{args.rounds} rounds, a checkpoint every round, evaluation at the end; deployment on loopback "
                   f"(TLS, node authentication), 2 SuperNodes x 50 training clients; SuperNode 1 killed (SIGKILL, "
                   f"its process tree) once it released in round {args.kill_round}, started again at once after "
                   "privfl flower run exited 1, then privfl flower run --resume",
        "command": "nice python benchmarks/flower_fault.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs)",
        "uninterrupted_total_s": clean["total_s"],
        "interrupted_total_s": faulty["total_s"],
        "time_lost_s": faulty["total_s"] - clean["total_s"],
        "ratio": faulty["total_s"] / clean["total_s"],
        "uninterrupted": {k: v for k, v in clean.items() if k not in ("run", "total_s")},
        "interrupted": {k: v for k, v in faulty.items() if k not in ("run", "total_s")},
        "model_update_releases": updates,
        "final_numbers": same,
        "numerics": numerics()}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=1))
    if not all(v for k, v in same.items() if k.endswith("_equal")):
        sys.exit("the resumed run's final numbers differ from the uninterrupted run's")


if __name__ == "__main__":
    main()
