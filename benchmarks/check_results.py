"""List the results under benchmarks/results/ whose code changed after the revision that made them.

A result JSON records the revision of the code that made it (``numerics.code_revision``, :mod:`privfl.provenance`,
anywhere in the file: a file whose rows come from several runs holds several). :data:`DEPENDENCIES` declares, per
result file (a glob under benchmarks/results/), the source paths its figures depend on: the script that wrote it,
the method, the privacy layer, data, models and the runtime, and every source file of the packages those import
(:func:`with_imports`). A result is

- **stale** when one of those paths differs between a recorded revision and the working tree (``git diff
  --name-only REVISION -- PATHS``: a change made and undone since is no change; uncommitted edits count, so a
  change about to be committed shows the results it leaves stale), unless the difference is in docstrings,
  comments or layout only (a Python file whose syntax tree without docstrings is the same, :func:`same_code`: such
  an edit moves no figure; text a result copies from a docstring, as scaling's setting, is not a figure);
- **unknown** when it records no revision, or one this repository's history does not hold (a shallow clone);
- **undeclared** when no entry of :data:`DEPENDENCIES` names it (declare it: a result never passes unchecked);
- **historical** when it would be stale but :data:`HISTORICAL` keeps it as made on purpose (a measurement of
  behaviour the current code no longer has, the "before" beside an "after"), and every README that quotes it names
  the revision that made it, so no reader takes it for the current code's; one whose README does not stays stale;
- **current** otherwise.

A revision marked ``-dirty`` was made with uncommitted changes on top of that commit, which git cannot see: it is
compared as that commit. A result is **quoted** when README.md or benchmarks/README.md names its file
(``results/<name>``; ``{a,b}`` alternatives are expanded), so its figures are published and must be regenerated
when it is stale. Every quoting README must also name the revision that made it (its recorded revision, or the
commit that wrote a file that records none) within :data:`NEAR` characters of the file's name; the quoted results
where it does not are listed too (``Finding.unnamed_in``), whatever their status.

    python benchmarks/check_results.py            # every stale, unknown and undeclared result (make check-results)
    python benchmarks/check_results.py --brief    # a few warning lines (make test)

Exit status: 0, or 1 with ``--strict`` when a quoted result is stale; 2 when a declared path does not exist (the
declaration is wrong, not the result).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from code_changes import (  # noqa: E402  (beside this script)
    CERTIFICATES,
    PACKAGES,
    _git,
    bridge,
    code_changes,
    load_certificates,
    pathspecs,
)

#: Where the results are, relative to the checkout's top.
RESULTS = "benchmarks/results"

#: The files that quote results: a result they name is published.
READMES = ("README.md", "benchmarks/README.md")

# Groups of source paths (a folder stands for every file under it; ``!path`` excludes one).
#: What every federated run executes: configs, the run loop and the in-process engine, the wire, seeding, data, the
#: local-training path every method uses, the privacy wrapper around methods, and the scoring of novel clients.
RUNTIME = ("privfl/config.py", "privfl/experiment.py", "privfl/engines/choice.py", "privfl/federation",
           "privfl/data", "privfl/methods/base.py", "privfl/methods/local_training.py", "privfl/modes",
           "privfl/metrics.py", "privfl/evaluation/novel_pool.py", "privfl/memory.py", "privfl/devices.py")
#: Every noise, sensitivity and epsilon: the privacy layer and the accountants.
PRIVACY = ("privfl/privacy", "accounting")
#: Targets, encoders, hypernetworks and backbones.
MODELS = ("privfl/models",)
#: A federated training: all three.
TRAINING = RUNTIME + PRIVACY + MODELS
#: The Flower engines (simulation and deployment).
FLOWER = ("privfl/engines/flower",)
#: The reconstruction attack: the attack code (not the empirical DP audits, which it never imports), the backbone's
#: features, data, and the FedPFT / DP-FedPFT releases through the wire and the ledger.
ATTACK = ("attacks", "!attacks/audit.py", "!attacks/audit_mechanisms.py", "!attacks/audit_statistics.py",
          "privfl/models/backbones.py", "privfl/data", "privfl/methods/base.py", "privfl/methods/fedpft.py",
          "privfl/federation", *PRIVACY)


def _methods(*names: str) -> tuple[str, ...]:
    return tuple(f"privfl/methods/{name}.py" for name in names)


@functools.cache
def _imported(path: Path) -> tuple[str, ...]:
    """The dotted names a Python file imports (``import a.b``: ``a.b``; ``from a import b``: ``a`` and ``a.b``), from
    every import statement in it, a lazy one inside a function included."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return tuple(names)


