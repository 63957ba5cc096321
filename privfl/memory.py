"""Keep freed large blocks in the process heap, so big tensors are not page-faulted in afresh every round.

glibc's ``malloc`` serves every block above its mmap threshold (128 KiB to 32 MiB, adjusted dynamically) with a
fresh ``mmap`` and returns it to the kernel on ``free``. A hypernetwork's head for the MNIST 2NN's first layer has
15.7 million weights, so each round allocates and frees dozens of 63 MB gradients, momentum steps and sums; every
one of them is zero-filled page by page by the kernel on first touch. On the FedTTA MNIST protocol (50 clients a round,
one CPU thread) that page faulting is about a quarter of a pFedHN or ODPFL-HN round
(``benchmarks/odpfl_mnist.py --part speed --default-allocator``).

:func:`reuse_freed_memory` raises the mmap threshold, the trim threshold and the top pad (``mallopt``), so freed
blocks stay in the heap and are reused. Numbers are unchanged (allocation does not touch values); the price is a
resident set that stays near its peak. The benchmark scripts and the ``privfl`` command call it at start-up; library
code never does, since it changes the whole process.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["reuse_freed_memory"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 1 << 30    # blocks up to 1 GiB come from the heap
_TRIM_THRESHOLD = 1 << 31    # keep up to 2 GiB of free heap top instead of returning it to the kernel
_TOP_PAD = 1 << 29           # grow the heap 512 MiB at a time


def reuse_freed_memory() -> bool:
    """Tune glibc's allocator as the module docstring says; ``True`` if it took effect, ``False`` where the C
    library is not glibc (macOS, musl): there the call changes nothing."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_TOP_PAD, _TOP_PAD)))
