"""The NCCL settings a run starts with, so that the ranks that survive a lost one can say which it was.

PyTorch's defaults on NCCL tear a process down from the communicator's watchdog thread when a collective fails
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), before Python sees an exception: the survivors' report (the heartbeat's lost
and stalled ranks, :mod:`lightning_mgpu.resilience.liveness`) would never print. Here the communicator is aborted and
the error raised in Python instead (``2``), and a failed or timed-out collective dumps the Flight Recorder's entries
into the run directory. Each is set only where the user set nothing: a user's own value wins.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lightning_mgpu.resilience.collective_trace import BUFFER_ENTRIES

#: Each setting and why.
SETTINGS = {
    # abort the communicator and raise in the calling thread: the survivors name the lost rank before exiting
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # a failed or timed-out collective dumps each rank's last collectives (the Flight Recorder) ...
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # ... which it keeps only with a buffer (the same size the hang report reads on every backend)
    "TORCH_NCCL_TRACE_BUFFER_SIZE": BUFFER_ENTRIES,
}
#: Where the dumps go: one file per rank, this prefix then the rank.
DUMP_PREFIX = "nccl-trace-rank-"


def nccl_settings(report_dir: Optional[Path]) -> dict[str, str]:
    """The settings for a run whose reports go to ``report_dir`` (the dumps too; torch's default is ``/tmp``)."""
    out = dict(SETTINGS)
    if report_dir is not None:
        out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(report_dir) / DUMP_PREFIX)
    return out


def apply_nccl_settings(backend: str, report_dir: Optional[Path]) -> dict[str, str]:
    """Set what the user left unset, before the first NCCL process group exists; returns what was set."""
    if "nccl" not in backend:
        return {}
    chosen = {k: v for k, v in nccl_settings(report_dir).items() if k not in os.environ}
    os.environ.update(chosen)
    return chosen