@functools.cache
def _script(name: str) -> tuple[str, ...]:
    """The benchmark script ``name`` and every benchmark module it imports, directly or through another (a script
    that takes its protocol from another's module depends on that module too)."""
    found: list[str] = []
    todo = [name]
    while todo:
        module = todo.pop()
        path = Path(__file__).parent / f"{module}.py"
        if module in found or not path.exists():
            continue
        found.append(module)
        todo += _imported(path)
    return tuple(f"benchmarks/{module}.py" for module in [name, *sorted(set(found) - {name})])


def _source(root: Path, dotted: str) -> str | None:
    """The file of module ``dotted`` under one of :data:`PACKAGES` (``a/b.py`` or ``a/b/__init__.py``), or ``None``
    (another package's module, or a name that is not a module: ``from a import function``)."""
    parts = dotted.split(".")
    if parts[0] not in PACKAGES:
        return None
    for candidate in (Path(*parts).with_suffix(".py"), Path(*parts, "__init__.py")):
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def with_imports(paths: Sequence[str], root: Path = ROOT) -> tuple[str, ...]:
    """``paths`` and every source file of :data:`PACKAGES` that a Python file among them (or under a folder among
    them) imports, directly or through another, with the ``__init__.py`` of each package on the way (importing
    ``a.b.c`` runs ``a`` and ``a.b``). A path excluded with ``!`` is not added back. Only import statements are seen:
    what a run imports by name (a method from the registry, a feature stage) has to be declared."""
    excluded = {p[1:] for p in paths if p.startswith("!")}
    folders = tuple(p.rstrip("/") + "/" for p in paths if not p.startswith("!") and (root / p).is_dir())
    found = list(paths)
    todo: list[str] = []
    for p in paths:
        if p.startswith("!"):
            continue
        target = root / p
        todo += ([f.relative_to(root).as_posix() for f in sorted(target.rglob("*.py"))] if target.is_dir()
                 else [p] if p.endswith(".py") and target.is_file() else [])
    seen: set[str] = set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for name in _imported(root / file):
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                source = _source(root, ".".join(parts[:end]))
                if source is None or source in excluded:
                    continue
                if source not in found and not source.startswith(folders):
                    found.append(source)
                todo.append(source)
    return tuple(found)


