"""README.md's code runs as written: every ``python`` block is executed (the long training example with the smaller
settings the README itself names), the cheap ``privfl`` lines of its ``bash`` blocks are run, and every other
``privfl`` line is parsed by the command's own parser, so a renamed or removed option fails here."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from privfl.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
#: What the README says to change for a first try of its training example ("`rounds=2` and `max_samples=2000` in the
#: `FederationSpec`"): the test applies exactly these, and checks that the README still says so.
SMALLER = {"rounds=50": "rounds=2", 'novel_fraction=0.5)': 'novel_fraction=0.5, max_samples=2000)'}
#: Lines run as written: they take seconds.
CHEAP = (["datasets"], ["attack", "audit"])


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def privfl_lines() -> list[list[str]]:
    """The arguments of every ``privfl`` command in the README's bash blocks (continuation lines joined, comments
    dropped), as the shell would split them."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["privfl"]:
                found.append(words[1:])
    return found


def test_the_readme_has_the_blocks_this_runs():
    assert len(blocks("python")) == 2 and any("RunConfig(" in b for b in blocks("python"))
    commands = {tuple(words[:1]) for words in privfl_lines()}
    assert {("train",), ("report",), ("ledger",), ("datasets",), ("sweep",), ("attack",), ("features",)} <= commands
    text = " ".join(README.read_text().split())
    assert "`rounds=2` and `max_samples=2000` in the `FederationSpec`" in text     # what SMALLER applies


@pytest.mark.slow
def test_python_blocks_run_as_written(tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)       # the examples write under runs/
    privacy, training = blocks("python")
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(privacy, "README.md (privacy layer)", "exec"), namespace)
    ledger = namespace["ledger"]
    assert len(ledger.records) == 1 and namespace["descriptor"].shape == (16,)
    assert 0 < ledger.spent(1e-5).epsilon <= 1.0 + 1e-6 and "epsilon" in printed.getvalue().lower()

    for old, new in SMALLER.items():
        assert training.count(old) == 1, old
        training = training.replace(old, new)
    namespace = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(training, "README.md (training)", "exec"), namespace)
    summary = namespace["summary"]
    assert summary["method"] == "odpflhn" and summary["rounds_completed"] == 2
    assert summary["privacy"]["epsilon_max_training"] == pytest.approx(8.0, rel=1e-2)   # calibrated to end at 8
    assert summary["privacy"]["epsilon_max_novel"] == pytest.approx(1.0, rel=1e-6)
    assert summary["novel"]["num_clients"] == 50
    assert printed.getvalue().split() == [str(summary["novel"]["accuracy_mean"]),
                                          str(summary["privacy"]["epsilon_max_training"])]
    assert (tmp_path / "runs" / "odpflhn" / "summary.json").exists()


def test_privfl_lines_parse_and_the_cheap_ones_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    from attacks.audit import audit_parser
    from attacks.reconstruct_cli import build_parser as reconstruct_parser
    from privfl.engines.flower.launch import build_parser as flower_parser

    ran = 0
    for words in privfl_lines():
        if any(words[:len(cheap)] == cheap for cheap in CHEAP):
            assert main(words) == 0, words
            ran += 1
        elif words[:1] == ["flower"]:
            flower_parser().parse_args(words[1:])     # run as written in test_flower.py's loopback session
        elif words[:2] == ["attack", "reconstruct"]:
            reconstruct_parser().parse_args(words[2:])
        elif words[:2] == ["attack", "audit"]:
            audit_parser().parse_args(words[2:])
        else:
            build_parser().parse_args(words)   # argparse exits (a failure here) on an unknown or malformed option
    assert ran == 2
    out = capsys.readouterr().out
    assert "mnist" in out and "consistent with claim" in out
