"""launch.distributed: a rank keeps a forward's freed activations for the next forward (reuse_freed_memory), so a
prefill chunk's tensors are not mapped and page-faulted in again on every layer (the start-up's timing and serving
then run alike), and gives back what the start-up's timing freed (release_freed_memory). Each case in a fresh
interpreter: malloc's thresholds move with what a process has freed before."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# A 24 MiB block (about a 512-token chunk's MLP activations of a 7B layer in fp32: 22 MiB) allocated, freed, and
# the heap's free bytes read back: mallinfo2 (glibc 2.33 and later).
PROBE = """
import ctypes, sys
if sys.argv[1] != "default":
    from launch.distributed import release_freed_memory, reuse_freed_memory
    assert reuse_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(ctypes.c_size_t(24 << 20))
libc.free(ctypes.c_void_p(block))
if sys.argv[1] == "released":
    release_freed_memory()
print(libc.mallinfo2().fordblks >> 20)
"""


def heap_free_mib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="glibc 2.33+ only (mallinfo2)")
def test_a_freed_activation_block_stays_in_the_process():
    assert heap_free_mib("default") < 24  # glibc by default: the block was mapped, and unmapped when freed
    assert heap_free_mib("reuse") >= 24  # kept in the heap for the next forward's


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="glibc 2.33+ only (mallinfo2)")
def test_the_start_up_timings_freed_blocks_go_back_to_the_os():
    assert heap_free_mib("released") < 24  # (the handshake, once every rank has timed itself)
