"""privfl on Flower: record conversion and packing, the ServerApp against nodes in this process (a loopback Grid: node
discovery, time limits, nodes holding several clients), the simulation engine against the in-process runtime, serving
novel clients in a run of their own, a node's ledger and client state across a restart, and the deployment engine
(SuperLink + SuperNodes with TLS and node authentication) on loopback."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr")

from conftest import book_records, journal_records  # noqa: E402
from flower_loopback import LoopbackGrid  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402

from accounting import PrivacyLedger  # noqa: E402
from privfl.config import RunConfig  # noqa: E402
from privfl.data import build_federation  # noqa: E402
from privfl.engines.choice import flower_main, flower_runtime_factory  # noqa: E402
from privfl.engines.choice import run as run_on_engine  # noqa: E402
from privfl.engines.flower import (  # noqa: E402  # noqa: E402
    FlowerOptions,
    client_app,
    from_records,
    launch,
    server_app,
    supervisor,  # noqa: E402
    to_records,
)
from privfl.engines.flower import protocol as p  # noqa: E402
from privfl.engines.flower.records import pack, records_to_state, state_to_records, unpack  # noqa: E402
from privfl.engines.flower.simulation import num_clients  # noqa: E402
from privfl.engines.flower.transport import FlowerClientError  # noqa: E402
from privfl.errors import ConfigError, PublicConfigError  # noqa: E402
from privfl.experiment import build_runtime, train  # noqa: E402
from privfl.federation import Message, RunDirectory  # noqa: E402
from privfl.federation.context import client_context  # noqa: E402
from privfl.federation.timing import without_timing  # noqa: E402
from privfl.methods import METHODS  # noqa: E402
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy  # noqa: E402

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


def test_pack_stores_a_shared_message_once_and_gives_each_client_its_own_copy():
    shared = Message(arrays={"w": torch.arange(6.0).reshape(2, 3)}, config={"lr": 0.1})
    own = Message(arrays={"c": torch.ones(2, dtype=torch.float64)}, metrics={"n": 3})
    packed = pack({7: (shared, {"state_of": 2}), 3: (shared, {}), 5: (own, {"state_of": -1})}, {"op": "train"})
    assert sorted(k for k in packed if k.endswith(".metrics")) == ["m0.metrics", "m1.metrics"]  # 2 distinct messages
    # every tensor in one Flower array (one object to move, not one per tensor), the shared one stored once
    assert list(packed.array_records) == ["blob"] and len(packed["blob"]) == 1
    assert packed["blob"]["blob"].numpy().nbytes == 6 * 4 + 2 * 8
    header, items = unpack(packed)
    assert header == {"op": "train"} and sorted(items) == [3, 5, 7]
    assert items[7][1] == {"state_of": 2} and items[3][1] == {} and items[5][1] == {"state_of": -1}
    assert torch.equal(items[3][0].arrays["w"], shared.arrays["w"]) and items[3][0].config == {"lr": 0.1}
    assert items[5][0].arrays["c"].dtype == torch.float64 and items[5][0].metrics == {"n": 3}
    items[3][0].arrays["w"].add_(1.0)                     # a client that writes into its copy touches no other
    assert torch.equal(items[7][0].arrays["w"], shared.arrays["w"])
    with pytest.raises(ConfigError, match="reserved"):
        pack({1: (shared, {})}, {"op": "train", "clients": [1]})
    # dtypes and shapes travel: a 0-d tensor, an empty one, bool, int8, bfloat16
    odd = Message(arrays={"s": torch.tensor(2.5), "e": torch.empty(0, 3), "b": torch.tensor([True, False]),
                          "i": torch.tensor([-3, 7], dtype=torch.int8), "h": torch.tensor([1.5], dtype=torch.bfloat16)})
    back = unpack(pack({1: (odd, {}), 2: (Message(), {})}, {}))[1]
    assert list(back[1][0].arrays) == ["s", "e", "b", "i", "h"] and back[2][0].arrays == {}
    for name, tensor in odd.arrays.items():
        got = back[1][0].arrays[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name


def test_node_config_names_one_partition_or_a_range():
    assert p.node_partitions({"partition-id": 2, "num-partitions": 5}) == ([2], 5)
    assert p.node_partitions({"partition-range": "1-3", "num-partitions": 5}) == ([1, 2, 3], 5)
    with pytest.raises(ConfigError, match="partition-range='3-5'.*0 <= FIRST <= LAST < num-partitions"):
        p.node_partitions({"partition-range": "3-5", "num-partitions": 5})
    with pytest.raises(ConfigError, match="exactly one of partition-id .* and partition-range"):
        p.node_partitions({"partition-id": 0, "partition-range": "0-1", "num-partitions": 5})


def test_the_simulation_chooses_its_clients_per_node_from_the_clients_and_the_client_processes():
    # ceil(clients / (4 x actors)): about 4 virtual nodes per client process; one client per node under SecAgg+
    assert [p.auto_clients_per_node(n, 1) for n in (1, 4, 5, 12, 200)] == [1, 1, 2, 3, 50]
    assert [p.auto_clients_per_node(200, a) for a in (1, 2, 3, 8)] == [50, 25, 17, 7]
    assert p.auto_clients_per_node(200, 2, secure=True) == 1
    assert [p.simulated_nodes(n, p.auto_clients_per_node(n, 2)) for n in (7, 8, 200, 201)] == [7, 8, 8, 8]
    # the option: None chooses per run, deterministically; a given value is kept
    chosen = FlowerOptions(max_actors=2).for_clients(200)
    assert chosen.clients_per_node == 25 and chosen == FlowerOptions(max_actors=2).for_clients(200)
    assert FlowerOptions(max_actors=2, clients_per_node=7).for_clients(200).clients_per_node == 7
    assert FlowerOptions(max_actors=2).for_clients(200, secure=True).clients_per_node == 1
    with pytest.raises(ConfigError, match="num_clients >= 1 and actors >= 1"):
        p.auto_clients_per_node(0, 1)


def test_simulated_nodes_hold_consecutive_groups_of_clients():
    grouped = {"clients-per-node": 4, "num-clients": 10}
    assert p.simulated_nodes(10, 4) == 3 and p.simulated_nodes(8, 4) == 2 and p.simulated_nodes(10, 1) == 10
    assert [p.node_partitions({"partition-id": i, "num-partitions": 3}, grouped) for i in range(3)] == [
        ([0, 1, 2, 3], 10), ([4, 5, 6, 7], 10), ([8, 9], 10)]
    # one client per node, or a deployment node's range, ignore the grouping
    assert p.node_partitions({"partition-id": 7, "num-partitions": 10}, {}) == ([7], 10)
    assert p.node_partitions({"partition-range": "2-5", "num-partitions": 10}, grouped) == ([2, 3, 4, 5], 10)
    with pytest.raises(ConfigError, match="num-partitions=4 does not fit clients-per-node=4 and num-clients=10: "
                                          "there must be 3 nodes"):
        p.node_partitions({"partition-id": 0, "num-partitions": 4}, grouped)
    with pytest.raises(ConfigError, match="num-clients=None is invalid"):
        p.node_partitions({"partition-id": 0, "num-partitions": 3}, {"clients-per-node": 4})
    with pytest.raises(ConfigError, match=r"clients_per_node must be None \(chosen per run\) or an integer >= 1, "
                                          "got 0"):
        FlowerOptions(clients_per_node=0)


def test_the_wheel_ships_the_flower_app():
    # `privfl flower run` hands privfl/engines/flower/app/ to `flwr run`: a non-editable install needs its files.
    root = Path(__file__).resolve().parents[2]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["privfl.engines.flower"]
    package = root / "privfl" / "engines" / "flower"
    data_files = [f.relative_to(package).as_posix() for f in package.rglob("*")
                  if f.is_file() and f.suffix not in (".py", ".pyc")]
    assert "app/pyproject.toml" in data_files
    for name in data_files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
    assert launch.APP_DIR == package / "app"


def test_records_refuse_values_flower_cannot_carry():
    with pytest.raises(ConfigError, match="grad_clip=None"):
        to_records(Message(config={"grad_clip": None}))


def test_flower_options_validate_their_values():
    with pytest.raises(ConfigError, match="max_actors must be .* got 0"):
        FlowerOptions(max_actors=0)
    with pytest.raises(ConfigError, match="poll_max_s must be a number >= poll_min_s"):
        FlowerOptions(poll_min_s=0.5, poll_max_s=0.1)
    assert FlowerOptions(max_actors=2, cpus_per_client=1).backend_config()["init_args"]["num_cpus"] == 2
    # a dead node must end a run, not hang it: the default limit is finite, in the options and in the App's config
    assert FlowerOptions().timeout_s == p.DEFAULT_TIMEOUT_S < math.inf
    app_config = tomllib.loads((launch.APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app_config["timeout-s"] == p.DEFAULT_TIMEOUT_S
    assert server_app.options_from_run_config(app_config).timeout_s == p.DEFAULT_TIMEOUT_S
    with pytest.raises(ConfigError, match="timeout-s=0 must be > 0 seconds"):
        server_app.options_from_run_config({"timeout-s": 0})


# -- the ServerApp against nodes in this process --------------------------------------------------------------------


def _loopback(config, tmp_path, ranges, *, num_partitions=None, silent=(), text=None):
    """Nodes 100, 101, ... (started as ``--node`` 0, 1, ...) holding the partition ranges ``ranges`` (inclusive
    pairs)."""
    federation = build_federation(config.federation, seed=config.seed)
    total = num_partitions or len(federation.training_clients) + len(federation.novel_clients)
    nodes = {100 + i: {"partition-range": f"{a}-{b}", "num-partitions": total, "privfl-dir": str(tmp_path / f"n{i}"),
                       "privfl-node": i} for i, (a, b) in enumerate(ranges)}
    grid = LoopbackGrid(nodes, {"privfl-config": text or json.dumps(config.to_dict())}, silent=silent)
    return grid, federation


def _serve_config(config, out):
    return {"privfl-config": json.dumps(config.to_dict()), "out": str(out)}


def test_nodes_holding_several_clients_give_the_in_process_numbers(tmp_path, make_spec, task_identity):
    # SCAFFOLD keeps control variates on the clients; best_val evaluates the selected round's pinned states.
    config = _run_config(make_spec(), "scaffold")
    training = len(build_federation(config.federation, seed=config.seed).training_clients)     # 9, and 3 novel
    grid, _ = _loopback(config, tmp_path, [(0, 4), (5, 11)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = train(config, str(tmp_path / "inprocess"), progress=False)
        got = flower_main(grid, _serve_config(config, tmp_path / "flower"),
                                    options=FlowerOptions(timeout_s=60, node_wait_s=5))
    finally:
        torch.set_num_threads(threads)
    for key in ("novel", "training_val", "selected_round", "rounds_completed", "privacy", "communication"):
        assert json.dumps(got[key], sort_keys=True) == json.dumps(expected[key], sort_keys=True), key
    assert _comparable(tmp_path / "flower")[:3] == _comparable(tmp_path / "inprocess")[:3]
    assert _equal_states(_comparable(tmp_path / "flower")[3], _comparable(tmp_path / "inprocess")[3])
    assert got["flower"]["nodes"] == 2 and got["flower"]["clients_per_node_max"] == 7
    assert len(got["flower"]["round_seconds"]) == config.rounds and got["flower"]["novel_not_served"] == []
    # what reached the server without a ledger record, counted: the final scores of the 9 training clients (the
    # best_val evaluations during training are releases) and of the 3 novel clients, and the ledgers
    outside = got["flower"]["outside_ledger"]
    assert outside["evaluate"]["replies"] == training and outside["novel_model"]["replies"] == 3
    assert outside["ledger"]["replies"] >= training + 3 and "batch_size / n" in outside["ledger"]["carries"]
    # one Flower message per node and exchange, whatever the number of clients it holds
    assert sum(kind == "train" for _, kind in grid.sent) <= 2 * config.rounds
    assert sum(kind == "evaluate" for _, kind in grid.sent) == 2 * (config.rounds + 1)
    # the clients' states are on the nodes' disks, tensors only: SCAFFOLD's control variates of the last round
    states = sorted((tmp_path / "n0").glob("state-client-*.pt")) + sorted((tmp_path / "n1").glob("state-client-*.pt"))
    assert 0 < len(states) <= training
    saved = torch.load(states[0], weights_only=True)
    assert saved["committed_round"] >= 0 and saved["committed"]
    assert all(isinstance(v, torch.Tensor) for v in saved["committed"].values())


def test_the_server_waits_only_for_the_nodes_the_run_needs(tmp_path, make_spec, task_identity):
    settings = {"lr": 0.1, "local_steps": 2, "batch_size": 16}
    config = RunConfig(federation=make_spec(), method="fedavg", method_config=settings, rounds=1, select="last", seed=3)
    federation = build_federation(config.federation, seed=config.seed)
    training, novel = len(federation.training_clients), [c.client_id for c in federation.novel_clients]
    patient = FlowerOptions(node_wait_s=120, timeout_s=60)

    # Nodes started with num-partitions = training clients: no novel client is in this deployment. The run does not
    # wait for novel nodes, and its summary (and a warning) says which novel clients were not served and why.
    grid, _ = _loopback(config, tmp_path / "a", [(0, training - 1)], num_partitions=training)
    started = time.monotonic()
    with pytest.warns(UserWarning, match=f"{len(novel)} novel clients will not be served"):
        summary = flower_main(grid, _serve_config(config, tmp_path / "a" / "run"), options=patient)
    assert time.monotonic() - started < 60
    assert summary["flower"]["novel_not_served"] == novel and summary["novel"]["num_clients"] == 0
    assert f"num-partitions={training}" in summary["flower"]["novel_not_served_reason"]
    assert json.loads((tmp_path / "a" / "run" / "summary.json").read_text())["flower"]["novel_not_served"] == novel

    # A method that serves no novel clients does not wait for their nodes, even when the nodes declare them.
    local = RunConfig(federation=make_spec(), method="local", method_config=settings, rounds=1, select="last", seed=3)
    grid, _ = _loopback(local, tmp_path / "b", [(0, training - 1)], num_partitions=training + len(novel))
    started = time.monotonic()
    summary = flower_main(grid, _serve_config(local, tmp_path / "b" / "run"), options=patient)
    assert time.monotonic() - started < 60 and summary["flower"]["novel_not_served"] == []

    # The nodes declare novel partitions but one novel node never connects: the run stops, naming it.
    grid, _ = _loopback(config, tmp_path / "c", [(0, training + len(novel) - 2)])
    missing = rf"clients \[{novel[-1]}\] \(partitions \[{training + len(novel) - 1}\] of {training + len(novel)}\)"
    with pytest.raises(FlowerClientError, match=missing):
        flower_main(grid, _serve_config(config, tmp_path / "c" / "run"),
                              options=FlowerOptions(node_wait_s=0.5, timeout_s=60))


def test_a_node_that_does_not_answer_is_named_when_the_exchange_times_out(tmp_path, make_spec, task_identity):
    config = _run_config(make_spec(), "fedavg", rounds=1, client_fraction=1.0)
    grid, federation = _loopback(config, tmp_path, [(0, 4), (5, 11)], silent={101})
    held = sorted(c.client_id for c in federation.training_clients[5:] + federation.novel_clients)
    started = time.monotonic()
    with pytest.raises(FlowerClientError, match=rf"1 of 2 nodes did not answer 'train' within 0.5 s \(timeout-s\): "
                                                rf"SuperNode --node 1 \(partitions 5-11, clients "
                                                rf"\[{', '.join(map(str, held))}\]\); is a SuperNode down\?"):
        flower_main(grid, _serve_config(config, tmp_path / "run"),
                              options=FlowerOptions(timeout_s=0.5, node_wait_s=5))
    assert time.monotonic() - started < 30


def test_a_run_that_stops_early_leaves_its_release_journal_and_ledger(tmp_path, make_spec, task_identity):
    # Node 101 answers the hello and then nothing: the first train exchange times out. Node 100's replies arrived
    # before that; their releases are in the run's releases.jsonl and ledger.json, tagged with the run's id.
    config = _run_config(make_spec(), "fedavg", rounds=1, client_fraction=1.0)
    grid, federation = _loopback(config, tmp_path, [(0, 4), (5, 11)], silent={101})
    answered = sorted(c.client_id for c in federation.training_clients[:5])
    with pytest.raises(FlowerClientError, match="did not answer 'train'"):
        flower_main(grid, _serve_config(config, tmp_path / "run"), options=FlowerOptions(timeout_s=0.5, node_wait_s=5))
    run = RunDirectory(tmp_path / "run")
    assert not run.path("summary.json").exists()
    journal = journal_records(run.path("releases.jsonl"))
    assert sorted(cid for cid, _ in journal) == answered
    assert {record["purpose"] for _, record in journal} == {"model_update"}
    assert sorted(book_records(run.path("ledger.json"))) == answered
    (run_id,) = _run_ids(tmp_path / "run")
    assert len(run_id) == 12 and {record["metadata"]["run"] for _, record in journal} == {run_id}
    # the same records as on the nodes
    for cid in answered:
        on_node = PrivacyLedger.load(tmp_path / "n0" / f"ledger-client-{cid}.json")
        assert [r.to_dict() for r in on_node.records] == [record for c, record in journal if c == cid]


def test_a_node_failure_does_not_lose_the_releases_that_arrived_with_it(tmp_path, make_spec, task_identity,
                                                                         monkeypatch):
    # Node 100's clients fail in train; node 101's replies come back in the same pull, after node 100's error. The
    # exchange stops, naming node 100 and its clients, but node 101's releases (made, recorded on its node) are
    # journaled first.
    config = _run_config(make_spec(), "fedavg", rounds=1, client_fraction=1.0)
    grid, federation = _loopback(config, tmp_path, [(0, 4), (5, 11)])
    doomed = {c.client_id for c in federation.training_clients[:5]}
    survivors = sorted(c.client_id for c in federation.training_clients[5:])
    procedure = type(build_runtime(config, federation).client)
    train_client = procedure.train

    def refuse(self, data, body, state, ctx):
        if data.client_id in doomed:
            raise PublicConfigError(f"client {data.client_id} refuses")
        return train_client(self, data, body, state, ctx)

    monkeypatch.setattr(procedure, "train", refuse)
    _restart_node()
    # named as its operator started it, in one line: its --node and partitions, not Flower's node id
    with pytest.raises(FlowerClientError, match=rf"^SuperNode --node 0 \(partitions 0-4, clients "
                                                rf"\[{', '.join(map(str, sorted(doomed)))}\]\) failed in 'train'"):
        flower_main(grid, _serve_config(config, tmp_path / "run"), options=FlowerOptions(timeout_s=60, node_wait_s=5))
    assert sorted(cid for cid, _ in journal_records(tmp_path / "run" / "releases.jsonl")) == survivors
    assert sorted(book_records(tmp_path / "run" / "ledger.json")) == survivors


def test_a_run_stopped_on_nodes_resumes_there_with_the_uninterrupted_numbers(tmp_path, make_spec, task_identity,
                                                                             monkeypatch):
    # SCAFFOLD keeps control variates on the nodes and best_val pins the selected round's states there: the resumed
    # run (a new Flower run, the same privfl run id) must find them and end with the in-process numbers. Before
    # that, resumes on a full disk (the run directory's, a node's) are refused before any round's message is sent.
    import shutil

    from privfl.errors import StorageError
    from privfl.experiment import RunInterrupted

    config = _run_config(make_spec(), "scaffold")
    options = FlowerOptions(timeout_s=60, node_wait_s=5)
    out = tmp_path / "flower"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = train(config, str(tmp_path / "inprocess"), progress=False)
        grid, _ = _loopback(config, tmp_path, [(0, 4), (5, 11)])
        with pytest.raises(RunInterrupted) as stopped:
            flower_main(grid, _serve_config(config, out), options=options, stop_after_round=1)
        # the interruption names the command that continues a deployment run, not privfl train's
        resume = f"continue the run with: privfl flower run --certs CERTS --superlink HOST:PORT --resume {out} "
        assert str(stopped.value).startswith(f"run interrupted after 1 of 3 rounds; {resume}"), str(stopped.value)
        # the in-process engine cannot continue it (the nodes hold its states and ledgers), and says so
        with pytest.raises(ConfigError, match="ran on Flower nodes.*in-process engine cannot continue it; continue "
                                              "the run with: privfl flower run --certs CERTS --superlink HOST:PORT "
                                              "--resume RUN_DIR"):
            train(None, str(out), resume=True, progress=False)
        # nor does a new run replace it by mistake
        with pytest.raises(ConfigError, match="already holds a run; continue the run with: privfl flower run "):
            flower_main(grid, _serve_config(config, out), options=options)
        records = {path: path.read_bytes() for path in [out / "releases.jsonl", *tmp_path.glob("n*/*")]}
        real = shutil.disk_usage
        for full, refused in [(out, rf"the disk holding {out} has 0.0 MiB free, but each checkpoint of this run"),
                              (tmp_path / "n1", r"SuperNode --node 1 \(partitions 5-11, clients \[[0-9, ]+\]\) has 0.0 "
                                                rf"MiB free in its node directory {tmp_path / 'n1'}, but")]:
            monkeypatch.setattr(shutil, "disk_usage", lambda path, full=full: real(path)._replace(free=4096)
                                if Path(path).is_relative_to(full) else real(path))
            _restart_node()
            grid, _ = _loopback(config, tmp_path, [(0, 4), (5, 11)])
            with pytest.raises(StorageError, match=refused + ".*this attempt released nothing"):
                flower_main(grid, {**_serve_config(config, out), "resume": True}, options=options)
            assert {kind for _, kind in grid.sent} == {"query.hello"}        # no round's message left the server
            assert {path: path.read_bytes() for path in records} == records   # nor did a node record a release
        monkeypatch.setattr(shutil, "disk_usage", real)
        _restart_node()
        grid, _ = _loopback(config, tmp_path, [(0, 4), (5, 11)])
        got = flower_main(grid, {**_serve_config(config, out), "resume": True}, options=options)
    finally:
        torch.set_num_threads(threads)
    for key in ("novel", "training_val", "selected_round", "rounds_completed", "privacy", "communication"):
        assert json.dumps(got[key], sort_keys=True) == json.dumps(expected[key], sort_keys=True), key
    assert _comparable(out)[:2] == _comparable(tmp_path / "inprocess")[:2]
    assert _equal_states(_comparable(out)[3], _comparable(tmp_path / "inprocess")[3])
    assert _run_ids(out) == {got["flower"]["lifetime"]["run_id"]}


def test_a_stopped_run_of_the_simulation_engine_says_it_cannot_be_continued_and_nothing_offers_privfl_train(
        tmp_path, make_spec):
    # privfl train --resume runs the in-process engine, which cannot continue a run whose clients' states and
    # ledgers are on Flower's nodes, and the simulation engine does not resume: every message says so
    from privfl.experiment import RunInterrupted

    config = _run_config(make_spec(), "fedavg", rounds=2, checkpoint_every=1)
    out = tmp_path / "sim"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(RunInterrupted) as stopped:
            run_on_engine(config, str(out), progress=False, engine="flower-sim", stop_after_round=1,
                          flower_options=FlowerOptions(max_actors=1, threads=1))
    finally:
        torch.set_num_threads(threads)
    cannot = "a run of Flower's simulation engine cannot be continued yet"
    assert str(stopped.value).startswith(f"run interrupted after 1 of 2 rounds; {cannot}"), str(stopped.value)
    assert "privfl train --resume" not in str(stopped.value) and "privfl flower run" not in str(stopped.value)
    with pytest.raises(ConfigError, match=f"ran on Flower nodes.*in-process engine cannot continue it; {cannot}"):
        train(None, str(out), resume=True, progress=False)
    with pytest.raises(ConfigError, match=f"--resume is not supported with --engine flower-sim yet: for a run of "
                                          f"the in-process engine in {out}, continue the run with: privfl train "
                                          f"--resume {out}; for one of the simulation engine, {cannot}"):
        run_on_engine(None, str(out), engine="flower-sim", resume=True)


def test_a_run_on_nodes_that_served_an_earlier_run_reports_its_spend_and_the_lifetime_apart(
        tmp_path, make_spec, task_identity, capsys):
    # The same node directories serve a non-private run, then a DP-SGD run. The node ledgers keep each client's
    # lifetime (epsilon inf since the first run); the DP run reports its own finite epsilons, as in-process, and the
    # lifetime beside them, naming the earlier run.
    from privfl.cli import main as privfl_main

    settings = {"lr": 0.1, "local_steps": 2, "batch_size": 16}
    plain = RunConfig(federation=make_spec(), method="fedavg", method_config=settings, rounds=1, select="last", seed=3)
    private = RunConfig(federation=make_spec(), method="fedavg", method_config=settings, rounds=2, select="last",
                        seed=3, privacy=TrainingPrivacy(mode="record", noise_multiplier=1.5))
    options = FlowerOptions(timeout_s=60, node_wait_s=5)
    grid, federation = _loopback(plain, tmp_path, [(0, 11)])
    first = flower_main(grid, _serve_config(plain, tmp_path / "first"), options=options)
    _restart_node()
    grid, _ = _loopback(private, tmp_path, [(0, 11)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        second = flower_main(grid, _serve_config(private, tmp_path / "second"), options=options)
        expected = train(private, str(tmp_path / "inprocess"), progress=False)
    finally:
        torch.set_num_threads(threads)
    training = [str(c.client_id) for c in federation.training_clients]
    assert first["privacy"]["epsilon_max_training"] == math.inf
    # this run's spend: the in-process run's epsilons, exactly
    assert second["privacy"]["epsilon_per_client"] == expected["privacy"]["epsilon_per_client"]
    assert 0 < second["privacy"]["epsilon_max_training"] < math.inf
    lifetime = second["flower"]["lifetime"]
    earlier = first["flower"]["lifetime"]["run_id"]
    assert lifetime["earlier_runs"] == [earlier] and lifetime["run_id"] != earlier
    assert all(lifetime["epsilon_per_client"][cid] == math.inf for cid in training)
    assert lifetime["earlier_runs_per_client"] == {cid: [earlier] for cid in training}
    # ledger.json holds this run's releases only; the node ledgers hold both runs'
    assert _run_ids(tmp_path / "second") == {lifetime["run_id"]}
    node_ledger = PrivacyLedger.load(tmp_path / "n0" / f"ledger-client-{training[0]}.json")
    assert [r.metadata["run"] for r in node_ledger.records] == [earlier] + [lifetime["run_id"]] * 2
    capsys.readouterr()
    assert privfl_main(["ledger", str(tmp_path / "second")]) == 0
    out = capsys.readouterr().out
    assert f"in run {lifetime['run_id']}" in out and f"earlier runs' ({earlier})" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == [training[0]])
    assert row[1] == "2" and float(row[2]) == pytest.approx(second["privacy"]["epsilon_per_client"][training[0]],
                                                            rel=1e-2) and row[3] == "inf"


def test_the_hello_compares_parsed_run_configs(tmp_path, make_spec, task_identity):
    config = _run_config(make_spec(), "fedavg")
    # the same config written differently (other key order, indentation) is the same config
    reordered = json.dumps(dict(reversed(list(config.to_dict().items()))), indent=3)
    grid, federation = _loopback(config, tmp_path / "same", [(0, 11)], text=reordered)
    runtime = flower_runtime_factory(grid, FlowerOptions(timeout_s=60, node_wait_s=5))(config, federation)
    assert sorted(runtime.nodes) == sorted(c.client_id for c in federation.training_clients + federation.novel_clients)
    # a config that differs is refused, naming what differs
    other = json.dumps({**config.to_dict(), "seed": 4})
    grid, federation = _loopback(config, tmp_path / "other", [(0, 11)], text=other)
    with pytest.raises(ConfigError, match=r"SuperNode --node 0 \(partitions 0-11\) runs with a different privfl-config "
                                          r".*seed: server 3, node 4"):
        flower_runtime_factory(grid, FlowerOptions(timeout_s=60, node_wait_s=5))(config, federation)


# -- simulation engine == in-process runtime --------------------------------------------------------------------------

_SETTINGS = {
    "fedavg": {"lr": 0.1, "local_steps": 3, "batch_size": 16},
    "scaffold": {"lr": 0.1, "local_steps": 3, "batch_size": 16},
    # three stages per round; the novel clients release a DP descriptor (finite epsilon on both engines)
    "odpflhn": {"lr": 0.05, "local_steps": 2, "batch_size": 16, "encoder_hidden": 8, "hn_hidden": 8,
                "hn_layers": 1},
}
_NOVEL = {"odpflhn": NovelPrivacy(epsilon=2.0, noise="seeded")}


def _method(name):
    if name not in METHODS:
        return pytest.param(name, marks=pytest.mark.skip(reason=f"method {name!r} is not registered in this tree"))
    return name


def _run_config(spec, method, **overrides):
    values = dict(federation=spec, method=method, method_config=_SETTINGS[method], rounds=3, eval_every=1,
                  checkpoint_every=2, client_fraction=0.5, seed=3, novel_privacy=_NOVEL.get(method, NovelPrivacy()))
    values.update(overrides)
    return RunConfig(**values)


def _comparable(run_dir):
    run = RunDirectory(run_dir)
    records = sorted((cid, [(r["purpose"], r["round"], r["event"], _without_run(r["metadata"])) for r in held])
                     for cid, held in book_records(run.path("ledger.json")).items())
    strategy = torch.load(run.path("checkpoint.pt"), weights_only=True)["runtime"]["strategy"]
    return without_timing(run.read_metrics()), run.read_clients(), records, strategy


def _without_run(metadata):
    """A record's metadata without the run id a Flower node adds (an in-process run has none)."""
    return {k: v for k, v in metadata.items() if k != p.RUN_KEY}


