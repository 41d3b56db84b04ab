"""A step-progress watchdog: the rank whose training has not moved for as long as the collective timeout writes its own
collective trace and every thread's stacks into the run directory, and says so in the rendezvous store.

The heartbeat (``lightning_mgpu.resilience.liveness``) cannot see this: its thread goes on stamping while the training
thread spins in Python (a loop that never ends, a stuck data loader), so such a rank looks alive, and the other ranks,
timing out in the collective it never enters, can only name it from outside. This watchdog measures progress instead:
the time since the last optimizer step (validation and checkpoint saves pause it). When that passes ``stall_s`` (the
collective timeout: by then the others' collective has failed too), it writes the report files once and records
``mgpu/stalled/<rank>`` (how long, and the files), which the others' error quotes.

A rank whose training thread holds the GIL in C code (a C extension's call that never returns) stops this thread and
the heartbeat's too: it looks dead from outside and can say nothing. For it, Python's ``faulthandler`` is armed at
every step for half of ``stall_s``: its timer runs in a native thread that needs no GIL, and writes every thread's
Python stack to ``stall-rank<r>-native-stacks.txt`` in the run directory, which the others' error points to (an
empty file is removed at the end of training).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from lightning_mgpu.resilience import collective_trace

log = logging.getLogger(__name__)
#: How often the watchdog looks at the time since the last step.
CHECK_S = 0.5
#: Where ``faulthandler`` writes a rank's stacks when its steps stop for half the stall time, whatever holds the GIL.
NATIVE_STACKS = "stall-rank{rank}-native-stacks.txt"


def native_stacks_file(report_dir: Path, rank: int) -> Path:
    return Path(report_dir) / NATIVE_STACKS.format(rank=rank)


class StepWatchdog:
    """Arm at the start of training; :meth:`beat` after every optimizer step; :meth:`paused` around work that is not
    a step (validation, a checkpoint save); :meth:`stop` at the end."""

    def __init__(self, store: Any, rank: int, stall_s: float, report_dir: Optional[Path]) -> None:
        self.store, self.rank, self.stall_s, self.report_dir = store, rank, stall_s, report_dir
        self._last, self._armed, self._reported = time.monotonic(), True, False
        self._beats, self._lock = 0, threading.Lock()  # a step during a report withdraws it (see _report)
        self._stop = threading.Event()
        self._native = native_stacks_file(report_dir, rank).open("w") if report_dir is not None else None
        self._arm_native()
        self._thread = threading.Thread(target=self._run, name="mgpu-step-watchdog", daemon=True)
        self._thread.start()

    def _arm_native(self) -> None:
        """(Re)start faulthandler's timer: every half ``stall_s`` without a step appends every thread's stack (again
        and again: a step slow for another reason, which dumps first, does not hide a hold that follows)."""
        if self._native is not None:
            faulthandler.dump_traceback_later(self.stall_s / 2, repeat=True, file=self._native)

    def beat(self) -> None:
        self._last = time.monotonic()
        if self._armed:
            self._arm_native()
        if self._reported:  # it moved again: what it said no longer holds
            with self._lock:
                self._beats += 1
                self._reported = False
                with contextlib.suppress(Exception):  # the store is gone: nobody is left to read it
                    self.store.set(f"mgpu/stalled/{self.rank}", json.dumps({"resumed": True}))

    def pause(self) -> None:
        self._armed = False
        faulthandler.cancel_dump_traceback_later()

    def resume(self) -> None:
        self._armed = True
        self.beat()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        armed, self._armed = self._armed, False
        faulthandler.cancel_dump_traceback_later()
        try:
            yield
        finally:
            self._armed = armed
            self.beat()

    def stop(self) -> None:
        """Stop watching, and wait for the thread (it holds the store, which must not outlive its server); remove the
        native stacks file if nothing was written to it."""
        faulthandler.cancel_dump_traceback_later()
        if self._native is not None:
            self._native.close()
            path = Path(self._native.name)
            if path.exists() and path.stat().st_size == 0:
                path.unlink()
            self._native = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=4 * CHECK_S)

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            idle = time.monotonic() - self._last
            if self._armed and not self._reported and idle > self.stall_s:
                self._reported = True
                self._report(idle)

    def _report(self, idle: float) -> None:
        """Write the files (``stall-rank<r>-*``), then say so in the store, unless a step came meanwhile."""
        files: list[str] = []
        beats = self._beats
        try:
            if self.report_dir is not None:
                files = [str(p) for p in collective_trace.write_report(self.report_dir, self.rank, "stall")]
            with self._lock:
                if self._beats != beats:
                    return
                self.store.set(f"mgpu/stalled/{self.rank}", json.dumps({"idle_s": round(idle, 1), "files": files}))
        except Exception:  # the store or the directory is gone: the others' error goes without this rank's word
            return
        log.error("rank %d has made no optimizer step for %.0f s (busy, or waiting in a collective); its collective "
                  "trace and stacks: %s", self.rank, idle, ", ".join(files) or "not written (no run directory)")


def stalled_ranks(store: Any, ranks: list[int]) -> dict[int, dict]:
    """``{rank: {"idle_s", "files"}}`` of the ``ranks`` whose watchdog reported no progress."""
    found = {}
    for rank in ranks:
        key = f"mgpu/stalled/{rank}"
        if store.check([key]) and "idle_s" in (said := json.loads(store.get(key).decode())):
            found[rank] = said
    return found


def paused(heartbeat: Any) -> contextlib.AbstractContextManager:
    """The watchdog of ``heartbeat`` (a :class:`~lightning_mgpu.resilience.liveness.Heartbeat` or None) paused."""
    watchdog = getattr(heartbeat, "watchdog", None)
    return watchdog.paused() if watchdog is not None else contextlib.nullcontext()
