"""What decides a run's floating-point sums, stored beside its results so a later repeat can be judged.

Training amplifies a last-bit difference into a different model within tens of rounds (FedTTA's second-order meta
step on rotated MNIST turns one into different weights within ten rounds), so a repeat of a stored run reproduces it
only when the code and the numerics match: torch's version, the instruction set its CPU kernels dispatch to, and the
thread count (1, 2 and 3 threads train three different FedTTA models from one seed). The same four repeat a run to
the last digit on the same kind of machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

__all__ = ["RESULTS_DIR", "numerics"]

#: Where the benchmarks write their results, relative to the checkout's top: changes there are not code changes.
RESULTS_DIR = "benchmarks/results"


def numerics(checkout: str | Path | None = None) -> dict:
    """``{"torch", "cpu_capability", "threads", "code_revision"}`` of this process now.

    ``code_revision`` is ``git describe --always`` in ``checkout``, with ``-dirty`` appended when a tracked file
    differs from that commit, or ``None`` where that is not a git checkout, git is missing, or git cannot tell whether
    tracked files changed (never a clean revision by default). Files under
    :data:`RESULTS_DIR` do not count as differences: the benchmarks write there, so without the exception every run
    after a benchmark's first in a checkout would be marked dirty for the results it had stored. By default the
    checkout is the one this package's own files are tracked in; a copy installed inside some other repository (a
    virtual environment in a project's folder) gives ``None`` rather than that repository's commit.
    """
    where: Path | None
    if checkout is None:
        where = Path(__file__).parent
        if not _git(where, "ls-files", "--error-unmatch", Path(__file__).name):
            where = None
    else:
        where = Path(checkout)
    revision = (_git(where, "describe", "--always") or None) if where is not None else None
    if revision is not None and where is not None:   # a revision comes from a checkout
        changed = _git(where, "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                       f":(top,exclude){RESULTS_DIR}")
        # a status git could not give leaves the state unknown: no revision rather than a clean one by default
        revision = None if changed is None else revision + ("-dirty" if changed else "")
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "code_revision": revision}


def _git(where: Path, *args: str) -> str | None:
    """``git <args>``'s output in ``where`` (``""`` if it printed nothing), or ``None`` if it failed or git is
    missing."""
    try:
        done = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
