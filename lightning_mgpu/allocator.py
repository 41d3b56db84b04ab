"""Make a CPU training process hand freed tensor memory back to the operating system.

torch allocates CPU tensors with glibc's ``malloc``. glibc serves a large block with its own ``mmap`` (returned to
the OS on ``free``), but after the first such block is freed it raises that threshold to the block's size, up to
32 MiB, and from then on serves blocks below it from its heap, where freed memory stays with the process. A training
step frees and allocates blocks of many sizes (whole gradients, gathered ZeRO-3 parameters, flat copies, optimizer
temporaries), so the heap keeps hundreds of MB that a later, differently sized block cannot reuse: measured on 8
processes of a 200M-parameter Llama (tp2 x pp2 x dp2, ZeRO-3, fp32), the first step's peak resident memory per rank was
1.50-1.63 GB with glibc's default and 1.09-1.23 GB with a fixed 1 MiB threshold (64 KiB: 1.09-1.21 GB).
Written by hand because neither torch nor Lightning sets it; glibc reads the same setting from the environment
(``MALLOC_MMAP_THRESHOLD_``), which a user's own value keeps precedence over.

It costs CPU time: every block of 1 MiB or more is fresh memory the kernel maps and zeroes. Measured on one process
of a 39M-parameter Llama (ZeRO-0, one thread): 2.27-2.41M minor page faults over 8 steps against 0.48M, and a median
step of 2.80-2.96 s against 2.29-2.60 s (+10-25%). A 4 MiB threshold cost less (2.84 s) but let the 401M-parameter
8-process run's first step peak at 2.04-2.22 GB per rank instead of 1.80-1.92. ``MALLOC_MMAP_THRESHOLD_=33554432``
(glibc's own ceiling) gives the speed back, and the memory check then counts glibc's default behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable, Optional

#: Blocks of at least this many bytes are mmapped and go back to the OS when freed (tensors below stay in the heap).
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def _mallopt() -> Optional[Callable[[int, int], int]]:
    """glibc's ``mallopt`` where this process may set it: not when the user set ``MALLOC_MMAP_THRESHOLD_`` (their
    value stays) or the C library has none."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def returns_freed_memory() -> bool:
    """Whether a CPU training process started from here will fix the threshold (what the memory check assumes)."""
    return _mallopt() is not None


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (not raised again by frees). Returns whether
    it was set (see :func:`returns_freed_memory`)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))
