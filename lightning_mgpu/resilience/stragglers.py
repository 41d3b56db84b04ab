"""Slow ranks: a chaos setting that makes chosen ranks slower, each rank's own time per step, and a report at the
end of training that names the rank the others waited for.

A rank's busy time of a step is the time from the end of its previous optimizer step to the start of this one: the
forward and backward of its batch, without the wait for other ranks that the step's own reductions begin with
(under ZeRO 2-3 and tensor or pipeline parallelism the forward and backward hold collectives too, so their waits
count there). The wall time of a step adds the optimizer step with its waits. The report compares busy times: a
straggler is a rank whose mean busy time is at least :data:`STRAGGLER_FACTOR` times the median of the other ranks'.

``slow_ranks={rank: factor}`` (``parallel.slow_ranks``) makes a rank ``factor`` times slower: after its forward and
backward it sleeps ``factor - 1`` times their duration, so its busy time grows by that factor. It is for testing how
a layout and a replica update rule live with a slow GPU (one per rank, or another job on the node).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from lightning_mgpu.problems import Problem

#: A rank is named a straggler when its mean busy time per step is at least this factor times the median.
STRAGGLER_FACTOR = 1.3


def slow_rank_problems(slow_ranks: Optional[Mapping], world_size: Optional[int] = None) -> list[Problem]:
    """The chaos setting's rule: a mapping of ranks of the world, each to a factor >= 1."""
    if slow_ranks is not None and not isinstance(slow_ranks, Mapping):
        return [Problem("slow_ranks", slow_ranks, "must map global ranks to slow-down factors", "write {1: 2.0}")]
    out = []
    for rank, factor in (slow_ranks or {}).items():
        if not isinstance(rank, int) or rank < 0 or world_size is not None and rank >= world_size:
            out.append(Problem("slow_ranks", rank, "is not a rank of this job" + (
                f" (ranks 0 to {world_size - 1})" if world_size else ""), "name global ranks"))
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
            out.append(Problem("slow_ranks", {rank: factor}, "must slow the rank by a factor >= 1",
                               "use 2.0 to make it twice as slow"))
    return out


@dataclass
class StepClock:
    """This rank's busy and wall time of every optimizer step; ``slowdown`` > 1 sleeps to make it that much slower."""

    slowdown: float = 1.0
    busy: list[float] = field(default_factory=list)  #: per step, seconds of forward and backward (and sleep)
    ends: list[float] = field(default_factory=list)  #: per step, when it ended (``time.time()``)
    _last_end: Optional[float] = None

    def start(self) -> None:
        """Training starts: the first step's busy time counts from here."""
        self._last_end = time.perf_counter()

    def before_step(self) -> None:
        now = time.perf_counter()
        busy = now - (self._last_end if self._last_end is not None else now)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * busy)
            busy *= self.slowdown
        self.busy.append(busy)

    def after_step(self) -> None:
        self._last_end = time.perf_counter()
        self.ends.append(time.time())

    def mean_busy(self) -> float:
        """Mean busy time per step, the first step (start-up, compilation of kernels) left out when there are more."""
        kept = self.busy[1:] if len(self.busy) > 1 else self.busy
        return sum(kept) / len(kept) if kept else 0.0


def straggler_report(mean_busy: list[float]) -> str:
    """One line from every rank's mean busy time per step (index = global rank): the slowest rank against the
    median of the others, named a straggler when at least :data:`STRAGGLER_FACTOR` times it."""
    if len(mean_busy) < 2 or not any(mean_busy):
        return "straggler report: no other rank to compare with" if mean_busy else "straggler report: no steps timed"
    slowest = max(range(len(mean_busy)), key=mean_busy.__getitem__)
    median = statistics.median(b for rank, b in enumerate(mean_busy) if rank != slowest)
    ratio = mean_busy[slowest] / median if median > 0 else float("inf")
    verdict = "straggler" if ratio >= STRAGGLER_FACTOR else "no straggler"
    return (f"straggler report: {verdict}: rank {slowest} is busy {mean_busy[slowest]:.3f} s per step, {ratio:.2f}x "
            f"the median {median:.3f} s of the other {len(mean_busy) - 1} ranks (forward and backward, without the "
            "waits at the optimizer step)")


def report_stragglers(clock: StepClock, replica_sync: Optional[object] = None) -> str:
    """The straggler report of the run (collective over every rank: each rank's mean busy time), with under
    ``replica_update="async"`` each replica's staleness (outer steps the weights its rounds started from missed)."""
    import torch.distributed as dist

    mine = (clock.mean_busy(), list(getattr(replica_sync, "staleness", None) or []))
    gathered = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    lines = [straggler_report([busy for busy, _ in gathered])]
    if getattr(replica_sync, "staleness", None) is not None:
        per_replica = {}
        for rank, (_, rounds) in enumerate(gathered):
            per_replica.setdefault(replica_sync.layout.coords(rank)["rep"], []).extend(rounds)
        lines += [f"replica {r} staleness: max {max(s, default=0)}, mean {sum(s) / max(1, len(s)):.2f} rounds over "
                  f"{len(s)} rank-rounds" for r, s in sorted(per_replica.items())]
    return "\n".join(lines)


def log_round(trainer: object, replica_sync: object) -> None:
    """Log the round that just ended to the trainer's logger (rank 0's, like every Lightning logger): the outer
    steps taken and, under ``replica_update="async"``, the round's staleness."""
    logger = getattr(trainer, "logger", None)
    if logger is None:
        return
    metrics = {"replica/outer_steps": float(replica_sync.outer_steps)}
    if getattr(replica_sync, "staleness", None):
        metrics["replica/staleness"] = float(replica_sync.staleness[-1])
    logger.log_metrics(metrics, step=trainer.global_step)