#: Per result file (a glob relative to benchmarks/results/): the source paths its figures depend on, as declared
#: (the script, the methods it runs by name, the layers it trains through) and with every source file those import
#: (:func:`with_imports`). A file matched by several entries depends on all of them.
_DECLARED: dict[str, tuple[str, ...]] = {
    # the main job (`privfl sweep`, `make demo`)
    "sweep_demo*.json": ("privfl/sweep.py", *_methods("odpflhn", "odpflhn_config"), *TRAINING),
    "descriptor_headroom.json": (*_script("descriptor_headroom"), "privfl/sweep.py",
                                 *_methods("odpflhn", "odpflhn_config"), *TRAINING),
    "descriptor_settings.json": (*_script("descriptor_settings"), "privfl/sweep.py",
                                 *_methods("odpflhn", "odpflhn_config"), *TRAINING),
    "odpfl_*.json": (*_script("odpfl_mnist"), *_script("fedtta_mnist"), "privfl/sweep.py",
                     *_methods("odpflhn", "odpflhn_config", "pfedhn", "itpflhn", "pfl_baselines", "fedavg", "fedprox",
                               "fedtta"),
                     *TRAINING),
    "client_dp_mnist*.json": (*_script("client_dp_mnist"), *_methods("fedavg"), *TRAINING),
    "fedtta_*_code.json": (*_script("fedtta_mnist"),
                           *_methods("fedavg", "fedprox", "scaffold", "fedtta", "heterofedtta", "tent", "local",
                                     "odpflhn", "odpflhn_config"), *TRAINING),
    "fedtta_timing.json": (*_script("fedtta_mnist"), *_methods("fedtta"), *TRAINING),
    "fedtta_summary.json": (*_script("fedtta_summary"), *_script("fedtta_mnist"),
                            *_methods("fedavg", "fedprox", "fedtta", "heterofedtta", "tent", "odpflhn",
                                      "odpflhn_config"), *TRAINING),
    "tta_baselines_mnist*.json": (*_script("tta_baselines_mnist"), *_script("fedtta_mnist"),
                                  *_methods("afl", "fedadg", "fedavg", "fedgma", "fedsr", "tent"), *TRAINING),
    "pefll_mnist_*.json": (*_script("pefll_mnist"),
                           *_methods("pefll", "pfedhn", "fedavg", "odpflhn", "odpflhn_config"), *TRAINING),
    "methods_dp_mnist.json": (*_script("methods_dp_mnist"), "privfl/methods", *TRAINING),
    "features_dp_mnist.json": (*_script("features_dp_mnist"), "privfl/sweep.py", "privfl/methods", *TRAINING),
    "hypernets_features_mnist.json": (*_script("hypernets_features_mnist"), "privfl/sweep.py",
                                      *_methods("pfedhn", "itpflhn", "pefll", "odpflhn", "odpflhn_config",
                                                "shared_part"), *TRAINING),
    "cross_silo_mnist.json": (*_script("cross_silo_mnist"), *_methods("mrmtl", "fedavg", "local"), *TRAINING),
    "cross_silo_paired.json": (*_script("cross_silo_paired"), *_methods("mrmtl", "fedavg", "local"), *TRAINING),
    "central_dp_mnist.json": (*_script("central_dp_mnist"), "privfl/data", *PRIVACY, *MODELS, "privfl/metrics.py"),
    "fedpft_mnist.json": (*_script("fedpft_mnist"), *_methods("fedpft", "fedpft_baselines", "local"), *TRAINING),
    # attacks and audits
    "attack_mnist*.json": (*_script("attack_mnist"), *ATTACK),
    "mlp_guide/attack_mnist.json": (*_script("attack_mnist"), *ATTACK),
    "tuned_guide/attack_mnist.json": (*_script("attack_mnist"), *ATTACK),
    "attack_dp_class_size.json": (*_script("attack_dp_class_size"), *ATTACK),
    "audit_privatize.json": (*_script("audit_privatize"), "attacks/audit.py", "attacks/audit_statistics.py",
                             "attacks/audit_mechanisms.py", "attacks/statistics.py", *PRIVACY, *MODELS),
    "accounting_table.json": (*_script("accounting_table"), "accounting"),
    # performance: what the timed code executes
    "runtime_overhead.json": (*_script("runtime_overhead"), *_methods("fedavg"), *TRAINING),
    "workers.json": (*_script("workers"), *_methods("fedavg"), *TRAINING),
    "peer_pfl*.json": (*_script("peer_pfl"), *_methods("fedavg"), *TRAINING),
    "scaling.json": (*_script("scaling"), *_methods("fedavg"), *TRAINING, *FLOWER),
    "flower_*.json": (*_script("flower_overhead"), *_script("flower_fault"), *_methods("fedavg"), *TRAINING,
                      *FLOWER),
    "flower_message_cost.json": (*_script("flower_message_cost"), *FLOWER, "privfl/federation", "privfl/models"),
    "deployment_database.json": (*_script("deployment_database"), *_script("flower_overhead"), *_script("scaling"),
                                 *_methods("fedavg"), *TRAINING, *FLOWER),
    "privacy_step_time.json": (*_script("privacy_step_time"), *_methods("fedavg"), *TRAINING),
    "dp_sgd_step_time.json": (*_script("dp_sgd_step_time"), "privfl/methods/local_training.py", *PRIVACY, *MODELS),
    "import_time.json": (*_script("import_time"), "privfl", "accounting"),
}
#: Entries taken as declared, without :func:`with_imports`: import_time times the import of the packages it declares
#: whole, which runs their module-level code only (a lazy import inside a function, as the CLI's of the attacks, is
#: not timed).
AS_DECLARED = frozenset({"import_time.json"})
DEPENDENCIES: dict[str, tuple[str, ...]] = {glob: paths if glob in AS_DECLARED else with_imports(paths)
                                            for glob, paths in _DECLARED.items()}

