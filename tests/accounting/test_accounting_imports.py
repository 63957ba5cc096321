"""The accounting package stays pure mathematics: no torch, no privfl, and its docstring examples run."""

import doctest
import subprocess
import sys
from pathlib import Path

import pytest

import accounting.accountants
import accounting.calibration
import accounting.events
import accounting.ledger

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_accounting_imports_neither_torch_nor_privfl():
    code = (
        "import sys, accounting\n"
        "from accounting import GaussianEvent, SelfComposedEvent, epsilon, analytic_gaussian_sigma\n"
        "epsilon(SelfComposedEvent(GaussianEvent(2.0), 3), 1e-5)\n"
        "epsilon(GaussianEvent(2.0), 1e-5, accountant='rdp')\n"
        "analytic_gaussian_sigma(1.0, 1e-5)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert not any(m == 'privfl' or m.startswith('privfl.') for m in sys.modules), 'privfl was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "module", [accounting.events, accounting.calibration, accounting.accountants, accounting.ledger],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
