"""Every registered method against the method contract (``sorted(METHODS)``: a new method gets these tests by
registering, as a new layer gets Opacus' grad-sample tests or a new metric torchmetrics' ``MetricTester``).

For each method:

* its config round-trips through ``config.json``;
* for every privacy mode (none, record, central, distributed, local) either a 2-round synthetic run ends with a
  finite epsilon for every training client in ``summary.json`` and ``ledger.json``, equal to what ``privfl ledger``
  recomputes from ``releases.jsonl`` and to the epsilon of what the run released, or the method's registration
  refuses the mode and the run is refused with that reason before anything is released;
* a run interrupted after its first round and resumed gives the same final server state as an uninterrupted run
  (seeded noise; record-level DP, where methods have the most private paths);
* its serving snapshot (the best-validation snapshot a checkpoint keeps, without momentum or optimiser state)
  gives training and novel clients the messages its full state gives;
* novel clients never see labels (the object a method receives has no ``y``).

Methods with a hypernetwork that can generate only the target's head (a ``generated`` setting) run the privacy-mode
and resume checks a second time with ``generated="head"`` (the rest of the target shared, moved by the mean weight
change with momentum), so the shared part's release, accounting and saved state are held to the same contract.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from accounting import ComposedEvent, LedgerBook, ReleaseJournal
from accounting import epsilon as accounting_epsilon
from privfl.cli import main as cli
from privfl.config import RunConfig
from privfl.data import FederationSpec, NovelClient, build_federation
from privfl.errors import ConfigError, InternalError
from privfl.experiment import RunInterrupted, build_runtime, train
from privfl.federation import RunDirectory
from privfl.methods import METHODS
from privfl.privacy.training import MODES, TrainingPrivacy

METHOD_NAMES = sorted(METHODS)
#: The methods whose hypernetwork can generate only the target's head, and the settings that make it do so.
HEAD_METHODS = [m for m in METHOD_NAMES if "generated" in {f.name for f in dataclasses.fields(METHODS[m].config)}]
HEAD = {"generated": "head", "shared_momentum": 0.5}
DELTA = 1e-5
QUICK = {"local_steps": 2, "batch_size": 16}   # for every method that has them; its smoke_settings add the rest


def smoke_config(method: str, mode: str | None, settings: dict | None = None, **overrides) -> RunConfig:
    """A 2-round run of ``method`` on a small synthetic federation, under ``mode`` with seeded noise; ``settings``
    override the method's smoke settings."""
    spec = METHODS[method]
    federation = FederationSpec(source="synthetic", source_options={"num_samples": 900, "dim": 8, "num_classes": 3},
                                num_clients=8, partition="iid", novel_fraction=0.25, val_fraction=0.2)
    privacy = TrainingPrivacy() if mode is None else TrainingPrivacy(
        mode=mode, noise_multiplier=1.0, clip=1.0, noise="seeded", noise_seed=11, min_samples=8)
    fields = {f.name for f in dataclasses.fields(spec.config)}
    method_settings = {k: v for k, v in QUICK.items() if k in fields} | dict(spec.smoke_settings) | (settings or {})
    values = dict(federation=federation, method=method, method_config=method_settings, rounds=2,
                  eval_every=1, checkpoint_every=1, select="last", seed=5, delta=DELTA, privacy=privacy,
                  client_fraction=0.75 if mode == "central" else 1.0)
    values.update(overrides)
    return RunConfig(**values)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_the_config_round_trips_through_config_json(method):
    config = smoke_config(method, None)
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("mode", (None, *MODES))
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_runs_each_privacy_mode_with_finite_epsilons_or_refuses_it_by_name(method, mode, tmp_path,
                                                                                       capsys):
    _runs_or_refuses(method, mode, tmp_path, capsys)


@pytest.mark.parametrize("mode", (None, *MODES))
@pytest.mark.parametrize("method", HEAD_METHODS)
def test_hypernetworks_generating_only_the_head_run_each_privacy_mode_or_refuse_it_by_name(method, mode, tmp_path,
                                                                                          capsys):
    _runs_or_refuses(method, mode, tmp_path, capsys, HEAD)


