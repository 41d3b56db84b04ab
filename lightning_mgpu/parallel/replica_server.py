"""The global weights of ``replica_update="async"``, held sharded across the ranks at the same place of every replica,
and the thread on each rank that serves its slice to the other replicas.

The parameter-server pattern without a central server: the share of the fp32 master weights a rank holds (the same
on every replica, see ``lightning_mgpu.engine.master_weights``) is cut into R slices, and the rank of replica ``j``
owns slice ``j``: its global weights, their outer optimizer and their version (the outer steps applied to it). A
replica that ends its round ``k`` pushes each owner that slice of its pseudo-gradient; an owner applies the outer
step of round ``k`` (the mean of every replica's round-``k`` pseudo-gradient, each scaled by ``1 / (1 + staleness)``)
as soon as each replica still training has pushed it, then serves the result to whoever asks. A pull for round ``k``
with a staleness bound ``S`` waits until the slice's version is at least ``k - S``: ``S = 0`` waits for every
replica (the arithmetic of ``replica_update="local"``), a larger bound lets a fast replica run ahead.

Written by hand: gloo has no one-sided operations and torch's RPC framework does not run over it, so each rank runs
a thread that answers requests with point-to-point messages on two process groups of its own (requests in, replies
out): the training thread's collectives never share a group with it, and gloo's receives block without holding the
GIL. Those groups are gloo's on every device (NCCL has no receive from any source), so the global slices live in host
memory and travel through it.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

#: Message kinds: a push (round, base version, then the slice), a pull (the lowest acceptable version, or FINAL for
#: the weights after every replica's last round), a replica's last round, and a client's goodbye.
PUSH, PULL, FINISH, BYE = 0, 1, 2, 3
FINAL = -1
REQUEST_TAG, PAYLOAD_TAG, REPLY_TAG = 11, 12, 13
#: A server waits for requests between rounds, through validation and checkpoints: not bounded by the collective
#: timeout (a lost client is named by the training thread's own collectives and the heartbeat).
IDLE_TIMEOUT = timedelta(days=7)


def staleness(round_: int, base_version: int) -> int:
    """Outer steps a replica's round missed: it started round ``round_`` from version ``base_version`` where a
    replica in lockstep starts it from ``round_ - 1``."""
    return max(0, round_ - 1 - base_version)


class SliceOwner:
    """One slice of the global weights and its outer optimizer; the training thread and the server thread both
    call it, under its lock."""

    def __init__(self, weights: torch.Tensor, outer: Any, replicas: int) -> None:
        self.weights = torch.nn.Parameter(weights, requires_grad=False)
        self.optimizer = outer.build([self.weights])
        self.replicas, self.version = replicas, 0
        self.pending: dict[int, list] = {}  #: round -> [sum of scaled pseudo-gradients, replicas that pushed it]
        self.last_rounds: dict[int, int] = {}  #: replica -> its last round, once it has finished
        self.lock = threading.Lock()

    def push(self, round_: int, base_version: int, delta: torch.Tensor, replica: int) -> None:
        with self.lock:
            bucket = self.pending.setdefault(round_, [torch.zeros_like(delta), set()])
            bucket[0].add_(delta, alpha=1.0 / (1 + staleness(round_, base_version)))
            bucket[1].add(replica)
            self._apply_complete_rounds()

    def missing(self, want: int) -> list[int]:
        """The replicas a pull of ``want`` waits for: those that have not pushed the round after this slice's
        version (or, for :data:`FINAL`, not finished)."""
        with self.lock:
            if want == FINAL:
                return sorted(set(range(self.replicas)) - set(self.last_rounds))
            pushed = self.pending.get(self.version + 1, [None, set()])[1]
            return sorted(set(range(self.replicas)) - pushed - set(self.last_rounds))

    def finish(self, replica: int, last_round: int) -> None:
        with self.lock:
            self.last_rounds[replica] = last_round
            self._apply_complete_rounds()

    def pull(self, want: int) -> Optional[tuple[int, torch.Tensor]]:
        """(version, a copy of the weights) once they are at least version ``want`` (or, for :data:`FINAL`, after
        every replica's last round); None until then."""
        with self.lock:
            if want == FINAL and not self._all_applied() or want != FINAL and self.version < want:
                return None
            return self.version, self.weights.detach().clone()

    def _expected(self, round_: int) -> int:
        """Replicas that push round ``round_``: every one, less those that finished before it."""
        return self.replicas - sum(last < round_ for last in self.last_rounds.values())

    def _all_applied(self) -> bool:
        return len(self.last_rounds) == self.replicas and self.version >= max(self.last_rounds.values())

    @torch.no_grad()
    def _apply_complete_rounds(self) -> None:
        while (bucket := self.pending.get(self.version + 1)) is not None and len(bucket[1]) >= self._expected(
                self.version + 1):
            self.weights.grad = bucket[0].div_(len(bucket[1]))
            self.optimizer.step()
            self.weights.grad = None
            del self.pending[self.version + 1]
            self.version += 1


class ServerGroups:
    """The two process groups of the servers at this rank's place in every replica: ``requests`` (clients send,
    servers receive) and ``replies`` (servers send, clients receive). Created by every rank together."""

    def __init__(self, all_rep_ranks: list[list[int]], rank: int, timeout: Optional[timedelta]) -> None:
        self.requests = self.replies = None
        for ranks in all_rep_ranks:  # new_group is collective over the world: every rank creates every group
            requests = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo")
            replies = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if rank in ranks:
                self.requests, self.replies, self.ranks = requests, replies, ranks


def serve(owner: SliceOwner, groups: ServerGroups, clients: int, errors: list) -> None:
    """The server thread: answer requests from the ``clients`` other replicas until each has said goodbye."""
    try:
        goodbyes = 0
        while goodbyes < clients:
            header = torch.zeros(4, dtype=torch.int64)
            work = groups.requests.recv_anysource([header], REQUEST_TAG)
            work.wait()
            goodbyes += _answer(owner, groups, work._source_rank(), header.tolist())
    except Exception as error:  # the training thread raises it at its next request
        errors.append(error)


def _answer(owner: SliceOwner, groups: ServerGroups, source: int, header: list[int]) -> int:
    kind, value, base, replica = header
    if kind == PUSH:
        delta = torch.empty_like(owner.weights)
        groups.requests.recv([delta], source, PAYLOAD_TAG).wait()
        owner.push(value, base, delta, replica)
    elif kind == PULL:
        found = owner.pull(value)
        groups.replies.send([torch.tensor([-2 if found is None else found[0]])], source, REPLY_TAG).wait()
        if found is not None:
            groups.replies.send([found[1]], source, REPLY_TAG).wait()
    elif kind == FINISH:
        owner.finish(replica, value)
    return int(kind == BYE)
