"""Certify that a change moved no number: the same short runs at two commits, their tensors compared bit for bit.

A refactor (code moved between modules, a duplicate folded into one helper) changes the code every stored result
depends on, so ``benchmarks/check_results.py`` lists them all as stale, although none of their figures can have
moved if the runs are unchanged. This script is the evidence that they are: it checks out ``--base`` and ``--head``
into temporary worktrees and runs the same fingerprint suite in each (one process per commit, one thread, seeded
noise, a fixed hash seed, every call traced), then compares:

* every registered method under every privacy mode its registration allows (none, record, central, distributed,
  local), and each hypernetwork method again generating only the head: a 2-round run on a small synthetic
  federation, its final server and client state, its summary (novel and validation accuracies, every epsilon), its
  metrics and its ledger; the same runs with a private novel release (epsilon 1) for the methods whose novel
  clients release through ``privatize``; and, for PeFLL, whose novel clients need labels, the models the trained run
  serves them as labelled unseen clients (and once with their labelled descriptor released at epsilon 1);
* the main job reduced (``privfl sweep``: MNIST through the ScatterNet stage, a training at epsilon 8 and one without
  DP, a private novel release at epsilon 1), its whole result.

Wall times, memory and the code revision are left out; every tensor must be equal to the last bit, every other number
to :data:`FLOAT_REL_TOL` (an epsilon composed in another order differs in its last bits). When every case is, the pair
is added to :data:`CERTIFICATES` with the fingerprint of each case and the lines the runs executed on each side in the
Python files the change touches (``lines_run``, traced line by line in those files only). ``check_results`` then
treats a result made at (code equal to) ``base`` as made at ``head`` when every statement the change adds, removes or
rewrites ran on its side (``benchmarks/code_changes.py``, ``changed_statements``): a change to code the suite never
ran (an attack, a Flower engine, a branch no case takes) is not certified and still stales what depends on it. When
a case differs, nothing is written and the cases are named. Coverage is by statement: a changed statement that ran is
certified whatever part of it ran (one side of a conditional expression, say).

    python benchmarks/same_numbers.py --base REV [--head REV]    # head: HEAD; -> benchmarks/same_numbers.json

Both commits must run the suite's public calls (``RunConfig``, ``train``, ``SweepConfig``, ``run_sweep``, the method
registry); a change to those is not a refactor this script can certify.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from code_changes import CERTIFICATES as CERTIFICATES_PATH  # noqa: E402  (beside this script)
from code_changes import PACKAGES, to_ranges  # noqa: E402

#: The certificates, newest last (read by ``benchmarks/check_results.py``).
CERTIFICATES = ROOT / CERTIFICATES_PATH
#: Keys of a run's files that measure the machine, not the computation (and every key ending in ``_s``: seconds).
UNTIMED = {"time", "t", "peak_memory_mib", "numerics"}
#: The hash seed of both fingerprint processes, so that no set's order differs between them. Before 984339d
#: ``accounting`` composed an epsilon's releases in a frozenset's order, and the last bits of an epsilon followed the
#: process's hash seed; a base older than that still does.
HASH_SEED = "0"


# -- the fingerprint suite (run inside a checkout of one commit) ---------------------------------------------------

def canonical(value: object) -> object:
    """``value`` without :data:`UNTIMED` keys (nor ``*_s``), tensors as (dtype, shape, sha256 of their bytes), floats
    exact, keys sorted; a ledger's records (``[kind, round, time]``, :mod:`accounting.ledger`) without their time."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return [str(t.dtype), list(t.shape), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                                            if t.numel() else b"").hexdigest()]
    if isinstance(value, dict):
        return {str(k): canonical(_untimed_records(v) if k == "records" else v)
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
                if str(k) not in UNTIMED and not str(k).endswith("_s")}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def _untimed_records(records: object) -> object:
    if isinstance(records, list) and all(isinstance(r, list) and len(r) == 3 for r in records):
        return [r[:2] for r in records]
    return records


def digest(value: object) -> str:
    """sha256 of :func:`canonical` ``value`` (floats as their shortest exact repr): equal only to the bit."""
    return hashlib.sha256(json.dumps(canonical(value), sort_keys=True).encode()).hexdigest()