def _runs_or_refuses(method: str, mode: str | None, tmp_path, capsys, settings: dict | None = None) -> None:
    spec = METHODS[method]
    reason = None if mode is None else spec.privacy[mode]
    if reason is not None:
        with pytest.raises(ConfigError, match=re.escape(f"method {method!r} cannot run with privacy mode {mode!r}: "
                                                        f"{reason}")):
            smoke_config(method, mode, settings)
        return
    out = tmp_path / "run"
    summary = train(smoke_config(method, mode, settings), str(out), progress=False)
    run = RunDirectory(out)
    training = [int(row["client_id"]) for row in run.read_clients() if row["role"] == "training"]
    reported = {int(cid): eps for cid, eps in summary["privacy"]["epsilon_per_client"].items()}
    book = LedgerBook.load(run.path(RunDirectory.LEDGER))
    journal = LedgerBook()
    ReleaseJournal(run.path(RunDirectory.RELEASES)).replay_into(journal)
    for cid in training:
        from_ledger = book[cid].spent(DELTA).epsilon if cid in book else 0.0
        from_journal = journal[cid].spent(DELTA).epsilon if cid in journal else 0.0
        assert reported[cid] == pytest.approx(from_ledger, rel=1e-9) == pytest.approx(from_journal, rel=1e-9)
        if mode is None:
            continue
        assert math.isfinite(reported[cid]) and reported[cid] >= 0, (cid, reported[cid])
        if cid in book:
            assert all(r.audience != "everyone" or r.event.relation is not None for r in book[cid].records), \
                [r.purpose for r in book[cid].records]
    if mode is not None:
        assert math.isfinite(summary["privacy"]["epsilon_max_training"])
        assert summary["privacy"]["training_mode"] == mode
    if mode == "central":
        # every training client's ledger holds one aggregate per round, sampled that round or not
        for cid in training:
            assert [r.purpose for r in book[cid].records if r.audience == "everyone"] == ["central_aggregate"] * 2
    # `privfl ledger` recomputes the same epsilons from the run's files
    assert cli(["ledger", str(out)]) == 0
    listed = capsys.readouterr().out
    for cid in training:
        if cid in book:
            assert re.search(rf"^\s*{cid}\s", listed, flags=re.M), listed


@pytest.mark.parametrize("method", [m for m in METHOD_NAMES if METHODS[m].privacy["record"] is None
                                    and METHODS[m].releases_per_round > 0])
def test_the_round_a_plan_prices_bounds_every_round_a_training_client_records(method, tmp_path):
    """Record level: the round the plan prices before the first release (``planned_round_event``) bounds every round
    a training client then records (equal for one-release methods: DP-SGD fits, DP-FedPFT's one Gaussian)."""
    from privfl.config import build_client

    config = smoke_config(method, "record", rounds=2)
    federation = build_federation(config.federation, seed=config.seed)
    client = build_client(config, federation.input_shape, federation.num_classes, len(federation.training_clients))
    planned = getattr(client, "inner", client).planned_round_event()
    train(config, str(tmp_path / "run"), progress=False)
    run = RunDirectory(tmp_path / "run")
    training = {int(row["client_id"]) for row in run.read_clients() if row["role"] == "training"}
    book = LedgerBook.load(run.path(RunDirectory.LEDGER))
    rounds: dict[tuple, list] = {}
    for cid in training & set(book):
        for record in book[cid].records:
            rounds.setdefault((cid, record.round), []).append(record.event)
    assert rounds, "no training client recorded a release"
    priced = accounting_epsilon(planned, DELTA)
    for (cid, round), events in rounds.items():
        recorded = events[0] if len(events) == 1 else ComposedEvent(tuple(events))
        if METHODS[method].releases_per_round == 1:
            assert recorded == planned, (method, cid, round, events, planned)
        assert accounting_epsilon(recorded, DELTA) <= priced * (1 + 1e-9), (method, cid, round, events, planned)


