"""Derived random streams, so every random draw is a pure function of (seed, round, client, purpose).

Keying every draw this way (instead of threading one generator through the run) is what makes a resumed run end
with the same numbers as an uninterrupted one, and what lets the Flower runtime, where each client lives in its own
process, reproduce the in-process runtime exactly (invariant 7 of docs/invariants.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


def _key(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


#: A 32-bit word's range: seed material below it goes to SeedSequence as words.
_WORD = 2**32


def derive_rng(seed: int, purpose: str, *keys: int) -> np.random.Generator:
    """A numpy generator for ``purpose`` (e.g. ``"batches"``) keyed by the run seed and integer keys."""
    entropy = [int(seed), _key(purpose), *(int(k) for k in keys)]
    if all(0 <= v < _WORD for v in entropy):
        # np.random.default_rng(entropy) itself: a list of ints below 2^32 is these 32-bit words to SeedSequence, and
        # given as words it skips the list's conversion (a third of the time)
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(np.array(entropy, dtype=np.uint32))))
    return np.random.default_rng(entropy)


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit integer seed for ``purpose`` keyed like :func:`derive_rng` (for ``torch.manual_seed``)."""
    return int(derive_rng(seed, purpose, *keys).integers(0, 2**63 - 1))


def seeded_init(factory: Callable[[], T], seed: int) -> T:
    """Call ``factory()`` with torch's global RNG seeded by ``seed``, leaving the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()