#: How far two floats of a run's files (not its tensors) may differ and be the same number: an epsilon composed from
#: the same releases in another order differs in its last bits (3e-12 relative seen before 984339d, whose base
#: composed in a frozenset's order, which followed the order the set was built in).
FLOAT_REL_TOL = 1e-10


def same(a: object, b: object) -> bool:
    """Whether two :func:`canonical` values are the same numbers: equal structure, equal tensors (their hashes),
    equal strings and integers, floats within :data:`FLOAT_REL_TOL` (NaN equal to NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=FLOAT_REL_TOL, abs_tol=0.0)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)      # type: ignore[union-attr]
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


@dataclasses.dataclass(frozen=True)
class Case:
    """One fingerprint run: ``method`` under privacy ``mode`` (``None``: no DP) with method ``settings``, novel clients
    releasing at ``novel_epsilon`` (seeded) when it is set; with ``labelled``, the trained run then serves the
    federation's novel clients as labelled unseen clients (:data:`LABELLED_NOVEL`), as ``benchmarks/pefll_mnist.py``
    serves them, and the served models join the digest."""

    name: str
    method: str
    mode: str | None = None
    settings: dict = dataclasses.field(default_factory=dict)
    novel_epsilon: float | None = None
    labelled: bool = False


#: The epsilon of the private novel releases among :func:`method_cases`.
NOVEL_EPSILON = 1.0
#: Methods whose novel clients need labels: the run's novel clients cannot serve them, so a labelled case serves them
#: after training (:func:`privfl.methods.pefll.unseen_clients_with_labels`).
LABELLED_NOVEL = ("pefll",)


def method_cases() -> list[Case]:
    """Every method under every mode it allows, the head-only hypernetworks, a private novel release (epsilon
    :data:`NOVEL_EPSILON`, whole set and, where the method has one, batch means) for every method whose novel
    clients release through ``privatize``, and labelled serving under every mode for :data:`LABELLED_NOVEL`, once more
    without DP in training and a private labelled release (epsilon :data:`NOVEL_EPSILON`, seeded)."""
    from privfl.methods import METHODS
    from privfl.privacy.training import MODES

    cases = []
    for method in sorted(METHODS):
        spec = METHODS[method]
        fields = {f.name for f in dataclasses.fields(spec.config)}
        modes = [mode for mode in (None, *MODES) if mode is None or spec.privacy[mode] is None]
        variants = [("", {})] + ([("+head", {"generated": "head", "shared_momentum": 0.5})]
                                 if "generated" in fields else [])
        cases += [Case(f"{method}{suffix}/{mode or 'none'}", method, mode, extra)
                  for suffix, extra in variants for mode in modes]
        if spec.novel_privacy is None and spec.client.serves_novel_clients:
            cases.append(Case(f"{method}+novel/none", method, novel_epsilon=NOVEL_EPSILON))
            if "descriptor_batch_size" in fields:
                cases.append(Case(f"{method}+novel-batches/none", method,
                                  settings={"descriptor": "batch_mean", "descriptor_batch_size": 16},
                                  novel_epsilon=NOVEL_EPSILON))
        if method in LABELLED_NOVEL:
            cases += [Case(f"{method}+labelled/{mode or 'none'}", method, mode, labelled=True) for mode in modes]
            cases.append(Case(f"{method}+labelled-novel/none", method, novel_epsilon=NOVEL_EPSILON, labelled=True))
    return cases


def method_run(case: Case, folder: str) -> object:
    """One case: a 2-round run on a synthetic federation of 8 clients (2 novel), :func:`canonical`."""
    import torch

    from privfl.config import RunConfig
    from privfl.data import FederationSpec
    from privfl.experiment import train
    from privfl.methods import METHODS
    from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

    spec = METHODS[case.method]
    fields = {f.name for f in dataclasses.fields(spec.config)}
    settings = {k: v for k, v in {"local_steps": 2, "batch_size": 16}.items() if k in fields}
    settings.update(spec.smoke_settings)
    settings.update(case.settings)
    mode = case.mode
    private = {} if mode is None else dict(mode=mode, noise_multiplier=1.0, clip=1.0, noise="seeded",
                                           noise_seed=3, min_samples=8)
    config = RunConfig(
        federation=FederationSpec(source="synthetic", num_clients=8, partition="iid", novel_fraction=0.25,
                                  val_fraction=0.2, source_options={"num_samples": 900, "dim": 8, "num_classes": 3}),
        method=case.method, method_config=settings, rounds=2, eval_every=1, checkpoint_every=1, select="last",
        seed=7, privacy=TrainingPrivacy(**private), client_fraction=0.75 if mode == "central" else 1.0,
        novel_privacy=NovelPrivacy(epsilon=None if case.labelled else case.novel_epsilon, noise="seeded",
                                   noise_seed=5))
    summary = train(config, folder, progress=False)
    run = Path(folder)
    state = torch.load(run / "checkpoint.pt", weights_only=True)["runtime"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    found = {"summary": summary, "state": state, "metrics": metrics,
             "ledger": json.loads((run / "ledger.json").read_text())}
    if case.labelled:
        found["served"] = served_labelled(config, state, case.novel_epsilon)
    return canonical(found)


def served_labelled(config: object, state: dict, novel_epsilon: float | None = None) -> dict:
    """The models a trained run (``state``) serves the federation's novel clients as labelled unseen clients, their
    descriptors released at ``novel_epsilon`` (seeded) when it is set. A run's config refuses a novel epsilon for a
    method whose novel clients need labels (they are served outside the run), so it is set on the client procedure,
    as a library call building the procedure would."""
    from privfl.data import build_federation
    from privfl.experiment import build_runtime
    from privfl.methods.pefll import unseen_clients_with_labels
    from privfl.privacy.training import NovelPrivacy

    federation = build_federation(config.federation, seed=config.seed)      # type: ignore[attr-defined]
    runtime = build_runtime(config, federation)
    runtime.load_state_dict(state)
    if novel_epsilon is not None:
        runtime.client.novel_privacy = NovelPrivacy(epsilon=novel_epsilon, noise="seeded", noise_seed=5)
    return {str(client.client_id): runtime.novel_client_model(client).state_dict()
            for client in unseen_clients_with_labels(federation)}


def sweep_run(folder: str) -> object:
    """The main job reduced: the golden test's federation and settings, 2 rounds."""
    from privfl.sweep import SweepConfig, run_sweep

    config = SweepConfig(clients=10, max_samples=3000, rounds=2, min_samples=255, train_epsilons=(8.0, None),
                         sizes=(50,), epsilons=(1.0,), novel_mixes=2, eval_size=200, repeats=1, noise="seeded")
    result = json.dumps(run_sweep(config, folder, progress=False), default=str)
    return canonical(json.loads(result.replace(str(folder), "<out>")))


