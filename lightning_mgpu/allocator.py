"""Make a CPU training process hand freed tensor memory back to the operating system: the memory-lean setting
``MGPUStrategy(return_freed_memory=True)`` (``parallel.return_freed_memory=true``), off by default because it costs
step time.

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
step of 2.80-2.96 s against 2.29-2.60 s (+10-25%); ``benchmarks/overhead.py`` measured 1.187 x a hand-written loop with
it and 1.029 without. A 4 MiB threshold cost less (2.84 s) but let the 401M-parameter 8-process run's first step peak
at 2.04-2.22 GB per rank instead of 1.80-1.92. Handing back only between steps does not replace it: ``malloc_trim(0)``
after setup and after every optimizer step left that run's first-step peaks at 2.55-3.16 GB per rank, as high as
glibc's default (2.46-2.91 GB), because the growth is fragmentation inside the step. So the fast behaviour is the
default and this one a setting, which the memory check counts (``CPU_STATE_FACTOR`` with it, the larger
``CPU_STATE_FACTOR_KEPT_HEAP`` without) and proposes as a fix when a CPU run does not fit. A user's own
``MALLOC_MMAP_THRESHOLD_`` keeps precedence either way.
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


def returns_freed_memory(asked: bool) -> bool:
    """Whether a CPU training process started from here with ``return_freed_memory=asked`` will fix the threshold
    (what the memory check counts): asked, and glibc lets it (the user set no ``MALLOC_MMAP_THRESHOLD_``)."""
    return asked and _mallopt() is not None


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (not raised again by frees). Returns whether
    it was set (see :func:`returns_freed_memory`)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))
