"""Universal checkpoints written in the background while training goes on (``checkpoint.async_save``).

Training is blocked only while each rank takes its snapshot
(:func:`~lightning_mgpu.checkpoint.universal.universal_state` with ``defer``: under ZeRO 1-2 a copy of this rank's own
pieces of every fp32 weight and moment, no collective; at other stages the whole tensors, gathered as a synchronous
save gathers them) and rank 0 writes the small trainer state. ``torch.distributed.checkpoint.async_save`` then stages
the snapshot in a thread (:class:`AssemblingStager` puts the pieces together over twins of the data-parallel groups;
whole tensors are a snapshot already, not copied again) and writes it from another. That thread, once this rank's
files are written, meets the other ranks and records the checksums of every file
(``lightning_mgpu.checkpoint.integrity``). All of it runs on gloo groups of its own (:func:`background_groups`), so
the threads' collectives never interleave with training's.

The checkpoint stays ``step-N.partial`` until it is published: the periodic checkpoint asks at every step whether
every rank's write has finished (:meth:`BackgroundSave.state`) and renames it only then. A failed write is reported at
that step, on every rank, with the rank and path.
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from lightning_mgpu.checkpoint.integrity import record_checksums
from lightning_mgpu.checkpoint.universal import Deferred, universal_state, write_trainer_state
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.collectives import gather_objects

#: What :meth:`BackgroundSave.state` says: the write is still going, finished, or failed.
WRITING, WRITTEN, FAILED = 0, 1, 2


class AssemblingStager(AsyncStager):
    """Stages the snapshot for DCP in a thread of its own: each ZeRO 1-2 tensor still in this rank's pieces
    (:class:`~lightning_mgpu.checkpoint.universal.Deferred`) is assembled over its data-parallel group's background
    twin; whole tensors are a snapshot already (fresh copies no training step touches) and pass as they are. DCP's
    writing thread waits for the staged dict."""

    _synchronize_after_execute = False

    def __init__(self, groups: "BackgroundGroups") -> None:
        self.groups = groups
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mgpu-checkpoint-staging")

    def stage(self, state_dict: dict) -> Future:
        staged = self._executor.submit(self._assemble, state_dict)
        staged.add_done_callback(lambda _: self._executor.shutdown(wait=False))
        return staged

    def _assemble(self, state_dict: dict) -> dict:
        return {key: value.assemble(self.groups.twins[value.piece.ranks]) if isinstance(value, Deferred) else value
                for key, value in state_dict.items()}


@dataclass
class BackgroundGroups:
    """The gloo groups background writes use, so that their collectives never meet training's: ``world`` (DCP's
    planning and the checksums) and a twin of every data-parallel group the ZeRO 1-2 pieces are assembled over."""

    world: Any
    twins: dict[tuple[int, ...], Any]


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
    """``storage_options`` of ``trainer.save_checkpoint`` asking ``MGPUStrategy`` to write in the background; the
    strategy creates :attr:`groups` at the first save (collective) and leaves the started save in :attr:`started`.
    One per periodic checkpoint, kept from save to save."""

    timeout: Optional[timedelta] = None
    groups: Optional[BackgroundGroups] = None
    started: Optional[BackgroundSave] = None


def background_groups(state: dict, timeout: Optional[timedelta]) -> BackgroundGroups:
    """Create the gloo groups of background writes for the pieces in ``state`` (collective over the world: every rank
    creates every group, in the same order)."""
    mine = sorted({value.piece.ranks for value in state.values() if isinstance(value, Deferred)})
    everyone = gather_objects(mine)
    world = dist.new_group(backend="gloo", timeout=timeout)
    twins = {ranks: dist.new_group(list(ranks), backend="gloo", timeout=timeout)
             for ranks in sorted({tuple(r) for ranks in everyone for r in ranks})}
    return BackgroundGroups(world, twins)


def start_background_save(engine: Any, layout: ParallelLayout, path: str | Path, client_state: dict,
                          options: InBackground, replica_sync: Any = None) -> BackgroundSave:
    """Snapshot this rank's share (its own pieces under ZeRO 1-2), write rank 0's trainer state, and return while DCP
    stages and writes the tensors (collective: every rank calls it for the same ``path``)."""
    from lightning_mgpu.resilience.faults import kill_job_at  # chaos hook (MGPU_KILL_AT); nothing without the variable

    begin, path = time.perf_counter(), Path(path)
    step = int(client_state.get("global_step", -1))
    state, plain = universal_state(engine, layout, client_state, replica_sync, defer=True)
    if options.groups is None:
        options.groups = background_groups(state, options.timeout)
    write_trainer_state(path, plain)
    kill_job_at("staged", step, dist.get_rank())
    response = dcp.async_save(state, checkpoint_id=str(path), process_group=options.groups.world,
                              async_stager=AssemblingStager(options.groups))
    done: Future = Future()
    response.upload_completion.add_done_callback(lambda f: _finish(f, done, path, options.groups.world, step))
    return BackgroundSave(path, step, time.perf_counter() - begin, done)


def _finish(written: Future, done: Future, path: Path, group: Any, step: int) -> None:
    """In DCP's thread, after this rank's files: every rank's written, then the checksums (on ``group``)."""
    from lightning_mgpu.resilience.faults import kill_job_at
    from lightning_mgpu.resilience.strikes import strike_at

    failure: Optional[BaseException] = None
    try:
        written.result()
        kill_job_at("written", step, dist.get_rank())
        strike_at("flush", step, dist.get_rank())
    except BaseException as error:  # noqa: BLE001 - this rank's own: the others hear it in the checksums' gathers
        failure = error
    try:  # every rank joins the gathers, a failed one with its error, so that none waits for the collective timeout
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        record_checksums(path, rank, world, gather=lambda value: gather_objects(value, group),
                         failure=None if failure is None else _one_line(failure))
        done.set_result(None)
    except BaseException as error:  # noqa: BLE001 - handed to the training thread, which reports it
        done.set_exception(failure or error)

