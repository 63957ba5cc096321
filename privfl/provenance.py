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

__all__ = ["numerics"]


def numerics(checkout: str | Path | None = None) -> dict:
    """``{"torch", "cpu_capability", "threads", "code_revision"}`` of this process now.

    ``code_revision`` is ``git describe --always --dirty`` in ``checkout`` (default: the folder this package is in),
    or ``None`` where that is not a git checkout or git is missing: an installed copy has no revision to give.
    """
    where = Path(checkout) if checkout is not None else Path(__file__).parent
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=where, capture_output=True, text=True,
                              timeout=30, check=False)
        revision = (done.stdout.strip() or None) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        revision = None
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "code_revision": revision}
