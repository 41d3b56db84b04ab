"""Replicas that synchronise asynchronously (``replica_update="async"``): each pushes its change in weights when its
round of ``sync_every`` inner steps ends and continues from the newest global weights, waiting for nobody unless it
would be more than ``max_staleness`` rounds ahead of them.

The global weights are sharded over the ranks at the same place of every replica
(``lightning_mgpu.parallel.replica_server``). At the end of round ``k`` a rank cuts the pseudo-gradient of its share
(weights at the start of the round minus now) into R slices, pushes each to its owner, then pulls every slice at
version ``k - max_staleness`` or newer and continues from them: the weights at the start of its next round. The
staleness of each round (outer steps the weights it started from missed) is logged as ``replica/staleness``. With
``max_staleness=0`` every pull waits for every replica's push of the round: the arithmetic of ``local``. The last
step of training pulls the weights after every replica's last round, so every replica ends with the same weights.

A replica's ranks push and pull on their own: with a staleness bound above 0 a replica may continue from slices of
different versions (each owner's newest), as workers of a parameter server do.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_mgpu import engine as engines
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.replica_server import (BYE, FINAL, FINISH, PAYLOAD_TAG, PULL, PUSH, REPLY_TAG,
                                                    REQUEST_TAG, ServerGroups, SliceOwner, serve, staleness)
from lightning_mgpu.parallel.replicas import OuterOptimizer, start_together

#: Seconds between two pulls of a slice that is not new enough yet.
POLL_SECONDS = 0.002


class AsyncReplicaSync:
    """The client side of one rank: call :meth:`after_inner_step` after every inner optimizer step."""

    def __init__(self, engine: Any, layout: ParallelLayout, outer: OuterOptimizer,
                 timeout: Optional[timedelta] = None) -> None:
        self.engine, self.layout, self.every, self.bound = engine, layout, layout.sync_every, layout.max_staleness
        self.masters = engines.master_weights(engine)
        start_together(engine, layout, self.masters)
        self.replicas, self.replica = layout.size("rep"), layout.rank("rep")
        #: the weights this round started from (this rank's share), in host memory where the server's slices travel
        self.anchor = self._flat()
        n, r = self.anchor.numel(), self.replicas
        self.bounds = [n // r + (1 if j < n % r else 0) for j in range(r)]  # replica j owns slice j
        self.owner = SliceOwner(self._slices(self.anchor)[self.replica].clone(), outer, self.replicas)
        self.timeout = (timeout or timedelta(minutes=30)).total_seconds()  #: how long a pull waits for the others
        self.groups = ServerGroups(layout.group_ranks("rep"), dist.get_rank(), timeout)
        self.errors: list = []
        self.server = threading.Thread(target=serve, args=(self.owner, self.groups, self.replicas - 1, self.errors),
                                       name="mgpu-replica-server", daemon=True)
        self.server.start()
        self.base = [0] * self.replicas  #: the version of each slice this round started from
        self.inner_steps = self.rounds = self.outer_steps = self.synced_at = 0
        self.staleness: list[int] = []  #: per round, the most outer steps any slice it started from missed
        self.sent_elements = self.received_elements = 0  #: of weights and pseudo-gradients, to and from other replicas
        self.finished = False

    def describe(self) -> str:
        return (f"{self.replicas} replicas stepping alone, asynchronously: a push and a pull every {self.every} "
                f"steps, at most {self.bound} rounds ahead; this rank owns slice {self.replica} of its share "
                f"({self.owner.weights.numel():,} of {self.anchor.numel():,} elements, "
                f"{type(self.owner.optimizer).__name__})")

    def after_inner_step(self, last: bool = False) -> bool:
        """Count an inner step; every ``sync_every``-th, push and pull; at the ``last`` step of training, also wait
        for every replica's last round. Returns whether this step ended a round."""
        self.inner_steps += 1
        if self.inner_steps % self.every and not last:
            return False
        self._end_round()
        if last:
            self._finish_all()
        return True

    def finish(self) -> None:
        """At the end of training: a round cut short is pushed, then the weights after every replica's last round."""
        if self.finished:
            return
        if self.inner_steps != self.synced_at:
            self._end_round()
        self._finish_all()

    @torch.no_grad()
    def _end_round(self) -> None:
        self.rounds += 1
        self.staleness.append(max(staleness(self.rounds, b) for b in self.base))
        delta = self.anchor.sub_(self._flat())  # weights before minus after; the anchor is refilled by the pull
        for j, piece in enumerate(self._slices(delta)):
            self._push(j, piece)
        self._pull_all(max(0, self.rounds - self.bound))
        self.synced_at = self.inner_steps

    def _finish_all(self) -> None:
        for j in range(self.replicas):
            self._request(j, FINISH, self.rounds)
        self._pull_all(FINAL)
        for j in self._others():
            self._request(j, BYE, 0)
        self.server.join()
        self._raise_server_error()
        self.finished = True

    @torch.no_grad()
    def _pull_all(self, want: int) -> None:
        for j, piece in enumerate(self._slices(self.anchor)):
            self.base[j] = self._pull(j, want, piece)
        offset = 0
        for master in self.masters:
            master.view(-1).copy_(self.anchor[offset:offset + master.numel()].to(master.device))
            offset += master.numel()
        engines.refresh_working_weights(self.engine)
        self.outer_steps = min(self.base)

    def _push(self, owner: int, piece: torch.Tensor) -> None:
        if owner == self.replica:
            self.owner.push(self.rounds, self.base[owner], piece, self.replica)
            return
        self._request(owner, PUSH, self.rounds, self.base[owner])
        self.groups.requests.send([piece.contiguous()], owner, PAYLOAD_TAG).wait()
        self.sent_elements += piece.numel()

    def _pull(self, owner: int, want: int, into: torch.Tensor) -> int:
        """Fill ``into`` with slice ``owner`` at version ``want`` or newer; return its version. Waiting longer than
        the collective timeout raises, naming the replicas the slice waits for (stopped, or that much slower)."""
        began = time.monotonic()
        while True:
            self._raise_server_error()
            if time.monotonic() - began > self.timeout:
                raise RuntimeError(self._waited_too_long(owner, want))
            if owner == self.replica:
                found = self.owner.pull(want)
                if found is not None:
                    into.copy_(found[1])
                    return found[0]
            else:
                self._request(owner, PULL, want)
                version = torch.zeros(1, dtype=torch.int64)
                self.groups.replies.recv([version], owner, REPLY_TAG).wait()
                if int(version) >= 0:
                    self.groups.replies.recv([into], owner, REPLY_TAG).wait()
                    self.received_elements += into.numel()
                    return int(version)
            time.sleep(POLL_SECONDS)

    def _waited_too_long(self, owner: int, want: int) -> str:
        what = "the weights after every replica's last round" if want == FINAL else f"round {want}"
        waiting = f"; replica {', '.join(map(str, self.owner.missing(want)))} has not pushed its part" \
            if owner == self.replica and self.owner.missing(want) else ""
        return (f"replica {self.replica} waited {self.timeout:.0f} s for {what} of slice {owner} (owned by replica "
                f"{owner}){waiting}: a replica stopped or is slower than the timeout (parallel.timeout)")

    def _request(self, owner: int, kind: int, value: int, base: int = 0) -> None:
        if owner == self.replica:
            if kind == FINISH:
                self.owner.finish(self.replica, value)
            return
        header = torch.tensor([kind, value, base, self.replica], dtype=torch.int64)
        self.groups.requests.send([header], owner, REQUEST_TAG).wait()

    def _raise_server_error(self) -> None:
        if self.errors:
            raise RuntimeError(f"the replica server thread of replica {self.replica} failed: {self.errors[0]!r}") \
                from self.errors[0]

    def _others(self) -> list[int]:
        return [j for j in range(self.replicas) if j != self.replica]

    def _flat(self) -> torch.Tensor:
        return torch.cat([m.detach().reshape(-1).cpu() for m in self.masters])

    def _slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, self.bounds))
