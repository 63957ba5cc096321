"""End-to-end runs on the synthetic source: run directory contents, privacy summary, checkpoint and resume."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import assert_resumed_as_uninterrupted

from accounting import LedgerBook
from privfl.config import RunConfig
from privfl.errors import ConfigError
from privfl.experiment import RunInterrupted, train, train_once
from privfl.federation import RunDirectory
from privfl.federation.timing import without_timing


@pytest.fixture
def config(make_spec):
    return lambda method="fedavg", **overrides: _config(make_spec(), method, **overrides)


def _config(spec, method, **overrides):
    values = dict(federation=spec, method=method, method_config={"lr": 0.1, "local_steps": 5,
                                                                             "batch_size": 16},
                  rounds=6, eval_every=2, checkpoint_every=2, seed=3)
    values.update(overrides)
    return RunConfig(**values)


def test_fedavg_end_to_end_writes_a_complete_run_directory(tmp_path, config):
    summary = train(config(rounds=10), str(tmp_path / "run"), progress=False)
    run = RunDirectory(tmp_path / "run")
    for name in ("config.json", "metrics.jsonl", "clients.csv", "summary.json", "ledger.json", "checkpoint.pt",
                 "plots.png"):
        assert run.path(name).exists(), name
    assert summary["novel"]["accuracy_mean"] > 60.0      # 4 well-separated classes: chance is 25%
    assert summary["novel"]["num_clients"] == 3 and summary["training_val"]["num_clients"] == 9
    assert [r["round"] for r in run.read_metrics()] == [2, 4, 6, 8, 10]
    rows = run.read_clients()
    assert sorted(r["role"] for r in rows) == ["novel"] * 3 + ["training"] * 9
    # FedAvg sends raw updates: training clients have epsilon = inf; novel clients sent nothing: epsilon 0
    assert summary["privacy"]["epsilon_max_training"] == "inf" or math.isinf(summary["privacy"]["epsilon_max_training"])
    assert summary["privacy"]["epsilon_max_novel"] == 0.0
    ledger = json.loads(run.path("ledger.json").read_text())
    assert "model_update" in json.dumps(ledger) and "validation_metrics" in json.dumps(ledger)
    assert summary["selected_round"] in (2, 4, 6, 8, 10)
    assert summary["numerics"]["threads"] == torch.get_num_threads()
    assert summary["numerics"]["torch"] == torch.__version__
    assert RunConfig.from_dict(run.read_json("config.json")) == config(rounds=10)
    # every file gets the mode the umask gives new files (atomic writes go through mkstemp, which would give 0600)
    modes = {name: run.path(name).stat().st_mode & 0o777 for name in ("config.json", "summary.json", "ledger.json",
                                                                        "checkpoint.pt", "metrics.jsonl")}
    assert len(set(modes.values())) == 1, modes


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "scaffold", "local"])
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, method, config):
    cfg = config(method, method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16}, rounds=6,
                 client_fraction=0.5, checkpoint_every=4)
    full = train(cfg, str(tmp_path / "full"), progress=False)
    with pytest.raises(RunInterrupted, match=re.escape(f"3 of 6 rounds; continue the run with: privfl train --resume "
                                                       f"{tmp_path / 'cut'}")):
        train(cfg, str(tmp_path / "cut"), progress=False, stop_after_round=3)   # between checkpoints
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    assert_resumed_as_uninterrupted(full, resumed, tmp_path / "full", tmp_path / "cut")
    assert without_timing(RunDirectory(tmp_path / "full").read_metrics()) == \
        without_timing(RunDirectory(tmp_path / "cut").read_metrics())


def test_a_best_round_before_the_checkpoint_resumes_exactly_and_its_snapshot_holds_no_momentum(tmp_path):
    # ODPFL-HN with a server momentum that overshoots: validation accuracy peaks at round 4 of 6 (15, 33, 62, 67,
    # 36, 34 %), so the checkpoint of round 5 keeps an earlier round's snapshot beside the state it resumes from
    from privfl.data import FederationSpec
    from privfl.methods import METHODS

    spec = FederationSpec(source="synthetic", source_options={"num_samples": 900, "dim": 8, "num_classes": 3},
                          num_clients=8, partition="iid", novel_fraction=0.25, val_fraction=0.2)
    cfg = RunConfig(federation=spec, method="odpflhn", rounds=6, eval_every=1, checkpoint_every=2, seed=5,
                    select="best_val", method_config={**METHODS["odpflhn"].smoke_settings, "lr": 0.5, "hn_lr": 0.1,
                                                      "server_momentum": 0.99})
    full = train(cfg, str(tmp_path / "full"), progress=False)
    with pytest.raises(RunInterrupted):
        train(cfg, str(tmp_path / "cut"), progress=False, stop_after_round=5)
    saved = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert saved["runtime"]["completed_rounds"] == 5 and saved["best"]["round"] == full["selected_round"] == 4
    momentum = {"hnet_momentum", "encoder_momentum"}
    assert momentum <= saved["runtime"]["strategy"].keys()          # resume continues the server's momentum ...
    assert not momentum & saved["best"]["snapshot"]["strategy"].keys()   # ... serving needs none of it
    assert saved["best"]["snapshot"]["strategy"]["hnet"].keys() == saved["runtime"]["strategy"]["hnet"].keys()
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    for key in ("novel", "training_val", "selected_round", "rounds_completed"):
        assert resumed[key] == full[key], key
    from conftest import tensors_by_name

    a, b = (tensors_by_name(torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)) for d in ("full", "cut"))
    strategy = [name for name in a if name.startswith(("runtime.strategy.", "best.snapshot."))]
    assert any(".hnet_momentum." in name for name in strategy) and a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in strategy)
    assert without_timing(RunDirectory(tmp_path / "full").read_metrics()) == \
        without_timing(RunDirectory(tmp_path / "cut").read_metrics())


def test_train_once_reuses_only_the_same_run_and_resumes_an_interrupted_one(tmp_path, config):
    out = str(tmp_path / "run")
    first = train_once(config(rounds=4), out, progress=False)
    assert first["rounds_completed"] == 4
    # the same config: read back, not trained again (the wall time would differ)
    assert train_once(config(rounds=4), out, progress=False)["wall_time_s"] == first["wall_time_s"]
    # another number of rounds in the same directory: refused, never the 4-round model under a 6-round label, nor
    # silently replaced; with overwrite it is trained afresh
    with pytest.raises(ConfigError, match="holds a run of another configuration"):
        train_once(config(rounds=6), out, progress=False)
    longer = train_once(config(rounds=6), out, progress=False, overwrite=True)
    assert longer["rounds_completed"] == 6 and RunConfig.from_dict(RunDirectory(out).read_json("config.json")) \
        == config(rounds=6)
    assert [r["round"] for r in RunDirectory(out).read_metrics()] == [2, 4, 6]
    # an interrupted run of the same config is continued to the numbers of an uninterrupted one
    with pytest.raises(RunInterrupted):
        train(config(rounds=6, seed=4), str(tmp_path / "cut"), progress=False, stop_after_round=4)
    resumed = train_once(config(rounds=6, seed=4), str(tmp_path / "cut"), progress=False)
    whole = train(config(rounds=6, seed=4), str(tmp_path / "whole"), progress=False)
    assert resumed["novel"] == whole["novel"] and resumed["rounds_completed"] == 6


def _on_aggregate(monkeypatch, strategy, round, action):
    """Make ``strategy`` call ``action()`` as it aggregates ``round``; returns what undoes it."""
    aggregate = strategy.aggregate_train

    def patched(self, r, replies):
        if r == round:
            action()
        return aggregate(self, r, replies)

    monkeypatch.setattr(strategy, "aggregate_train", patched)
    return lambda: monkeypatch.setattr(strategy, "aggregate_train", aggregate)


def _killed():
    raise RuntimeError("process killed")


def test_a_run_killed_between_checkpoints_keeps_the_releases_it_made(tmp_path, config, monkeypatch):
    from privfl.methods.fedavg import FedAvgStrategy

    cfg = config(rounds=6, client_fraction=0.5, checkpoint_every=2)
    full = train(cfg, str(tmp_path / "full"), progress=False)
    # rounds 0-2 done, the last checkpoint after round 1: the releases of rounds 2 and 3 are in no checkpoint
    undo = _on_aggregate(monkeypatch, FedAvgStrategy, 3, _killed)
    with pytest.raises(RuntimeError, match="process killed"):
        train(cfg, str(tmp_path / "cut"), progress=False)
    undo()
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    assert resumed["novel"] == full["novel"]        # the numbers of an uninterrupted run

    def rounds(path, purpose):
        book = LedgerBook.load(tmp_path / path / "ledger.json")
        return sorted(r.round for cid in book for r in book[cid].records if r.purpose == purpose)
    # every release made is recorded: the updates of rounds 2 and 3 twice, once before the kill and once when re-run
    # (the validation scores of round 3 were never sent: the process died first)
    lost = [r for r in rounds("full", "model_update") if r in (2, 3)]
    assert len(lost) > 0 and rounds("cut", "model_update") == sorted(rounds("full", "model_update") + lost)
    assert rounds("cut", "validation_metrics") == rounds("full", "validation_metrics") != []


def test_a_first_ctrl_c_finishes_the_round_in_progress_so_resuming_repeats_no_release(tmp_path, config, monkeypatch):
    from privfl.methods.fedavg import FedAvgStrategy

    cfg = config(rounds=4, checkpoint_every=10, eval_every=10, select="last")
    full = train(cfg, str(tmp_path / "full"), progress=False)
    # a shell's background job starts with SIGINT ignored, which train() respects; a terminal's Ctrl-C is the default
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # the user presses Ctrl-C while round 1's replies are being aggregated
    undo = _on_aggregate(monkeypatch, FedAvgStrategy, 1, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(RunInterrupted, match="interrupted after 2 of 4 rounds"):
        train(cfg, str(tmp_path / "cut"), progress=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # the handler was restored
    signal.signal(signal.SIGINT, previous)
    undo()
    resumed = train(None, str(tmp_path / "cut"), resume=True, progress=False)
    assert resumed["novel"] == full["novel"]
    # every release made once: the ledgers equal the uninterrupted run's, round by round
    books = [LedgerBook.load(tmp_path / run / "ledger.json") for run in ("full", "cut")]
    rounds = [sorted(r.round for cid in book for r in book[cid].records) for book in books]
    assert rounds[0] == rounds[1] and len(rounds[0]) == 4 * 9


def test_client_level_dp_runs_keep_their_release_cap_through_sampling_model_selection_and_resume(
        tmp_path, make_spec, monkeypatch):
    from privfl.errors import ConfigError
    from privfl.methods.fedavg import FedAvgStrategy
    from privfl.privacy.training import TrainingPrivacy

    spec = make_spec(num_clients=6, novel_fraction=0.5)

    def local_dp(**privacy):
        return TrainingPrivacy(**{"mode": "local", "epsilon": 2.0, "clip": 1.0, "participations": 4, **privacy})

    def fedavg(**overrides):
        values = dict(federation=spec, method="fedavg", model="mlp2nn", rounds=4, eval_every=100, checkpoint_every=2,
                      select="last", method_config={"local_steps": 1, "batch_size": 8}, seed=0, privacy=local_dp())
        values.update(overrides)
        return RunConfig(**values)

    # Choosing the round on validation would have every client report its accuracy outside any mechanism.
    with pytest.raises(ConfigError, match=r"select='best_val' with client-level DP, local \(epsilon=2.*"
                                          r"use select='last'"):
        fedavg(select="best_val")
    # A sampling schedule that takes a client past its cap is refused before anything runs (the schedule is public).
    with pytest.raises(ConfigError, match=r"rounds=8, client_fraction=0.5 and seed=0, training clients \[.*\] take "
                                          r"part in up to \d rounds, more than privacy participations=3"):
        train(fedavg(rounds=8, client_fraction=0.5, privacy=local_dp(participations=3)), str(tmp_path / "sampled"),
              progress=False)
    assert not (tmp_path / "sampled" / "releases.jsonl").exists()
    # Distributed noise shares: more shares than a round's clients would leave their sum short of its noise.
    with pytest.raises(ConfigError, match=r"shares=4 noise shares .* a round samples 3 training clients"):
        train(fedavg(privacy=local_dp(mode="distributed", shares=4)), str(tmp_path / "shares"), progress=False)

    # Killed in round 3, after the releases of rounds 2 and 3 but with a checkpoint of rounds 0-1 only: running
    # rounds 2 and 3 again would make 6 rounds of releases against the 4 each client's noise is calibrated for.
    undo = _on_aggregate(monkeypatch, FedAvgStrategy, 3, _killed)
    for name, every in (("cut", 2), ("every_round", 1)):
        with pytest.raises(RuntimeError, match="process killed"):
            train(fedavg(checkpoint_every=every), str(tmp_path / name), progress=False)
    undo()
    with pytest.raises(ConfigError, match=r"cannot be resumed within its privacy budget: its checkpoint holds 2 "
                                          r"rounds.* up to 6 rounds of releases, more than the 4"):
        train(None, str(tmp_path / "cut"), resume=True, progress=False)
    # With a checkpoint every round only round 3 runs again, but its releases were delivered before the kill:
    # 4 + 1 = 5 > 4 is refused as well.
    with pytest.raises(ConfigError, match=r"checkpoint holds 3 rounds.* up to 5 rounds of releases"):
        train(None, str(tmp_path / "every_round"), resume=True, progress=False)
    # An interruption between rounds (what Ctrl-C gives: a checkpoint of every completed round) resumes and ends at
    # the calibrated epsilon, 4 releases per client.
    with pytest.raises(RunInterrupted):
        train(fedavg(), str(tmp_path / "stopped"), progress=False, stop_after_round=2)
    summary = train(None, str(tmp_path / "stopped"), resume=True, progress=False)
    book = LedgerBook.load(tmp_path / "stopped" / "ledger.json")
    training = [cid for cid in book if len(book[cid])]
    assert len(training) == 3 and all(len(book[cid]) == 4 for cid in training)
    assert summary["privacy"]["epsilon_max_training"] == pytest.approx(2.0, rel=1e-9)
    assert summary["privacy"]["noise_sources"] == {"secure": 12} and "seeded_noise" not in summary["privacy"]


def _cli(*args):
    return [sys.executable, "-m", "privfl.cli", "train", "--dataset", "synthetic",
            "--source-option", "num_samples=3000", "--clients", "12", "--partition", "dirichlet", "--alpha", "1",
            "--novel-fraction", "0.25", "--rounds", "40", "--local-steps", "5", "--batch-size", "16",
            "--eval-every", "10", "--checkpoint-every", "1", "--seed", "5", "--no-progress", *args]


def test_killed_process_resumes_to_the_same_numbers(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(_cli("--out", str(tmp_path / "full")), check=True, env=env, capture_output=True)
    proc = subprocess.Popen(_cli("--out", str(tmp_path / "cut")), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "cut" / "checkpoint.pt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if checkpoint.exists() and torch.load(checkpoint, weights_only=True)["runtime"]["completed_rounds"] >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "cut" / "summary.json").exists()
    result = subprocess.run([sys.executable, "-m", "privfl.cli", "train", "--resume", str(tmp_path / "cut"),
                             "--no-progress"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    full = RunDirectory(tmp_path / "full").read_json("summary.json")
    resumed = RunDirectory(tmp_path / "cut").read_json("summary.json")
    assert resumed["novel"] == full["novel"] and resumed["training_val"] == full["training_val"]


def test_fedavg_with_dp_sgd_reports_the_composed_epsilon(tmp_path, make_spec):
    from accounting import SelfComposedEvent, SubsampledGaussianEvent, epsilon
    from privfl.privacy.training import TrainingPrivacy

    cfg = _config(make_spec(num_clients=5, novel_fraction=0.4), "fedavg",
                  method_config={"lr": 0.1, "local_steps": 4, "batch_size": 16}, rounds=3, eval_every=3,
                  select="last", privacy=TrainingPrivacy(mode="record", noise_multiplier=1.1, clip=1.0))
    summary = train(cfg, str(tmp_path / "dp"), progress=False)
    rows = {int(r["client_id"]): r for r in RunDirectory(tmp_path / "dp").read_clients()}
    client = next(r for r in rows.values() if r["role"] == "training")
    q = min(1.0, 16 / 8)    # the public rate: batch_size / min_samples (8 by default), never batch / n
    expected = epsilon(SelfComposedEvent(SubsampledGaussianEvent(1.1, q), 3 * 4), 1e-5)   # 3 rounds x 4 steps
    assert float(client["epsilon"]) == pytest.approx(expected, rel=1e-6)
    assert 0 < summary["privacy"]["epsilon_max_training"] < float("inf")
    assert summary["privacy"]["relations"] == ["add_or_remove_one"]   # DP-SGD's records
    assert summary["novel"]["num_clients"] == 2


def test_best_validation_selection_without_validation_data_is_refused_by_name(tmp_path, make_spec):
    from privfl.errors import ConfigError

    with pytest.raises(ConfigError, match="select='best_val'.*val_fraction=0 gives them none"):
        _config(make_spec(num_clients=5, novel_fraction=0.4, val_fraction=0.0), "fedavg", select="best_val")
    # a val_fraction too small for any client to keep a validation sample is found at the first evaluation
    tiny = _config(make_spec(num_clients=5, novel_fraction=0.4, val_fraction=0.001), "fedavg", select="best_val",
                   rounds=2, eval_every=1)
    with pytest.raises(ConfigError, match="no training client has any at val_fraction=0.001"):
        train(tiny, str(tmp_path / "tiny"), progress=False)
    assert _config(make_spec(num_clients=5, novel_fraction=0.4, val_fraction=0.0), "fedavg", select="last")


def _add_keys(path: str, worker: int, count: int) -> None:
    from privfl.federation.rundir import update_json

    for i in range(count):
        def add(stored: dict, key=f"{worker}-{i}", i=i) -> dict:
            time.sleep(0.001)   # widen the read-write window an unlocked merge would lose rows in
            return {**stored, key: float("inf") if i == 0 else i}
        update_json(path, add)


def test_update_json_merges_parallel_writers_without_losing_rows(tmp_path):
    import multiprocessing

    path = tmp_path / "results.json"
    workers = [multiprocessing.get_context("fork").Process(target=_add_keys, args=(str(path), w, 20)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join()
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]
    stored = json.loads(path.read_text())   # strict JSON: non-finite values as strings
    assert sorted(stored) == sorted(f"{w}-{i}" for w in range(4) for i in range(20))
    assert stored["2-0"] == "inf" and stored["3-19"] == 19
    assert not list(tmp_path.glob(".results.json.*.tmp"))   # no temporary file left behind


def test_the_library_refuses_an_empty_out_and_deltas_that_disagree(tmp_path, tiny_config, monkeypatch):
    from privfl.privacy.training import TrainingPrivacy

    monkeypatch.chdir(tmp_path)
    # the command line refused --out '', the library wrote a whole run into the current directory
    for out in ("", "  "):
        with pytest.raises(ConfigError, match="out must name a run directory, got"):
            train(tiny_config(), out, progress=False)
    assert list(tmp_path.iterdir()) == []
    # epsilon reported at delta 0.5 for noise calibrated at 1e-5 read 0.0: the two must be the same delta
    with pytest.raises(ConfigError, match=r"delta=0\.5 \(the delta every epsilon of the run is reported at\) differs "
                                          r"from privacy delta=1e-05 \(the delta its noise is calibrated for\)"):
        tiny_config(delta=0.5, privacy=TrainingPrivacy(mode="record", epsilon=1.0, delta=1e-5))


def test_a_new_run_refused_by_its_plan_leaves_no_folder(tmp_path, tiny_config, small_pld_grids):
    from privfl.privacy.training import TrainingPrivacy

    # central DP at client fraction 1e-9: every client is sampled with probability below delta, so epsilon is 0
    # whatever the noise and no noise multiplier is the least that meets epsilon 1 (this search used to run away
    # in memory, ignoring Ctrl-C); refused before any release, no folder left
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"cannot be calibrated for 4 rounds at client sampling rate 1e-09: "
                                          r"even the least noise .* spends only epsilon 0"):
        train(tiny_config(client_fraction=1e-9, privacy=TrainingPrivacy(mode="central", epsilon=1.0)), str(out),
              progress=False)
    assert not out.exists()
