"""Clients trained in worker processes (``RunConfig(workers=N)``): the numbers, ledgers and journal of one process."""

import json
import os

import pytest
import torch
from conftest import book_records, journal_records

from privfl.config import RunConfig
from privfl.errors import ConfigError, InternalError
from privfl.experiment import build_runtime, train
from privfl.federation import RunDirectory
from privfl.federation.timing import without_timing
from privfl.privacy.training import TrainingPrivacy

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def _dp_fedavg(make_spec, **overrides):
    values = {"federation": make_spec(num_clients=8, novel_fraction=0.25), "method": "fedavg",
              "method_config": {"lr": 0.1, "local_steps": 4, "batch_size": 16}, "rounds": 3, "eval_every": 1,
              "select": "last", "seed": 7, "client_fraction": 0.9,
              "privacy": TrainingPrivacy(mode="record", noise_multiplier=1.1, clip=1.0, noise="seeded")}
    values.update(overrides)
    return RunConfig(**values)


def _tensors(state):
    from conftest import tensors_by_name

    return tensors_by_name(state)


def _untimed(records):
    """Records (``journal_records`` pairs, or ``book_records``' lists by client) without their clock readings."""
    if isinstance(records, dict):
        return {cid: _untimed(held) for cid, held in records.items()}
    return [(r[0], {k: v for k, v in r[1].items() if k != "time"}) if isinstance(r, tuple)
            else {k: v for k, v in r.items() if k != "time"} for r in records]


def _shapes(path):
    """Each journal line's keys and the earlier lines it names (not its hash or clock reading)."""
    return [{k: v for k, v in json.loads(line).items() if k not in ("p", "t", "r")}
            for line in path.read_text().splitlines()]


def test_two_workers_write_the_metrics_ledger_and_journal_of_one_process(tmp_path, make_spec):
    one = train(_dp_fedavg(make_spec), str(tmp_path / "one"), progress=False)
    two = train(_dp_fedavg(make_spec, workers=2), str(tmp_path / "two"), progress=False)
    a, b = RunDirectory(tmp_path / "one"), RunDirectory(tmp_path / "two")
    assert a.path("clients.csv").read_text() == b.path("clients.csv").read_text()
    assert without_timing(a.read_metrics()) == without_timing(b.read_metrics())
    # the same records in the same order, the same lines of the journal; only the clock differs
    assert _untimed(book_records(a.path("ledger.json"))) == _untimed(book_records(b.path("ledger.json")))
    assert _untimed(journal_records(a.path("releases.jsonl"))) == _untimed(journal_records(b.path("releases.jsonl")))
    assert _shapes(a.path("releases.jsonl")) == _shapes(b.path("releases.jsonl"))
    assert len(a.read_metrics()) == 3 and "train_loss" in a.read_metrics()[0]
    assert one["novel"] == two["novel"] and one["training_val"] == two["training_val"]
    assert 0 < one["privacy"]["epsilon_max_training"] < float("inf")
    weights = [_tensors(torch.load(d.path("checkpoint.pt"), weights_only=True)["runtime"]) for d in (a, b)]
    assert len(weights[0]) >= 6 and weights[0].keys() == weights[1].keys()   # the server's 2NN weights at least
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_the_clients_run_in_the_worker_processes_and_leave_torch_generator_as_sequential(make_spec):
    from privfl.data import build_federation

    config = _dp_fedavg(make_spec, workers=2)
    federation = build_federation(config.federation, seed=config.seed)
    runtime = build_runtime(config, federation)
    sequential = build_runtime(RunConfig.from_dict({**config.to_dict(), "workers": 1}), federation)
    try:
        runtime.run_round(0)
        after_workers = torch.default_generator.get_state()
        sequential.run_round(0)
        assert torch.equal(after_workers, torch.default_generator.get_state())
        pool = runtime._pool
        assert pool is not None and len(pool._processes) == 2
        assert all(p.is_alive() and p.pid != os.getpid() for p in pool._processes)
        processes = pool._processes
    finally:
        runtime.close()
    assert runtime._pool is None and not any(p.is_alive() for p in processes)
    # each worker ended on its own when its task pipe closed; a copy of a pipe end held by a worker (its own write
    # end, or an earlier worker's) kept it waiting until close() gave up and terminated it (exit code -15)
    assert [p.exitcode for p in processes] == [0, 0]


