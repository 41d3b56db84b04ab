"""Universal checkpoints written in the background while training goes on (``checkpoint.async_save``).

Training is blocked only while each rank takes its snapshot (:func:`~lightning_mgpu.checkpoint.universal.universal_state`
gathers fresh fp32 copies out of the engine, which a synchronous save takes too) and rank 0 writes the small trainer
state. ``torch.distributed.checkpoint.async_save`` then writes the tensors from a thread; it is given the snapshot as
already staged (:class:`SnapshotStager`), because copying it again would double the blocked time for nothing. The same
thread, once this rank's files are written, meets the other ranks and records the checksums of every file
(``lightning_mgpu.checkpoint.integrity``). All of it runs on a gloo group of its own (:func:`background_group`), so the
thread's collectives never interleave with training's on the default group.

The checkpoint stays ``step-N.partial`` until it is published: the periodic checkpoint asks at every step whether
every rank's write has finished (:func:`~lightning_mgpu.checkpoint.background.BackgroundSave.state`) and renames it
only then. A failed write is reported at that step, on every rank, with the rank and path.
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from lightning_mgpu.checkpoint.integrity import record_checksums
from lightning_mgpu.checkpoint.universal import universal_state, write_trainer_state
from lightning_mgpu.layout import ParallelLayout

#: What :meth:`BackgroundSave.state` says: the write is still going, finished, or failed.
WRITING, WRITTEN, FAILED = 0, 1, 2


class SnapshotStager(AsyncStager):
    """Hands DCP the state as staged: it is a snapshot already (fresh copies no training step touches)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict


@dataclass
class BackgroundSave:
    """One checkpoint being written in the background by this rank: its path, the step it holds, how long training
    was blocked starting it, and the future of the whole write (DCP's files, then the checksums)."""

    path: Path
    step: int
    blocked_s: float
    done: Future = field(repr=False)
    started: float = field(default_factory=time.perf_counter)

    def state(self) -> int:
        """:data:`WRITING`, :data:`WRITTEN` or :data:`FAILED`, without waiting."""
        if not self.done.done():
            return WRITING
        return FAILED if self.done.exception() is not None else WRITTEN

    def wait(self) -> int:
        """Block until the write has finished or failed; :data:`WRITTEN` or :data:`FAILED`."""
        try:
            self.done.result()
        except BaseException:  # reported by error(), on every rank together
            return FAILED
        return WRITTEN

    def error(self) -> str:
        """The failure in one line per rank it names (empty if none). DCP raises the same ``CheckpointException`` on
        every rank, holding each failed rank's error: those are listed by rank."""
        error = self.done.exception() if self.done.done() else None
        if error is None:
            return ""
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            return "; ".join(f"rank {rank}: {_one_line(e)}" for rank, (e, _) in sorted(failures.items()))
        return _one_line(error)


def _one_line(error: BaseException) -> str:
    return " ".join("".join(traceback.format_exception_only(type(error), error)).split())


@dataclass
class InBackground:
    """``storage_options`` of ``trainer.save_checkpoint`` asking ``MGPUStrategy`` to write in the background on
    ``group`` (from :func:`background_group`); the strategy leaves the started save in :attr:`started`."""

    group: Any
    started: Optional[BackgroundSave] = None


def background_group(timeout: Optional[timedelta] = None) -> Any:
    """A gloo group of every rank for background writes (collective: every rank calls it, at the same point)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def start_background_save(engine: Any, layout: ParallelLayout, path: str | Path, client_state: dict,
                          group: Any, replica_sync: Any = None) -> BackgroundSave:
    """Snapshot this rank's share, write rank 0's trainer state, and return while DCP writes the tensors (collective:
    every rank calls it for the same ``path``)."""
    from lightning_mgpu.faults import kill_job_at  # chaos hook (MGPU_KILL_AT); nothing without the variable

    begin, path = time.perf_counter(), Path(path)
    step = int(client_state.get("global_step", -1))
    state, plain = universal_state(engine, layout, client_state, replica_sync)
    write_trainer_state(path, plain)
    kill_job_at("staged", step, dist.get_rank())
    written = dcp.async_save(state, checkpoint_id=str(path), process_group=group, async_stager=SnapshotStager())
    done: Future = Future()
    written.add_done_callback(lambda f: _finish(f, done, path, group, step))
    return BackgroundSave(path, step, time.perf_counter() - begin, done)


def _finish(written: Future, done: Future, path: Path, group: Any, step: int) -> None:
    """In DCP's thread, after this rank's files: every rank's written, then the checksums (on ``group``)."""
    from lightning_mgpu.faults import kill_job_at

    try:
        written.result()
        kill_job_at("written", step, dist.get_rank())
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        record_checksums(path, rank, world, gather=lambda value: _gather(value, group, world))
        done.set_result(None)
    except BaseException as error:  # noqa: BLE001 - handed to the training thread, which reports it
        done.set_exception(error)


def _gather(value: Any, group: Any, world: int) -> list:
    out: list = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out
