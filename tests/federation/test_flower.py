"""privfl on Flower: record conversion, the simulation engine against the in-process runtime, a node's ledger across a
restart, and the deployment engine (SuperLink + SuperNodes with TLS and node authentication) on loopback."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402

from accounting import PrivacyLedger  # noqa: E402
from privfl.data import build_federation  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402
from privfl.experiment import RunConfig, build_runtime, train  # noqa: E402
from privfl.federation import Message, RunDirectory  # noqa: E402
from privfl.federation.flower import FlowerOptions, from_records, to_records  # noqa: E402
from privfl.federation.flower import client_app, launch  # noqa: E402
from privfl.federation.flower.records import records_to_state, state_to_records  # noqa: E402
from privfl.methods import METHODS  # noqa: E402

# -- records ---------------------------------------------------------------------------------------------------------


def test_records_round_trip_keeps_values_dtypes_and_shapes():
    arrays = {"w": torch.randn(3, 4), "w64": torch.randn(2, dtype=torch.float64),
              "steps": torch.tensor(7, dtype=torch.int64), "mask": torch.tensor([True, False]),
              "bytes": torch.arange(5, dtype=torch.uint8), "half": torch.randn(3, dtype=torch.float16),
              "transposed": torch.randn(2, 3).t(), "empty": torch.zeros(0, 4)}
    message = Message(arrays=arrays, metrics={"loss": 0.25, "num_examples": 12.0, "count": 3},
                      config={"lr": 0.1, "local_steps": 20, "name": "x", "flag": True})
    back, header = from_records(to_records(message, {"op": "train", "round": 4, "keep": "1,3"}))
    assert header == {"op": "train", "round": 4, "keep": "1,3"}
    assert list(back.arrays) == list(arrays)
    for name, tensor in arrays.items():
        assert back.arrays[name].dtype == tensor.dtype and back.arrays[name].shape == tensor.shape, name
        assert torch.equal(back.arrays[name], tensor), name
    assert back.metrics == message.metrics and type(back.metrics["count"]) is int
    assert back.config == message.config and type(back.config["local_steps"]) is int
    assert back.num_bytes() == message.num_bytes()

    state = {"c_i.w": torch.randn(2, 2), "calls": 3}
    assert records_to_state(*state_to_records(state))["calls"] == 3
    assert torch.equal(records_to_state(*state_to_records(state))["c_i.w"], state["c_i.w"])


def test_records_refuse_values_flower_cannot_carry():
    with pytest.raises(ConfigError, match="grad_clip=None"):
        to_records(Message(config={"grad_clip": None}))


def test_flower_options_validate_their_values():
    with pytest.raises(ConfigError, match="max_actors must be .* got 0"):
        FlowerOptions(max_actors=0)
    assert FlowerOptions(max_actors=2, cpus_per_client=1).backend_config()["init_args"]["num_cpus"] == 2


# -- simulation engine == in-process runtime --------------------------------------------------------------------------

_SETTINGS = {
    "fedavg": {"lr": 0.1, "local_steps": 3, "batch_size": 16},
    "scaffold": {"lr": 0.1, "local_steps": 3, "batch_size": 16},
    # three stages per round; the novel clients release a DP descriptor (finite epsilon on both engines)
    "odpflhn": {"lr": 0.05, "local_steps": 2, "batch_size": 16, "encoder_hidden": 8, "hn_hidden": 8,
                "hn_layers": 1, "novel_epsilon": 2.0, "novel_noise": "seeded"},
}


def _method(name):
    if name not in METHODS:
        return pytest.param(name, marks=pytest.mark.skip(reason=f"method {name!r} is not registered in this tree"))
    return name


def _run_config(spec, method, **overrides):
    values = dict(federation=spec, method=method, method_config=_SETTINGS[method], rounds=3, eval_every=1,
                  checkpoint_every=2, client_fraction=0.5, seed=3)
    values.update(overrides)
    return RunConfig(**values)


def _comparable(run_dir):
    run = RunDirectory(run_dir)
    ledger = json.loads(run.path("ledger.json").read_text())
    records = sorted((entry["client_id"], [(r["purpose"], r["round"], r["event"], r["metadata"]) for r in entry["records"]])
                     for entry in ledger["ledgers"])
    strategy = torch.load(run.path("checkpoint.pt"), weights_only=True)["runtime"]["strategy"]
    return run.read_metrics(), run.read_clients(), records, strategy


def _equal_states(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("method", [_method("fedavg"), _method("scaffold"), _method("odpflhn")])
def test_flower_simulation_gives_the_in_process_numbers(tmp_path, make_spec, method):
    config = _run_config(make_spec(), method)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                    # the Flower client processes compute with one thread too
    try:
        expected = train(config, str(tmp_path / "inprocess"), progress=False)
        got = train(config, str(tmp_path / "flower"), progress=False, engine="flower-sim",
                    flower_options=FlowerOptions(max_actors=1, threads=1))
    finally:
        torch.set_num_threads(threads)
    for key in ("novel", "training_val", "selected_round", "rounds_completed", "privacy", "communication"):
        assert json.dumps(got[key], sort_keys=True) == json.dumps(expected[key], sort_keys=True), key
    metrics, clients, ledgers, strategy = _comparable(tmp_path / "flower")
    metrics_in, clients_in, ledgers_in, strategy_in = _comparable(tmp_path / "inprocess")
    assert metrics == metrics_in and clients == clients_in and ledgers == ledgers_in
    assert _equal_states(strategy, strategy_in)
    # the nodes, not the server, hold the ledgers: one file per client that released something
    node_ledgers = sorted((tmp_path / "flower" / "nodes").glob("partition-*/ledger-client-*.json"))
    assert len(node_ledgers) == len(ledgers)
    if method == "odpflhn":
        assert 0 < got["privacy"]["epsilon_max_novel"] < math.inf


# -- a node's ledger survives a restart ---------------------------------------------------------------------------------


def _node_context(config, node_dir, partition, count):
    return Context(run_id=1, node_id=100 + partition, state=RecordDict(),
                   node_config={"partition-id": partition, "num-partitions": count, "privfl-dir": str(node_dir)},
                   run_config={"privfl-config": json.dumps(config.to_dict()), "threads": 0})


def _train_message(message, round, completed):
    header = {"op": "train", "round": round, "stage": 0, "completed_rounds": completed}
    return FlowerMessage(to_records(message, header), 100, "train")


@pytest.fixture
def task_identity(monkeypatch):
    """The identity Flower gives a process that runs a task (messages cannot be made without one)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)


