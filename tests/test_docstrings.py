"""Size rules for the code and its documentation, checked statically (``ast``; nothing is imported).

- A module docstring says what the module is for and its main entry points in at most 25 lines; derivations, paper
  discussions and design arguments live in ``docs/`` (one page per method family, one for the privacy layer), and a
  page a module docstring points to (``docs/PAGE.md, "SECTION"``) must have that section.
- No function over 80 lines and no file over 700 lines outside ``tests/``. The current offenders are listed below
  with their current sizes: the lists may only shrink (an entry that falls under the limit should be removed), so no
  new offender can appear and no listed one can grow.
- Every link in the repository's Markdown is relative (or to another site) and resolves: the file exists and, for a
  Markdown target, so does the anchor.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privfl", "attacks", "accounting")
MAX_MODULE_DOCSTRING_LINES = 25
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 700

#: Functions over MAX_FUNCTION_LINES ("path::qualified name": lines from ``def`` to the last line, decorators not
#: counted). Split them and lower or remove their entries; never raise one.
LONG_FUNCTIONS: dict[str, int] = {}

#: Files over MAX_FILE_LINES outside tests/ (lines). Split them and lower or remove their entries; never raise one.
LONG_FILES: dict[str, int] = {}


def source_files(*roots):
    for root in roots:
        yield from sorted(p for p in (ROOT / root).rglob("*.py") if "__pycache__" not in p.parts)


def repository_python_files():
    """Every Python file of the repository outside tests/ and the virtual environments."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in ("tests", "runs", "shared") or any(p.startswith(".") or p == "__pycache__" for p in parts):
            continue
        yield path


def rel(path):
    return path.relative_to(ROOT).as_posix()


def functions(tree):
    """(qualified name, node) of every function and method, nested ones included."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)
    yield from visit(tree, "")


def headings(markdown):
    """The GitHub anchors of a Markdown text's headings (code blocks skipped; repeated titles get -1, -2, ...)."""
    anchors, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_module_docstrings_are_short():
    long = {}
    for path in source_files(*PACKAGES):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc is not None and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long[rel(path)] = len(doc.splitlines())
    assert not long, (f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the discussion to docs/ and "
                      f"point to it): {long}")


def test_module_docstrings_point_to_existing_sections():
    pointers = 0
    for path in source_files(*PACKAGES):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        for page, section in re.findall(r'(docs/[\w/.-]+\.md), "([^"]+)"', " ".join(doc.split())):
            if page == "docs/papers.md":
                continue
            target = ROOT / page
            assert target.is_file(), f"{rel(path)} points to {page}, which does not exist"
            assert any(line.lstrip("#").strip() == section for line in target.read_text().splitlines()
                       if line.startswith("#")), f"{rel(path)} points to {page}, \"{section}\": no such section"
            pointers += 1
    assert pointers >= 30


def test_no_new_or_longer_long_functions():
    found = {}
    for path in repository_python_files():
        for name, node in functions(ast.parse(path.read_text())):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found[f"{rel(path)}::{name}"] = lines
    new = {k: v for k, v in found.items() if k not in LONG_FUNCTIONS}
    grown = {k: (LONG_FUNCTIONS[k], v) for k, v in found.items() if k in LONG_FUNCTIONS and v > LONG_FUNCTIONS[k]}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: {new}"
    assert not grown, f"listed long functions that grew (listed, now): {grown}"


def test_no_new_or_longer_long_files():
    found = {rel(p): len(p.read_text().splitlines()) for p in repository_python_files()}
    found = {k: v for k, v in found.items() if v > MAX_FILE_LINES}
    new = {k: v for k, v in found.items() if k not in LONG_FILES}
    grown = {k: (LONG_FILES[k], v) for k, v in found.items() if k in LONG_FILES and v > LONG_FILES[k]}
    assert not new, f"files over {MAX_FILE_LINES} lines outside tests/: {new}"
    assert not grown, f"listed long files that grew (listed, now): {grown}"


def test_markdown_links_are_relative_and_resolve():
    pages = [p for p in ROOT.rglob("*.md")
             if not any(part.startswith(".") or part in ("runs", "shared") for part in p.relative_to(ROOT).parts)]
    assert ROOT / "README.md" in pages
    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"(https?|mailto):", target):
                continue
            if target.startswith("/"):
                broken.append(f"{rel(page)}: {target} (absolute)")
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{rel(page)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in headings(dest.read_text()):
                broken.append(f"{rel(page)}: {target} (no such anchor)")
    assert not broken, broken
    assert checked >= 40
