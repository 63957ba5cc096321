"""benchmarks/check_results.py on a git repository the test makes: a result made at revision A is stale once a file
it depends on changes at B, and not after a change to anything else."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from privfl.provenance import numerics

ROOT = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=privfl", "-c", "user.email=privfl@example.org", "-c", "commit.gpgsign=false"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def load_checker():
    spec = importlib.util.spec_from_file_location("check_results", ROOT / "benchmarks" / "check_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


checker = load_checker()
code_changes = sys.modules["code_changes"]      # beside it, imported by it

#: The repository the tests build: a method, the code beside it, and results that depend on the method.
DECLARED = {"made_*.json": ("src/method", "!src/method/notes.md"), "other.json": ("src/other.py",)}


def commit(repo: Path, message: str, files: dict[str, str] | None = None) -> None:
    for name, text in (files or {}).items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    subprocess.run([*GIT, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(repo), "commit", "-q", "-m", message], check=True)


def result(repo: Path, name: str, revision: str | None) -> None:
    """A result as the benchmarks write one: the numerics of the process beside its figures."""
    path = repo / "benchmarks" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": [{"accuracy": 97.0, "numerics": {"code_revision": revision}}]}))


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    repo = tmp_path / "repo"
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    commit(repo, "A", {"src/method/fit.py": "def fit(): return 1\n", "src/method/notes.md": "notes\n",
                       "src/other.py": "x = 1\n", "README.md": "Figures: `benchmarks/results/made_{quoted,x}.json`.\n"})
    return repo


def findings(repo: Path, declared=DECLARED, historical=None) -> dict[str, object]:
    return {Path(f.path).name: f for f in checker.check(repo, declared, historical=historical or {})}


def test_a_dependency_changed_after_the_result_makes_it_stale_and_an_unrelated_change_does_not(repo):
    made_at_a = numerics(repo)["code_revision"]
    assert made_at_a and not made_at_a.endswith("-dirty")
    result(repo, "made_quoted.json", made_at_a)
    result(repo, "made_unquoted.json", made_at_a)
    commit(repo, "the results")
    # unrelated changes: other code, an excluded file inside the dependency's folder, the results themselves
    commit(repo, "B0", {"src/other.py": "x = 2\n", "src/method/notes.md": "more notes\n"})
    result(repo, "made_unquoted.json", made_at_a)
    assert {name: f.status for name, f in findings(repo).items()} == {"made_quoted.json": "current",
                                                                       "made_unquoted.json": "current"}
    commit(repo, "B: the method changes", {"src/method/fit.py": "def fit(): return 2\n"})
    found = findings(repo)
    assert {name: f.status for name, f in found.items()} == {"made_quoted.json": "stale",
                                                              "made_unquoted.json": "stale"}
    stale = found["made_quoted.json"]
    assert stale.changed == ["src/method/fit.py"] and stale.revisions == [made_at_a]
    assert stale.newest_change.endswith("B: the method changes") and stale.quoted_in == ["README.md"]
    assert found["made_unquoted.json"].quoted_in == []
    brief = checker.report(list(found.values()), brief=True)
    assert "STALE benchmarks/results/made_quoted.json [quoted in README.md]" in brief
    assert "made_unquoted" not in brief and "1 unquoted stale" in brief
    # undone since: the dependency is as it was at A again, so the result is current
    commit(repo, "undo B", {"src/method/fit.py": "def fit(): return 1\n"})
    assert findings(repo)["made_quoted.json"].status == "current"


def test_an_edit_of_docstrings_comments_or_layout_only_leaves_a_result_current_and_a_code_edit_does_not(repo):
    commit(repo, "the method documented", {"src/method/fit.py": '"""Fit."""\n\n\ndef fit():\n    return 1\n'})
    result(repo, "made_quoted.json", numerics(repo)["code_revision"])
    commit(repo, "the results")
    # docstrings rewritten (module and function), a comment, a blank line and another layout: the same code
    neutral = ('"""Fit, at length:\n\nwhat it is for."""\n\n\ndef fit():  # one\n    """One."""\n\n'
               '    return (1)\n')
    commit(repo, "docs only", {"src/method/fit.py": neutral})
    found = findings(repo)["made_quoted.json"]
    assert found.status == "current" and found.changed == []
    # a string that is not a docstring is code: a returned string, and the same docstring after a statement
    for text in ('"""Fit."""\n\n\ndef fit():\n    return "1"\n',
                 '"""Fit."""\nimport os\n"""not a docstring"""\n\n\ndef fit():\n    return 1\n'):
        (repo / "src/method/fit.py").write_text(text)
        assert findings(repo)["made_quoted.json"].status == "stale"
    # a file that no longer parses, and a non-Python dependency, count as changed
    (repo / "src/method/fit.py").write_text("def fit(:\n")
    assert findings(repo)["made_quoted.json"].changed == ["src/method/fit.py"]
    (repo / "src/method/fit.py").write_text(neutral)
    (repo / "src/method/weights.txt").write_text("0.5\n")
    commit(repo, "a data file beside the method")
    commit(repo, "docs again", {"src/method/fit.py": neutral.replace("One.", "The one.")})
    found = findings(repo)["made_quoted.json"]
    assert found.status == "stale" and found.changed == ["src/method/weights.txt"]
    assert found.newest_change.endswith("a data file beside the method")    # docs again is not a change


def test_uncommitted_changes_count_and_a_dirty_revision_is_compared_as_its_commit(repo):
    (repo / "src" / "method" / "fit.py").write_text("def fit(): return 3\n")
    dirty = numerics(repo)["code_revision"]
    assert dirty.endswith("-dirty")
    result(repo, "made_dirty.json", dirty)
    found = findings(repo)["made_dirty.json"]
    assert found.status == "stale" and found.newest_change == "uncommitted changes"
    assert f"uncommitted changes on {dirty.removesuffix('-dirty')}" in found.note


def test_results_without_a_revision_one_not_in_history_and_undeclared_ones_are_listed(repo):
    result(repo, "made_none.json", None)
    result(repo, "made_elsewhere.json", "0123456789abcdef")
    result(repo, "made_v1.json", "v1.0-3-g" + numerics(repo)["code_revision"])   # git describe with a tag
    result(repo, "nobody_declared.json", numerics(repo)["code_revision"])
    found = findings(repo)
    assert found["made_none.json"].status == "unknown" and "no code revision" in found["made_none.json"].note
    assert found["made_elsewhere.json"].status == "unknown" and "not in this" in found["made_elsewhere.json"].note
    assert found["made_v1.json"].status == "current"
    assert found["nobody_declared.json"].status == "undeclared"
    listing = checker.report(list(found.values()), brief=False)
    assert "UNDECLARED" in listing and "nobody_declared.json" in listing


def test_a_result_without_a_revision_is_dated_by_the_commit_that_wrote_it(repo):
    result(repo, "made_none.json", None)
    commit(repo, "the result, no revision recorded")
    written = subprocess.run([*GIT, "-C", str(repo), "log", "-1", "--format=%h", "--abbrev=7"], check=True,
                             capture_output=True, text=True).stdout.strip()
    found = findings(repo)["made_none.json"]
    assert found.status == "unknown" and f"unchanged since {written}" in found.note
    commit(repo, "an unrelated change", {"src/other.py": "x = 3\n"})
    assert findings(repo)["made_none.json"].status == "unknown"
    commit(repo, "B: the method changes", {"src/method/fit.py": "def fit(): return 2\n"})
    found = findings(repo)["made_none.json"]
    assert found.status == "stale" and found.changed == ["src/method/fit.py"] and found.revisions == [written]
    assert f"dated by {written}" in found.note and found.newest_change.endswith("B: the method changes")


def test_main_warns_and_fails_only_when_asked(repo, monkeypatch, capsys):
    result(repo, "made_quoted.json", numerics(repo)["code_revision"])
    commit(repo, "B", {"src/method/fit.py": "def fit(): return 2\n"})
    monkeypatch.setattr(checker, "DEPENDENCIES", DECLARED)
    assert checker.main(["--root", str(repo), "--brief"]) == 0
    assert "WARNING: 1 result(s) quoted" in capsys.readouterr().out
    assert checker.main(["--root", str(repo), "--strict"]) == 1
    monkeypatch.setattr(checker, "DEPENDENCIES", {**DECLARED, "x.json": ("src/nothing_here.py",)})
    assert checker.main(["--root", str(repo)]) == 2
    assert "src/nothing_here.py" in capsys.readouterr().err


def test_the_repository_declares_only_paths_that_exist():
    assert checker.missing_declarations(ROOT, checker.DEPENDENCIES) == []


def test_a_result_kept_as_made_is_historical_only_where_its_readme_names_the_revision_near_the_file(repo):
    made_at_a = numerics(repo)["code_revision"]
    result(repo, "made_before.json", made_at_a)
    readme = "Figures: `benchmarks/results/made_{quoted,x}.json`.\n"
    commit(repo, "the before measurement", {"README.md": readme + "Before: `results/made_before.json`.\n"})
    commit(repo, "B: the method changes", {"src/method/fit.py": "def fit(): return 2\n"})
    kept = {"made_before.json": "the method before B"}
    found = findings(repo, historical=kept)["made_before.json"]
    assert found.status == "stale" and "declared historical (the method before B)" in found.note
    assert f"does not name the revision that made it ({made_at_a[:7]})" in found.note
    # named, but far from the file's mention: still stale
    far = readme + f"Made at {made_at_a[:7]}.\n" + "x" * (checker.NEAR + 10) + "\nBefore: `results/made_before.json`.\n"
    commit(repo, "named far away", {"README.md": far})
    found = findings(repo, historical=kept)["made_before.json"]
    assert found.status == "stale"
    near = readme + f"Before: `results/made_before.json` (made at {made_at_a[:7]}, kept as made).\n"
    commit(repo, "named beside it", {"README.md": near})
    found = findings(repo, historical=kept)["made_before.json"]
    assert found.status == "historical" and found.note == f"kept as made at {made_at_a[:7]}: the method before B"
    assert "1 historical" in checker.report([found], brief=True)
    # the same file not declared historical stays stale; a declared one whose code is unchanged stays current
    assert findings(repo)["made_before.json"].status == "stale"
    commit(repo, "undo B", {"src/method/fit.py": "def fit(): return 1\n"})
    assert findings(repo, historical=kept)["made_before.json"].status == "current"


def test_every_historical_result_exists_and_is_declared():
    results = ROOT / "benchmarks" / "results"
    for pattern in checker.HISTORICAL:
        matches = list(results.glob(pattern))
        assert matches, f"HISTORICAL names {pattern}, which matches no result"
        assert all(checker.dependencies_of(m.relative_to(results).as_posix(), checker.DEPENDENCIES) for m in matches)


def test_a_quoted_result_whose_readme_does_not_name_its_revision_near_the_file_is_listed(repo):
    made_at_a = numerics(repo)["code_revision"]
    result(repo, "made_quoted.json", made_at_a)
    result(repo, "made_x.json", None)       # no recorded revision: the commit that wrote it made it
    commit(repo, "the results")
    written = subprocess.run([*GIT, "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
    found = findings(repo)
    assert found["made_quoted.json"].unnamed_in == ["README.md"] and found["made_quoted.json"].made_at == [made_at_a]
    assert found["made_x.json"].unnamed_in == ["README.md"] and found["made_x.json"].made_at == [written]
    brief = checker.report(list(found.values()), brief=True)
    assert "2 quoted result(s) whose README does not name the revision" in brief and "made_x.json" in brief
    assert f"benchmarks/results/made_quoted.json [README.md]: made at {made_at_a[:7]}" in checker.report(
        list(found.values()), brief=False)
    # naming the writing commit of one and the recorded revision of the other beside the file clears both
    commit(repo, "named", {"README.md": f"Figures: `benchmarks/results/made_{{quoted,x}}.json` (at {made_at_a[:7]}"
                                        f" and {written[:9]}).\n"})
    found = findings(repo)
    assert found["made_quoted.json"].unnamed_in == [] and found["made_x.json"].unnamed_in == []
    assert "does not name" not in checker.report(list(found.values()), brief=True)
    assert findings(repo)["made_quoted.json"].status == "current"     # naming a revision changes no status


def test_a_script_depends_on_the_benchmark_modules_it_imports_directly_or_through_another():
    assert checker._script("scaling") == ("benchmarks/scaling.py", "benchmarks/flower_overhead.py")
    assert checker._script("deployment_database") == ("benchmarks/deployment_database.py",
                                                       "benchmarks/flower_overhead.py", "benchmarks/scaling.py")
    assert checker._script("accounting_table") == ("benchmarks/accounting_table.py",)
    assert "benchmarks/fedtta_mnist.py" in checker.dependencies_of("pefll_mnist_100.json", checker.DEPENDENCIES)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_declared_file_brings_every_package_file_it_imports_lazily_or_through_another(tmp_path):
    root = _tree(tmp_path, {"bench/s.py": "import json\n\ndef f():\n    from privfl.a import thing\n",
                            "privfl/__init__.py": "", "privfl/a.py": "import privfl.b\nthing = 1\n",
                            "privfl/b.py": "import numpy\n", "privfl/c.py": "",
                            "privfl/sub/__init__.py": "", "privfl/sub/d.py": "from privfl import c\n"})
    found = checker.with_imports(("bench/s.py",), root)
    assert found[0] == "bench/s.py"
    assert set(found) == {"bench/s.py", "privfl/__init__.py", "privfl/a.py", "privfl/b.py"}
    # an excluded file stays out, and what only it imports is not reached
    assert set(checker.with_imports(("bench/s.py", "!privfl/b.py"), root)) == {
        "bench/s.py", "!privfl/b.py", "privfl/__init__.py", "privfl/a.py"}
    # a declared folder is followed file by file; its own files are not listed again
    assert set(checker.with_imports(("privfl/sub",), root)) == {"privfl/sub", "privfl/__init__.py", "privfl/c.py"}


def test_the_repository_declarations_hold_what_the_scripts_import():
    sweep = checker.dependencies_of("sweep_demo.json", checker.DEPENDENCIES)
    assert {"privfl/provenance.py", "privfl/evaluation/report.py", "privfl/errors.py"} <= set(sweep)
    headroom = checker.dependencies_of("descriptor_headroom.json", checker.DEPENDENCIES)
    assert {"privfl/provenance.py", "privfl/evaluation/__init__.py"} <= set(headroom)
    # the benchmarks on pixels pin ODPFL-HN's settings themselves and never import the main job's module
    assert "privfl/sweep.py" not in checker.dependencies_of("pefll_mnist_100.json", checker.DEPENDENCIES)
    assert "privfl/sweep.py" not in checker.dependencies_of("fedtta_family_code.json", checker.DEPENDENCIES)
    # import_time times module-level code only: taken as declared
    assert checker.DEPENDENCIES["import_time.json"] == checker._DECLARED["import_time.json"]


def certify(repo: Path, base: str, head: str, lines_run: dict[str, dict[str, list[int]]]) -> None:
    """A certificate as benchmarks/same_numbers.py writes one (its cases' digests are not read by the check):
    ``lines_run`` ``{"base": {path: lines}, "head": {...}}``, the lines each side's runs executed."""
    path = repo / checker.CERTIFICATES
    stored = json.loads(path.read_text()) if path.exists() else {"certificates": []}
    stored["certificates"].append({"base": base, "head": head, "cases": {"case": "0" * 64},
                                   "lines_run": {side: {name: code_changes.to_ranges(lines)
                                                        for name, lines in files.items()}
                                                 for side, files in lines_run.items()}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored))
    code_changes._certificates.cache_clear()


def test_a_change_certified_to_move_no_number_leaves_a_result_current_only_for_the_files_its_runs_ran(repo):
    def head() -> str:
        return subprocess.run([*GIT, "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()

    made_at_a = numerics(repo)["code_revision"]
    a = head()
    result(repo, "made_quoted.json", made_at_a)
    result(repo, "other.json", made_at_a)
    commit(repo, "the results")
    commit(repo, "B: a refactor of both", {"src/method/fit.py": "def fit():\n    one = 1\n    return one\n",
                                          "src/method/helper.py": "ONE = 1\n", "src/other.py": "x = 1 + 0\n"})
    b = head()
    assert {n: f.status for n, f in findings(repo).items()} == {"made_quoted.json": "stale", "other.json": "stale"}
    # certified, but its runs defined fit without calling it and never ran other.py: neither change is covered
    before = {"src/method/fit.py": [1], "src/other.py": [1]}
    certify(repo, a, b, {"base": before, "head": {"src/method/fit.py": [1], "src/method/helper.py": [1]}})
    assert {n: f.status for n, f in findings(repo).items()} == {"made_quoted.json": "stale", "other.json": "stale"}
    certify(repo, a, b, {"base": before, "head": {"src/method/fit.py": [1, 2, 3], "src/method/helper.py": [1]}})
    commit(repo, "the certificate")
    found = findings(repo)
    assert {n: f.status for n, f in found.items()} == {"made_quoted.json": "current", "other.json": "stale"}
    assert f"{a[:7]}..{b[:7]}" in found["made_quoted.json"].note
    # a certificate from a base whose code is not the result's carries nothing
    commit(repo, "C", {"src/method/fit.py": "def fit():\n    return 1\n"})
    c = head()
    commit(repo, "D", {"src/method/fit.py": "def fit():\n    return (1)\n"})
    certify(repo, c, head(), {"base": {}, "head": {}})
    commit(repo, "E: an uncertified change", {"src/method/fit.py": "def fit():\n    return 3\n"})
    assert findings(repo)["made_quoted.json"].status == "stale"
    # certificates chain: A..B, then G..H where G has B's code; the working tree is H's
    commit(repo, "F: back to D", {"src/method/fit.py": "def fit():\n    return (1)\n"})
    commit(repo, "G", {"src/method/fit.py": "def fit():\n    one = 1\n    return one\n"})
    g = head()
    commit(repo, "H", {"src/method/fit.py": "def fit():\n    return 1\n"})
    assert findings(repo)["made_quoted.json"].status == "stale"      # A..B reaches B's code, nothing reaches H's
    certify(repo, g, head(), {"base": {"src/method/fit.py": [1, 2, 3]}, "head": {"src/method/fit.py": [1, 2]}})
    found = findings(repo)["made_quoted.json"]
    assert found.status == "current" and f"{a[:7]}..{b[:7]}" in found.note and f"{g[:7]}..{head()[:7]}" in found.note


BRANCHED = """def fit(a):
    if a:
        return scale(a)
    return fallback(
        a)
"""


def test_a_certificate_with_traced_lines_covers_a_change_only_where_its_runs_executed_the_changed_statements(repo):
    def head() -> str:
        return subprocess.run([*GIT, "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()

    commit(repo, "A: the method", {"src/method/fit.py": BRANCHED})
    a = head()
    result(repo, "made_quoted.json", numerics(repo)["code_revision"])
    commit(repo, "the result")
    # the branch the runs took (lines 1-3, never 4-5) is rewritten: certified, although the function also holds
    # code that never ran
    commit(repo, "B", {"src/method/fit.py": BRANCHED.replace("return scale(a)", "return scale(a=a)")})
    b = head()
    ran = {"src/method/fit.py": [1, 2, 3]}
    certify(repo, a, b, {"base": ran, "head": ran})
    assert findings(repo)["made_quoted.json"].status == "current"
    # the branch they never took is rewritten: the function ran, but not the changed statement: not certified
    commit(repo, "C", {"src/method/fit.py": BRANCHED.replace("return scale(a)", "return scale(a=a)")
                       .replace("        a)", "        a, b=1)")})
    certify(repo, b, head(), {"base": ran, "head": ran})
    assert findings(repo)["made_quoted.json"].status == "stale"
    # the same change where the base's runs executed the removed statement and the head's the added one; and where
    # only the base's did
    for head_ran, status in (([1, 2, 5], "current"), ([1, 2, 3], "stale")):
        (repo / checker.CERTIFICATES).unlink()
        certify(repo, a, b, {"base": ran, "head": ran})
        certify(repo, b, head(), {"base": {"src/method/fit.py": [1, 2, 4]}, "head": {"src/method/fit.py": head_ran}})
        assert findings(repo)["made_quoted.json"].status == status, head_ran


def test_line_ranges_round_trip():
    for lines in ([], [4], [1, 2, 3, 7, 9, 10], [5, 3, 3, 4, 12]):
        text = code_changes.to_ranges(lines)
        assert code_changes.from_ranges(text) == set(lines)
    assert code_changes.to_ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"


def test_a_change_is_the_statements_whose_keys_differ_with_their_header_lines():
    before = "def f(a):\n    if a:\n        x = 1\n        y = 2\n    return x\n"
    assert code_changes.statements(before)[1][1] == (2, 2)
    # a statement moved from the if's body to its else: both sides change, not just the layout
    after = "def f(a):\n    if a:\n        x = 1\n    else:\n        y = 2\n    return x\n"
    keys = [key for key, _ in code_changes.statements(after)]
    assert [key for key, _ in code_changes.statements(before)] != keys and keys[3][1] == "orelse"
    # a docstring, a comment or a line break is no change; a decorator or a default changes the def's header
    same = 'def f(a):\n    """Doc."""\n    if (a):  # yes\n        x = 1\n        y = (\n            2)\n    return x\n'
    assert [k for k, _ in code_changes.statements(same)] == [k for k, _ in code_changes.statements(before)]
    decorated = "@d(\n    1)\ndef f(a,\n      b=2):\n    return a\n"
    assert code_changes.statements(decorated)[0][1] == (1, 4)


SOURCE = '''"""Doc."""
import os
X = 1


def f(a):
    """Doc."""
    def g():
        return [a for _ in ()]
    return g


class C(Base):
    y: int = 2

    def m(self):
        return 3

    class D:
        z = 4
'''


def test_docstrings_comments_and_layout_are_no_change_and_a_class_attribute_changes_one_statement():
    keys = [key for key, _ in code_changes.statements(SOURCE)]
    edited = SOURCE.replace('    """Doc."""\n', "").removeprefix('"""Doc."""\n')
    edited = edited.replace("X = 1", "X = 1  # a comment").replace("return 3", '"""Another doc."""\n        return 3')
    assert '"""Doc."""' not in edited and "Another doc" in edited
    assert [key for key, _ in code_changes.statements(edited)] == keys
    changed = [key for key, _ in code_changes.statements(edited.replace("z = 4", "z = 5"))]
    assert [i for i, (x, y) in enumerate(zip(keys, changed, strict=True)) if x != y] == [len(keys) - 1]
