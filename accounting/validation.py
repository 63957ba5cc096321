"""Checks of given values, written once for every package: the accountants, the privacy layer, the methods, the
attacks.

Each check names the value, says what would be valid and shows what it got. The package that raises decides the
exception class: :mod:`accounting` raises ``ValueError``; privfl binds the same checks to its
:class:`privfl.errors.ConfigError` (``privfl.errors.check``), which the command line prints as a one-line user error.

>>> check = Checks(ValueError)
>>> check.epsilon(1)
1.0
>>> check.delta(1.5)
Traceback (most recent call last):
...
ValueError: delta must be a probability in (0, 1), got 1.5
>>> check.require(is_int_at_least(True, 1), "steps", True, "an integer >= 1")
Traceback (most recent call last):
...
ValueError: steps must be an integer >= 1, got True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, TypeGuard


def is_real(value: Any) -> TypeGuard[float]:
    """A real number that is not a bool (``True`` is an int in Python, never a rate or a count). For the type checker
    it is then a float: every ``numbers.Real`` converts with ``float()`` and compares as one."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite(value: Any) -> TypeGuard[float]:
    """A finite real number that is not a bool."""
    return is_real(value) and math.isfinite(value)


def is_int_at_least(value: Any, minimum: int) -> TypeGuard[int]:
    """An integer >= ``minimum`` that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= minimum


class Checks:
    """The checks, raising ``error`` (an exception class taking one message)."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    def require(self, ok: bool, name: str, value: Any, valid: str) -> None:
        """Raise ``"{name} must be {valid}, got {value!r}"`` unless ``ok``."""
        if not ok:
            raise self.error(f"{name} must be {valid}, got {value!r}")

    def epsilon(self, value: Any, name: str = "epsilon", *, allow_zero: bool = False) -> float:
        """A finite epsilon > 0 (>= 0 with ``allow_zero``), natural log."""
        ok = is_finite(value) and (value > 0 or (allow_zero and value == 0))
        self.require(ok, name, value, f"a finite number {'>= 0' if allow_zero else '> 0'} (natural log)")
        return float(value)

    def delta(self, value: Any, name: str = "delta", *, allow_zero: bool = False) -> float:
        """A probability in (0, 1) (or [0, 1) with ``allow_zero``)."""
        ok = is_real(value) and (0 < value < 1 or (allow_zero and value == 0))
        self.require(ok, name, value, f"a probability in {'[0, 1)' if allow_zero else '(0, 1)'}")
        return float(value)

    def positive(self, value: Any, name: str) -> float:
        """A finite number > 0."""
        self.require(is_finite(value) and value > 0, name, value, "a finite number > 0")
        return float(value)

    def non_negative(self, value: Any, name: str) -> float:
        """A finite number >= 0."""
        self.require(is_finite(value) and value >= 0, name, value, "a finite number >= 0")
        return float(value)

    def fraction(self, value: Any, name: str) -> float:
        """A number in (0, 1]: a rate or a share."""
        self.require(is_real(value) and 0 < value <= 1, name, value, "in (0, 1]")
        return float(value)

    def integer(self, value: Any, name: str, minimum: int = 1) -> int:
        """An integer >= ``minimum`` (not a bool)."""
        self.require(is_int_at_least(value, minimum), name, value, f"an integer >= {minimum}")
        return int(value)

    def choice(self, value: Any, name: str, choices: Iterable[Any]) -> Any:
        """One of ``choices``."""
        choices = tuple(choices)
        self.require(value in choices, name, value, f"one of {', '.join(map(repr, choices))}")
        return value


#: The checks as :mod:`accounting` raises them.
check = Checks(ValueError)