#: Results kept as made on purpose (a glob relative to benchmarks/results/, as in DEPENDENCIES): measurements of code
#: that no longer exists, quoted as the "before" of a change. No rerun can reproduce them, so a dependency changed
#: since is expected; what keeps them honest is that each README quoting one names the revision that made it (the
#: recorded one, or for a file that records none, the last commit that wrote it).
HISTORICAL: dict[str, str] = {
    "flower_overhead_before.json": "the Flower engines before issue 30: a SuperNode per client in simulation and a "
                                   "ClientApp process per message in deployment",
    "flower_overhead_deployment.json": "the deployment engine before issue 30: a ClientApp process per message",
    "flower_overhead_45_pulls.json": "the shorter object-pull retries of 0ab1f27, reverted by 602af55",
    "odpfl_privacy_ball_lr5.json": "an earlier ODPFL-HN configuration: phi clipped to the unit ball, MLP psi, "
                                   "encoder rate 5.0",
}


@dataclass
class Finding:
    """One result file and what the check found."""

    path: str                                   #: relative to the checkout's top
    status: str                                 #: "stale", "unknown", "undeclared", "historical" or "current"
    revisions: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)      #: dependency files that differ since a recorded revision
    dependencies: list[str] = field(default_factory=list)  #: the declared paths
    newest_change: str | None = None            #: the newest commit touching them since then (hash, date, subject)
    quoted_in: list[str] = field(default_factory=list)
    note: str = ""
    #: the commits that made it (:func:`making_commits`), and the quoting READMEs that name none of them near the
    #: file's name (:func:`names_revision`)
    made_at: list[str] = field(default_factory=list)
    unnamed_in: list[str] = field(default_factory=list)

    @property
    def quoted(self) -> bool:
        return bool(self.quoted_in)