def test_a_node_that_restarts_keeps_its_ledger_and_epsilon_keeps_growing(tmp_path, make_spec, task_identity):
    # FedAvg with DP-SGD: every round's update is a DP release, so epsilon is finite and grows round by round.
    config = RunConfig(federation=make_spec(), method="fedavg", rounds=2, seed=3,
                       method_config={"lr": 0.1, "local_steps": 2, "batch_size": 16, "dp_noise_multiplier": 1.5})
    reference = build_runtime(config, build_federation(config.federation, seed=config.seed))
    client_id = sorted(reference.clients)[0]          # partition 0 holds the first training client
    node_dir = tmp_path / "node-0"
    strategy = reference.strategy

    context = _node_context(config, node_dir, 0, len(reference.clients))
    reply = client_app.app(_train_message(strategy.configure_train(0, [client_id])[client_id], 0, 0), context)
    assert not reply.has_error() and from_records(reply.content)[1]["kind"] == "release"
    after_one = PrivacyLedger.load(node_dir / f"ledger-client-{client_id}.json")
    assert len(after_one) == 1

    client_app._PARTS.clear()                  # the node process restarts: nothing in memory, an empty Flower state
    client_app._PROCEDURES.clear()
    client_app._FEDERATIONS.clear()
    context = _node_context(config, node_dir, 0, len(reference.clients))
    reply = client_app.app(_train_message(strategy.configure_train(1, [client_id])[client_id], 1, 1), context)
    assert not reply.has_error()
    after_two = PrivacyLedger.load(node_dir / f"ledger-client-{client_id}.json")

    # The same two rounds in the in-process runtime (every client trains each round) record the same events.
    for round in range(2):
        reference.run_round(round)
    expected = reference.wire.ledgers[client_id]
    assert [r.round for r in after_two.records] == [0, 1]
    assert after_two.events == expected.events
    assert after_two.spent(1e-5).epsilon == expected.spent(1e-5).epsilon
    assert after_two.spent(1e-5).epsilon > after_one.spent(1e-5).epsilon > 0


