"""Periodic checkpoints that are either complete or invisible, and finding the newest complete one.

A checkpoint is written under ``step-NNNNNNNN.partial`` by every rank; only after the strategy's save has
returned on all ranks (it ends with a barrier) does rank 0 rename it to ``step-NNNNNNNN``, an atomic
rename on one file system. A crash at any moment leaves the previous complete checkpoints as they were;
``newest_checkpoint`` ignores partial ones, so ``checkpoint.resume=auto`` continues from the newest complete
checkpoint. Older complete checkpoints beyond ``keep_last``, and partial ones left by an earlier crash, are
deleted after a new one is published. A resumed fit prints which checkpoint it continues from.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.testing import kill_job_at  # fault points for tests (MGPU_KILL_AT); nothing without the variable

_COMPLETE = re.compile(r"step-(\d{8})")
_PARTIAL = re.compile(r"step-(\d{8})\.partial")


def newest_checkpoint(directory: str | Path) -> Optional[Path]:
    """The complete checkpoint of the highest step in ``directory`` (``None`` when there is none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _COMPLETE.fullmatch(p.name)) and p.is_dir()]
    return max(steps)[1] if steps else None


class PeriodicCheckpoint(L.Callback):
    """Save every ``every_n_steps`` optimizer steps into ``directory``, keeping the newest ``keep_last``."""

    def __init__(self, directory: str | Path, every_n_steps: int, keep_last: int = 2) -> None:
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError(f"every_n_steps={every_n_steps} and keep_last={keep_last} must be >= 1")
        self.directory, self.every_n_steps, self.keep_last = Path(directory), every_n_steps, keep_last

    def on_train_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.ckpt_path:
            rank_zero_info(f"Resumed at step {trainer.global_step} from {trainer.ckpt_path}")

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
            complete = sorted(p for p in self.directory.iterdir() if _COMPLETE.fullmatch(p.name))
            torn = [p for p in self.directory.iterdir() if _PARTIAL.fullmatch(p.name)]  # no rank is writing now
            for old in complete[: -self.keep_last] + torn:
                shutil.rmtree(old, ignore_errors=True)
        trainer.strategy.barrier()
        return final
