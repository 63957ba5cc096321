"""Registries by name: one shape for every "pick it by name" table (methods, models, set encoders, data sources,
backbones, audited mechanisms).

A :class:`Registry` is a dict (``name in registry``, ``registry[name]``, ``sorted(registry)`` work as on any dict)
that refuses a name registered twice and, through :meth:`Registry.lookup`, names an unknown one with the valid
choices, as a :class:`~privfl.errors.ConfigError`:

>>> shapes = Registry("shape", {"square": 4})
>>> shapes.register("triangle", 3)
3
>>> shapes.lookup("circle")
Traceback (most recent call last):
...
privfl.errors.ConfigError: unknown shape 'circle'; valid choices: square, triangle
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from privfl.errors import ConfigError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Items of one ``kind`` by name (``kind`` names them in errors: "method", "model", ...)."""

    def __init__(self, kind: str, items: Mapping[str, T] | None = None) -> None:
        super().__init__()
        self.kind = kind
        for name, item in (items or {}).items():
            self.register(name, item)

    def register(self, name: str, item: T) -> T:
        """Add ``item`` under ``name``; a name registered already raises ``ValueError`` (a programming error)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} is registered under a non-empty str name, got {name!r}")
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = item
        return item

    def lookup(self, name: str) -> T:
        """The item registered as ``name``; an unknown name raises :class:`ConfigError` listing the valid ones."""
        if name not in self:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid choices: {', '.join(sorted(self))}")
        return self[name]


__all__ = ["Registry"]
