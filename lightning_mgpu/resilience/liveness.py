"""Naming the rank that was lost, and how: each rank stamps the rendezvous store every half second, and a rank
whose own code raised records ``<type>: <message>`` there before it exits. When a collective fails (a peer's
socket closed, or the collective timeout passed), the surviving ranks read both: a rank that recorded a failure
*failed* with that exception; a rank whose stamp has gone stale *stopped responding* (killed, hung, its node
lost). The error says which, instead of a bare transport error.

The store is torch.distributed's default rendezvous store (``_get_default_store``, private but stable since
torch 1.x): it is already shared by every rank and needs no extra port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.distributed as dist

from lightning_mgpu.resilience import collective_trace, watchdog

log = logging.getLogger(__name__)
INTERVAL_S = 0.5
STALE_S = 2.0
#: How much of a failed rank's exception message is recorded (the report quotes it).
MESSAGE_CHARS = 500


class LostRankError(RuntimeError):
    """A collective failed because other ranks are gone."""


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch.distributed reporting that a peer went away (closed socket, timeout, store error),
    i.e. a consequence of another rank's failure rather than a failure of this rank's own code.

    gloo raises plain ``RuntimeError`` whose message names its source file (``[.../gloo/transport/tcp/pair.cc:553]
    Connection closed by peer``, ``... Timed out waiting 5000ms for recv operation to complete``); NCCL and the
    store raise ``torch.distributed.DistError`` subclasses.
    """
    return isinstance(err, (LostRankError, dist.DistError)) or (isinstance(err, RuntimeError) and "gloo" in str(err))


@dataclass
class LostPeers:
    """What the store says about the other ranks: recorded failures, stale stamps, or the store itself gone."""

    failed: dict[int, str] = field(default_factory=dict)
    stale: list[int] = field(default_factory=list)
    store_gone: bool = False

    def __bool__(self) -> bool:
        return bool(self.failed or self.stale or self.store_gone)


class Heartbeat:
    """Stamps ``mgpu/heartbeat/<rank>`` in the store from a daemon thread; records this rank's own failure in
    ``mgpu/failed/<rank>``."""

    def __init__(self, store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        #: where a hang report writes this rank's collective trace and stacks (the strategy sets the run directory)
        self.report_dir: Optional[Path] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mgpu-heartbeat", daemon=True)
        #: this rank's step-progress watchdog while it trains (``lightning_mgpu.resilience.watchdog``), stopped with this
        self.watchdog: Optional[Any] = None

    @classmethod
    def for_default_group(cls) -> "Heartbeat":
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store(), dist.get_rank(), dist.get_world_size()).start()

    def start(self) -> "Heartbeat":
        # No clean-up of an earlier job's records here: a delete_key on the rendezvous store right after the
        # rendezvous was followed, once in a full test run, by "Broken pipe" on the next set (second job of a
        # multirun). A store that outlives a job (torchrun restarts) can therefore name an old failure.
        self._stamp()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop stamping, and wait for the thread: the next job of a multirun then starts with no stamp in flight."""
        self._stop.set()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=4 * INTERVAL_S)

    def _stamp(self) -> None:
        self.store.set(f"mgpu/heartbeat/{self.rank}", repr(time.time()))
        self.store.set(f"mgpu/at/{self.rank}", json.dumps(collective_trace.place()))

    def where(self) -> tuple[Optional[str], list[int]]:
        """Where this rank and the others part in the collective this rank waits in (from everyone's last stamp), and
        the ranks that have not entered it."""
        theirs = {}
        for r in range(self.world_size):
            if r != self.rank and self.store.check([f"mgpu/at/{r}"]):
                theirs[r] = json.loads(self.store.get(f"mgpu/at/{r}").decode())
        return collective_trace.divergence(self.rank, collective_trace.place(), theirs)

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self._stamp()
            except Exception:  # the store is gone (its host died): nothing left to stamp
                return

    def record_failure(self, err: BaseException) -> None:
        """Record that this rank's own code raised ``err``, for the ranks left waiting on it. A collective failure
        is not recorded: it is the consequence of another rank's failure, which that rank records (or its stamp
        shows)."""
        if is_collective_failure(err):
            return
        text = f"{type(err).__name__}: {err}"
        try:
            self.store.set(f"mgpu/failed/{self.rank}", text[:MESSAGE_CHARS])
        except Exception:  # the store is gone: the peers will see a lost store host instead
            pass

    def lost_peers(self, wait_s: float = STALE_S + 2 * INTERVAL_S) -> LostPeers:
        """The other ranks that recorded a failure or whose stamp is older than ``STALE_S``, waiting up to
        ``wait_s`` for a just-failed rank's record to appear or a just-killed rank's stamp to age."""
        deadline = time.time() + wait_s
        while True:
            try:
                found = LostPeers()
                now = time.time()
                for r in range(self.world_size):
                    if r == self.rank:
                        continue
                    if self.store.check([f"mgpu/failed/{r}"]):
                        found.failed[r] = self.store.get(f"mgpu/failed/{r}").decode()
                    elif now - float(self.store.get(f"mgpu/heartbeat/{r}").decode()) > STALE_S:
                        found.stale.append(r)
            except Exception:
                return LostPeers(store_gone=True)
            if found or time.time() > deadline:
                return found
            time.sleep(INTERVAL_S / 2)


def _safely(read):
    try:
        return read()
    except Exception:  # the store or the trace is gone: the report goes without it
        return None


def _report_files(heartbeat: Heartbeat) -> str:
    """Write this rank's collective trace and stacks into the run directory; the sentence that points to them."""
    if heartbeat.report_dir is None:
        return ""
    files = _safely(lambda: collective_trace.write_report(heartbeat.report_dir, heartbeat.rank))
    return f" Rank {heartbeat.rank}'s collective trace and stacks: {', '.join(map(str, files))}." if files else ""


