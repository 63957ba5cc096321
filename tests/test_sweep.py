"""``privfl sweep``: a tiny MNIST sweep end to end (table, files, ledger epsilons), and its user errors."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from conftest import book_records

from privfl.cli import main
from privfl.config import RunConfig
from privfl.data import FederationSpec, build_federation
from privfl.errors import ConfigError
from privfl.evaluation.novel_pool import NovelPool, held_out_pool
from privfl.experiment import RunInterrupted, train
from privfl.sweep import SweepConfig, descriptor_margin, smallest_size_without_loss, summarise_training

TINY = ["sweep", "--clients", "6", "--max-samples", "1200", "--rounds", "2", "--client-fraction", "0.5",
        "--sizes", "20,60", "--epsilons", "0.3,3", "--novel-mixes", "2", "--eval-size", "40", "--repeats", "1",
        "--train-epsilons", "8,inf", "--private-rounds", "1", "--min-samples", "50", "--threads", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_sweep_writes_the_table_files_and_ledger_epsilons(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(TINY + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| novel epsilon \\ n | 20 | 60 |" in printed and "| non-private |" in printed and "| 0.3 |" in printed
    assert "training clients record-level DP, epsilon 8 (delta 1e-05; largest spent 8)" in printed
    # each table's epsilons with their relation, trust model and source
    assert "training epsilons: relation add_or_remove_one, trust untrusted server, from ledger.json; novel " \
           "epsilons: relation " in printed
    assert "training epsilons: relation -, trust not private, from ledger.json" in printed
    assert "trust untrusted server (each novel client noises its own descriptor), from each novel client's ledger" \
        in printed
    assert "training epsilon (rows) against novel epsilon" in printed
    for name in ("sweep.csv", "sweep.json", "sweep.png", "train/summary.json", "train/ledger.json",
                 "train-eps8/summary.json", "train-eps8/ledger.json"):
        assert (out / name).exists(), name
    result = json.loads((out / "sweep.json").read_text())
    assert list(result["trainings"]) == ["8", "inf"]
    # the private training's clients each spent exactly the epsilon their noise was calibrated for; without DP, inf
    private, clean = result["trainings"]["8"], result["trainings"]["inf"]
    assert private["training"]["epsilon_max_training"] == pytest.approx(8.0, rel=1e-3)
    assert private["training"]["training_mode"] == "record" and clean["training"]["epsilon_max_training"] == "inf"
    assert (private["training"]["rounds"], clean["training"]["rounds"]) == (1, 2)     # --private-rounds 1, --rounds 2
    assert "2 rounds without DP, 1 per private training" in printed
    purposes = {r["purpose"] for held in book_records(out / "train-eps8" / "ledger.json").values() for r in held}
    # the default encoder stays at its initialisation (encoder_lr 0): a descriptor and a weight change a round, no
    # encoder gradient
    assert purposes == {"descriptor", "weight_change"}
    for training in (private, clean):
        assert list(training["table"]) == ["inf", "0.3", "3", "control_mean_training", "control_other_mix"]
        assert list(training["table"]["0.3"]) == ["20", "60"]
        # every served novel client made exactly one release, accounted at the epsilon asked for
        assert training["ledger_epsilon_max"]["0.3"] == pytest.approx(0.3, rel=1e-6)
        assert training["ledger_epsilon_max"]["3"] == pytest.approx(3.0, rel=1e-6)
        assert training["ledger_epsilon_max"]["inf"] == "inf"          # strict JSON: no Infinity
        assert training["table"]["0.3"]["20"]["count"] == 2 and training["table"]["inf"]["20"]["count"] == 2
        # the margin is the non-private accuracy minus the better control's, per n, and the verdict follows from it
        for n in ("20", "60"):
            best = max(training["table"][c][n]["accuracy"] for c in ("control_mean_training", "control_other_mix"))
            assert training["descriptor_margin"][n] == pytest.approx(training["table"]["inf"][n]["accuracy"] - best)
        assert training["descriptor_informative"] == all(m >= 2.0 for m in training["descriptor_margin"].values())
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    for key in ("8", "inf"):
        served = [r for r in rows if r["descriptor"] in ("clean", "private") and r["train_epsilon"] == key]
        controls = [r for r in rows if r["descriptor"].startswith("control_") and r["train_epsilon"] == key]
        # 2 mixes x 2 sizes x (1 non-private + 2 epsilons x 1 repeat), one release each; the controls release nothing
        assert len(served) == 2 * 2 * 3 and {r["releases"] for r in served} == {"1"}
        assert len(controls) == 2 * 2 * 2 and {r["releases"] for r in controls} == {"0"}
    assert len(rows) == 2 * 20
    assert "non-private minus best control, per n" in printed
    # the repository's stored sweeps were made with other settings than this tiny one, and the report says so
    assert "Reference: no reference for these settings" in printed

    # A sweep whose training was interrupted continues it when run again, rather than training from scratch: the
    # releases of round 0, journaled by the interrupted process, are still the journal's first lines.
    run = RunConfig.from_dict(json.loads((out / "train" / "config.json").read_text()))
    again = tmp_path / "again"
    with pytest.raises(RunInterrupted):
        train(run, str(again / "train"), progress=False, stop_after_round=1)
    first = (again / "train" / "releases.jsonl").read_text()
    capsys.readouterr()
    assert main(TINY + ["--out", str(again), "--train-epsilons", "inf", "--reference", str(out / "sweep.json")]) == 0
    assert (again / "train" / "releases.jsonl").read_text().startswith(first)
    # the same training and serving reproduce the first sweep's cells (those of its training without DP)
    assert "Reproduced within tolerance (10 cells compared; 10 within tolerance)" in capsys.readouterr().out
    trained = [json.loads((d / "train" / "summary.json").read_text())["novel"] for d in (out, again)]
    assert trained[0] == trained[1]


@pytest.mark.parametrize("extra,needle", [
    (["--epsilons", "0"], "epsilons must be finite numbers > 0"),
    (["--sizes", "1"], "sizes must be integers >= 2"),
    (["--min-samples", "5000"], "record-level privacy min_samples=5000 is the public lower bound"),
    (["--novel-mixes", "1"], "novel_mixes must be >= 2"),
    (["--train-epsilons", "0,inf"], "train_epsilons must be finite numbers > 0 or None"),
    (["--method", "fedsgd"], "unknown method 'fedsgd'"),
])
def test_user_errors_exit_2(tmp_path, capsys, extra, needle):
    assert main(TINY + ["--out", str(tmp_path / "s")] + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_private_trainings_run_private_rounds_and_the_full_grid_runs_them_as_long_as_the_clean_one(capsys):
    from privfl.sweep import PRIVATE_ROUNDS

    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert PRIVATE_ROUNDS is None          # every training runs --rounds rounds unless told otherwise
    assert "rounds of each private training (default: as --rounds)" in " ".join(capsys.readouterr().out.split())
    config = SweepConfig(rounds=100, private_rounds=40)
    assert (config.run_config(8.0).rounds, config.run_config(None).rounds) == (40, 100)
    # validation every twentieth of the rounds (at least every round)
    assert config.run_config(8.0).eval_every == 2 and config.run_config(None).eval_every == 5
    assert SweepConfig(rounds=30, private_rounds=5).run_config(8.0).eval_every == 1
    assert SweepConfig(rounds=30, private_rounds=None).run_config(8.0).rounds == 30
    with pytest.raises(ConfigError, match="private_rounds must be an integer >= 1 or None .*got 0"):
        SweepConfig(private_rounds=0)


def test_held_out_pool_is_disjoint_from_every_training_client():
    spec = FederationSpec(source="mnist", split="train_test", num_clients=6, novel_clients=2, max_samples=1200)
    x, y = held_out_pool(spec, seed=0)
    assert x.shape == (58800, 1, 28, 28) and y.shape == (58800,)
    federation = build_federation(spec, seed=0)
    held = {row.numpy().tobytes() for row in x[:5000]}
    training = [c.x_train for c in federation.training_clients] + [c.x_val for c in federation.training_clients]
    assert sum(row.numpy().tobytes() in held for row in torch.cat(training)) == 0
    pool = NovelPool(x, y)
    a, ya = pool.draw({3: 1.0, 7: 1.0}, 101, np.random.default_rng(0))
    b, yb = pool.draw({3: 1.0, 7: 1.0}, 100, np.random.default_rng(0))
    assert sorted(torch.bincount(ya, minlength=10)[[3, 7]].tolist()) == [50, 51]
    assert torch.bincount(yb, minlength=10)[[3, 7]].tolist() == [50, 50] and pool.remaining == 58800 - 201
    assert not ({r.numpy().tobytes() for r in a} & {r.numpy().tobytes() for r in b})


def test_held_out_pool_refuses_a_spec_that_shifts_images():
    # the pool's images come back unshifted: drawing "novel clients" of a rotated spec from it would silently be wrong
    spec = FederationSpec(source="mnist", split="train_test", num_clients=6, novel_clients=2, max_samples=1200,
                          novel_rotation=30.0)
    with pytest.raises(ConfigError, match="held_out_pool returns unshifted images.*novel_rotation=30.0"):
        held_out_pool(spec, seed=0)


def test_descriptor_margin_is_clean_minus_the_best_control():
    table = {"inf": {"50": {"accuracy": 90.0}, "500": {"accuracy": 95.0}},
             "control_mean_training": {"50": {"accuracy": 89.5}, "500": {"accuracy": 80.0}},
             "control_other_mix": {"50": {"accuracy": 70.0}, "500": {"accuracy": 94.0}}}
    assert descriptor_margin(table) == {"50": pytest.approx(0.5), "500": pytest.approx(1.0)}


def test_smallest_size_without_loss_needs_every_larger_size_to_pass():
    clean = {n: {"accuracy": 95.0} for n in ("50", "150", "500", "1500")}
    cells = {"50": {"accuracy": 94.5}, "150": {"accuracy": 90.0}, "500": {"accuracy": 94.2}, "1500": {"accuracy": 95.0}}
    assert smallest_size_without_loss(cells, clean, 1.0) == 500          # 50 passes, but 150 does not
    assert smallest_size_without_loss(clean, clean, 1.0) == 50
    assert smallest_size_without_loss({**cells, "1500": {"accuracy": 93.0}}, clean, 1.0) is None


def test_the_sem_is_over_mixes_with_repeats_averaged_first():
    # 2 mixes x 2 noise repeats at epsilon 0.3: the repeats share the mix's evaluation and descriptor sets, so the
    # independent units are the mixes (means 91 and 81): SEM = |91 - 81| / 2 = 5. Pooling the four rows as
    # independent would give sqrt((4^2 + 6^2 + 6^2 + 4^2) / 3 / 4) = 2.94.
    config = SweepConfig(epsilons=(0.3,), sizes=(20,), novel_mixes=2, repeats=2, train_epsilons=(None,))
    rows = [{"mix": m, "n": 20, "epsilon": 0.3, "accuracy": a, "ledger_epsilon": 0.3}
            for m, accs in ((0, (90.0, 92.0)), (1, (80.0, 82.0))) for a in accs]
    rows += [{"mix": m, "n": 20, "epsilon": level, "accuracy": a, "ledger_epsilon": math.inf}
             for level, accs in (("inf", (95.0, 85.0)), ("control_mean_training", (70.0, 60.0)),
                                 ("control_other_mix", (50.0, 40.0))) for m, a in enumerate(accs)]
    table = summarise_training(config, rows)["table"]
    assert table["0.3"]["20"] == {"accuracy": 86.0, "sem": pytest.approx(5.0, rel=1e-12), "count": 2, "rows": 4}


def test_a_sweep_writes_over_nothing_without_overwrite(tmp_path, capsys):
    from privfl.sweep import claim

    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--dataset", "synthetic", "--clients", "8", "--partition", "iid",
                 "--rounds", "1", "--local-steps", "1", "--no-progress"]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in run.iterdir())
    # into a run directory: refused before anything is trained or written
    assert main(TINY + ["--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run} holds a training run, not a sweep" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == before
    # beside runs that are not its trainings: refused
    assert main(TINY + ["--out", str(tmp_path)]) == 2
    assert "holds runs in run, which are not this sweep's trainings (train-eps8, train)" in capsys.readouterr().err
    # into the folder of a sweep of other settings: refused, naming what differs
    out = tmp_path / "sweep"
    settings = dict(clients=6, max_samples=1200, rounds=2, client_fraction=0.5, sizes=(20, 60),
                       epsilons=(0.3, 3.0), novel_mixes=2, eval_size=40, repeats=1, train_epsilons=(8.0, None),
                       private_rounds=1, min_samples=50)
    claim(SweepConfig(**settings), out, overwrite=False)
    claim(SweepConfig(**settings), out, overwrite=False)        # the same sweep again: its own folder
    assert main(TINY + ["--out", str(out), "--repeats", "2"]) == 2
    assert "holds a sweep of other settings (repeats differ)" in capsys.readouterr().err
    # one of its training directories holding another training: refused, never retrained over
    run.rename(out / "train")
    with pytest.raises(ConfigError, match="train holds a run of another configuration"):
        claim(SweepConfig(**settings), out, overwrite=False)
    claim(SweepConfig(**{**settings, "repeats": 2}), out, overwrite=True)
    assert json.loads((out / "sweep-config.json").read_text())["repeats"] == 2


def test_sweep_passes_its_source_options_to_the_source(tmp_path, capsys):
    out = tmp_path / "sweep"
    synthetic = ["--dataset", "synthetic", "--source-option", "num_samples=3000", "--source-option", "dim=12",
                 "--train-epsilons", "inf", "--epsilons", "3", "--features", "none"]
    assert main(TINY + synthetic + ["--out", str(out)]) == 0
    config = json.loads((out / "train" / "config.json").read_text())
    assert config["federation"]["source"] == "synthetic"
    assert config["federation"]["source_options"] == {"num_samples": 3000, "dim": 12}
    spec = RunConfig.from_dict(config).federation
    assert build_federation(spec, seed=0).input_shape == (12,)       # dim=12 reached the data, not the default 20
    capsys.readouterr()
    assert main(TINY + synthetic[:2] + ["--features", "none", "--source-option", "colour=red",
                                        "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "source 'synthetic' has no option colour" in err and len(err.strip().splitlines()) == 1
