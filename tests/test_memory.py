"""reuse_freed_memory: a 64 MB tensor comes from the heap instead of a fresh mmap, and numbers do not change."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# counts glibc's mmapped blocks (mallinfo2().hblks) around the allocation of one 64 MB tensor, in a fresh process so
# the setting does not leak into the rest of the suite
CODE = """
import ctypes, sys, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "on":
    from privfl.memory import reuse_freed_memory
    assert reuse_freed_memory() is True
torch.manual_seed(0)
before = libc.mallinfo2().hblks
x = torch.randn(16_000_000)
print(libc.mallinfo2().hblks - before, float(x.double().sum()))
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_tensors_come_from_the_heap_once_tuned_and_values_are_unchanged():
    runs = {}
    for mode in ("off", "on"):
        result = subprocess.run([sys.executable, "-c", CODE, mode], cwd=REPO_ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        mmapped, total = result.stdout.split()
        runs[mode] = (int(mmapped), float(total))
    assert runs["off"][0] == 1      # glibc's default: a fresh mmap for the 64 MB block
    assert runs["on"][0] == 0       # tuned: served from the heap
    assert runs["on"][1] == runs["off"][1]
