"""Federated methods, one module each, registered by name (see :mod:`privfl.methods.base`)."""

from privfl.methods import fedavg, fedprox, local, scaffold  # noqa: F401  (registration side effects)
from privfl.methods.base import (
    METHODS,
    ClientContext,
    ClientProcedure,
    LocalTrainingConfig,
    MethodSpec,
    ModelFactory,
    Strategy,
    get_method,
    register_method,
)

__all__ = [
    "METHODS", "ClientContext", "ClientProcedure", "LocalTrainingConfig", "MethodSpec", "ModelFactory", "Strategy",
    "get_method", "register_method",
]
