"""Central evaluation (the server model on the novel clients' pooled samples) and per-round timing in
``metrics.jsonl``."""

import json
import math

import pytest
import torch
from conftest import book_records

from privfl.config import RunConfig
from privfl.data import FederationSpec, build_federation
from privfl.errors import ConfigError
from privfl.experiment import RunInterrupted, train
from privfl.federation import RunDirectory
from privfl.federation.timing import PARTS, TIMING_KEY, RoundTimer, without_timing
from privfl.models import build_model

CENTRAL = ("central_accuracy", "central_loss", "central_num_samples")


def _config(make_spec, **overrides):
    values = dict(federation=make_spec(), method="fedavg", method_config={"lr": 0.1, "local_steps": 3,
                                                                          "batch_size": 16},
                  rounds=4, eval_every=2, checkpoint_every=2, select="last", seed=3)
    values.update(overrides)
    return RunConfig(**values)


@pytest.mark.slow
def test_central_eval_on_real_mnist_is_the_global_models_pooled_accuracy_on_the_novel_clients(tmp_path):
    spec = FederationSpec(source="mnist", num_clients=10, partition="iid", novel_fraction=0.3, max_samples=3000)
    config = RunConfig(federation=spec, method="fedavg", method_config={"lr": 0.1, "local_steps": 10,
                                                                       "batch_size": 32},
                       model="mlp2nn", rounds=2, eval_every=1, checkpoint_every=1, select="last", seed=0,
                       central_eval=True)
    summary = train(config, str(tmp_path / "run"), progress=False)
    run = RunDirectory(tmp_path / "run")
    lines = run.read_metrics()
    assert [line["round"] for line in lines] == [1, 2] and all(set(CENTRAL) <= set(line) for line in lines)
    # independently: the final global weights from the checkpoint, in a fresh 2NN, on every novel client's samples
    weights = torch.load(run.path("checkpoint.pt"), weights_only=True)["runtime"]["strategy"]["weights"]
    model = build_model("mlp2nn", (1, 28, 28), 10)
    model.load_state_dict(weights)
    model.eval()
    federation = build_federation(spec, seed=0)
    x = torch.cat([novel.x for novel in federation.novel_clients])
    y = torch.cat([federation.novel_labels.labels(novel.client_id) for novel in federation.novel_clients])
    with torch.no_grad():
        logits = model(x)
    accuracy = 100.0 * float((logits.argmax(dim=1) == y).double().mean())
    loss = float(torch.nn.functional.cross_entropy(logits.double(), y))
    last = lines[-1]
    assert last["central_num_samples"] == len(y) == sum(len(n.x) for n in federation.novel_clients) > 500
    assert last["central_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert last["central_loss"] == pytest.approx(loss, rel=1e-5)
    assert 60.0 < accuracy < 100.0          # a model that learned (75% after 2 rounds), not chance (10%)
    # FedAvg serves every novel client the global model: the final central accuracy is their pooled accuracy
    assert summary["novel"]["accuracy_pooled"] == pytest.approx(last["central_accuracy"], abs=1e-9)
    assert lines[0]["central_accuracy"] != last["central_accuracy"]     # evaluated each round, not once


def test_central_eval_changes_no_other_number_and_releases_nothing(tmp_path, make_spec):
    plain = train(_config(make_spec), str(tmp_path / "plain"), progress=False)
    central = train(_config(make_spec, central_eval=True), str(tmp_path / "central"), progress=False)
    a, b = (without_timing(RunDirectory(tmp_path / d).read_metrics()) for d in ("plain", "central"))
    assert [{k: v for k, v in line.items() if k not in CENTRAL} for line in b] == a
    assert all(0.0 <= line["central_accuracy"] <= 100.0 and line["central_loss"] > 0 for line in b)
    assert plain["novel"] == central["novel"] and plain["training_val"] == central["training_val"]
    books = [book_records(RunDirectory(tmp_path / d).path("ledger.json")) for d in ("plain", "central")]
    purposes = [sorted((cid, [r["purpose"] for r in records]) for cid, records in book.items()) for book in books]
    assert purposes[0] == purposes[1]                   # central evaluation is no release
    assert all(cid >= 0 for cid in books[1])             # and no client id of its own (CENTRAL_CLIENT is -1)
    config = json.loads(RunDirectory(tmp_path / "central").path("config.json").read_text())
    assert config["central_eval"] is True and RunConfig.from_dict(config).central_eval


@pytest.mark.parametrize("overrides,needle", [
    ({"method": "odpflhn", "method_config": {}},
     "central_eval: method 'odpflhn' has no server model to evaluate centrally: it generates each client's model"),
    ({"method": "local"}, "central_eval: method 'local' has no server model to evaluate centrally: every training"),
    ({"federation": "client_test"}, "split='client_test' has none"),
])
def test_central_eval_is_refused_where_no_server_model_or_no_held_out_set_exists(make_spec, overrides, needle):
    if overrides.get("federation") == "client_test":
        overrides = {"federation": make_spec(split="client_test", partition="iid", val_fraction=0.0)}
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _config(make_spec, central_eval=True, **overrides)


def _check_timing(line):
    time = line[TIMING_KEY]
    assert set(time) == {"rounds", "wall_s", "cpu_s"} | {f"{part}_{clock}_s" for part in (*PARTS, "bookkeeping")
                                                         for clock in ("wall", "cpu")}
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0.0 for k, v in time.items() if k != "rounds")
    for clock in ("wall", "cpu"):
        parts = [time[f"{part}_{clock}_s"] for part in PARTS]
        assert sum(parts) <= time[f"{clock}_s"] * (1 + 1e-9)
        assert sum(parts) + time[f"bookkeeping_{clock}_s"] == pytest.approx(time[f"{clock}_s"], rel=1e-9, abs=1e-12)
    assert time["client_wall_s"] > 0.0 and time["evaluation_wall_s"] > 0.0   # clients trained, then were scored
    return time["rounds"]


def test_every_metrics_line_times_the_rounds_since_the_last_and_a_resume_keeps_the_file_consistent(tmp_path,
                                                                                                   make_spec):
    config = _config(make_spec, rounds=6, checkpoint_every=4, central_eval=True)
    train(config, str(tmp_path / "full"), progress=False)
    full = RunDirectory(tmp_path / "full").read_metrics()
    assert [_check_timing(line) for line in full] == [2, 2, 2]
    with pytest.raises(RunInterrupted):
        train(config, str(tmp_path / "cut"), progress=False, stop_after_round=3)
    train(None, str(tmp_path / "cut"), resume=True, progress=False)
    cut = RunDirectory(tmp_path / "cut").read_metrics()
    # the resumed attempt's first line times the one round it ran since the checkpoint of round 3
    assert [_check_timing(line) for line in cut] == [2, 1, 2]
    assert without_timing(cut) == without_timing(full)


def test_a_timer_counts_a_part_entered_inside_another_once():
    timer = RoundTimer()
    with timer.part("client"), timer.part("aggregation"):
        sum(range(10000))
    time = timer.lap(rounds=1)
    assert time["aggregation_wall_s"] == 0.0 and 0.0 < time["client_wall_s"] <= time["wall_s"]
    assert timer.lap(rounds=0)["client_wall_s"] == 0.0        # a lap starts the next period afresh
    with pytest.raises(ValueError, match="no timed part 'network'; parts: client, aggregation, evaluation"):
        with timer.part("network"):
            pass