def fingerprint(tree: Path, watch: Iterable[str] = ()) -> dict:
    """Every case's digest in this process (whose imports must come from ``tree``), and the lines the cases executed
    in the files ``watch``."""
    import torch

    torch.set_num_threads(1)
    from tqdm import tqdm

    cases: dict[str, object] = {}
    # traced before the packages load: their module and class bodies run then
    with Traced(tree, watch=watch) as traced, tempfile.TemporaryDirectory() as folder:
        import privfl

        if Path(privfl.__file__).resolve().parent != (tree / "privfl").resolve():
            raise SystemExit(f"privfl was imported from {privfl.__file__}, not from {tree}: run with PYTHONPATH={tree}")
        for case in tqdm(method_cases(), desc=f"fingerprint {tree.name}", unit="case"):
            with contextlib.redirect_stdout(io.StringIO()):     # a case's printed tables
                cases[case.name] = method_run(case, f"{folder}/{len(cases)}")
        with contextlib.redirect_stdout(io.StringIO()):
            cases["sweep/golden-2-rounds"] = sweep_run(f"{folder}/sweep")
    return {"cases": cases, "lines": {path: sorted(lines) for path, lines in sorted(traced.lines.items())}}


class Traced:
    """The lines executed in the files ``watch`` (paths under ``tree``) while it is entered, ``{path: lines}``: a
    trace hook on every Python call, in this thread and in threads started meanwhile, that follows line by line only
    the frames of watched files."""

    def __init__(self, tree: Path, watch: Iterable[str] = ()):
        self.top = Path(tree).resolve()
        self.watch = frozenset(watch)
        self.lines: dict[str, set[int]] = {}
        self._files: dict[str, str | None] = {}

    def _trace(self, frame, event, arg):
        if event != "call":
            return None
        filename = frame.f_code.co_filename
        rel = self._files.get(filename, "")
        if rel == "":      # not seen yet; code made by exec or eval has no file ("", "<string>")
            path = Path(filename).resolve()
            inside = filename[:1] not in ("", "<") and path.is_relative_to(self.top)
            found = "/".join(path.relative_to(self.top).parts) if inside else None
            rel = self._files[filename] = found if found in self.watch else None
        if rel is None:
            return None
        executed = self.lines.setdefault(rel, set())

        def line(frame, event, arg):
            if event == "line":
                executed.add(frame.f_lineno)
            return line
        return line

    def __enter__(self) -> Traced:
        self._before = sys.gettrace(), threading.gettrace()     # a debugger's or a coverage tool's, put back after
        threading.settrace(self._trace)
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._before[0])
        threading.settrace(self._before[1])  # type: ignore[arg-type]