@pytest.mark.parametrize("method,settings", [(m, None) for m in METHOD_NAMES] + [(m, HEAD) for m in HEAD_METHODS])
def test_a_resumed_run_gives_the_uninterrupted_run_s_state(method, settings, tmp_path):
    mode = "record" if METHODS[method].privacy["record"] is None else None
    config = smoke_config(method, mode, settings, rounds=3)
    whole = train(config, str(tmp_path / "whole"), progress=False)
    with pytest.raises(RunInterrupted):
        train(config, str(tmp_path / "parts"), progress=False, stop_after_round=1)
    resumed = train(None, str(tmp_path / "parts"), resume=True, progress=False)
    assert resumed["rounds_completed"] == whole["rounds_completed"] == 3
    states = [torch.load(RunDirectory(tmp_path / d).path(RunDirectory.CHECKPOINT), weights_only=True)["runtime"]
              for d in ("whole", "parts")]
    assert _equal(states[0]["strategy"], states[1]["strategy"])
    assert _equal(states[0]["client_states"], states[1]["client_states"])
    assert resumed["novel"] == whole["novel"]


@pytest.mark.parametrize("method,mode", [(m, None) for m in METHOD_NAMES] + [("odpflhn", "central")])
def test_a_serving_snapshot_scores_and_serves_as_the_full_state_does(method, mode):
    config = smoke_config(method, mode, rounds=2)
    federation = build_federation(config.federation, seed=config.seed)
    runtime = build_runtime(config, federation)
    for round in range(2):
        runtime.run_round(round)
    full, serving = runtime.snapshot(), runtime.serving_snapshot()
    novel = federation.novel_clients[0].client_id

    def messages():
        sent = {cid: runtime.strategy.configure_evaluate(cid).arrays for cid in runtime.training_ids}
        if runtime.serves_novel_clients:
            sent["novel"] = runtime.strategy.novel_request(novel).arrays
        return sent

    runtime.restore(full)
    expected = messages()
    runtime.restore(serving)     # its momentum or optimiser state starts afresh: nothing the messages read
    assert _equal(messages(), expected)
    assert _equal(runtime.snapshot()["client_states"], full["client_states"])
    with pytest.raises(InternalError, match="serving snapshot"):
        runtime.run_round(2)
    # the parts it leaves out are those the method names as training-only, and only those
    inner = (lambda state: state["inner"]) if mode == "central" else (lambda state: state)
    strategy = runtime.strategy.inner if mode == "central" else runtime.strategy
    assert set(inner(full["strategy"])) - set(inner(serving["strategy"])) == \
        set(strategy.training_only) & set(inner(full["strategy"]))
    if method in ("odpflhn", "pfedhn", "pefll", "scaffold"):
        assert set(strategy.training_only) <= set(inner(full["strategy"]))


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_novel_clients_reach_the_method_without_labels(method, tmp_path, monkeypatch):
    # whatever a method's procedure is given for a novel client holds unlabelled inputs and an id, nothing else
    procedure = METHODS[method].client
    seen = []
    for hook in ("novel_query", "novel_model"):
        original = getattr(procedure, hook)

        def spy(self, novel, message, _original=original):
            seen.append(novel)
            return _original(self, novel, message)

        monkeypatch.setattr(procedure, hook, spy)
    summary = train(smoke_config(method, None, rounds=1), str(tmp_path / "run"), progress=False)
    if not METHODS[method].client.serves_novel_clients:
        assert seen == [] and summary["novel"]["num_clients"] == 0
        return
    assert seen and all(type(novel) is NovelClient for novel in seen)
    assert all(not hasattr(novel, name) for novel in seen for name in ("y", "labels", "__dict__"))
    assert summary["novel"]["num_clients"] == 2


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_central_evaluation_scores_the_server_model_or_is_refused_with_the_registration_s_reason(method, tmp_path):
    reason = METHODS[method].central_eval
    if reason is not None:
        assert isinstance(reason, str) and reason
        with pytest.raises(ConfigError, match=re.escape(f"method {method!r} has no server model to evaluate "
                                                        f"centrally: {reason}")):
            smoke_config(method, None, central_eval=True)
        return
    train(smoke_config(method, None, rounds=1, central_eval=True), str(tmp_path / "run"), progress=False)
    line = RunDirectory(tmp_path / "run").read_metrics()[-1]
    federation = build_federation(smoke_config(method, None).federation, seed=5)
    assert line["central_num_samples"] == sum(len(novel.x) for novel in federation.novel_clients)
    assert 0.0 <= line["central_accuracy"] <= 100.0 and math.isfinite(line["central_loss"])
