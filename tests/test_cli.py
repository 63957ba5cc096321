"""The command line: user errors exit 2 with one message naming the bad value; never a traceback."""

import argparse
import re
import time

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
    # a --method-option VALUE of the wrong JSON type: named with the type due, never a TypeError's traceback
    (["--method", "odpflhn", "--method-option", 'encoder={"a": 1}'],
     "method 'odpflhn' setting encoder must be a string, got {'a': 1}, a JSON object"),
    (["--method-option", 'lr="fast"'], "method 'fedavg' setting lr must be a number, got 'fast', a string"),
    (["--method-option", "local_steps=true"],
     "setting local_steps must be an integer, got True, a boolean (true or false)"),
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

    from privfl.federation import RunDirectory
    from privfl.federation.timing import without_timing

    before = torch.get_num_threads()
    try:
        runs = {}
        for workers in ("1", "2"):
            out = tmp_path / workers
            assert main(BASE[:1] + ["--out", str(out)] + BASE[1:] + ["--local-steps", "2", "--workers", workers,
                                                                     "--threads", "1"]) == 0
            assert json.loads((out / "config.json").read_text())["workers"] == int(workers)
            runs[workers] = without_timing(RunDirectory(out).read_metrics())
        args = BASE[:1] + ["--out", str(tmp_path / "t")] + BASE[1:] + ["--local-steps", "2", "--workers", "2"]
        assert main(args) == 0
        assert torch.get_num_threads() == 1     # --workers above 1 without --threads: one thread
    finally:
        torch.set_num_threads(before)
    assert runs["1"] == runs["2"] == without_timing(RunDirectory(tmp_path / "t").read_metrics())


