"""Start-up stays cheap: the command line's help loads none of the numeric stack, and a run whose models and data
need no torchvision never imports it (its import, with torch._dynamo, takes seconds). Each check is a fresh
interpreter, since this test process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

_LOADED = "import json, sys; print(json.dumps(sorted(m for m in {names!r} if m in sys.modules)))"


def loaded_after(code: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` are in ``sys.modules`` after a fresh interpreter runs ``code``."""
    done = subprocess.run([sys.executable, "-c", f"{code}\n{_LOADED.format(names=names)}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_loads_neither_torch_nor_numpy_nor_the_accountants():
    code = ("import sys\nfrom privfl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as done:\n"
            "    assert done.code == 0\n")
    assert loaded_after(code, ("torch", "numpy", "scipy", "dp_accounting", "privfl.methods")) == []


def test_import_privfl_methods_does_not_import_torchvision():
    assert loaded_after("import privfl.methods", ("torch", "torchvision")) == ["torch"]


def test_a_fedavg_mnist_2nn_round_does_not_import_torchvision():
    code = (
        "from privfl.config import RunConfig\n"
        "from privfl.data import FederationSpec, build_federation\n"
        "from privfl.experiment import build_runtime\n"
        "config = RunConfig(federation=FederationSpec(source='mnist', num_clients=10, max_samples=1000), "
        "method='fedavg', method_config={'local_steps': 1}, model='mlp2nn', rounds=1, select='last')\n"
        "runtime = build_runtime(config, build_federation(config.federation, seed=0))\n"
        "assert runtime.run_round(0)['clients'] == 5\n"
    )
    assert loaded_after(code, ("torch", "torchvision")) == ["torch"]


def test_the_probe_sees_torchvision_when_a_rotation_needs_it():
    """The same probe on a run with rotated images, which use torchvision's transforms: the check above can fail."""
    code = ("import numpy as np\nfrom privfl.data.federated import _shift_images\n"
            "_shift_images(np.zeros((2, 1, 8, 8), np.float32), 30.0, 0.0, 5)\n")
    assert loaded_after(code, ("torch", "torchvision")) == ["torch", "torchvision"]
