"""Naming the rank that died: each rank stamps the rendezvous store every half second; when a collective fails
(a peer's socket closed, or the collective timeout passed), the ranks whose stamps have gone stale are the
ones that were lost, and the error says so instead of a bare transport error.

The store is torch.distributed's default rendezvous store (``_get_default_store``, private but stable since
torch 1.x): it is already shared by every rank and needs no extra port.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

import torch.distributed as dist

INTERVAL_S = 0.5
STALE_S = 2.0


class LostRankError(RuntimeError):
    """A collective failed because other ranks are gone."""


class Heartbeat:
    """Stamps ``mgpu/heartbeat/<rank>`` in the store from a daemon thread."""

    def __init__(self, store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mgpu-heartbeat", daemon=True)

    @classmethod
    def for_default_group(cls) -> "Heartbeat":
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store(), dist.get_rank(), dist.get_world_size()).start()

    def start(self) -> "Heartbeat":
        self._stamp()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _stamp(self) -> None:
        self.store.set(f"mgpu/heartbeat/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self._stamp()
            except Exception:  # the store is gone (its host died): nothing left to stamp
                return

    def lost_ranks(self, wait_s: float = STALE_S + 2 * INTERVAL_S) -> list[int]:
        """Ranks whose stamp is older than ``STALE_S``, waiting up to ``wait_s`` for a just-died rank's stamp to age.
        ``[-1]`` when the store itself is unreachable."""
        deadline = time.time() + wait_s
        while True:
            try:
                now = time.time()
                stale = [r for r in range(self.world_size) if r != self.rank and
                         now - float(self.store.get(f"mgpu/heartbeat/{r}").decode()) > STALE_S]
            except Exception:
                return [-1]
            if stale or time.time() > deadline:
                return stale
            time.sleep(INTERVAL_S / 2)


@contextlib.contextmanager
def name_lost_ranks(heartbeat: Optional[Heartbeat]) -> Iterator[None]:
    """Re-raise a failed collective as :class:`LostRankError` naming the lost ranks, when there are any."""
    try:
        yield
    except LostRankError:
        raise
    except Exception as err:
        lost = heartbeat.lost_ranks() if heartbeat is not None else []
        if not lost:
            raise
        who = "the rank hosting the rendezvous store" if lost == [-1] else \
            f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
        raise LostRankError(f"{who} of {heartbeat.world_size} stopped responding (no heartbeat for more than "
                            f"{STALE_S:.0f} s) while rank {heartbeat.rank} waited on it: the job cannot continue; "
                            f"restart it (checkpoint.resume=auto continues from the newest complete checkpoint). "
                            f"The collective failed with: {type(err).__name__}: {err}") from err
