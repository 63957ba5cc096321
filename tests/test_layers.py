"""The import graph: every import points down the layers, so no package imports one above it and there is no circle.

The layers, bottom to top (a module may import its own package and any lower layer, never a higher one or a package
beside it on the same layer):

0. ``accounting``: pure DP mathematics (no torch, no privfl);
1. leaves of privfl: errors, pickle loading, provenance, memory, scoring (``privfl.metrics``), the
   ``--help`` format; above
   them the device choice (``privfl.devices``) and the registry;
2. data and models;
3. the privacy layer;
4. the federation core: messages, the wire, runtimes, run directories;
5. the methods;
6. the run config (which method, with which settings, on which data);
7. the Flower adapter (``privfl.federation.flower``): below the training loop, which it never imports;
8. reports and plots (``privfl.evaluation``); 9. the training loop (``privfl.experiment``);
10. the engine choice and the sweep; 11. the deployed ServerApp and the attack suite;
12. the command line; 13. the package's own lazy exports (``privfl/__init__.py``).

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    ("accounting",),
    ("privfl.errors", "privfl.safe_pickle", "privfl.provenance", "privfl.memory", "privfl.metrics",
     "privfl.helpformat"),
    ("privfl.devices",),
    ("privfl.registry",),
    ("privfl.data", "privfl.models"),
    ("privfl.privacy",),
    ("privfl.federation",),
    ("privfl.methods",),
    ("privfl.config",),
    ("privfl.federation.flower",),
    ("privfl.evaluation",),
    ("privfl.experiment",),
    ("privfl.engine", "privfl.sweep"),
    ("privfl.flower_server", "attacks"),
    ("privfl.cli",),
    ("privfl",),
]


def group_of(module: str) -> str:
    """The longest layer entry that ``module`` is or lies inside."""
    found = [g for layer in LAYERS for g in layer if module == g or module.startswith(g + ".")]
    assert found, f"{module} is in no layer: add it to LAYERS"
    return max(found, key=len)


LAYER_OF = {group: i for i, layer in enumerate(LAYERS) for group in layer}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("privfl", "accounting", "attacks"):
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
        found += [(node.lineno, n) for n in names if n.split(".")[0] in ("privfl", "accounting", "attacks")]
    return found


def test_every_import_points_down_the_layers():
    wrong = []
    for name, path in sorted(modules().items()):
        source = group_of(name)
        for line, target in imports(path):
            goal = group_of(target)
            if goal != source and LAYER_OF[goal] >= LAYER_OF[source]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (layer {LAYER_OF[goal]}, {goal}) "
                             f"from layer {LAYER_OF[source]} ({source})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(wrong)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    # the check itself: a lazy import of the training loop from the Flower adapter is found
    path = tmp_path / "server_app.py"
    path.write_text("def f():\n    from privfl.experiment import train\n")
    (line, target), = imports(path)
    assert (line, target) == (2, "privfl.experiment")
    assert LAYER_OF[group_of(target)] > LAYER_OF[group_of("privfl.federation.flower.server_app")]


def test_the_training_loop_and_the_package_do_not_import_flower():
    code = ("import sys, privfl, privfl.experiment, privfl.config, privfl.engine; "
            "print(sorted(m for m in sys.modules "
            "if m == 'flwr' or m.startswith(('flwr.', 'privfl.federation.flower'))))")
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
