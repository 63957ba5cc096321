import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from privfl import provenance
from privfl.provenance import numerics

GIT = ["git", "-c", "user.name=privfl", "-c", "user.email=privfl@example.org", "-c", "commit.gpgsign=false"]


def test_numerics_reports_this_process_threads_and_kernels():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = numerics()
        torch.set_num_threads(2)
        two = numerics()
    finally:
        torch.set_num_threads(before)
    assert (one["threads"], two["threads"]) == (1, 2)
    assert one["torch"] == torch.__version__
    assert one["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_code_revision_is_the_commit_and_marks_uncommitted_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))   # no checkout above tmp_path counts
    assert numerics(tmp_path)["code_revision"] is None            # not a checkout: no revision rather than a guess
    subprocess.run([*GIT, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*GIT, "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run([*GIT, "-C", str(tmp_path), "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    clean = numerics(tmp_path)["code_revision"]
    assert head.startswith(clean) and len(clean) >= 7
    # what the benchmarks write is not a code change; any other tracked file is, seen from any folder of the checkout
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "r.json").write_text("{}\n")
    subprocess.run([*GIT, "-C", str(tmp_path), "add", "."], check=True)
    subprocess.run([*GIT, "-C", str(tmp_path), "commit", "-q", "-m", "two"], check=True)
    clean = numerics(tmp_path)["code_revision"]
    (results / "r.json").write_text('{"seconds": 1}\n')
    (tmp_path / "untracked.py").write_text("y = 1\n")
    assert numerics(tmp_path)["code_revision"] == clean == numerics(results)["code_revision"]
    (tmp_path / "a.py").write_text("x = 2\n")
    assert numerics(tmp_path)["code_revision"] == clean + "-dirty" == numerics(results)["code_revision"]
    # a checkout whose state git cannot report gets no revision, not a clean one
    real_git = provenance._git
    monkeypatch.setattr(provenance, "_git",
                        lambda where, *args: None if args[0] == "status" else real_git(where, *args))
    (tmp_path / "a.py").write_text("x = 1\n")
    assert numerics(tmp_path)["code_revision"] is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_this_checkout_gives_its_own_commit():
    import privfl

    package = Path(privfl.__file__).parent
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "__init__.py"], cwd=package, capture_output=True)
    if tracked.returncode != 0:
        pytest.skip("privfl is not run from its git checkout here")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, check=True)
    revision = numerics()["code_revision"]
    assert head.stdout.strip().startswith(revision.removesuffix("-dirty"))


def test_every_benchmark_that_writes_a_result_records_its_numerics():
    """A result JSON without ``code_revision`` can only be dated by the commit that stored it, so
    ``benchmarks/check_results.py`` cannot tell a run made before a code change from one made after it."""
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    writers = []
    for script in sorted(benchmarks.glob("*.py")):
        source = script.read_text()
        writes = re.search(r"\.write_text\(json\.dumps|update_json\(|json\.dump\(", source)
        if writes and re.search(r"[\"']results[\"']|/ \"results\"|benchmarks/results", source):
            writers.append(script.name)
            assert "numerics(" in source, f"{script.name} writes a result without privfl.provenance.numerics()"
    assert "peer_pfl.py" in writers and "workers.py" in writers and "fedpft_mnist.py" in writers, writers