# -- deployment engine on loopback: SuperLink + two SuperNodes, TLS and node authentication ---------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Flower's SuperExec, ServerApp and ClientApp processes), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _end(processes: list[subprocess.Popen]) -> None:
    """End every started process and what it started, by process id."""
    for process in processes:
        below = _descendants(process.pid) if Path("/proc").exists() else []
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process clean-up reads /proc")
def test_deployment_engine_on_loopback_with_tls_and_node_auth_gives_the_in_process_numbers(tmp_path, make_spec):
    # One training client and one novel client: one round, then the novel node is served through the Grid.
    config = RunConfig(federation=make_spec(num_clients=2, novel_fraction=0.5), method="fedavg", rounds=1,
                       method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16}, select="last", seed=3)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    certs = launch.generate_certificates(tmp_path / "certs", nodes=2)
    env = {**launch.flower_env(certs), "OMP_NUM_THREADS": "1", "FLWR_HOME": str(tmp_path / "flwr-home")}
    address = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "privfl.federation.flower.launch"]
    log = open(tmp_path / "flower.log", "w")
    processes: list[subprocess.Popen] = []
    try:
        processes.append(subprocess.Popen(command + ["superlink", "--certs", str(certs), "--address", address],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        register = command + ["register", "--certs", str(certs), "--superlink", address, "0", "1"]
        deadline = time.monotonic() + 60
        while subprocess.run(register, env=env, capture_output=True).returncode != 0:   # until the link listens
            assert time.monotonic() < deadline, "the SuperLink did not accept registrations within 60 s"
            time.sleep(1)
        for node in range(2):
            processes.append(subprocess.Popen(
                command + ["supernode", "--certs", str(certs), "--superlink", address, "--node", str(node),
                           "--partition-id", str(node), "--num-partitions", "2",
                           "--node-dir", str(tmp_path / f"node-{node}"), "--port", str(_free_port())],
                env=env, stdout=log, stderr=subprocess.STDOUT))
        out = tmp_path / "run"
        started = subprocess.run(command + ["run", "--certs", str(certs), "--superlink", address, "--config",
                                            str(tmp_path / "config.json"), "--out", str(out), "--timeout-s", "300"],
                                 env=env, capture_output=True, text=True)
        assert started.returncode == 0, started.stdout + started.stderr
        deadline = time.monotonic() + 360
        while not (out / "summary.json").exists():
            assert time.monotonic() < deadline, (tmp_path / "flower.log").read_text()[-3000:]
            assert all(p.poll() is None for p in processes), (tmp_path / "flower.log").read_text()[-3000:]
            time.sleep(1)
    finally:
        _end(processes)
        log.close()
    got = json.loads((out / "summary.json").read_text())
    train(config, str(tmp_path / "inprocess"), progress=False)
    expected = RunDirectory(tmp_path / "inprocess").read_json("summary.json")
    for key in ("novel", "training_val", "selected_round", "privacy", "communication"):
        assert got[key] == expected[key], key
    assert got["novel"]["num_clients"] == 1
    # the training client's node recorded its releases (model update) in its own directory
    ledger = PrivacyLedger.load(next((tmp_path / "node-0").glob("ledger-client-*.json")))
    assert [r.purpose for r in ledger.records] == ["model_update"]
    assert not any((tmp_path / "node-1").glob("ledger-client-*.json"))   # FedAvg's novel client sends nothing
