"""Federated methods, one module each, registered by name (see :mod:`privfl.methods.base`).

Every module of this package is imported here, so a new method is one new module whose ``register_method`` call runs
on import; nothing else needs editing.
"""

import importlib
import pkgutil

from privfl.methods.base import (
    METHODS,
    ClientContext,
    ClientProcedure,
    LocalTrainingConfig,
    MethodConfig,
    MethodSpec,
    ModelFactory,
    Strategy,
    get_method,
    register_method,
)

__all__ = [
    "METHODS", "ClientContext", "ClientProcedure", "LocalTrainingConfig", "MethodConfig", "MethodSpec", "ModelFactory",
    "Strategy",
    "get_method", "register_method",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