def recorded_revisions(data: object) -> list[str]:
    """Every ``code_revision`` string anywhere in a result's JSON, in order of first appearance."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "code_revision" and isinstance(value, str) and value and value not in found:
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(data)
    return found


def commit_of(revision: str) -> str:
    """The commit a recorded revision names: ``git describe --always`` output without ``-dirty`` (``v1-3-gabc1234``
    names ``abc1234``)."""
    base = revision.removesuffix("-dirty")
    match = re.fullmatch(r".+-\d+-g([0-9a-f]{4,40})", base)
    return match.group(1) if match else base


def dependencies_of(name: str, declared: Mapping[str, Sequence[str]]) -> list[str] | None:
    """The union of the declared paths of every entry whose glob matches ``name`` (relative to the results folder),
    or ``None`` when none does."""
    paths: list[str] = []
    matched = False
    for pattern, deps in declared.items():
        if fnmatch.fnmatchcase(name, pattern):
            matched = True
            paths += [p for p in deps if p not in paths]
    return paths if matched else None


def missing_declarations(root: Path, declared: Mapping[str, Sequence[str]]) -> list[str]:
    """Declared paths that do not exist in the checkout (a typo would otherwise never see a change)."""
    return sorted({p for deps in declared.values() for p in deps if not (root / p.removeprefix("!")).exists()})


def quoting(root: Path, readmes: Sequence[str] = READMES) -> dict[str, list[str]]:
    """``{"results/<name>": [readme, ...]}`` for every ``results/...`` name the READMEs write, ``{a,b}``
    expanded (a folder's name quotes the files in it)."""
    quoted: dict[str, list[str]] = {}
    for readme in readmes:
        path = root / readme
        if not path.exists():
            continue
        for token in re.findall(r"results/[\w./{},*-]+", path.read_text()):
            for name in _expand_braces(token.rstrip(".,")):
                quoted.setdefault(name.rstrip("/."), [])
                if readme not in quoted[name.rstrip("/.")]:
                    quoted[name.rstrip("/.")].append(readme)
    return quoted


def _expand_braces(text: str) -> Iterator[str]:
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        yield text
        return
    for option in match.group(1).split(","):
        yield from _expand_braces(text[:match.start()] + option + text[match.end():])


def check(root: Path = ROOT, declared: Mapping[str, Sequence[str]] = DEPENDENCIES, *, results: str = RESULTS,
          readmes: Sequence[str] = READMES, historical: Mapping[str, str] = HISTORICAL) -> list[Finding]:
    """One :class:`Finding` per JSON file under ``root/results``, sorted by path, each quoted one with the READMEs
    that do not name its revision (:func:`unnamed_in`); a stale one that ``historical`` declares is checked again by
    :func:`_as_historical`."""
    findings = _check(root, declared, results=results, readmes=readmes)
    texts = {readme: (root / readme).read_text() for readme in readmes if (root / readme).exists()}
    for finding in findings:
        finding.made_at = making_commits(root, finding)
        finding.unnamed_in = unnamed_in(finding, texts)
        name = finding.path.removeprefix(f"{results}/")
        reason = next((why for pattern, why in historical.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if reason is not None and finding.status == "stale":
            _as_historical(finding, reason)
    return findings


def making_commits(root: Path, finding: Finding) -> list[str]:
    """The commits that made a result: its recorded revisions, or for one that records none, the last commit that
    wrote the file."""
    if finding.revisions:
        return [commit_of(r) for r in finding.revisions]
    written = _git(root, "log", "-1", "--format=%H", "--", finding.path)
    return [written] if written else []


def unnamed_in(finding: Finding, readme_texts: Mapping[str, str]) -> list[str]:
    """The READMEs quoting ``finding`` that do not name a commit that made it (``finding.made_at``) within
    :data:`NEAR` characters of the file's name (every one, where no commit is known)."""
    file_name = Path(finding.path).name
    return [readme for readme in finding.quoted_in
            if not finding.made_at or not names_revision(readme_texts[readme], file_name, finding.made_at)]


#: How near (characters) to a mention of a result's file a README must name the revision that made it.
NEAR = 600


def names_revision(text: str, file_name: str, commits: Sequence[str], near: int = NEAR) -> bool:
    """Whether ``text`` names one of ``commits`` (its first 7 hex digits or more) within ``near`` characters of a
    mention of ``file_name`` (the name itself, or a ``results/...`` path whose ``{a,b}`` alternatives give it)."""
    mentions = [m.span() for m in re.finditer(re.escape(file_name), text)]
    mentions += [m.span() for m in re.finditer(r"results/[\w./{},*-]+", text)
                 if any(Path(n.rstrip(".,")).name == file_name for n in _expand_braces(m.group()))]
    for start, end in mentions:
        window = text[max(0, start - near):end + near]
        if any(re.search(rf"\b{re.escape(c[:7])}[0-9a-f]*\b", window) for c in commits):
            return True
    return False


def _as_historical(finding: Finding, reason: str) -> None:
    """A stale result kept as made on purpose becomes historical when every README that quotes it names one of its
    revisions near a mention of the file (``finding.unnamed_in`` is empty); otherwise it stays stale, with a note
    saying what is missing."""
    commits = [c[:7] for c in finding.made_at]
    if finding.unnamed_in:
        missing = (f"declared historical ({reason}), but {', '.join(finding.unnamed_in)} does not name the revision "
                   f"that made it ({', '.join(commits)}) within {NEAR} characters of the file's name")
        finding.note = "; ".join(filter(None, [finding.note, missing]))
        return
    finding.status = "historical"
    finding.note = f"kept as made at {', '.join(commits)}: {reason}"


def _check(root: Path, declared: Mapping[str, Sequence[str]], *, results: str, readmes: Sequence[str]
           ) -> list[Finding]:
    quoted = quoting(root, readmes)
    findings = []
    for file in sorted((root / results).rglob("*.json")):
        name = file.relative_to(root / results).as_posix()
        where = f"{results}/{name}"
        quoted_in = sorted({r for key, rs in quoted.items() for r in rs
                            if key == f"results/{name}" or f"results/{name}".startswith(key + "/")
                            and "*" not in key})
        deps = dependencies_of(name, declared)
        if deps is None:
            findings.append(Finding(where, "undeclared", quoted_in=quoted_in,
                                    note="no entry of DEPENDENCIES in benchmarks/check_results.py names it"))
            continue
        try:
            revisions = recorded_revisions(json.loads(file.read_text()))
        except (OSError, ValueError) as error:
            findings.append(Finding(where, "unknown", quoted_in=quoted_in, note=f"unreadable: {error}"))
            continue
        if not revisions:
            findings.append(_dated_by_history(root, where, deps, quoted_in))
            continue
        findings.append(_compare(root, where, revisions, deps, quoted_in))
    return findings


def _compare(root: Path, where: str, revisions: list[str], deps: list[str], quoted_in: list[str]) -> Finding:
    certificates = load_certificates(root)
    changed: list[str] = []
    bridged: list[str] = []
    newest = None
    unknown = []
    for revision in revisions:
        commit = commit_of(revision)
        if _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}") is None:
            unknown.append(revision)
            continue
        code = code_changes(root, commit, None, deps)
        if code is None:
            unknown.append(revision)
            continue
        if code:
            used = bridge(root, commit, deps, certificates)
            if used is not None:
                steps = [f"{c.base[:7]}..{c.head[:7]}" for c in used]
                bridged += [step for step in steps if step not in bridged]
                continue
        changed += [p for p in code if p not in changed]
        if code:
            log = _git(root, "log", "-1", "--format=%h %cs %s", f"{commit}..HEAD", "--", *pathspecs(code))
            newest = newest or (log if log else "uncommitted changes")
    dirty = [r for r in revisions if r.endswith("-dirty")]
    note = (f"made with uncommitted changes on {', '.join(commit_of(r) for r in dirty)} (compared as those commits)"
            if dirty else "")
    if bridged:
        note = "; ".join(filter(None, [note, "its code changed since only by changes certified to move no number "
                                             f"({CERTIFICATES}: {', '.join(bridged)})"]))
    if changed:
        return Finding(where, "stale", revisions, sorted(changed), deps, newest, quoted_in, note)
    if unknown:
        return Finding(where, "unknown", revisions, quoted_in=quoted_in,
                       note=f"revision {', '.join(unknown)} is not in this repository's history")
    return Finding(where, "current", revisions, quoted_in=quoted_in, note=note)


def _dated_by_history(root: Path, where: str, deps: list[str], quoted_in: list[str]) -> Finding:
    """A result that records no revision, dated by the last commit that wrote the file: it was made with code no
    newer than that commit, so a dependency changed after it makes the result stale for certain; one unchanged since
    stays unknown (the run may have used older code)."""
    written = _git(root, "log", "-1", "--format=%H", "--", where)
    if not written:
        return Finding(where, "unknown", quoted_in=quoted_in, note="records no code revision (and is not committed)")
    dated = _compare(root, where, [written[:7]], deps, quoted_in)
    if dated.status == "stale":
        dated.note = (f"records no code revision; dated by {written[:7]}, the last commit that wrote it: code it "
                      "depends on changed after that")
        return dated
    return Finding(where, "unknown", quoted_in=quoted_in,
                   note=f"records no code revision; the code it depends on is unchanged since {written[:7]}, the last "
                        "commit that wrote it, but the run may predate that commit" + (f"; {dated.note}" if dated.note
                                                                                        else ""))


# -- report ---------------------------------------------------------------------------------------------------------

def changed_areas(changed: Sequence[str], dependencies: Sequence[str]) -> list[str]:
    """The changed files grouped by the declared path that holds them: ``["privfl/sweep.py", "accounting (3
    files)"]``, single files first."""
    counts: dict[str, int] = {}
    for file in changed:
        holders = [p for p in dependencies if not p.startswith("!") and (file == p or file.startswith(p + "/"))]
        area = max(holders, key=len) if holders else file
        counts[area] = counts.get(area, 0) + 1
    singles = sorted(area for area in counts if area in changed)
    return singles + [f"{area} ({n} file{'s' if n > 1 else ''})" for area, n in sorted(counts.items())
                      if area not in changed]


def describe(finding: Finding, *, brief: bool = False) -> str:
    """One line per finding; ``brief``: a stale one's changed files counted, not named."""
    where = finding.path + (f" [quoted in {', '.join(finding.quoted_in)}]" if finding.quoted else "")
    if finding.status == "stale":
        newest = finding.newest_change or ""
        if brief:
            return (f"{where}: made at {', '.join(finding.revisions)}; {len(finding.changed)} of its dependency "
                    f"files changed since, newest change {' '.join(newest.split()[:2])}")
        newest = newest if len(newest) <= 90 else newest[:87] + "..."
        text = (f"{where}: made at {', '.join(finding.revisions)}; changed since: "
                f"{', '.join(changed_areas(finding.changed, finding.dependencies))}; newest change {newest}")
    elif finding.status == "current":
        text = f"{where}: made at {', '.join(finding.revisions)}" + (f"; {finding.note}" if finding.note else "")
    else:
        text = f"{where}: {finding.note}"
    return text + (f"; {finding.note}" if finding.status == "stale" and finding.note else "")


def report(findings: list[Finding], *, brief: bool) -> str:
    """The full listing, or (``brief``) the quoted stale results by name and counts of the rest."""
    groups: dict[tuple[str, bool], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.status, f.quoted), []).append(f)
    unnamed = [f for f in findings if f.unnamed_in and f.status != "historical"]
    lines = []
    if brief:
        quoted_stale = groups.get(("stale", True), [])
        if quoted_stale:
            lines.append(f"check-results: WARNING: {len(quoted_stale)} result(s) quoted by the READMEs are STALE "
                         "(code they depend on changed after the revision that made them); regenerate before "
                         "quoting them:")
            lines += [f"  STALE {describe(f, brief=True)}" for f in quoted_stale]
        if unnamed:
            lines.append(f"check-results: warning: {len(unnamed)} quoted result(s) whose README does not name the "
                         f"revision that made them within {NEAR} characters of the file's name: "
                         + ", ".join(f.path.split("/results/", 1)[-1] for f in unnamed))
        counts = [(n, label) for n, label in (
            (len(groups.get(("unknown", True), [])), "quoted results of unknown revision"),
            (len(groups.get(("stale", False), [])), "unquoted stale"),
            (len(groups.get(("unknown", False), [])), "unquoted of unknown revision"),
            (len(groups.get(("historical", True), [])) + len(groups.get(("historical", False), [])),
             "historical (kept as made, the revision named where quoted)"),
            (len(groups.get(("undeclared", True), [])) + len(groups.get(("undeclared", False), [])),
             "undeclared (no dependencies declared)")) if n]
        current = len(groups.get(("current", True), [])) + len(groups.get(("current", False), []))
        lines.append(f"check-results: warning: {len(findings)} results, {current} current"
                     + "".join(f", {n} {label}" for n, label in counts) + ("; `make check-results` lists them"
                                                                           if counts else ""))
        return "\n".join(lines)
    titles = {"stale": "STALE (code they depend on changed after the revision that made them, or, for a result that "
                       "records none, after the last commit that wrote it)",
              "unknown": "UNKNOWN (no recorded revision, or one not in this history)",
              "undeclared": "UNDECLARED (add them to DEPENDENCIES)",
              "historical": "historical (kept as made on purpose: HISTORICAL; the quoting READMEs name the revision)",
              "current": "current"}
    for status in ("stale", "unknown", "undeclared", "historical", "current"):
        for quoted in (True, False):
            chosen = groups.get((status, quoted), [])
            if chosen:
                lines.append(f"\n{titles[status]}, {'quoted by the READMEs' if quoted else 'not quoted'}: "
                             f"{len(chosen)}")
                lines += [f"  {describe(f)}" for f in chosen]
    if unnamed:
        lines.append(f"\nquoted where the README does not name the revision that made them (within {NEAR} "
                     f"characters of the file's name; name it where the figure is quoted): {len(unnamed)}")
        lines += [f"  {f.path} [{', '.join(f.unnamed_in)}]: made at "
                  f"{', '.join(c[:7] for c in f.made_at) or 'an unknown revision'}" for f in unnamed]
    return "\n".join(lines).lstrip("\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brief", action="store_true", help="the quoted stale results and counts of the rest")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a quoted result is stale")
    parser.add_argument("--root", default=str(ROOT), help="the checkout's top (default: this script's checkout)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    missing = missing_declarations(root, DEPENDENCIES)
    if missing:
        print(f"check-results: error: DEPENDENCIES declares paths that do not exist: {', '.join(missing)}",
              file=sys.stderr)
        return 2
    if _git(root, "rev-parse", "--show-toplevel") is None:
        print(f"check-results: warning: {root} is not a git checkout (or git is missing): no revision can be "
              "compared, nothing checked")
        return 0
    findings = check(root, DEPENDENCIES)
    print(report(findings, brief=args.brief))
    return 1 if args.strict and any(f.status == "stale" and f.quoted for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
