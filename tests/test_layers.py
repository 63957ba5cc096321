"""The import graph between folders: every import points down the layers, so no folder imports one above it and
there is no loop between folders.

A layer is a folder: a top-level package or module of ``privfl`` (``privfl/federation/``, ``privfl/cli/``; the
package's own ``privfl/__init__.py`` is ``__init__``), or the ``accounting`` and ``attacks`` packages. :data:`LAYERS`
orders them bottom to top; a module may import anything in its own folder and any folder below its own, never one
above it. The list names every folder and only folders that exist, so the tree and this test cannot disagree: a new
folder fails here until it is given its place.

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privfl", "accounting", "attacks")

#: Bottom to top: pure DP mathematics (no torch, no privfl); the leaves of privfl (errors, pickle loading, provenance,
#: memory, the ``--help`` format, per-client scores), the device choice and the registry; data, models, the privacy
#: layer; what every engine shares (messages, the wire, the round loop, run directories, seeding), the methods, the
#: privacy modes wrapped around any method, the run config; reports and plots, the training loop, the engines
#: (in-process choice and Flower), the sweep; the attack suite, the command line, its console entry (which guards the
#: command line's import against Ctrl-C), the package's own lazy exports, and ``python -m privfl`` (the entry again).
LAYERS = [
    "accounting",
    "errors", "safe_pickle", "provenance", "memory", "helpformat", "metrics", "devices", "registry",
    "data", "models", "privacy",
    "federation", "methods", "modes", "config",
    "evaluation", "experiment", "engines", "sweep",
    "attacks", "cli", "entry", "__init__", "__main__",
]
RANK = {name: i for i, name in enumerate(LAYERS)}


def folder_of(module: str) -> str:
    """The folder (layer) that dotted ``module`` lies in."""
    parts = module.split(".")
    if parts[0] == "privfl":
        return parts[1] if len(parts) > 1 else "__init__"
    return parts[0]


def folders_on_disk() -> set[str]:
    found = {"accounting", "attacks"}
    for path in (ROOT / "privfl").iterdir():
        if path.suffix == ".py":
            found.add(path.stem)
        elif path.is_dir() and (path / "__init__.py").exists():
            found.add(path.name)
    return found


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of project code in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PACKAGES]
    return found


def wrong_imports(name: str, path: Path) -> list[str]:
    """Each import of module ``name`` (at ``path``) into another folder that is not below its own."""
    source = folder_of(name)
    wrong = []
    for line, target in imports(path):
        goal = folder_of(target)
        if goal != source and RANK.get(goal, len(LAYERS)) >= RANK.get(source, -1):
            wrong.append(f"{path}:{line} imports {target} (folder {goal}, layer {RANK.get(goal)}) from folder "
                         f"{source} (layer {RANK.get(source)})")
    return wrong


def folder_graph() -> dict[str, set[str]]:
    """folder -> the other folders its modules import."""
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        source = folder_of(name)
        graph.setdefault(source, set()).update(folder_of(t) for _, t in imports(path) if folder_of(t) != source)
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan), each sorted: every folder
    of one reaches every other, so each is a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {n for targets in graph.values() for n in targets}):
        if node not in index:
            visit(node)
    return sorted(found)


def test_every_folder_has_one_place_in_the_layers():
    assert len(LAYERS) == len(set(LAYERS)), "a folder is listed twice"
    on_disk = folders_on_disk()
    assert not on_disk - set(LAYERS), f"folders in no layer (add them to LAYERS): {sorted(on_disk - set(LAYERS))}"
    assert not set(LAYERS) - on_disk, f"LAYERS names folders that do not exist: {sorted(set(LAYERS) - on_disk)}"


def test_every_import_points_down_the_layers():
    wrong = [w for name, path in sorted(modules().items()) for w in wrong_imports(name, path.relative_to(ROOT))]
    assert not wrong, "imports that do not point down:\n" + "\n".join(wrong)


def test_no_folders_import_each_other_in_a_loop():
    assert loops(folder_graph()) == []


def test_the_loop_check_sees_a_loop():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == [["a", "b"], ["c", "d"]]
    assert loops({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_layer_check_sees_an_upward_and_a_sideways_import(tmp_path):
    # a lazy import of the training loop from the shared round loop: up
    path = tmp_path / "runtime.py"
    path.write_text("def f():\n    from privfl.experiment import train\n")
    assert imports(path) == [(2, "privfl.experiment")]
    assert len(wrong_imports("privfl.federation.runtime", path)) == 1
    # a method reaching into the engines, and the sweep into the attack suite: both into a higher folder
    path.write_text("import privfl.engines.flower.protocol\nfrom attacks.audit import audit\n")
    assert len(wrong_imports("privfl.methods.fedavg", path)) == 2
    assert len(wrong_imports("privfl.sweep", path)) == 1
    # its own folder and the folders below are fine; a folder in no layer never is
    path.write_text("from privfl.engines.flower import protocol\nfrom privfl.experiment import train\n")
    assert wrong_imports("privfl.engines.choice", path) == []
    assert wrong_imports("privfl.new_folder.x", path) != []


def test_the_training_loop_and_the_package_do_not_import_flower():
    code = ("import sys, privfl, privfl.experiment, privfl.config, privfl.engines.choice; "
            "print(sorted(m for m in sys.modules "
            "if m == 'flwr' or m.startswith(('flwr.', 'privfl.engines.flower'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_package_exports_its_main_names_lazily():
    # `import privfl` loads no torch; each exported name is the object its module defines
    code = ("import sys, privfl; assert 'torch' not in sys.modules, 'import privfl loaded torch'; "
            "from privfl import privatize, PrivacyLedger, PrivacyBudget, train, RunConfig; "
            "import privfl.privacy, privfl.experiment, privfl.config, accounting; "
            "assert privatize is privfl.privacy.privatize and train is privfl.experiment.train; "
            "assert RunConfig is privfl.config.RunConfig and PrivacyLedger is accounting.PrivacyLedger; "
            "assert PrivacyBudget is accounting.PrivacyBudget; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr
