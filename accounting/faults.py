"""A fault-injection hook for tests: the process kills itself (SIGKILL, a real death, no Python cleanup) at a chosen
point of a write. Inert unless the environment variable ``PRIVFL_KILL_AT`` is set; nothing else sets or reads it.

``PRIVFL_KILL_AT=POINT:N`` kills the process the N-th time (counted from 1, per process) it reaches ``POINT``:

- ``journal_line``: halfway through writing a line of a release journal (:mod:`accounting.journal`): the line is
  left cut short, as a kill during the append leaves it;
- ``journal_after``: just after a release journal line is written, before the release is delivered;
- ``write:NAME``: halfway through an atomic write (:func:`accounting.files.atomic_write`) of a file named ``NAME``
  (``write:checkpoint.pt``): its temporary file is left half written.

The fault-injection suite (``tests/federation/test_faults.py``) kills runs at seeded points this way and checks that a
resumed run reports every release made.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import NoReturn

#: The environment variable that arms the hook.
ENV = "PRIVFL_KILL_AT"

_reached: Counter[str] = Counter()


def reached(point: str) -> bool:
    """Count one arrival at ``point``; true when it is the arrival ``PRIVFL_KILL_AT`` names (the caller then leaves
    its work half done and calls :func:`die`). Always false when the variable is unset."""
    armed = os.environ.get(ENV)
    if not armed:
        return False
    name, _, count = armed.rpartition(":")
    if not name or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV} must be POINT:N with N >= 1 (for example journal_line:3), got {armed!r}")
    if name != point:
        return False
    _reached[point] += 1
    return _reached[point] == int(count)


def die() -> NoReturn:
    """Kill this process with SIGKILL: no exception, no ``finally``, no flush of Python buffers."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL ends the process")   # pragma: no cover


__all__ = ["ENV", "die", "reached"]
