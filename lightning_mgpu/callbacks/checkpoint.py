"""Periodic checkpoints that are either complete or invisible, and finding the newest complete one.

A checkpoint is written under ``step-NNNNNNNN.partial`` by every rank; only after the strategy's save has
returned on all ranks (it ends with a barrier) does rank 0 rename it to ``step-NNNNNNNN``, an atomic
rename on one file system. A crash at any moment leaves the previous complete checkpoints as they were;
``newest_checkpoint`` ignores partial ones, so ``checkpoint.resume=auto`` continues from the newest complete
checkpoint (the strategy's loader also skips damaged ones and those of another format); a resumed fit prints which
checkpoint it continues from. Every file's checksum is recorded by the strategy's save, before the rename publishes it. Older
complete checkpoints beyond ``keep_last``, and partial ones left by an earlier crash, are deleted after a new one
is published.

With ``async_save=True`` (``checkpoint.async_save``) a save blocks training only while each rank snapshots its share;
the files are written in the background (``lightning_mgpu.checkpoint.background``) and the checkpoint is published at
the first step boundary after every rank's write has finished (one all-reduce of two numbers per step while a save is
in flight). At most one save is in flight: a save waits for the one before, and so does the end of training. A write
that failed on any rank stops the run at that boundary with :class:`CheckpointWriteError`, naming the rank and path;
the previous checkpoint is untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import lightning as L

from lightning_mgpu.resilience.agreement import agree, at_boundary
from lightning_mgpu.checkpoint.background import FAILED, WRITING, BackgroundSave, InBackground
from lightning_mgpu.checkpoint.formats import complete_checkpoints
from lightning_mgpu.parallel.collectives import gather_objects
from lightning_mgpu.resilience.watchdog import paused
from lightning_mgpu.resilience.faults import kill_job_at  # chaos hook (MGPU_KILL_AT); nothing without the variable
from lightning_mgpu.resilience.strikes import strike_at

_PARTIAL = re.compile(r"step-(\d{8})\.partial")


def newest_checkpoint(directory: str | Path) -> Optional[Path]:
    """The complete checkpoint of the highest step in ``directory`` (``None`` when there is none)."""
    complete = complete_checkpoints(directory)
    return complete[0] if complete else None


class CheckpointWriteError(RuntimeError):
    """A checkpoint written in the background failed on some rank (raised on every rank, at the same boundary)."""


class PeriodicCheckpoint(L.Callback):
    """Save every ``every_n_steps`` optimizer steps into ``directory``, keeping the newest ``keep_last``;
    ``async_save``: write them in the background. :attr:`blocked_s` lists, per save, the seconds training waited."""

    def __init__(self, directory: str | Path, every_n_steps: int, keep_last: int = 2, async_save: bool = False) -> None:
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError(f"every_n_steps={every_n_steps} and keep_last={keep_last} must be >= 1")
        self.directory, self.every_n_steps, self.keep_last = Path(directory), every_n_steps, keep_last
        self.async_save, self.in_flight = async_save, None
        self.blocked_s: list[float] = []
        self._background = InBackground() if async_save else None
        self._step_seen = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_mgpu.checkpoint.hooks import EngineCheckpointHooks

        if self.async_save and not isinstance(trainer.strategy, EngineCheckpointHooks):
            raise ValueError(f"PeriodicCheckpoint(async_save=True) writes through MGPUStrategy, and the trainer's strategy "
                             f"is {type(trainer.strategy).__name__}: use MGPUStrategy or async_save=False")

    def on_train_start(self, trainer: L.Trainer, *args) -> None:
        self._step_seen = trainer.global_step
        if self._background is not None:  # the background groups wait as long as the strategy's
            self._background.timeout = getattr(trainer.strategy, "_timeout", None)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        step = trainer.global_step
        if step == self._step_seen:
            return  # not an optimizer step: a batch of gradient accumulation
        self._step_seen = step
        kill_job_at("step", step, trainer.global_rank)
        if self.in_flight is not None and at_boundary(trainer):
            self.settle(trainer, wait=False)
        if step % self.every_n_steps == 0:
            self.save(trainer, step)

    def on_train_end(self, trainer: L.Trainer, *args) -> None:
        """The end of training waits for the save in flight, and publishes it."""
        self.settle(trainer, wait=True)

    def save(self, trainer: L.Trainer, step: int, blocking: bool = False) -> Path:
        """Save the checkpoint of ``step``; in the background with ``async_save`` unless ``blocking`` (an emergency
        checkpoint, published before this returns). Returns where it is (or will be) published."""
        begin = time.perf_counter()
        self.settle(trainer, wait=True)  # at most one save in flight: waiting for it is blocked time too
        final = self.directory / f"step-{step:08d}"
        partial = final.with_name(final.name + ".partial")
        if blocking and self.async_save and final.is_dir():
            return final  # the save in flight was this step's: published now
        kill_job_at("trained", step, trainer.global_rank)
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier attempt
        trainer.strategy.barrier()
        if self.async_save and not blocking:
            trainer.save_checkpoint(str(partial), weights_only=False, storage_options=self._background)
            self.in_flight, self._background.started = self._background.started, None
            self.blocked_s.append(time.perf_counter() - begin)
            return final
        trainer.save_checkpoint(str(partial), weights_only=False)  # the full training state (says so: no info line)
        strike_at("emergency" if blocking else "save", step, trainer.global_rank)  # chaos hook (MGPU_FAULT)
        trainer.strategy.barrier()  # every rank's files are written
        self.blocked_s.append(time.perf_counter() - begin)
        self._publish(trainer, step)
        return final

    def settle(self, trainer: L.Trainer, wait: bool) -> None:
        """Publish the save in flight once every rank's write has finished (``wait``: block until then); raise
        :class:`CheckpointWriteError` on every rank if any rank's failed. Collective while a save is in flight."""
        if self.in_flight is None:
            return
        with paused(getattr(trainer.strategy, "_heartbeat", None)):  # waiting for a write is not a stalled step
            state = self.in_flight.wait() if wait else self.in_flight.state()
        writing, failed = agree(trainer, [state == WRITING, state == FAILED], op="sum")
        if failed:
            self._raise_failure(trainer, self.in_flight)
        if not writing:
            step, self.in_flight = self.in_flight.step, None
            self._publish(trainer, step)

    def _raise_failure(self, trainer: L.Trainer, save: BackgroundSave) -> None:
        """Raise on every rank, with every rank's error: once when all ranks hold the same (a collective failure,
        which names its ranks itself), else by rank."""
        errors = gather_objects(save.error() if save.state() == FAILED else "")
        self.in_flight = None
        distinct = list(dict.fromkeys(e for e in errors if e))
        said = distinct[0] if len(distinct) == 1 and errors.count(distinct[0]) == len(errors) else \
            "; ".join(f"rank {rank}: {error}" for rank, error in enumerate(errors) if error)
        raise CheckpointWriteError(
            f"the checkpoint of step {save.step} ({save.path}) could not be written in the background: {said}. It "
            f"was not published; the complete checkpoints in {self.directory} are as they were, and "
            "checkpoint.resume=auto continues from the newest. Fix the cause (space, permissions, the file system) "
            "and resume")

    def _publish(self, trainer: L.Trainer, step: int) -> None:
        """Rank 0 renames ``step-N.partial`` (every rank's files written) into place and prunes old checkpoints."""
        final = self.directory / f"step-{step:08d}"
        partial = final.with_name(final.name + ".partial")
        kill_job_at("saving", step, trainer.global_rank)
        if trainer.is_global_zero:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            kill_job_at("published", step, trainer.global_rank)
            torn = [p for p in self.directory.iterdir() if _PARTIAL.fullmatch(p.name)]  # no rank is writing now
            for old in complete_checkpoints(self.directory)[self.keep_last:] + torn:
                shutil.rmtree(old, ignore_errors=True)
        trainer.strategy.barrier()

