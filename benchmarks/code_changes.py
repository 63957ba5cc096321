"""Which code changed between two commits, statement by statement, and which changes are certified to move no
number.

A Python file's code is its syntax tree without docstrings (:func:`code_tree`): comments, blank lines, layout and
docstrings are not code. :func:`changed_statements` finds, statement by statement, what a change adds, removes or
rewrites. A :class:`Certificate` (``benchmarks/same_numbers.py``) says that every fingerprint case gave the same
numbers at two commits and which lines the cases executed on each side; :func:`bridge` chains certificates from the
commit a result was made at to the working tree. ``benchmarks/check_results.py`` uses them.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import json
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The packages whose source results depend on and certificates cover.
PACKAGES = ("privfl", "accounting", "attacks")


def pathspecs(paths: Sequence[str]) -> list[str]:
    """git pathspecs (from the top of the checkout) for declared paths; ``!path`` excludes."""
    return [f":(top,exclude){p[1:]}" if p.startswith("!") else f":(top){p}" for p in paths]


def _diff_entries(raw: str) -> Iterator[tuple[str, str | None, str | None]]:
    """``(path, blob before, blob after)`` per line of ``git diff --raw --no-abbrev``; the blob before is ``None``
    for a file added, renamed or copied (its earlier text is not this path's), the blob after for one removed or
    not yet written to a blob (a diff against the working tree)."""
    for line in raw.splitlines():
        if not line.startswith(":"):
            continue
        meta, *paths = line.split("\t")
        fields = meta.split()
        added_or_moved = fields[4][0] in "ARC" or set(fields[2]) == {"0"}
        yield (paths[-1], None if added_or_moved else fields[2],
               None if fields[4][0] == "D" or set(fields[3]) == {"0"} else fields[3])


def code_changes(root: Path, before: str, after: str | None, deps: Sequence[str]) -> list[str] | None:
    """The files among ``deps`` whose code differs between commit ``before`` and commit ``after`` (``None``: the
    working tree), docstrings, comments and layout aside (:func:`same_code`); ``None`` when git cannot tell."""
    if after is not None:      # two commits: the answer never changes, and results share commits and declarations
        found = _between_commits(root, before, after, tuple(deps))
        return None if found is None else list(found)
    diff = _git(root, "diff", "--raw", "--no-abbrev", before, "--", *pathspecs(deps))
    if diff is None:
        return None
    return [path for path, old, _ in _diff_entries(diff) if not same_code(root, old, path)]


@functools.cache
def _between_commits(root: Path, before: str, after: str, deps: tuple[str, ...]) -> tuple[str, ...] | None:
    diff = _git(root, "diff", "--raw", "--no-abbrev", before, after, "--", *pathspecs(deps))
    if diff is None:
        return None
    return tuple(path for path, old, new in _diff_entries(diff) if not same_blobs(root, old, new, path))


def same_blobs(root: Path, before: str | None, after: str | None, path: str) -> bool:
    """:func:`same_code` between two blobs."""
    if before is None or after is None or not path.endswith(".py"):
        return False
    texts = _blob_text(root, before), _blob_text(root, after)
    try:
        return None not in texts and code_tree(texts[0] or "") == code_tree(texts[1] or "")
    except (SyntaxError, ValueError):
        return False


#: Certificates that a change moved no number (``benchmarks/same_numbers.py`` writes them).
CERTIFICATES = "benchmarks/same_numbers.json"


@dataclass(frozen=True)
class Certificate:
    """Every fingerprint case of ``benchmarks/same_numbers.py`` gave the same numbers at ``base`` and ``head``, and
    its runs executed the lines ``lines_run`` (``(side, path, line)``, side ``"base"`` or ``"head"``) of the Python
    files the change touches."""

    base: str
    head: str
    lines_run: frozenset[tuple[str, str, int]]


def load_certificates(root: Path) -> tuple[Certificate, ...]:
    """The certificates in ``root``'s :data:`CERTIFICATES` whose commits this history holds."""
    path = root / CERTIFICATES
    if not path.exists():
        return ()
    return _certificates(path.read_text(), root)


@functools.cache
def _certificates(text: str, root: Path) -> tuple[Certificate, ...]:
    found = []
    for entry in json.loads(text)["certificates"]:
        if not entry.get("cases") or "lines_run" not in entry:     # lines are what a change is checked against
            continue
        if all(_git(root, "rev-parse", "--verify", "--quiet", f"{c}^{{commit}}") for c in (entry["base"],
                                                                                         entry["head"])):
            run = frozenset((side, path, line) for side, files in entry["lines_run"].items()
                            for path, numbers in files.items() for line in from_ranges(numbers))
            found.append(Certificate(entry["base"], entry["head"], run))
    return tuple(found)


def bridge(root: Path, commit: str, deps: Sequence[str], certificates: Sequence[Certificate]
           ) -> list[Certificate] | None:
    """The certificates that carry a result made at ``commit`` to the working tree, or ``None``: a chain whose first
    base has ``commit``'s code (among ``deps``), each next base its predecessor's head's, and whose last head the
    working tree's; each certificate used only for changes among ``deps`` whose statements its runs executed (a
    change to code the fingerprint suite never ran is not certified)."""
    state, used = commit, []
    while True:
        step = next((c for c in certificates if c not in used and code_changes(root, state, c.base, deps) == []
                     and _covered(root, c, tuple(deps))), None)
        if step is None:
            return None
        used.append(step)
        state = step.head
        if code_changes(root, state, None, deps) == []:
            return used


@functools.cache
def _covered(root: Path, certificate: Certificate, deps: tuple[str, ...]) -> bool:
    """Whether the certificate's runs executed every change between its commits in the files among ``deps``: each
    statement a change adds, removes or rewrites (:func:`changed_statements`) ran on its side (a line of it in
    ``lines_run``). A file that is not Python, or does not parse, is never covered."""
    changed = code_changes(root, certificate.base, certificate.head, deps)
    if changed is None:
        return False
    for path in changed:
        spans = changed_statements(root, certificate.base, certificate.head, path)
        if spans is None:
            return False
        for side, side_spans in zip(("base", "head"), spans, strict=True):
            if not all(any((side, path, line) in certificate.lines_run for line in range(first, last + 1))
                       for first, last in side_spans):
                return False
    return True


def to_ranges(lines: Iterable[int]) -> str:
    """Line numbers as ranges, ``"1-3,7,9-10"``: how a certificate stores the lines its runs executed."""
    runs: list[list[int]] = []
    for line in sorted(set(lines)):
        if runs and line == runs[-1][1] + 1:
            runs[-1][1] = line
        else:
            runs.append([line, line])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def from_ranges(text: str) -> set[int]:
    """The line numbers of :func:`to_ranges`' text."""
    found: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


#: The fields of a statement that hold the statements (or handlers, or match cases) it nests.
BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")

#: A statement as :func:`statements` lists it: ``((depth, field, header), (first line, last line))``.
Statement = tuple[tuple[int, str, str], tuple[int, int]]


def statements(source: str) -> list[Statement]:
    """Every statement of ``source`` without its docstrings, in order (an ``except`` handler and a ``case`` count as
    statements): its key, ``(depth, the field of its parent that holds it, its header)``, the header being the
    statement's syntax tree with the statements it nests left out; and the lines of the header, where running the
    statement fires a line event (a ``try``'s: its line to the end of its first statement). The keys in order
    determine the file's code, so two files differ exactly where their key sequences do."""
    found: list[Statement] = []

    def visit(nodes: list[ast.AST], depth: int, field: str) -> None:
        for node in nodes:
            header = copy.copy(node)
            for name in BLOCKS:
                if hasattr(header, name):
                    setattr(header, name, [])
            found.append(((depth, field, ast.dump(header)), _header_lines(node, header)))
            for name in BLOCKS:
                visit(getattr(node, name, []), depth + 1, name)

    visit(list(_without_docstrings(ast.parse(source)).body), 0, "body")
    return found


def _header_lines(node: ast.AST, header: ast.AST) -> tuple[int, int]:
    """The first and last line of a statement's header (``header``: ``node`` with its blocks left out)."""
    first = getattr(node, "lineno", None)
    if isinstance(node, (ast.Try, ast.TryStar)) and node.body:
        return node.lineno, node.body[0].end_lineno or node.lineno
    if isinstance(node, ast.stmt) and not any(getattr(node, name, None) for name in BLOCKS):
        return node.lineno, node.end_lineno or node.lineno        # a simple statement: all of it
    inner = [n for n in ast.walk(header) if n is not header and hasattr(n, "lineno")]
    starts = [n.lineno for n in inner] + ([first] if first is not None else [])
    ends = [n.end_lineno or n.lineno for n in inner] + ([first] if first is not None else [])
    return min(starts), max(ends)


@functools.cache
def changed_statements(root: Path, before: str, after: str, path: str
                       ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None:
    """The header lines (:func:`statements`) of the statements of ``path`` that a change from commit ``before`` to
    commit ``after`` removes or rewrites (in ``before``) and adds or rewrites (in ``after``), the two key sequences
    aligned by :class:`difflib.SequenceMatcher`; ``None`` for a file that is not Python or does not parse."""
    if not path.endswith(".py"):
        return None
    texts = [_git(root, "show", f"{commit}:{path}") for commit in (before, after)]
    try:
        old, new = (statements(text) if text is not None else [] for text in texts)
    except (SyntaxError, ValueError):
        return None
    matcher = difflib.SequenceMatcher(None, [key for key, _ in old], [key for key, _ in new], autojunk=False)
    removed, added = [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            removed += [lines for _, lines in old[i1:i2]]
            added += [lines for _, lines in new[j1:j2]]
    return tuple(removed), tuple(added)


def same_code(root: Path, blob: str | None, path: str) -> bool:
    """Whether the Python file ``path`` in the working tree is the same code as the blob it was made from: both
    parse, and their syntax trees are equal once docstrings are dropped (comments, blank lines and layout never reach
    the tree). Such an edit cannot move a figure. Anything else (another kind of file, a file added, moved or
    removed, a syntax error) counts as a change."""
    if blob is None or not path.endswith(".py") or not (root / path).is_file():
        return False
    before = _blob_text(root, blob)
    if before is None:
        return False
    try:
        return code_tree(before) == code_tree((root / path).read_text())
    except (SyntaxError, ValueError, OSError):
        return False


@functools.cache
def _blob_text(root: Path, blob: str) -> str | None:
    """A blob's text, read once per process (many results were made at commits that hold the same blob)."""
    return _git(root, "cat-file", "blob", blob)


@functools.cache
def code_tree(source: str) -> str:
    """The syntax tree of ``source`` without its docstrings (the leading string of a module, class or function),
    dumped without positions."""
    return ast.dump(_without_docstrings(ast.parse(source)))


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:]
    return tree


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