def test_nan_in_client_data_exits_2(tmp_path, capsys):
    x = np.random.default_rng(0).normal(size=(200, 5)).astype(np.float32)
    x[17, 2] = np.nan
    np.savez(tmp_path / "feats.npz", x=x, y=np.arange(200) % 3)
    code = main(["train", "--out", str(tmp_path / "r"), "--dataset", "features", "--source-option",
                 f"path={tmp_path / 'feats.npz'}", "--clients", "4", "--partition", "iid", "--rounds", "1",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and ("nan" in err.lower() or "finite" in err.lower()) and "Traceback" not in err


def _table_row(table, first):
    """{column: cell} of the row of a fixed-width table (header on its first line) that starts with ``first``."""
    lines = [line for line in table.splitlines() if line.strip()]
    header = re.split(r"\s{2,}", lines[0].strip())
    return dict(zip(header, next(re.split(r"\s{2,}", line.strip()) for line in lines[2:] if line.startswith(first)),
                    strict=False))


def test_every_epsilon_table_names_the_relation_the_trust_model_and_the_source():
    from privfl.evaluation import comparison_table

    cases = [  # (privacy block of a summary, the trust model its table must show)
        ({"training_mode": "record", "relations": ["add_or_remove_one"]}, "untrusted server"),
        ({"training_mode": "local", "relations": ["replace_one"]}, "untrusted server"),
        ({"training_mode": "central", "relations": ["add_or_remove_one"]}, "trusted aggregator"),
        ({"training_mode": "distributed", "relations": ["replace_one"],
          "secure_aggregation": {"protocol": "simulated"}}, "simulated secure aggregation"),
        ({"training_mode": "distributed", "relations": ["replace_one"],
          "secure_aggregation": {"protocol": "SecAgg+"}}, "SecAgg+ secure aggregation"),
        ({"training_mode": None}, "not private"),
    ]
    for privacy, trust in cases:
        summary = {"method": "fedavg", "novel": {}, "training_val": {}, "rounds_completed": 1, "selected_round": 1,
                   "privacy": {"epsilon_max_training": 2.0, "epsilon_max_novel": 0.0,
                               "epsilon_source": "ledger.json", **privacy}}
        row = _table_row(comparison_table([summary]), "fedavg")
        assert (row["relation"], row["trust"], row["eps from"]) == (
            "; ".join(privacy.get("relations", [])) or "-", trust, "ledger.json"), privacy
    # a summary that does not say where its epsilons come from is shown as the summary's own figures
    del summary["privacy"]["epsilon_source"]
    assert _table_row(comparison_table([summary]), "fedavg")["eps from"] == "summary.json"


def test_train_then_report(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(BASE[:1] + ["--out", out] + BASE[1:] + ["--local-steps", "2"]) == 0
    # privfl train's closing table: the epsilons' relation, trust model and source (the run's ledger)
    row = _table_row(capsys.readouterr().out, "fedavg")
    assert (row["eps train"], row["relation"], row["trust"], row["eps from"]) == ("inf", "-", "not private",
                                                                                 "ledger.json")
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
    ("journal_line", "releases.jsonl is damaged: line 5 is not JSON"),
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
    from privfl.cli import build_parser
    from privfl.cli.options import privacy_of
    from privfl.errors import ConfigError, PrivflError

    def privacy(*flags):
        return privacy_of(build_parser().parse_args(["train", "--out", "x", *flags]))

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
    rated, _ = privacy("--dp-epsilon", "3", "--dp-sampling-rate", "0.05")
    assert (rated.sampling_rate, privacy("--dp-epsilon", "3")[0].sampling_rate) == (0.05, None)
    with pytest.raises(PrivflError, match="--dp-sampling-rate needs --dp-noise-multiplier or --dp-epsilon"):
        privacy("--dp-sampling-rate", "0.05")
    with pytest.raises(ConfigError, match=r"privacy sampling_rate must be a probability in \(0, 1\].*got 1.5"):
        privacy("--dp-epsilon", "3", "--dp-sampling-rate", "1.5")
    with pytest.raises(PrivflError, match="not both"):
        privacy("--dp-epsilon", "8", "--client-dp", "local")
    with pytest.raises(PrivflError, match="--client-dp-clip must be a number > 0 or 'adaptive', got 'auto'"):
        privacy("--client-dp", "central", "--client-dp-clip", "auto")


DEMO = ["demo", "--dataset", "synthetic", "--clients", "8", "--partition", "iid", "--rounds", "1", "--local-steps",
        "2", "--no-progress"]


def test_demo_applies_the_method_settings_it_is_given(tmp_path, capsys):
    """The demo's own settings (the FedTTA paper's learning rates) with the user's on top, per method that has
    them; nothing given is silently ignored."""
    import json

    from privfl.cli.commands import DEMO_METHODS

    out = tmp_path / "demo"
    assert main(DEMO + ["--out", str(out), "--lr", "0.05", "--mu", "0.5", "--method-option", "lr_decay=0.9"]) == 0
    capsys.readouterr()
    stored = {m: json.loads((out / m / "config.json").read_text())["method_config"] for m, _ in DEMO_METHODS}
    assert {m: (c["lr"], c["lr_decay"], c["local_steps"]) for m, c in stored.items()} == {
        m: (0.05, 0.9, 2) for m in stored}
    assert stored["fedprox"]["mu"] == 0.5
    assert stored["scaffold"]["server_lr"] == dict(DEMO_METHODS)["scaffold"]["server_lr"]
    assert main(DEMO + ["--out", str(tmp_path / "other"), "--method-option", "encoder=\"deepset\""]) == 2
    err = capsys.readouterr().err
    assert "have no setting encoder" in err and "valid:" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "other").exists()


def test_demo_writes_over_nothing_without_overwrite(tmp_path, capsys):
    import json

    out = tmp_path / "demo"
    assert main(DEMO + ["--out", str(out)]) == 0
    capsys.readouterr()
    journals = {m: (out / m / "releases.jsonl").read_bytes() for m in ("fedavg", "fedprox", "scaffold")}
    walls = {m: json.loads((out / m / "summary.json").read_text())["wall_time_s"] for m in journals}
    # the same settings again: every run read back, nothing trained or released again
    assert main(DEMO + ["--out", str(out)]) == 0
    capsys.readouterr()
    assert {m: (out / m / "releases.jsonl").read_bytes() for m in journals} == journals
    assert {m: json.loads((out / m / "summary.json").read_text())["wall_time_s"] for m in journals} == walls
    # other settings: refused before any training (scaffold, the last method, is untouched too), one line
    assert main(DEMO + ["--out", str(out), "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'fedavg'} holds a run of another configuration" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1
    assert {m: (out / m / "releases.jsonl").read_bytes() for m in journals} == journals
    # --out naming a run directory, or a sweep's folder: refused
    assert main(DEMO + ["--out", str(out / "fedavg")]) == 2
    assert f"{out / 'fedavg'} already holds a run" in capsys.readouterr().err
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep-config.json").write_text("{}")
    assert main(DEMO + ["--out", str(sweep)]) == 2
    assert f"{sweep} already holds a sweep" in capsys.readouterr().err
    assert sorted(p.name for p in sweep.iterdir()) == ["sweep-config.json"]
    # with --overwrite the runs of other settings are replaced
    assert main(DEMO + ["--out", str(out), "--seed", "3", "--overwrite"]) == 0
    assert json.loads((out / "scaffold" / "config.json").read_text())["seed"] == 3


def test_a_disk_that_fills_mid_run_is_one_line_and_the_run_resumes_from_its_last_checkpoint(tmp_path, capsys,
                                                                                            monkeypatch):
    import errno
    import os

    from accounting import LedgerBook
    from privfl.federation import rundir

    out = tmp_path / "run"
    writes = []
    real = rundir.atomic_write_bytes

    def filling(path, data):     # the third checkpoint (after round 1) meets a full disk
        writes.append(path.name)
        if writes.count("checkpoint.pt") == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(rundir, "atomic_write_bytes", filling)
    args = BASE[:1] + ["--out", str(out)] + BASE[1:] + ["--rounds", "3", "--checkpoint-every", "1", "--local-steps",
                                                        "1", "--select", "last"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"cannot write the run directory {out}: No space left on device ({out / 'checkpoint.pt'})" in err
    assert f"then continue the run with: privfl train --resume {out}" in err
    assert not list(out.glob(".checkpoint.pt.*.tmp"))
    monkeypatch.setattr(rundir, "atomic_write_bytes", real)
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    # continued from the checkpoint of round 0's end: round 0 released once, round 1 twice (before the fault and
    # again after it; both counted), round 2 once, by each of the 4 training clients
    book = LedgerBook.load(out / "ledger.json")
    rounds = sorted(r.round for cid in book for r in book[cid].records if r.round is not None)
    assert rounds == [0] * 4 + [1] * 8 + [2] * 4


def test_attack_audit_refuses_an_output_it_cannot_write_before_the_audit(tmp_path, capsys, monkeypatch):
    import attacks.audit

    def never(*args, **kwargs):
        raise AssertionError("the audit ran although its output cannot be written")

    monkeypatch.setattr(attacks.audit, "run_audit", never)
    (tmp_path / "file").write_text("")
    for path, why in [(tmp_path / "file" / "audit.json", "Not a directory"), (tmp_path, "it is a folder")]:
        assert main(["attack", "audit", "--mechanism", "maxpool", "--trials", "4000", "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--json {path} cannot be written ({why}" in err and "choose another path" in err
        assert len(err.strip().splitlines()) == 1


def _parsers():
    """(name, parser) of every privfl command, sub-commands included (``privfl flower`` builds its own parser in
    privfl.engines.flower.launch)."""
    from attacks.audit import audit_parser
    from attacks.reconstruct_cli import build_parser as reconstruct_parser
    from privfl.cli import build_parser
    from privfl.engines.flower.launch import build_parser as flower_parser

    found = []
    for prefix, root in (("privfl", build_parser()), ("privfl flower", flower_parser())):
        found.append((prefix, root))
        for action in root._actions:
            if isinstance(action, argparse._SubParsersAction):
                found += [(f"{prefix} {name}", parser) for name, parser in action.choices.items()]
    return found + [("privfl attack audit", audit_parser()), ("privfl attack reconstruct", reconstruct_parser())]


def default_mentions(text: str, default: object) -> int:
    """How often the rendered help ``text`` of an option states its default: each "default", and each value of it
    in parentheses, "(20)", the way help texts wrote it before the formatter added "(default: 20)"."""
    text = " ".join(text.split())
    values = {str(default)}
    if isinstance(default, float):
        values |= {f"{default:g}", f"{default:.1f}"}
    if isinstance(default, (tuple, list)):
        values.add(",".join(f"{v:g}" if isinstance(v, float) else "inf" if v is None else str(v) for v in default))
    bare = sum(text.count(f"({v}{end}") for v in values if v not in ("", "None") for end in ");")
    return len(re.findall(r"\bdefault\b", text, flags=re.IGNORECASE)) + bare


def test_default_mentions_counts_the_doubles_this_guards_against():
    assert default_mentions("processes, one thread each (1); the numbers (default: 1)", 1) == 2
    assert default_mentions("where: cpu (default), cuda (default: cpu)", "cpu") == 2
    assert default_mentions("training clients' clip (1.0) (default: 1.0)", 1.0) == 2
    assert default_mentions("epsilons (default: 1,3,8,inf)", (1.0, 3.0, 8.0, None)) == 1
    assert default_mentions("a set of defaults (listed below) (default: none)", None) == 1


def test_every_help_shows_each_default_once_and_the_one_that_applies(capsys):
    checked = 0
    for name, parser in _parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help in (None, argparse.SUPPRESS):
                continue
            shown = formatter._expand_help(action)
            flag = f"{name} {action.option_strings[-1]}"
            assert default_mentions(shown, action.default) <= 1, f"{flag} states its default twice: {shown!r}"
            stated = re.search(r"\(default: ([^;)]*)", shown)
            if stated and action.default is not None and not isinstance(action.default, (tuple, list)):
                assert stated.group(1).strip() in {str(action.default), f"{action.default}".lower()}, \
                    f"{flag} states default {stated.group(1)!r}, but its default is {action.default!r}"
            checked += 1
    assert checked > 180     # train's, sweep's, demo's, flower's, audit's, reconstruct's options ...
    # and the formatter shows a default once in the printed help, where the text did not state it
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--train-clip TRAIN_CLIP training clients' per-record L2 clip (default: 0.1) --min-samples" in shown
    assert "cpu (default)" not in shown and "--method METHOD any registered method (default: odpflhn)" in shown


def test_help_shows_each_default_that_applies(capsys):
    for command, rounds in (["train", 200], ["demo", 30]):
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert f"--rounds ROUNDS (default: {rounds})" in shown and "--seed SEED (default: 0)" in shown
        # no default to show where the method's own applies, nor for a flag
        assert "(default: None)" not in shown and "(default: False)" not in shown


# -- settings no accountant could report, guarantees without meaning, options that would do nothing ------------------

NO_FOLDER = [
    # each was accepted and crashed or hung in the accountant after every release was made (35 PiB, 142 PiB, 71 PiB,
    # 150 GiB, a hang) or ran away in memory before round 1 (9.5 GB)
    (["--dp-noise-multiplier", "1e-6"], "privacy noise_multiplier must be a finite number >= 0.1 (the least noise "
                                        "the accountants price"),
    (["--dp-noise-multiplier", "0.01"], "privacy noise_multiplier must be a finite number >= 0.1"),
    (["--client-dp", "local", "--client-dp-noise-multiplier", "1e-6"], "got 1e-06"),
    (["--client-dp", "central", "--client-dp-noise-multiplier", "1e-6"], "got 1e-06"),
    (["--dp-epsilon", "1e6"], "privacy epsilon must be at most 50 (the largest target noise is calibrated for"),
    (["--method", "odpflhn", "--novel-epsilon", "1e6"], "novel epsilon must be at most 50"),
    # a guarantee at a delta that lets one record (or client) out whole: refused, with what it means
    (["--dp-epsilon", "1", "--delta", "0.5"], "delta=0.5 is at least 1/"),
    (["--client-dp", "central", "--client-dp-epsilon", "1", "--delta", "0.3"],
     "delta=0.3 is at least 1/4 (one over the 4 training clients): at that delta a mechanism that publishes one of "
     "the training clients chosen at random, outright, is (0, 1/4)-DP"),
    (["--delta", "1"], "--delta must be a probability in (0, 1), got 1.0"),
    (["--delta", "1e-20"], "--delta must be a probability of at least 1e-12 (the least delta the accountants resolve"),
    # options that do nothing where they are given
    (["--novel-bound", "2"], "--novel-bound 2 would do nothing in this run of fedavg"),
    (["--method", "pefll", "--novel-epsilon", "2"],
     "novel_privacy epsilon=2.0 would go unused: a run of method 'pefll' serves no novel client"),
    (["--allow-overshoot"], "--allow-overshoot lets a resumed run (--resume RUN_DIR) pass its target epsilon"),
    # central evaluation where there is no server model, or no held-out set
    (["--method", "pefll", "--central-eval"], "central_eval: method 'pefll' has no server model to evaluate centrally"),
    (["--split", "client_test", "--val-fraction", "0", "--central-eval"], "split='client_test' has none"),
]


@pytest.mark.parametrize("extra,needle", NO_FOLDER)
def test_settings_no_accountant_can_report_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys,
                                                                                              extra, needle):
    out = tmp_path / "r"
    assert main(BASE[:1] + ["--out", str(out)] + BASE[1:] + ["--select", "last"] + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and "novel delta" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_large_delta_runs_only_when_allowed_and_says_what_it_means_and_the_plan_is_what_the_ledgers_spend(
        tmp_path, capsys):
    import json

    out = tmp_path / "r"
    assert main(BASE[:1] + ["--out", str(out)] + BASE[1:] + ["--select", "last", "--local-steps", "1",
                                                               "--dp-epsilon", "2", "--delta", "0.3",
                                                               "--allow-large-delta"]) == 0
    err = capsys.readouterr().err
    assert "privfl: warning: delta=0.3 is at least 1/" in err and "(--allow-large-delta)" in err
    summary = json.loads((out / "summary.json").read_text())
    # every training client takes part in every round (client fraction 1): the plan priced before round 1 is what
    # each ledger ends at, the calibrated target
    assert summary["privacy"]["planned"]["training"] == pytest.approx(summary["privacy"]["epsilon_max_training"],
                                                                      rel=1e-9)
    assert 1.99 < summary["privacy"]["planned"]["training"] <= 2.0 * (1 + 1e-6)   # z to a factor 1.001
    assert json.loads((out / "config.json").read_text())["allow_large_delta"] is True


def test_a_refused_sweep_leaves_nothing_and_private_rounds_under_the_full_grid_are_refused(tmp_path, capsys):
    sweep = ["sweep", "--dataset", "synthetic", "--clients", "4", "--max-samples", "400", "--rounds", "1",
             "--client-fraction", "1", "--sizes", "10", "--novel-mixes", "2", "--eval-size", "20", "--repeats", "1",
             "--epsilons", "1", "--train-epsilons", "1", "--threads", "1", "--no-progress", "--features", "none"]
    out = tmp_path / "sweep"
    # refused by its training's own check (no client holds 500 records): it left sweep-config.json, and the corrected
    # command was then refused as "a sweep of other settings"
    assert main(sweep + ["--out", str(out), "--private-rounds", "1", "--min-samples", "500"]) == 2
    err = capsys.readouterr().err
    assert "record-level privacy min_samples=500 is the public lower bound" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(sweep + ["--out", str(out), "--full-grid", "--private-rounds", "3"]) == 2
    err = capsys.readouterr().err
    assert "--private-rounds 3 would be ignored: under --full-grid every private training runs --rounds rounds" in err
    assert not out.exists()


def test_demo_writes_over_no_file_privfl_did_not_write(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "fedavg").mkdir(parents=True)
    (out / "fedavg" / "config.json").write_text('{"my": "notes"}')
    for extra in ([], ["--overwrite"]):
        assert main(DEMO + ["--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert f"{out / 'fedavg'} holds config.json, not the files of a privfl run" in err
        assert len(err.strip().splitlines()) == 1
        assert (out / "fedavg" / "config.json").read_text() == '{"my": "notes"}'
        assert sorted(p.name for p in out.rglob("*")) == ["config.json", "fedavg"]


def _console_script(entry, *args, hook="", ready=False):
    """The ``privfl`` console script as pip writes it for ``entry`` (``module:function``), or ``python -m entry``
    for a bare module name, started with SIGINT at its default (a shell that runs tests in the background ignores it,
    and a child would inherit that), stdout and stderr piped. ``hook``: code run first; ``ready`` (``module:function``
    only): the script prints ``ready`` once it has imported the entry module, just before it calls the function (the
    import of the entry module itself, a few milliseconds, is the script's own line, before any privfl code can guard
    it)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    if ":" in entry:
        module, function = entry.split(":")
        code = f"{hook}\nimport sys\nfrom {module} import {function}\n"
        code += "sys.stdout.write('ready\\n'); sys.stdout.flush()\n" if ready else ""
        code += f"sys.exit({function}())"
    else:       # what python -m runs
        code = f"{hook}\nimport runpy\nrunpy.run_module({entry!r}, run_name='__main__', alter_sys=True)"
    root = str(Path(__file__).resolve().parents[1])
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env={**__import__("os").environ, "PYTHONPATH": root},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


#: Sends this process SIGINT when the import of ``accounting`` begins: inside the console script's import of the
#: command line (privfl.cli -> privfl.errors -> accounting), the moment a Ctrl-C at start-up lands in.
_CTRL_C_WHILE_IMPORTING = """
import importlib.abc, os, signal, sys
class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "accounting":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlC())
"""


def test_a_ctrl_c_while_the_console_script_imports_the_command_line_ends_it_in_one_line_with_status_130():
    import signal
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    entry = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["privfl"]
    assert entry == "privfl.entry:main"
    # the Ctrl-C lands inside the import of the command line: one line, status 130
    script = _console_script(entry, "ledger", str(root / "no-such-run"), hook=_CTRL_C_WHILE_IMPORTING)
    _, err = script.communicate(timeout=120)
    assert (script.returncode, err) == (130, "privfl: interrupted\n")
    # the same Ctrl-C with the command line as the entry point itself: a traceback (why privfl.entry exists)
    bare = _console_script("privfl.cli:main", "ledger", str(root / "no-such-run"), hook=_CTRL_C_WHILE_IMPORTING)
    _, err = bare.communicate(timeout=120)
    assert "Traceback" in err and "KeyboardInterrupt" in err and bare.returncode == -signal.SIGINT
    # a real Ctrl-C at several moments once the entry module is imported: while the command line is imported (about
    # 0.1 s here), and while the command runs (seconds, importing torch)
    for delay in (0.0, 0.01, 0.03, 0.1, 0.3):
        script = _console_script(entry, "ledger", str(root / "no-such-run"), ready=True)
        assert script.stdout.readline() == "ready\n"
        time.sleep(delay)
        script.send_signal(signal.SIGINT)
        _, err = script.communicate(timeout=120)
        assert (script.returncode, err) == (130, "privfl: interrupted\n"), (delay, err)


def test_python_dash_m_privfl_is_the_console_script():
    """``python -m privfl`` runs the same guarded entry point: the same output and exit status, and a Ctrl-C while
    it imports the command line ends it in one line with status 130."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["ledger", str(root / "no-such-run")]
    module = subprocess.run([sys.executable, "-m", "privfl", *args], capture_output=True, text=True, cwd=root,
                            env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=120)
    script = _console_script("privfl.entry:main", *args)
    out, err = script.communicate(timeout=120)
    assert (module.returncode, module.stdout, module.stderr) == (script.returncode, out, err)
    assert module.returncode == 2 and "no-such-run/config.json does not exist" in module.stderr
    hooked = _console_script("privfl", *args, hook=_CTRL_C_WHILE_IMPORTING)
    _, err = hooked.communicate(timeout=120)
    assert (hooked.returncode, err) == (130, "privfl: interrupted\n")


@pytest.mark.parametrize("where", ["build_parser", "reuse_freed_memory"])
def test_a_ctrl_c_before_the_command_runs_ends_it_in_one_line_with_status_130(monkeypatch, capsys, where):
    """A Ctrl-C while the parser is built or torch is imported (seconds on a loaded machine) is no traceback."""
    import privfl.cli as cli
    import privfl.memory as memory

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli if where == "build_parser" else memory, where, interrupted)
    assert main(["train", "--dataset", "synthetic", "--out", "never-written"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "privfl: interrupted\n" and "Traceback" not in captured.out
