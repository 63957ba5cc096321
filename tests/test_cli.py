"""The command line: user errors exit 2 with one message naming the bad value; never a traceback."""

import numpy as np
import pytest

from privfl.cli import main

BASE = ["train", "--dataset", "synthetic", "--clients", "8", "--partition", "iid", "--rounds", "2",
        "--no-progress"]


@pytest.mark.parametrize("extra,needle", [
    (["--method", "fedsgd"], "unknown method 'fedsgd'"),
    (["--dataset", "imagenet"], "imagenet"),
    (["--novel-fraction", "1.5"], "1.5"),
    (["--novel-fraction", "0"], "novel_fraction"),
    (["--lr", "-0.1"], "-0.1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--client-fraction", "2"], "client_fraction"),
    (["--partition", "pathological", "--shards-per-client", "5000"], "shards"),
    (["--method", "fedavg", "--mu", "0.1"], "no setting mu"),
    (["--method", "fedavg", "--method-option", "novel_epsilon=1"], "no setting novel_epsilon"),
    (["--lr", "0.1", "--method-option", "lr=0.2"], "contradicts --lr"),
    (["--workers", "0"], "workers must be an integer >= 1"),
    (["--workers", "2", "--threads", "2"], "call torch.set_num_threads(1) (privfl --threads 1)"),
])
def test_user_errors_exit_2_with_a_message(tmp_path, capsys, extra, needle):
    args = BASE[:1] + ["--out", str(tmp_path / "r")] + BASE[1:] + extra
    if extra[:2] == ["--dataset", "imagenet"]:
        args = ["train", "--out", str(tmp_path / "r"), "--dataset", "imagenet", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_workers_train_the_clients_of_a_one_thread_run(tmp_path):
    import json

    import torch

    before = torch.get_num_threads()
    try:
        runs = {}
        for workers in ("1", "2"):
            out = tmp_path / workers
            assert main(BASE[:1] + ["--out", str(out)] + BASE[1:] + ["--local-steps", "2", "--workers", workers,
                                                                     "--threads", "1"]) == 0
            assert json.loads((out / "config.json").read_text())["workers"] == int(workers)
            runs[workers] = (out / "metrics.jsonl").read_text()
        args = BASE[:1] + ["--out", str(tmp_path / "t")] + BASE[1:] + ["--local-steps", "2", "--workers", "2"]
        assert main(args) == 0
        assert torch.get_num_threads() == 1     # --workers above 1 without --threads: one thread
    finally:
        torch.set_num_threads(before)
    assert runs["1"] == runs["2"] == (tmp_path / "t" / "metrics.jsonl").read_text()


def test_nan_in_client_data_exits_2(tmp_path, capsys):
    x = np.random.default_rng(0).normal(size=(200, 5)).astype(np.float32)
    x[17, 2] = np.nan
    np.savez(tmp_path / "feats.npz", x=x, y=np.arange(200) % 3)
    code = main(["train", "--out", str(tmp_path / "r"), "--dataset", "features", "--source-option",
                 f"path={tmp_path / 'feats.npz'}", "--clients", "4", "--partition", "iid", "--rounds", "1",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and ("nan" in err.lower() or "finite" in err.lower()) and "Traceback" not in err


def test_train_then_report(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(BASE[:1] + ["--out", out] + BASE[1:] + ["--local-steps", "2"]) == 0
    capsys.readouterr()
    assert main(["report", out]) == 0
    table = capsys.readouterr().out
    assert "fedavg" in table and "novel acc" in table and "inf" in table
    assert main(["ledger", out]) == 0
    listing = capsys.readouterr().out
    assert "model_update x2" in listing and "inf" in listing   # 2 rounds, every training client sampled
    assert main(["train", "--out", out] + BASE[1:]) == 2           # refuses to overwrite a run
    assert "already holds a run" in capsys.readouterr().err
    # --resume continues the run as its config.json says: another setting beside it is refused, not ignored
    assert main(["train", "--resume", out, "--rounds", "500", "--method", "odpflhn", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--method, --rounds would be ignored" in err and len(err.strip().splitlines()) == 1
    # resuming the finished run serves nobody again: the ledger and the release journal stay as they were
    run = tmp_path / "run"
    ledger, journal = (run / "ledger.json").read_bytes(), (run / "releases.jsonl").read_bytes()
    assert main(["train", "--resume", out, "--no-progress"]) == 0
    assert "holds a finished run: nothing to resume" in capsys.readouterr().out
    assert (run / "ledger.json").read_bytes() == ledger and (run / "releases.jsonl").read_bytes() == journal


def test_method_options_reach_the_method_config_and_the_ledger(tmp_path, capsys):
    import json

    out = tmp_path / "odpfl"
    args = ["train", "--out", str(out), "--dataset", "synthetic", "--clients", "8", "--partition", "iid",
            "--rounds", "1", "--no-progress", "--method", "odpflhn", "--local-steps", "2",
            "--novel-epsilon", "0.5", "--method-option", 'encoder="dp_deepset"',
            "--method-option", "encoder_hidden=8"]
    assert main(args) == 0
    capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    assert config["novel_privacy"]["epsilon"] == 0.5 and config["method_config"]["encoder_hidden"] == 8
    assert config["method_config"]["local_steps"] == 2
    privacy = json.loads((out / "summary.json").read_text())["privacy"]
    # the 4 novel clients each released one descriptor through privatize at the epsilon given
    assert privacy["epsilon_max_novel"] == pytest.approx(0.5, rel=1e-6)
    novel = {k: v for k, v in privacy["epsilon_per_client"].items() if v != "inf"}
    assert len(novel) == 4 and all(v == pytest.approx(0.5, rel=1e-6) for v in novel.values())
    # what those epsilons hold under (the training clients' releases are non-private: no relation)
    assert privacy["relations"] == ["replace one sample; n public"]


def test_datasets_lists_every_source(capsys):
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    for name in ("mnist", "digits", "fashion_mnist", "cifar10", "cifar100", "emnist", "features", "synthetic"):
        assert name in out
    assert [line for line in out.splitlines() if line.startswith("mnist ")][0].split()[1] == "available"


def test_attack_audit_runs_from_the_privfl_command(capsys):
    assert main(["attack", "audit", "--mechanism", "maxpool", "--epsilon", "1", "--trials", "4000", "--seed", "0"]) == 0
    assert "VIOLATION" in capsys.readouterr().out
    assert main(["attack", "audit", "--mechanism", "privatize", "--epsilon", "-1"]) == 2
    assert "-1" in capsys.readouterr().err


@pytest.mark.parametrize("damage,needle", [
    ("checkpoint_cut", "checkpoint.pt is damaged (RuntimeError"),
    ("config_cut", "config.json is damaged (not JSON"),
    ("config_key", "unknown run setting(s) colour"),
    ("journal_line", "cannot resume: malformed release journal"),
    ("config_edited", "checkpoint.pt was saved by a run with another config.json"),
])
def test_a_damaged_run_directory_is_named_in_one_line_on_resume(tmp_path, capsys, damage, needle):
    import json

    from privfl.config import RunConfig
    from privfl.experiment import RunInterrupted, train

    out = tmp_path / "run"
    config = RunConfig.from_dict({"federation": {"source": "synthetic", "num_clients": 8, "partition": "iid"},
                                  "rounds": 3, "checkpoint_every": 1,
                                  "method_config": {"local_steps": 2, "batch_size": 16}})
    with pytest.raises(RunInterrupted):
        train(config, str(out), progress=False, stop_after_round=1)
    if damage == "checkpoint_cut":
        data = (out / "checkpoint.pt").read_bytes()
        (out / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    elif damage == "config_cut":
        (out / "config.json").write_text((out / "config.json").read_text()[:40])
    elif damage == "config_edited":   # another method, whose checkpoint would load: only the config's sha256 tells
        edited = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**edited, "method": "fedprox"}))
    elif damage == "config_key":
        (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "colour": 1}))
    else:
        with open(out / "releases.jsonl", "a") as f:
            f.write("not json\n")
    assert main(["train", "--resume", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_paths_and_values_outside_a_run_exit_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(BASE[:1] + ["--out", str(tmp_path / "file" / "run")] + BASE[1:]) == 2
    assert "cannot create the run directory" in capsys.readouterr().err
    out = str(tmp_path / "run")
    assert main(BASE[:1] + ["--out", out] + BASE[1:] + ["--local-steps", "1"]) == 0
    capsys.readouterr()
    assert main(["ledger", out, "--delta", "2"]) == 2
    captured = capsys.readouterr()
    assert "--delta must be a probability in (0, 1), got 2.0" in captured.err and captured.out == ""


def test_an_internal_fault_shows_its_traceback_and_asks_for_a_report(tmp_path, capsys, monkeypatch):
    # a bug inside privfl is not a user error: it must not be printed as one (exit 2, one line, no traceback)
    from privfl.errors import InternalError
    from privfl.federation.runtime import InProcessRuntime

    def broken(self, round):
        raise InternalError(f"round {round} requested but 7 rounds are completed")

    monkeypatch.setattr(InProcessRuntime, "run_round", broken)
    code = main(BASE[:1] + ["--out", str(tmp_path / "r")] + BASE[1:] + ["--local-steps", "1"])
    err = capsys.readouterr().err
    assert code == 70
    assert "Traceback" in err and "InternalError: round 0 requested but 7 rounds are completed" in err
    assert "this is a bug in privfl" in err and "please report it" in err


def test_privacy_options_build_the_run_privacy_and_refuse_mixes():
    from privfl.cli import _privacy, build_parser
    from privfl.errors import PrivflError

    def privacy(*flags):
        return _privacy(build_parser().parse_args(["train", "--out", "x", *flags]))

    record, novel = privacy("--dp-epsilon", "8", "--dp-max-grad-norm", "0.5", "--dp-min-samples", "32",
                            "--novel-epsilon", "1", "--delta", "1e-6")
    assert (record.mode, record.epsilon, record.clip, record.min_samples, record.delta) == ("record", 8.0, 0.5, 32,
                                                                                            1e-6)
    assert (novel.epsilon, novel.delta, novel.bound) == (1.0, 1e-6, 1.0)
    central, _ = privacy("--client-dp", "central", "--client-dp-epsilon", "2", "--client-dp-clip", "adaptive")
    assert (central.mode, central.epsilon, central.clip) == ("central", 2.0, "adaptive")
    assert privacy()[0].mode is None
    with pytest.raises(PrivflError, match="--dp-min-samples needs --dp-noise-multiplier or --dp-epsilon"):
        privacy("--dp-min-samples", "32")
    with pytest.raises(PrivflError, match="not both"):
        privacy("--dp-epsilon", "8", "--client-dp", "local")
    with pytest.raises(PrivflError, match="--client-dp-clip must be a number > 0 or 'adaptive', got 'auto'"):
        privacy("--client-dp", "central", "--client-dp-clip", "auto")
