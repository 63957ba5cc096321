"""benchmarks/same_numbers.py: what a fingerprint keeps and drops, that it is the same for the same run and differs for
another, and that the lines a run executes are traced where benchmarks/code_changes.py looks for a change's
statements."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import code_changes  # noqa: E402
import same_numbers  # noqa: E402


def test_a_digest_drops_times_and_ledger_timestamps_and_keeps_every_bit_of_the_rest():
    import torch

    run = {"accuracy": 0.3, "time": {"wall_s": 1.0}, "wall_time_s": 2.0, "train_wall_s": 4.0,
           "numerics": {"code_revision": "abc"},
           "ledger": {"records": [[0, 1, 1795970980.9], [1, 1, 1795970981.2]]}, "w": torch.ones(3),
           "step": torch.tensor(2.0)}
    later = {**run, "time": {"wall_s": 9.0}, "wall_time_s": 3.0, "train_wall_s": 5.0,
             "numerics": {"code_revision": "def"},
             "ledger": {"records": [[0, 1, 1795970999.0], [1, 1, 1795971000.0]]}}
    assert same_numbers.digest(run) == same_numbers.digest(later)
    for changed in ({"accuracy": 0.1 + 0.2}, {"w": torch.ones(3, dtype=torch.float64)},
                    {"w": torch.cat([torch.ones(2), torch.nextafter(torch.ones(1), torch.full((1,), 2.0))])},
                    {"step": torch.tensor(3.0)}, {"ledger": {"records": [[0, 1, 1795970980.9], [1, 2, 1795970981.2]]}}):
        assert same_numbers.digest({**run, **changed}) != same_numbers.digest(run), changed


def test_every_method_and_every_mode_its_registration_allows_is_a_case():
    from privfl.methods import METHODS
    from privfl.privacy.training import MODES

    names = {case.name for case in same_numbers.method_cases()}
    for method, spec in METHODS.items():
        assert f"{method}/none" in names
        for mode in MODES:
            assert (f"{method}/{mode}" in names) == (spec.privacy[mode] is None), (method, mode)
    assert "odpflhn+head/record" in names and "fedavg+head/none" not in names
    novel = {name.split("+")[0] for name in names if "+novel" in name}
    assert novel == {m for m, spec in METHODS.items()
                     if spec.novel_privacy is None and spec.client.serves_novel_clients}
    assert novel >= {"odpflhn", "itpflhn"} and "odpflhn+novel-batches/none" in names
    assert {"pefll+labelled/none", "pefll+labelled/record", "pefll+labelled-novel/none"} <= names


@pytest.mark.usefixtures("one_thread")
def test_the_same_case_gives_the_same_digest_and_another_setting_another(tmp_path):
    case = same_numbers.Case("odpflhn/record", "odpflhn", "record")
    first = same_numbers.method_run(case, str(tmp_path / "a"))
    again = same_numbers.method_run(case, str(tmp_path / "b"))
    assert same_numbers.same(again, first) and same_numbers.digest(again) == same_numbers.digest(first)
    other = same_numbers.method_run(dataclasses.replace(case, settings={"encoder_lr": 0.5}), str(tmp_path / "c"))
    assert not same_numbers.same(other, first)


@pytest.mark.usefixtures("one_thread")
def test_a_labelled_case_serves_pefll_novel_clients_through_the_clipped_descriptor(tmp_path):
    """Under record-level DP a served PeFLL descriptor clips each embedding to the novel bound: the labelled case
    runs that line of descriptor_of, which no training round does, and digests the models it serves."""
    import inspect

    from privfl.methods import pefll

    lines, first = inspect.getsourcelines(pefll.descriptor_of)
    clip = first + next(i for i, line in enumerate(lines) if "clipped_rows(" in line)
    with same_numbers.Traced(ROOT, watch=["privfl/methods/pefll.py"]) as traced:
        served = same_numbers.method_run(same_numbers.Case("pefll+labelled/record", "pefll", "record", labelled=True),
                                         str(tmp_path / "a"))
    assert clip in traced.lines["privfl/methods/pefll.py"]
    assert len(served["served"]) == 2 and all(model for model in served["served"].values())
    with same_numbers.Traced(ROOT, watch=["privfl/methods/pefll.py"]) as traced:
        same_numbers.method_run(same_numbers.Case("pefll/record", "pefll", "record"), str(tmp_path / "b"))
    assert clip not in traced.lines["privfl/methods/pefll.py"]


@pytest.mark.usefixtures("one_thread")
def test_the_labelled_novel_case_releases_pefll_descriptors_privately(tmp_path):
    """The private labelled case runs PeFLL's private descriptor release, which no other case reaches, and serves
    other models than the same training serving exact descriptors."""
    import inspect

    from privfl.methods import pefll

    lines, first = inspect.getsourcelines(pefll.PeFLLClient.novel_query)
    release = first + next(i for i, line in enumerate(lines) if "release_labelled_mean(" in line)
    with same_numbers.Traced(ROOT, watch=["privfl/methods/pefll.py"]) as traced:
        private = same_numbers.method_run(
            same_numbers.Case("pefll+labelled-novel/none", "pefll", novel_epsilon=same_numbers.NOVEL_EPSILON,
                              labelled=True), str(tmp_path / "a"))
    assert release in traced.lines["privfl/methods/pefll.py"]
    exact = same_numbers.method_run(same_numbers.Case("pefll+labelled/none", "pefll", labelled=True),
                                    str(tmp_path / "b"))
    assert same_numbers.same(private["state"], exact["state"])      # the same training ...
    assert not same_numbers.same(private["served"], exact["served"])   # ... serving noised descriptors


def test_floats_are_the_same_numbers_to_ten_digits_and_tensors_only_to_the_bit():
    import torch

    run = same_numbers.canonical({"epsilon": 3.0, "w": torch.ones(2), "n": 5, "nan": float("nan")})
    assert same_numbers.same(run, same_numbers.canonical({"epsilon": 3.0 * (1 + 1e-13), "w": torch.ones(2), "n": 5,
                                                         "nan": float("nan")}))
    for changed in ({"epsilon": 3.0 * (1 + 1e-8)}, {"w": torch.ones(2) + 1e-7}, {"n": 6}, {"n": 5.0},
                    {"nan": 0.0}, {"extra": 1}):
        other = same_numbers.canonical({"epsilon": 3.0, "w": torch.ones(2), "n": 5, "nan": float("nan"), **changed})
        assert not same_numbers.same(run, other), changed


def test_a_traced_run_records_the_lines_it_executes_in_the_watched_files_only(tmp_path, monkeypatch):
    source = '''X = [i for i in range(2)]


def f(a):
    def g():
        return [a for _ in range(1)]
    return g()


class C:
    y = [j for j in range(1)]

    def m(self):
        return (lambda: 3)()

    def never(self):
        return 4

    class D:
        z = 5
'''
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pkg" / "other.py").write_text("def h():\n    return 1\n")
    with same_numbers.Traced(tmp_path, watch=["pkg/mod.py"]) as traced:
        module = importlib.import_module("pkg.mod")
        module.f(1)
        module.C().m()
        importlib.import_module("pkg.other").h()
    assert set(traced.lines) == {"pkg/mod.py"}
    # every statement ran but never's return (line 17)
    lines = traced.lines["pkg/mod.py"]
    ran = [any(line in lines for line in range(first, last + 1))
           for _, (first, last) in code_changes.statements(source)]
    assert [first for (_, (first, _)), r in zip(code_changes.statements(source), ran) if not r] == [17]
    assert 17 not in lines and {1, 4, 7, 10, 13, 14, 16, 19, 20} <= lines