def _run_ids(run_dir):
    """The run ids of the records in a run directory's ledger.json."""
    return {r["metadata"].get(p.RUN_KEY) for held in book_records(RunDirectory(run_dir).path("ledger.json")).values()
            for r in held}


def _equal_states(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("method,per_node", [(_method("fedavg"), 1), (_method("scaffold"), 3),
                                             (_method("odpflhn"), None)])
def test_flower_simulation_gives_the_in_process_numbers(tmp_path, make_spec, method, per_node):
    # SCAFFOLD's control variates live on the nodes: it runs with virtual nodes of 3 clients each (the last holds
    # fewer), whose packed messages must give the same numbers as one client per node; ODPFL-HN runs with the
    # clients per node the simulation chooses itself (None, the default). The methods with a server model evaluate
    # it centrally too, on the server, as in-process
    central = METHODS[method].central_eval is None
    config = _run_config(make_spec(), method, central_eval=central)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                    # the Flower client processes compute with one thread too
    try:
        expected = train(config, str(tmp_path / "inprocess"), progress=False)
        got = run_on_engine(config, str(tmp_path / "flower"), progress=False, engine="flower-sim",
                            flower_options=FlowerOptions(max_actors=1, threads=1, clients_per_node=per_node))
    finally:
        torch.set_num_threads(threads)
    for key in ("novel", "training_val", "selected_round", "rounds_completed", "privacy", "communication"):
        assert json.dumps(got[key], sort_keys=True) == json.dumps(expected[key], sort_keys=True), key
    chosen = per_node or p.auto_clients_per_node(num_clients(config), 1)
    assert got["flower"]["clients_per_node_max"] == chosen
    assert got["flower"]["nodes"] == -(-num_clients(config) // chosen)
    if per_node is None:
        assert chosen > 1          # the choice packs clients: the equal numbers above are not one client per node's
    metrics, clients, ledgers, strategy = _comparable(tmp_path / "flower")
    metrics_in, clients_in, ledgers_in, strategy_in = _comparable(tmp_path / "inprocess")
    assert metrics == metrics_in and clients == clients_in and ledgers == ledgers_in
    assert all(("central_accuracy" in line) == central for line in metrics)
    assert _equal_states(strategy, strategy_in)
    # every record names this run (the nodes tag theirs; the run's ledger.json holds this run's releases only)
    run_id = got["flower"]["lifetime"]["run_id"]
    assert len(run_id) == 12 and _run_ids(tmp_path / "flower") == {run_id}
    assert got["flower"]["lifetime"]["earlier_runs"] == []
    assert got["flower"]["lifetime"]["epsilon_per_client"] == got["privacy"]["epsilon_per_client"]
    # the release journal got each release as its reply arrived: the same records as ledger.json
    journal = journal_records(tmp_path / "flower" / "releases.jsonl")   # releases (the marks note run events)
    assert sorted((cid, record["purpose"], record["round"]) for cid, record in journal) == sorted(
        (cid, purpose, round) for cid, records in ledgers for purpose, round, _, _ in records)
    # the nodes, not the server, hold the ledgers: one file per client that released something
    node_ledgers = sorted((tmp_path / "flower" / "nodes").glob("partition-*/ledger-client-*.json"))
    assert len(node_ledgers) == len(ledgers)
    # every client has its own directory under the nodes root, however many clients a virtual node holds
    assert len(list((tmp_path / "flower" / "nodes").glob("partition-*"))) == num_clients(config)
    if method == "odpflhn":
        assert 0 < got["privacy"]["epsilon_max_novel"] < math.inf
        assert got["privacy"]["relations"] == ["replace one sample; n public"]   # the nodes' records, metadata kept


# -- novel clients served in a run of their own ------------------------------------------------------------------------


@pytest.mark.parametrize("method", [_method("odpflhn"), _method("fedavg")])
def test_novel_clients_are_served_in_a_run_of_their_own_on_the_simulation_engine(tmp_path, make_spec, method):
    # Train in-process (its finish serves the novel clients too), then serve them again from its checkpoint on
    # Flower's simulation engine: ODPFL-HN's descriptor goes up and a model comes down; FedAvg's model comes down.
    from privfl.engines.flower.simulation import serve_simulation

    config = _run_config(make_spec(), method, rounds=2)                # select best_val: the best snapshot is served
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = train(config, str(tmp_path / "train"), progress=False)
        served = serve_simulation(str(tmp_path / "train"), str(tmp_path / "serve"), nodes_root=str(tmp_path / "nodes"),
                                  options=FlowerOptions(max_actors=1, threads=1, node_wait_s=60, timeout_s=300))
    finally:
        torch.set_num_threads(threads)
    assert served["selected_round"] == expected["selected_round"]
    assert json.dumps(served["novel"], sort_keys=True) == json.dumps(expected["novel"], sort_keys=True)
    rows = {int(r["client_id"]): r for r in RunDirectory(tmp_path / "train").read_clients() if r["role"] == "novel"}
    assert [r["client_id"] for r in served["clients"]] == sorted(rows)
    for row in served["clients"]:
        assert row["accuracy"] == float(rows[row["client_id"]]["accuracy"]), row
        assert row["bytes_down"] > 0
    assert json.loads((tmp_path / "serve" / "serve.json").read_text())["novel"] == served["novel"]
    federation = build_federation(config.federation, seed=config.seed)
    training = len(federation.training_clients)
    for j, novel in enumerate(federation.novel_clients):
        row = next(r for r in served["clients"] if r["client_id"] == novel.client_id)
        ledger_path = tmp_path / "nodes" / f"partition-{training + j}" / f"ledger-client-{novel.client_id}.json"
        if method == "odpflhn":
            # one DP descriptor release, recorded on the novel client's node, with the in-process run's epsilon
            ledger = PrivacyLedger.load(ledger_path)
            assert [(r.purpose, r.round) for r in ledger.records] == [("descriptor", None)]
            assert 0 < row["epsilon"] == expected["privacy"]["epsilon_per_client"][str(novel.client_id)] < math.inf
            assert row["releases"] == 1 and row["bytes_up"] > 0
        else:
            assert not ledger_path.exists() and row["releases"] == 0 and row["bytes_up"] == 0 and row["epsilon"] == 0


# -- a node's ledger and client state survive a restart ----------------------------------------------------------


def _node_context(config, node_dir, partition, count):
    return Context(run_id=1, node_id=100 + partition, state=RecordDict(),
                   node_config={"partition-id": partition, "num-partitions": count, "privfl-dir": str(node_dir)},
                   run_config={"privfl-config": json.dumps(config.to_dict()), "threads": 0})


def _train_message(message, round, completed, client_id, state_of):
    header = {"op": "train", "round": round, "stage": 0, "completed_rounds": completed}
    return FlowerMessage(pack({client_id: (message, {"state_of": state_of})}, header), 100, "train")


def _restart_node():
    """What a SuperNode restart leaves: nothing in this process's memory (and an empty Flower Context)."""
    for cache in (client_app._PARTS, client_app._PROCEDURES, client_app._FEDERATIONS, client_app._NODES):
        cache.clear()


def _reply(reply, client_id):
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    return unpack(reply.content)[1][client_id]


def test_a_node_that_restarts_keeps_its_ledger_and_epsilon_keeps_growing(tmp_path, make_spec, task_identity):
    # FedAvg with DP-SGD: every round's update is a DP release, so epsilon is finite and grows round by round.
    config = RunConfig(federation=make_spec(), method="fedavg", rounds=2, seed=3,
                       method_config={"lr": 0.1, "local_steps": 2, "batch_size": 16}, select="last",
                       privacy=TrainingPrivacy(mode="record", noise_multiplier=1.5))
    reference = build_runtime(config, build_federation(config.federation, seed=config.seed))
    client_id = sorted(reference.clients)[0]          # partition 0 holds the first training client
    node_dir = tmp_path / "node-0"
    strategy = reference.strategy

    context = _node_context(config, node_dir, 0, len(reference.clients))
    message = strategy.configure_train(0, [client_id])[client_id]
    reply = client_app.app(_train_message(message, 0, 0, client_id, -1), context)
    assert _reply(reply, client_id)[1]["kind"] == "release"
    after_one = PrivacyLedger.load(node_dir / f"ledger-client-{client_id}.json")
    assert len(after_one) == 1

    _restart_node()
    context = _node_context(config, node_dir, 0, len(reference.clients))
    message = strategy.configure_train(1, [client_id])[client_id]
    _reply(client_app.app(_train_message(message, 1, 1, client_id, 0), context), client_id)
    after_two = PrivacyLedger.load(node_dir / f"ledger-client-{client_id}.json")

    # The same two rounds in the in-process runtime (every client trains each round) record the same events.
    for round in range(2):
        reference.run_round(round)
    expected = reference.wire.ledgers[client_id]
    assert [r.round for r in after_two.records] == [0, 1]
    assert after_two.events == expected.events
    assert after_two.spent(1e-5).epsilon == expected.spent(1e-5).epsilon
    assert after_two.spent(1e-5).epsilon > after_one.spent(1e-5).epsilon > 0


def test_a_long_lived_clientapp_process_reads_the_ledger_from_disk_for_every_release(tmp_path, make_spec,
                                                                                     task_identity):
    # A ClientApp process that serves many messages (process isolation) keeps data and procedures, never a ledger:
    # a record added to the ledger file between two messages (another tool, a restored file) is kept by the next
    # release, so nothing recorded on disk is dropped and the spend is not under-recorded.
    config = RunConfig(federation=make_spec(), method="fedavg", rounds=2, seed=3,
                       method_config={"lr": 0.1, "local_steps": 2, "batch_size": 16}, select="last",
                       privacy=TrainingPrivacy(mode="record", noise_multiplier=1.5))
    reference = build_runtime(config, build_federation(config.federation, seed=config.seed))
    client_id = sorted(reference.clients)[0]
    node_dir = tmp_path / "node-0"
    path = node_dir / f"ledger-client-{client_id}.json"
    context = _node_context(config, node_dir, 0, len(reference.clients))
    message = reference.strategy.configure_train(0, [client_id])[client_id]
    _reply(client_app.app(_train_message(message, 0, 0, client_id, -1), context), client_id)
    on_disk = PrivacyLedger.load(path)
    on_disk.record(on_disk.records[0].event, purpose="recorded elsewhere", round=None)
    on_disk.save(path)
    message = reference.strategy.configure_train(1, [client_id])[client_id]       # same process, nothing cleared
    _reply(client_app.app(_train_message(message, 1, 1, client_id, 0), context), client_id)
    after = PrivacyLedger.load(path)
    assert [(r.purpose, r.round) for r in after.records] == [("model_update", 0), ("recorded elsewhere", None),
                                                             ("model_update", 1)]
    assert after.spent(1e-5).epsilon > on_disk.spent(1e-5).epsilon > 0


def test_a_client_keeps_its_ledger_when_a_later_run_groups_the_nodes_differently(tmp_path, make_spec, task_identity):
    # Without an explicit node directory each client has its own NODES_ROOT/partition-<i>, whatever clients-per-node
    # the simulation uses: a run with 3 clients per virtual node, then one with a node per client, add to one ledger.
    config = RunConfig(federation=make_spec(), method="fedavg", rounds=2, seed=3,
                       method_config={"lr": 0.1, "local_steps": 2, "batch_size": 16}, select="last",
                       privacy=TrainingPrivacy(mode="record", noise_multiplier=1.5))
    reference = build_runtime(config, build_federation(config.federation, seed=config.seed))
    client_id, count = sorted(reference.clients)[1], len(reference.clients)      # partition 1
    root = tmp_path / "nodes"
    text = json.dumps(config.to_dict())

    def context(node_config, **grouping):
        return Context(run_id=1, node_id=100, state=RecordDict(), node_config=node_config,
                       run_config={"privfl-config": text, "nodes-root": str(root), "threads": 0, **grouping})

    grouped = context({"partition-id": 0, "num-partitions": -(-count // 3)}, **{"clients-per-node": 3,
                                                                                 "num-clients": count})
    message = reference.strategy.configure_train(0, [client_id])[client_id]
    _reply(client_app.app(_train_message(message, 0, 0, client_id, -1), grouped), client_id)
    assert sorted(d.name for d in root.iterdir()) == ["partition-0", "partition-1", "partition-2"]
    _restart_node()
    alone = context({"partition-id": 1, "num-partitions": count})
    message = reference.strategy.configure_train(1, [client_id])[client_id]
    _reply(client_app.app(_train_message(message, 1, 1, client_id, 0), alone), client_id)
    ledger = PrivacyLedger.load(root / "partition-1" / f"ledger-client-{client_id}.json")
    assert [r.round for r in ledger.records] == [0, 1]


def test_a_node_that_restarts_keeps_its_client_state_or_refuses_to_go_on(tmp_path, make_spec, task_identity):
    # SCAFFOLD: a client's round-1 update depends on the control variate c_i it kept from round 0.
    config = RunConfig(federation=make_spec(), method="scaffold", rounds=2, seed=3, method_config=_SETTINGS["scaffold"])
    federation = build_federation(config.federation, seed=config.seed)
    reference = build_runtime(config, federation)
    client_id = sorted(reference.clients)[0]
    first = reference.strategy.configure_train(0, sorted(reference.clients))[client_id].copy()
    reference.run_round(0)                               # every client trains (client_fraction 1)
    second = reference.strategy.configure_train(1, sorted(reference.clients))[client_id]
    data = reference.clients[client_id]
    expected = reference.client.train(data, second.copy(), dict(reference.client_states[client_id]),
                                      client_context(config.seed, client_id, 1)).message
    fresh = reference.client.train(data, second.copy(), {}, client_context(config.seed, client_id, 1)).message
    assert any(not torch.equal(expected.arrays[k], fresh.arrays[k]) for k in expected.arrays)   # c_i matters

    node_dir = tmp_path / "node-0"
    count = len(federation.training_clients)
    client_app.app(_train_message(first, 0, 0, client_id, -1), _node_context(config, node_dir, 0, count))
    _restart_node()                    # between round 0's reply and round 1: its state is still pending on disk
    reply = client_app.app(_train_message(second.copy(), 1, 1, client_id, 0), _node_context(config, node_dir, 0, count))
    got = _reply(reply, client_id)[0]
    assert got.arrays.keys() == expected.arrays.keys()
    assert all(torch.equal(got.arrays[k], expected.arrays[k]) for k in expected.arrays)

    # A node whose state file is gone (its directory replaced) refuses round 1 instead of starting from scratch.
    (node_dir / f"state-client-{client_id}.pt").unlink()
    _restart_node()
    with pytest.raises(RuntimeError, match=rf"client {client_id}: the server expects it to hold its state of round 0, "
                                           "but its node has no state file"):
        client_app.handle(_train_message(second.copy(), 1, 1, client_id, 0), _node_context(config, node_dir, 0, count))


def test_a_node_keeps_an_error_text_that_may_describe_its_data_and_the_server_hears_only_who_failed(
        tmp_path, make_spec, task_identity, monkeypatch):
    config = _run_config(make_spec(), "fedavg", rounds=1, client_fraction=1.0)
    federation = build_federation(config.federation, seed=config.seed)
    reference = build_runtime(config, federation)
    client_id = sorted(reference.clients)[0]
    message = reference.strategy.configure_train(0, [client_id])[client_id]
    node_dir = tmp_path / "node-0"
    context = _node_context(config, node_dir, 0, len(federation.training_clients))

    def refuse(self, data, body, state, ctx):       # a method refusing a value of the client's data, naming it
        raise ValueError(f"label sum {int(data.y_train.sum())} is out of range")

    secret = f"label sum {int(federation.training_clients[0].y_train.sum())}"
    _restart_node()
    monkeypatch.setattr(type(reference.client), "train", refuse)
    with pytest.raises(client_app.NodeFailure) as failure:
        client_app.handle(_train_message(message, 0, 0, client_id, -1), context)
    log = node_dir / client_app.ERROR_LOG
    # what Flower would send the server (the exception's type and text): who failed and where, not the data
    reason = f"{type(failure.value)}:<'{failure.value}'>"
    assert secret not in reason and "label" not in reason
    assert f"client {client_id} failed in 'train'" in reason and str(log) in reason
    assert secret in log.read_text() and "ValueError" in log.read_text()

    # Errors whose text is data-free (configuration, protocol state) still reach the server as they are.
    with pytest.raises(PublicConfigError, match=r"a message for client 999 arrived at the node"):
        client_app.handle(_train_message(message, 0, 0, 999, -1), context)


# -- deployment engine on loopback: SuperLink + SuperNodes, TLS and node authentication -------------------------------


def test_certs_keep_the_ca_key_refuse_to_overwrite_and_add_nodes(tmp_path, capsys):
    certs = tmp_path / "certs"
    assert launch.main(["certs", str(certs), "--nodes", "2"]) == 0
    ca_key = (certs / launch.CA_KEY).read_bytes()
    assert (certs / launch.CA_KEY).stat().st_mode & 0o777 == 0o600
    assert (certs / launch.SERVER_KEY).stat().st_mode & 0o777 == 0o600
    assert launch.node_indices(certs) == [0, 1]
    node_0 = (certs / "node-0.pub").read_bytes()
    # a second `certs` on the directory would replace the CA and every registered node key: refused, one line
    capsys.readouterr()
    assert launch.main(["certs", str(certs), "--nodes", "2"]) == 2
    error = capsys.readouterr().err
    assert "already holds certificates or keys" in error and "--overwrite" in error and len(error.splitlines()) == 1
    assert (certs / launch.CA_KEY).read_bytes() == ca_key and (certs / "node-0.pub").read_bytes() == node_0
    # a node added later gets the next index; nothing else changes
    assert launch.main(["certs", str(certs), "--add-node", "1"]) == 0
    assert launch.node_indices(certs) == [0, 1, 2] and (certs / "node-2.key").stat().st_mode & 0o777 == 0o600
    assert (certs / launch.CA_KEY).read_bytes() == ca_key and (certs / "node-0.pub").read_bytes() == node_0
    # --overwrite replaces all of it (the old node keys too)
    assert launch.main(["certs", str(certs), "--nodes", "1", "--overwrite"]) == 0
    assert (certs / launch.CA_KEY).read_bytes() != ca_key and launch.node_indices(certs) == [0]
    # the SuperLink keeps its state in the certs directory unless told otherwise
    command = launch.superlink_command(certs, "127.0.0.1:9093")
    assert command[command.index("--database") + 1] == str((certs / launch.DATABASE).resolve())
    assert "--database" not in launch.superlink_command(certs, "127.0.0.1:9093", ":memory:")
    # a missing key file is one line naming it, not a traceback
    capsys.readouterr()
    assert launch.main(["supernode", "--certs", str(certs), "--node", "5", "--partition-id", "0",
                        "--num-partitions", "2", "--node-dir", str(tmp_path / "n")]) == 2
    error = capsys.readouterr().err
    assert f"missing {certs / 'node-5.key'}" in error and len(error.splitlines()) == 1
    (certs / launch.SERVER_KEY).unlink()
    with pytest.raises(ConfigError, match=rf"missing {certs / launch.SERVER_KEY}"):
        launch.superlink_command(certs, "127.0.0.1:9093")


def test_waiting_for_a_superlink_that_does_not_listen_ends_with_a_clear_message():
    address = f"127.0.0.1:{supervisor.free_port()}"      # nothing listens there
    with pytest.raises(ConfigError, match=rf"the SuperLink at {address} did not accept connections within 0.3 s "
                                          r"\(--wait-s; last: Connection refused\); start it first"):
        launch.wait_for_superlink(address, 0.3, poll_s=0.1)


def test_flowers_error_lines_are_read_by_their_code():
    from flwr.supercore.error import ApiErrorCode

    # what `flwr supernode register` prints for a key the SuperLink knows (a SuperLink restarted on its database)
    box = ("Using SuperLink: privfl (127.0.0.1:59129)\n"
           "\u256d\u2500 Error \u2500\u2500\u2500\u2500\u256e\n"
           "\u2502 [code: 23] Public key already in use.                 \u2502\n"
           "\u2570\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u256f\n")
    assert supervisor.flower_message(box) == "[code: 23] Public key already in use."
    assert supervisor.flower_code(box) == supervisor.PUBLIC_KEY_ALREADY_IN_USE == ApiErrorCode.PUBLIC_KEY_ALREADY_IN_USE
    assert supervisor.NODE_ACTIVATION_FAILED == ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED
    supernode = ("\x1b[91mERROR \x1b[0m:     Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
                 "[code: 2004] Failed to activate SuperNode.\nThe SuperNode could not establish a connection.\n")
    assert supervisor.flower_code(supernode) == 2004
    assert supervisor.flower_message(supernode) == "[code: 2004] Failed to activate SuperNode."
    assert supervisor.flower_code("no code here") is None and supervisor.flower_message("") == "no output"


def test_a_refused_activation_is_retried_only_while_the_superlink_counts_the_node_online(tmp_path, monkeypatch,
                                                                                         capsys):
    certs = launch.generate_certificates(tmp_path / "certs", nodes=1)
    refused = "[code: 2004] Failed to activate SuperNode.\n"
    statuses = iter([("online", 41.6), ("online", 0.2), ("offline", 0.0)])
    monkeypatch.setattr(supervisor, "node_status", lambda env, superlink, certs, key: next(statuses))
    why = supervisor.refusal_of(1, refused, env={}, certs=certs, superlink="127.0.0.1:9", node=0)
    assert not why.final and "still counts node 0's previous connection as online (for about 42 s more" in why.reason
    # a SuperNode refused while its previous connection lingers is started again, saying so, and joins
    marker = tmp_path / "attempts"
    script = (f"import pathlib, sys; p = pathlib.Path({str(marker)!r}); n = len(p.read_text()) if p.exists() else 0; "
              f"p.write_text('x' * (n + 1)); sys.stderr.write({refused!r} if n < 2 else ''); "
              "sys.exit(0 if n >= 2 else 1)")

    def explain(code, output):
        return supervisor.refusal_of(code, output, env={}, certs=certs, superlink="127.0.0.1:9", node=0)

    assert supervisor.supervise_supernode([sys.executable, "-c", script], dict(os.environ), rejoin_s=60, retry_s=0.05,
                                      explain=explain) == 0
    err = capsys.readouterr().err
    assert marker.read_text() == "xxx" and err.count("previous connection as online (for about 0 s more") == 1, err
    assert "refused to activate node 0, registered and offline (Flower: [code: 2004]" in err
    assert err.count(refused) == 2                 # Flower's own lines are passed on as they come
    # unknown to the SuperLink: refused at once, naming the key and the command that registers it
    monkeypatch.setattr(supervisor, "node_status", lambda env, superlink, certs, key: (None, 0.0))
    why = supervisor.refusal_of(1, refused, env={}, certs=certs, superlink="127.0.0.1:9", node=0)
    assert why.final and why.reason == (
        f"the SuperLink at 127.0.0.1:9 does not know node 0's public key {certs / 'node-0.pub'} (Flower: [code: 2004] "
        f"Failed to activate SuperNode.): register it first: privfl flower register --certs {certs} --superlink "
        "127.0.0.1:9 0")
    # anything else: Flower's line, and another try
    why = supervisor.refusal_of(3, "boom\nRuntimeError: port taken\n", env={}, certs=certs, superlink="x:1", node=0)
    assert not why.final and why.reason == "the SuperNode exited with status 3 (Flower: RuntimeError: port taken)"


def test_a_serverapp_stopped_by_an_operators_error_logs_one_line_unless_verbose(tmp_path, make_spec):
    import logging

    from privfl.engines.flower.server_app import OneLineErrors

    def record(error):
        try:
            raise error
        except Exception:
            return logging.LogRecord("flwr", logging.ERROR, __file__, 1, "%s raised an exception", ("ServerApp",),
                                     sys.exc_info())

    one_line = OneLineErrors()
    failed = record(FlowerClientError("SuperNode --node 1 (partition 1, clients [2]) failed in 'train': gone"))
    assert one_line.filter(failed) and failed.exc_info is None
    assert failed.getMessage() == ("ServerApp stopped: SuperNode --node 1 (partition 1, clients [2]) failed in "
                                   "'train': gone (its traceback: privfl flower run --verbose)")
    bug = record(KeyError("a fault inside privfl"))
    assert one_line.filter(bug) and bug.exc_info is not None        # a bug keeps its traceback
    one_line.verbose = True
    kept = record(ConfigError("bad"))
    assert one_line.filter(kept) and kept.exc_info is not None and kept.getMessage() == "ServerApp raised an exception"
    # privfl flower run --verbose asks for it
    config = tmp_path / "config.json"
    config.write_text(json.dumps(RunConfig(federation=make_spec(), method="fedavg").to_dict()))
    for verbose in (False, True):
        command = launch.run_command(str(config), "out", verbose=verbose)
        assert command[command.index(f"verbose={str(verbose).lower()}") - 1] == "--run-config"


def test_a_refused_supernode_is_started_again_until_it_joins_or_rejoin_s_passes(tmp_path, capsys):
    # A stand-in for flower-supernode that the SuperLink refuses twice (exit 1), then runs and ends (exit 0).
    marker = tmp_path / "attempts"
    script = (f"import pathlib, sys; p = pathlib.Path({str(marker)!r}); n = len(p.read_text()) if p.exists() else 0; "
              "p.write_text('x' * (n + 1)); sys.exit(0 if n >= 2 else 1)")
    assert supervisor.supervise_supernode([sys.executable, "-c", script], dict(os.environ), rejoin_s=60,
                                      retry_s=0.05) == 0
    assert marker.read_text() == "xxx"
    assert capsys.readouterr().err.count("starting it again") == 2
    # one that keeps being refused: given up after rejoin_s, with its exit status
    refused = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert supervisor.supervise_supernode(refused, dict(os.environ), rejoin_s=0.0, retry_s=0.05) == 3
    assert "stopped retrying after 0 s (--rejoin-s)" in capsys.readouterr().err


_SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


def _children_of(pid, count, timeout=60):
    """The ``count`` processes ``pid`` started, once they are all there."""
    deadline = time.monotonic() + timeout
    while len(found := supervisor.descendants(pid)) < count:
        assert time.monotonic() < deadline, found
        time.sleep(0.05)
    return found


def _gone(pids, timeout=30):
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the SIGKILL case needs Linux")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_supernode_in_process_isolation_leaves_no_process_behind(how):
    # Stand-ins for flower-supernode and its long-lived ClientApp process under `privfl flower supernode`'s
    # supervisor: ending the supervisor (SIGTERM, passed on; SIGKILL, which it cannot see) ends both.
    import signal

    script = ("import os, sys; from privfl.engines.flower.supervisor import supervise_supernode; "
              f"sys.exit(supervise_supernode({_SLEEP!r}, dict(os.environ), rejoin_s=0, worker={_SLEEP!r}))")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        children = _children_of(parent.pid, 2)
        parent.send_signal(getattr(signal, how))
        parent.wait(timeout=60)
        assert _gone(children), [(pid, _state(pid)) for pid in children]
    finally:
        supervisor.end_processes([parent])


def test_a_clientapp_process_that_exits_is_started_again_and_one_that_keeps_exiting_stops_the_supernode(tmp_path,
                                                                                                      capsys):
    marker = tmp_path / "starts"
    worker = [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(marker)!r}); "
                                    "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); raise SystemExit(5)"]
    assert supervisor.supervise_supernode(_SLEEP, dict(os.environ), rejoin_s=60, worker=worker, worker_restarts=2) == 1
    assert marker.read_text() == "xxx"                  # the first start and 2 restarts, then the SuperNode stopped
    err = capsys.readouterr().err
    assert err.count("the ClientApp process exited with status 5; starting it again") == 2
    assert "exited with status 5, 3 times within a minute; stopping the SuperNode" in err
    # the commands: the SuperNode in process isolation runs no ClientApp; the worker asks its Runtime API for tasks
    certs = launch.generate_certificates(tmp_path / "certs", nodes=1)
    command = launch.supernode_command(certs, "127.0.0.1:9093", node=0, num_partitions=1, node_dir="n", port=9100,
                                       partition_id=0)
    assert command[command.index("--isolation") + 1] == "process" and command[command.index("--poll-s") + 1] == "0.25"
    assert command[1:3] == ["-m", "privfl.engines.flower.supernode"]    # Flower's SuperNode, polling every 0.25 s
    assert launch.worker_command("127.0.0.1", 9100, 7)[-4:] == ["--runtime-api-address", "127.0.0.1:9100",
                                                               "--parent-pid", "7"]
    with pytest.raises(ConfigError, match="--isolation must be one of process, subprocess, got 'thread'"):
        launch.supernode_command(certs, "127.0.0.1:9093", node=0, num_partitions=1, node_dir="n", port=9100,
                                 partition_id=0, isolation="thread")


def test_the_supernode_asks_for_work_every_poll_s_seconds_while_idle(monkeypatch):
    # Flower 1.41's SuperNode loop sleeps 3 s after an empty ask and 0.5 s while a reply is not ready, on the time
    # module it imports: the two sleeps the clock shortens (a Flower that changes them fails here, not silently)
    import inspect

    from flwr.supernode import start_client_internal as loop

    from privfl.engines.flower import supernode

    source = inspect.getsource(loop)
    assert source.count("time.sleep(3)") == 1 and source.count("time.sleep(0.5)") == 2 and loop.time is time
    monkeypatch.setattr(loop, "time", loop.time)            # undone after the test
    clock = supernode.install(0.25)
    assert loop.time is clock and loop.time.monotonic is time.monotonic
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    for seconds in (3, 0.5, 2, 0.1):
        clock.sleep(seconds)
    assert slept == [0.25, 0.25, 2, 0.1]
    assert supernode.PollingClock(3).sleep(3) is None and slept[-1] == 3 and slept[-2] == 0.1
    with pytest.raises(ConfigError, match=r"--poll-s must be a number of seconds in \(0, 3\] .*got 0"):
        supernode.install(0)


LAUNCH = [sys.executable, "-m", "privfl.engines.flower.launch"]


def _flower_log(tmp_path):
    return (tmp_path / "flower.log").read_text()[-3000:] if (tmp_path / "flower.log").exists() else ""


@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process clean-up reads /proc")
def test_a_deployment_run_that_does_not_complete_exits_non_zero_with_the_server_apps_error(tmp_path, make_spec):
    # Two runs on one SuperLink with no SuperNode: one into a run directory that holds a run already, one whose
    # nodes never come (node-wait-s 1). `privfl flower run` waits for each run's end and reports its failure.
    config = RunConfig(federation=make_spec(num_clients=2, novel_fraction=0.5), method="fedavg", rounds=1,
                       method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16}, select="last", seed=3)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text(json.dumps(config.to_dict()))
    certs = launch.generate_certificates(tmp_path / "certs", nodes=1)
    env = {**launch.flower_env(certs), "OMP_NUM_THREADS": "1", "FLWR_HOME": str(tmp_path / "flwr-home")}
    address = f"127.0.0.1:{supervisor.free_port()}"
    log = open(tmp_path / "flower.log", "w")
    processes: list[subprocess.Popen] = []
    try:
        processes.append(subprocess.Popen(LAUNCH + ["superlink", "--certs", str(certs), "--address", address],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        launch.wait_for_superlink(address, 120)
        runs = {}
        for name in ("taken", "nodeless"):
            runs[name] = subprocess.Popen(
                LAUNCH + ["run", "--certs", str(certs), "--superlink", address, "--config",
                          str(tmp_path / "config.json"), "--out", str(tmp_path / name), "--node-wait-s", "1",
                          "--timeout-s", "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            processes.append(runs[name])
        ended = {name: (run.communicate(timeout=400), run.returncode) for name, run in runs.items()}
    finally:
        supervisor.end_processes(processes)
        log.close()
    for name, ((stdout, stderr), code) in ended.items():
        assert code == 1, (name, stdout, stderr, _flower_log(tmp_path))
        assert "privfl flower: started run" in stdout and "flwr log" in stdout        # where to watch it
        assert "did not complete (finished:failed): ServerApp failed with exception:" in stderr, stderr
    assert f"run directory {tmp_path / 'taken'} already holds a run" in ended["taken"][0][1]
    assert "clients the run needs have no connected node after 1 s (node-wait-s): clients [0] (partitions [0] of " \
           "2)" in ended["nodeless"][0][1]
    assert not (tmp_path / "nodeless" / "summary.json").exists()


@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process clean-up reads /proc")
def test_a_real_superlink_refuses_unknown_nodes_at_once_and_keeps_registrations_across_a_restart(tmp_path):
    # One SuperLink on its database in the certs directory: a SuperNode whose key is not registered, and one that
    # trusts another CA, are refused in one line each without retrying (--rejoin-s would allow 5 minutes); the
    # SuperLink restarted on its database knows node 0 already, and registering it again is harmless, as documented.
    certs = launch.generate_certificates(tmp_path / "certs", nodes=2)
    foreign = tmp_path / "foreign"           # another CA's root, with node 0's own key
    launch.generate_certificates(foreign, nodes=0)
    for name in ("node-0.key", "node-0.pub"):
        (foreign / name).write_bytes((certs / name).read_bytes())
    env = {**launch.flower_env(certs), "OMP_NUM_THREADS": "1", "FLWR_HOME": str(tmp_path / "flwr-home")}
    address = f"127.0.0.1:{supervisor.free_port()}"
    log = open(tmp_path / "flower.log", "w")
    processes: list[subprocess.Popen] = []

    def superlink():
        processes.append(subprocess.Popen(LAUNCH + ["superlink", "--certs", str(certs), "--address", address],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        return processes[-1]

    def refused(directory, node):
        return subprocess.run(LAUNCH + ["supernode", "--certs", str(directory), "--superlink", address, "--node",
                                        str(node), "--partition-id", "0", "--num-partitions", "1", "--node-dir",
                                        str(tmp_path / f"node-{node}"), "--port", str(supervisor.free_port()),
                                        "--rejoin-s", "300"],
                              env=env, capture_output=True, text=True, timeout=300)

    def register(*nodes):
        return subprocess.run(LAUNCH + ["register", "--certs", str(certs), "--superlink", address,
                                        *map(str, nodes)], env=env, capture_output=True, text=True, timeout=300)

    try:
        first = superlink()
        done = register(0)
        assert done.returncode == 0 and f"registered node 0 ({certs / 'node-0.pub'})" in done.stdout, done
        unknown = refused(certs, 1)
        assert unknown.returncode == 2 and "starting it again" not in unknown.stderr, unknown.stderr
        assert unknown.stderr.splitlines()[-1] == (
            f"privfl flower: error: the SuperLink at {address} does not know node 1's public key "
            f"{certs / 'node-1.pub'} (Flower: [code: 2004] Failed to activate SuperNode.): register it first: "
            f"privfl flower register --certs {certs} --superlink {address} 1")
        stranger = refused(foreign, 0)
        assert stranger.returncode == 2 and "starting it again" not in stranger.stderr, stranger.stderr
        last = stranger.stderr.splitlines()[-1]
        assert last.startswith(f"privfl flower: error: the SuperLink at {address} presented a TLS certificate that "
                               f"{foreign / 'ca.crt'} does not verify (Flower: [SSL: CERTIFICATE_VERIFY_FAILED]"), last
        supervisor.end_processes([first])
        superlink()
        again = register(0, 1)
        assert again.returncode == 0, again
        assert again.stdout.splitlines() == [f"node 0 ({certs / 'node-0.pub'}) is registered already",
                                             f"registered node 1 ({certs / 'node-1.pub'})"]
    finally:
        supervisor.end_processes(processes)
        log.close()


def _readme_session(name):
    """The bash block under ``name`` in the Flower README, as an operator copies it."""
    text = (Path(launch.__file__).parent / "README.md").read_text()
    block = text[text.index(name):]
    return block[block.index("```bash\n") + len("```bash\n"):block.index("```\n", block.index("```bash\n") + 8)]


@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process clean-up reads /proc")
def test_the_readme_loopback_session_runs_as_written_and_gives_the_in_process_numbers(tmp_path):
    # The README's block, run by bash as written: `register` right after the SuperLink starts, the SuperNodes, an
    # in-process template run, `privfl flower run --stream`. Only the ports change (free ones), and `privfl` is this
    # checkout's. The deployment run (TLS, node authentication) must give the template's numbers.
    session = _readme_session("On loopback, one training and one novel client")
    ports = {"9093": supervisor.free_port(), "9100": supervisor.free_port(), "9101": supervisor.free_port()}
    for old, new in ports.items():
        assert old in session
        session = session.replace(old, str(new))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "privfl").write_text(f"#!/bin/sh\nexec {sys.executable} -m privfl.cli \"$@\"\n")
    (bin_dir / "privfl").chmod(0o755)
    root = str(Path(__file__).resolve().parents[2])
    env = {**launch.flower_env(tmp_path), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path),
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": root}
    env.pop("FLWR_HOME")                            # the block sets its own
    log = open(tmp_path / "flower.log", "w")
    processes: list[subprocess.Popen] = []
    try:
        processes.append(subprocess.Popen(["bash", "-e", "-c", session], cwd=tmp_path, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        code = processes[0].wait(timeout=800)
    finally:
        supervisor.end_processes(processes)
        log.close()
    output = (tmp_path / "flower.log").read_text()
    assert code == 0, output[-3000:]
    assert "registered node 0" in output and "registered node 1" in output
    assert "completed; results in runs/deployed" in output
    # its table: epsilons with their relation, trust model and source (the run's ledger, not its summary)
    lines = output.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("method ")][-1]   # after the template's own
    row, header = lines[header + 2].split(), lines[header]
    assert header.split()[header.split().index("relation"):][:4] == ["relation", "trust", "eps", "from"]
    assert row[0] == "fedavg" and "not private" in " ".join(row) and "releases.jsonl + ledger.json (recomputed)" in \
        " ".join(row)
    assert "privfl: round 1 of 1 done in" in output           # --stream shows the rounds
    got = RunDirectory(tmp_path / "runs" / "deployed").read_json("summary.json")
    expected = RunDirectory(tmp_path / "runs" / "template").read_json("summary.json")
    for key in ("novel", "training_val", "selected_round", "privacy", "communication"):
        assert got[key] == expected[key], key
    assert got["novel"]["num_clients"] == 1 and got["flower"]["nodes"] == 2
    # the training client's node recorded its releases (model update; its validation score, which select=best_val,
    # the CLI's default, reports to the server) in its own directory, under the run's id
    ledger = PrivacyLedger.load(next((tmp_path / "nodes" / "0").glob("ledger-client-*.json")))
    assert [r.purpose for r in ledger.records] == ["model_update", "validation_metrics"]
    assert {r.metadata["run"] for r in ledger.records} == {got["flower"]["lifetime"]["run_id"]}
    journal = (tmp_path / "runs" / "deployed" / "releases.jsonl").read_text().splitlines()
    assert [json.loads(line).get("mark") for line in journal] == [None, None, "novel_clients_served"]  # 2 releases
    assert not any((tmp_path / "nodes" / "1").glob("ledger-client-*.json"))   # FedAvg's novel client sends nothing


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process clean-up reads /proc")
def test_a_killed_supernode_is_named_rejoins_and_the_resumed_run_gives_the_uninterrupted_numbers(tmp_path, make_spec):
    # Two training clients on two SuperNodes, two rounds, a checkpoint every round. SuperNode 1 is killed (-9, its
    # whole process tree) once its client has released and a reply has reached the server; the run fails naming
    # that node's client (37.5 to 60 s later: Flower 1.41 declares a node offline 60 s after its last heartbeat,
    # an interval no option changes, see the Flower README). The node is
    # started again on its key and directory, `privfl flower run --resume` continues from the last checkpoint, and
    # the run ends with the numbers of an uninterrupted in-process run.
    import signal

    config = RunConfig(federation=make_spec(num_clients=3, novel_fraction=0.34), method="fedavg", rounds=2,
                       checkpoint_every=1, eval_every=2, method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16},
                       select="last", seed=3)
    federation = build_federation(config.federation, seed=config.seed)
    first, second = (c.client_id for c in federation.training_clients)       # partitions 0 and 1
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    certs = launch.generate_certificates(tmp_path / "certs", nodes=2)
    env = {**launch.flower_env(certs), "OMP_NUM_THREADS": "1", "FLWR_HOME": str(tmp_path / "flwr-home")}
    address = f"127.0.0.1:{supervisor.free_port()}"
    log = open(tmp_path / "flower.log", "w")
    processes: list[subprocess.Popen] = []
    out = tmp_path / "run"

    def supernode(node):
        processes.append(subprocess.Popen(
            LAUNCH + ["supernode", "--certs", str(certs), "--superlink", address, "--node", str(node),
                      "--partition-id", str(node), "--num-partitions", "2",
                      "--node-dir", str(tmp_path / f"node-{node}"), "--port", str(supervisor.free_port())],
            env=env, stdout=log, stderr=subprocess.STDOUT))
        return processes[-1]

    def flower_run(*how):
        processes.append(subprocess.Popen(
            LAUNCH + ["run", "--certs", str(certs), "--superlink", address, "--timeout-s", "300", *how],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return processes[-1]

    try:
        processes.append(subprocess.Popen(LAUNCH + ["superlink", "--certs", str(certs), "--address", address],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        assert subprocess.run(LAUNCH + ["register", "--certs", str(certs), "--superlink", address, "0", "1"],
                              env=env, capture_output=True, timeout=180).returncode == 0
        supernode(0)
        doomed = supernode(1)
        failing = flower_run("--config", str(tmp_path / "config.json"), "--out", str(out), "--stream")
        ledger = tmp_path / "node-1" / f"ledger-client-{second}.json"
        deadline = time.monotonic() + 600
        # a release of node 1 recorded, and one reply journaled by the server: on a loaded machine node 0's reply
        # could otherwise still be on its way when node 1's heartbeat expires, and the run fail with nothing journaled
        while not (ledger.exists() and (out / "releases.jsonl").exists()):
            assert time.monotonic() < deadline and failing.poll() is None, _flower_log(tmp_path)
            time.sleep(0.2)
        for pid in [doomed.pid] + supervisor.descendants(doomed.pid):
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = failing.communicate(timeout=600)
        assert failing.returncode == 1, stdout + stderr + _flower_log(tmp_path)
        assert "did not complete (finished:failed)" in stderr
        # the node named as it was started, in one line; the ServerApp's log (--stream) says it without a traceback
        assert f"SuperNode --node 1 (partition 1, clients [{second}]) failed in 'train'" in stderr, stderr
        assert f"(partition 0, clients [{first}])" not in stderr, stderr
        assert f"ServerApp stopped: SuperNode --node 1 (partition 1, clients [{second}])" in stdout, stdout[-3000:]
        assert "Traceback" not in stdout, stdout[-3000:]
        assert f"continue the run with: privfl flower run --certs {certs} --superlink {address} --resume {out} " \
            in stderr, stderr                                # the command that continues it, not privfl train's
        assert (out / "ledger.json").exists() and (out / "releases.jsonl").exists()
        supernode(1)                                        # the same key and node directory
        resumed = flower_run("--resume", str(out))
        stdout, stderr = resumed.communicate(timeout=900)
        assert resumed.returncode == 0, stdout + stderr + _flower_log(tmp_path)
    finally:
        supervisor.end_processes(processes)
        log.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = train(config, str(tmp_path / "inprocess"), progress=False)
    finally:
        torch.set_num_threads(threads)
    got = RunDirectory(out).read_json("summary.json")
    for key in ("training_val", "selected_round", "rounds_completed"):     # the novel client is not in this run
        assert got[key] == expected[key], key
    assert got["flower"]["novel_not_served"] == [c.client_id for c in federation.novel_clients]
    assert without_timing(RunDirectory(out).read_metrics()) == \
        without_timing(RunDirectory(tmp_path / "inprocess").read_metrics())
    # one run id across both attempts; the repeated round's release stays recorded (as an in-process resume keeps it)
    run_id = got["flower"]["lifetime"]["run_id"]
    assert _run_ids(out) == {run_id} and got["flower"]["lifetime"]["earlier_runs"] == []
    on_node = PrivacyLedger.load(tmp_path / "node-1" / f"ledger-client-{second}.json")
    assert {r.metadata["run"] for r in on_node.records} == {run_id}
    updates = [r.round for r in on_node.records if r.purpose == "model_update"]
    assert sorted(set(updates)) == [0, 1] and len(updates) >= 2
