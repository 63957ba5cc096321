"""privfl: federated learning for clients that arrive after training, with every client-to-server message crossing
a differential-privacy layer with formal accounting.

The names most programs need are importable from here; each is loaded on first use, so ``import privfl`` stays
cheap (no torch until a name that needs it is asked for):

>>> from privfl import RunConfig, train, privatize, PrivacyLedger, PrivacyBudget
>>> PrivacyBudget(epsilon=1.0, delta=1e-5).epsilon
1.0
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "RunConfig": "privfl.config",
    "train": "privfl.experiment",
    "privatize": "privfl.privacy",
    "PrivacyLedger": "accounting",
    "PrivacyBudget": "accounting",
    "LedgerBook": "accounting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'privfl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