# -- the comparison ------------------------------------------------------------------------------------------------

def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def fingerprint_commit(commit: str, work: Path, watch: Iterable[str]) -> dict:
    """Check ``commit`` out into ``work`` and fingerprint it in a fresh process, tracing the lines of ``watch``."""
    _git("worktree", "add", "--detach", "--force", str(work), commit)
    try:
        env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": HASH_SEED}
        out = work / "fingerprint.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fingerprint", str(work), str(out),
                        "--watch", *watch], env=env, cwd=work, check=True)
        return json.loads(out.read_text())
    finally:
        _git("worktree", "remove", "--force", str(work))


def differing(base: dict, head: dict) -> list[str]:
    """The cases whose runs are not the same numbers (:func:`same`), or that only one side ran."""
    names = sorted(set(base["cases"]) | set(head["cases"]))
    return [n for n in names if n not in base["cases"] or n not in head["cases"]
            or not same(base["cases"][n], head["cases"][n])]


def certify(base_rev: str, head_rev: str) -> int:
    from privfl.provenance import numerics

    base, head = _git("rev-parse", f"{base_rev}^{{commit}}"), _git("rev-parse", f"{head_rev}^{{commit}}")
    touched = set(_git("diff", "--name-only", base, head).splitlines())
    watch = sorted(p for p in touched if p.endswith(".py") and p.split("/")[0] in PACKAGES)
    with tempfile.TemporaryDirectory() as folder:
        prints = {side: fingerprint_commit(commit, Path(folder) / side, watch)
                  for side, commit in (("base", base), ("head", head))}
    different = differing(prints["base"], prints["head"])
    if different:
        print(f"{len(different)} of {len(prints['head']['cases'])} cases differ between {base[:7]} and "
              f"{head[:7]}; nothing certified:\n  " + "\n  ".join(different))
        return 1
    certificate = {"base": base, "head": head,
                   "cases": {name: digest(value) for name, value in prints["head"]["cases"].items()},
                   # what check_results looks up: the lines each side's runs executed in the Python files the
                   # change touches (a change is certified where they ran it)
                   "lines_run": {side: {path: to_ranges(lines) for path, lines in prints[side]["lines"].items()}
                                 for side in ("base", "head")},
                   "command": f"python benchmarks/same_numbers.py --base {base_rev} --head {head_rev}",
                   "numerics": {k: v for k, v in numerics().items() if k != "code_revision"} | {"threads": 1},
                   "hash_seed": HASH_SEED}
    stored = json.loads(CERTIFICATES.read_text()) if CERTIFICATES.exists() else {"certificates": []}
    stored["certificates"] = [c for c in stored["certificates"] if (c["base"], c["head"]) != (base, head)]
    stored["certificates"].append(certificate)
    CERTIFICATES.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"all {len(certificate['cases'])} cases the same numbers: {base[:7]} -> {head[:7]} certified in "
          f"{CERTIFICATES.relative_to(ROOT)} (lines traced in {len(watch)} files)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the commit before the change")
    parser.add_argument("--head", default="HEAD", help="the commit after it (default: HEAD)")
    parser.add_argument("--fingerprint", nargs=2, metavar=("TREE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--watch", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fingerprint:
        tree, out = map(Path, args.fingerprint)
        out.write_text(json.dumps(fingerprint(tree, args.watch)))
        return 0
    if not args.base:
        parser.error("--base REV is required: the commit before the change to certify")
    return certify(args.base, args.head)


if __name__ == "__main__":
    sys.exit(main())
