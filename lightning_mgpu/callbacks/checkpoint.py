"""Periodic checkpoints that are either complete or invisible, and finding the newest complete one.

A checkpoint is written under ``step-NNNNNNNN.partial`` by every rank; only after the strategy's save has
returned on all ranks (it ends with a barrier) does rank 0 rename it to ``step-NNNNNNNN``, an atomic
rename on one file system. A crash at any moment leaves the previous complete checkpoints as they were;
``newest_checkpoint`` ignores partial ones, so ``checkpoint.resume=auto`` continues from the newest complete
checkpoint (the strategy's loader also skips damaged ones and those of another format); a resumed fit prints which
checkpoint it continues from. Every file's checksum is recorded by the strategy's save, before the rename publishes it. Older
complete checkpoints beyond ``keep_last``, and partial ones left by an earlier crash, are deleted after a new one
is published.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.checkpoint.formats import LOADED_FROM, complete_checkpoints
from lightning_mgpu.faults import kill_job_at  # chaos hook (MGPU_KILL_AT); nothing without the variable

_PARTIAL = re.compile(r"step-(\d{8})\.partial")


def newest_checkpoint(directory: str | Path) -> Optional[Path]:
    """The complete checkpoint of the highest step in ``directory`` (``None`` when there is none)."""
    complete = complete_checkpoints(directory)
    return complete[0] if complete else None


class PeriodicCheckpoint(L.Callback):
    """Save every ``every_n_steps`` optimizer steps into ``directory``, keeping the newest ``keep_last``."""

    def __init__(self, directory: str | Path, every_n_steps: int, keep_last: int = 2) -> None:
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError(f"every_n_steps={every_n_steps} and keep_last={keep_last} must be >= 1")
        self.directory, self.every_n_steps, self.keep_last = Path(directory), every_n_steps, keep_last
        self.loaded_from: Optional[str] = None

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.loaded_from = checkpoint.get(LOADED_FROM, trainer.ckpt_path)

    def on_train_start(self, trainer: L.Trainer, *args) -> None:
        if self.loaded_from is not None:
            rank_zero_info(f"Resumed at step {trainer.global_step} from {self.loaded_from}")

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        step = trainer.global_step
        kill_job_at("step", step, trainer.global_rank)
        if step % self.every_n_steps == 0:
            self.save(trainer, step)

    def save(self, trainer: L.Trainer, step: int) -> Path:
        final = self.directory / f"step-{step:08d}"
        partial = final.with_name(final.name + ".partial")
        kill_job_at("trained", step, trainer.global_rank)
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier attempt
        trainer.strategy.barrier()
        trainer.save_checkpoint(str(partial), weights_only=False)  # the full training state (says so: no info line)
        trainer.strategy.barrier()  # every rank's files are written
        kill_job_at("saving", step, trainer.global_rank)
        if trainer.is_global_zero:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            kill_job_at("published", step, trainer.global_rank)
            torn = [p for p in self.directory.iterdir() if _PARTIAL.fullmatch(p.name)]  # no rank is writing now
            for old in complete_checkpoints(self.directory)[self.keep_last:] + torn:
                shutil.rmtree(old, ignore_errors=True)
        trainer.strategy.barrier()
        return final