def _failing_at(runtime, failing: int, error: Exception):
    train = runtime.client.train

    def patched(data, message, state, ctx):
        if ctx.client_id == failing:
            raise error
        return train(data, message, state, ctx)

    runtime.client.train = patched   # set before the workers fork: they inherit it


@pytest.mark.parametrize("error, raised", [(ConfigError("client refused: a user error"), ConfigError),
                                           (ZeroDivisionError("a bug"), InternalError)])
def test_a_client_failing_in_a_worker_raises_in_the_parent_after_the_releases_before_it(make_spec, error, raised):
    from privfl.data import build_federation

    config = _dp_fedavg(make_spec, workers=2, client_fraction=1.0)
    federation = build_federation(config.federation, seed=config.seed)
    ids = sorted(c.client_id for c in federation.training_clients)
    failing = ids[2]
    books = {}
    for workers in (1, 2):
        runtime = build_runtime(RunConfig.from_dict({**config.to_dict(), "workers": workers}), federation)
        _failing_at(runtime, failing, error)
        try:
            with pytest.raises((type(error), raised)) as caught:
                runtime.run_round(0)
        finally:
            runtime.close()
        if workers == 2:
            assert isinstance(caught.value, raised) and str(error) in str(caught.value)
        books[workers] = {cid: len(runtime.ledgers()[cid]) for cid in ids if cid in runtime.ledgers()}
    assert books[1] == books[2] == {cid: 1 for cid in ids[:2]}   # the clients before the failing one released


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_a_bad_worker_count_is_refused_by_name(make_spec, workers):
    with pytest.raises(ConfigError, match=f"workers must be an integer >= 1.*{workers!r}"):
        _dp_fedavg(make_spec, workers=workers)


def test_workers_are_refused_while_torch_runs_on_several_threads(make_spec):
    from privfl.data import build_federation

    config = _dp_fedavg(make_spec, workers=2)
    federation = build_federation(config.federation, seed=config.seed)
    torch.set_num_threads(2)
    with pytest.raises(ConfigError, match=r"workers=2 .* torch uses 2 here: call torch.set_num_threads\(1\)"):
        build_runtime(config, federation)


def test_flower_engines_refuse_workers(tmp_path, make_spec):
    from privfl.data import build_federation
    from privfl.engines.choice import flower_runtime_factory

    config = _dp_fedavg(make_spec, workers=2)
    with pytest.raises(ConfigError, match="workers=2 .* use workers=1, or engine 'inprocess'"):
        flower_runtime_factory(grid=None)(config, build_federation(config.federation, seed=config.seed))


def test_workers_change_no_run_and_runs_from_before_the_setting_resume(tmp_path, make_spec):
    from privfl.experiment import RunInterrupted, run_identity, train_once

    config = _dp_fedavg(make_spec, rounds=2)
    assert run_identity(config) == run_identity(_dp_fedavg(make_spec, rounds=2, workers=2))
    assert run_identity(config) != run_identity(_dp_fedavg(make_spec, rounds=2, device="auto"))
    with pytest.raises(RunInterrupted):
        train(config, str(tmp_path / "run"), progress=False, stop_after_round=1)
    stored = tmp_path / "run" / "config.json"
    values = json.loads(stored.read_text())
    del values["workers"], values["device"]       # as written before the two settings existed
    stored.write_text(json.dumps(values))
    resumed = train(None, str(tmp_path / "run"), resume=True, progress=False)
    assert resumed["rounds_completed"] == 2
    # the same run with two workers is read back, not trained again
    assert train_once(_dp_fedavg(make_spec, rounds=2, workers=2), str(tmp_path / "run")) == resumed


def test_the_flower_simulation_refuses_workers_before_it_starts(tmp_path, make_spec):
    from privfl.engines.choice import run

    with pytest.raises(ConfigError, match="workers=2 .* use workers=1, or engine 'inprocess'"):
        run(_dp_fedavg(make_spec, workers=2), str(tmp_path / "run"), engine="flower-sim", progress=False)
    assert not (tmp_path / "run").exists()