def _stalled(heartbeat: Heartbeat, behind: list[int], wait: bool) -> str:
    """What the watchdogs of the ranks ``behind`` said (``wait``: up to ``STALE_S`` for their word, when they are all
    alive and so can still say it)."""
    deadline = time.time() + (STALE_S if wait else 0)
    while not (said := _safely(lambda: watchdog.stalled_ranks(heartbeat.store, behind))) and time.time() < deadline:
        time.sleep(INTERVAL_S / 2)
    return "".join(f" Rank {r} has made no training progress for {s['idle_s']:.0f} s while its heartbeat went on: it is "
                   f"busy outside any collective (a loop in Python, a stuck data loader or file) or waits in another "
                   f"one; its stacks show where"
                   f"{': ' + ', '.join(s['files']) if s['files'] else ''}." for r, s in sorted((said or {}).items()))


def _native_stacks(heartbeat: Heartbeat, stale: list[int]) -> str:
    """The stacks that faulthandler wrote for the ranks that stopped responding (a rank holding the GIL in C code can
    say nothing else), where the run directory shows them."""
    if heartbeat.report_dir is None:
        return ""
    written = [watchdog.native_stacks_file(heartbeat.report_dir, r) for r in stale]
    written = [p for p in written if _safely(lambda p=p: p.stat().st_size)]
    return f" Their stacks, written without the GIL when their steps stopped: {', '.join(map(str, written))}." \
        if written else ""


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def describe(found: LostPeers, heartbeat: Heartbeat) -> str:
    """One sentence per kind of loss: who failed with what, who stopped responding."""
    of = f"of {heartbeat.world_size}"
    if found.store_gone:
        return "the rank hosting the rendezvous store stopped responding"
    parts = [f"rank {r} {of} failed with {text}" for r, text in sorted(found.failed.items())]
    if found.stale:
        parts.append(f"{_ranks(found.stale)} {of} stopped responding (no heartbeat for more than {STALE_S:.0f} s)")
    return "; ".join(parts)


@contextlib.contextmanager
def name_lost_ranks(heartbeat: Optional[Heartbeat]) -> Iterator[None]:
    """Re-raise a failed collective as :class:`LostRankError` naming the lost ranks and how they were lost.

    An exception of this rank's own code passes through at once, for the strategy's ``on_exception`` to record
    (:meth:`Heartbeat.record_failure`) before the process exits and its peers' collectives fail.
    """
    try:
        yield
    except LostRankError:
        raise
    except Exception as err:
        if heartbeat is None or not is_collective_failure(err):
            raise
        found = heartbeat.lost_peers()
        where, behind = (None, []) if found.store_gone else (_safely(heartbeat.where) or (None, []))
        if not found and not where:
            raise
        advice = (["that rank's own traceback shows where it raised"] if found.failed else []) + \
            (["restart the job (checkpoint.resume=auto continues from the newest complete checkpoint)"]
             if found.stale or found.store_gone else [])
        who = describe(found, heartbeat) if found else "every rank is alive (fresh heartbeats)"
        stalled = _stalled(heartbeat, behind, wait=not found) if behind and not found.store_gone else ""
        stalled += _native_stacks(heartbeat, found.stale)
        error = LostRankError(f"{who}, while rank {heartbeat.rank} waited: the job cannot continue"
                              f"{'; ' + '; '.join(advice) if advice else ''}.{f' Where: {where}.' if where else ''}"
                              f"{stalled}{_report_files(heartbeat)} The collective on rank {heartbeat.rank} failed "
                              f"with: {type(err).__name__}: {err}")
        # Logged at once as well: Lightning's local launcher SIGKILLs the surviving ranks within 5 s of a rank's exit,
        # often before the traceback of this error is printed.
        log.error("LostRankError: %s", error)
        raise error from err
