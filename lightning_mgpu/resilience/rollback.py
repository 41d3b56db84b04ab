"""Roll back after repeated bad steps: when the step guard has skipped ``after`` steps within the last ``window``, the
run goes back to the newest checkpoint before the first of them and leaves their global batches out from then on.

Skipping a step leaves no trace, but a run that keeps producing bad steps is in a bad region (PaLM restarted from a
checkpoint about 100 steps before a spike and skipped 200-500 batches, by hand). Here the checkpoints written since
the first skipped step of the window are set aside (renamed ``<name>.rolledback``), the skipped steps' global batches
are added to the checkpoint directory's :data:`SKIP_FILE` (which ``mgpu-train`` adds to ``data.skip_batches`` when it
starts), and every rank stops after the step; the run exits with the requeue status, and a restart with
``checkpoint.resume=auto`` (torch elastic's, SLURM's, or yours) resumes from before the region without those batches.
The batches of step ``s`` are those the package's token loaders draw there: ``accumulate_grad_batches`` of them, the
``s x accumulate``-th on, counting only batches not skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

#: The file of global batches to leave out, in the checkpoint directory (a JSON list of batch numbers).
SKIP_FILE = "skip_batches.json"
#: A published checkpoint's folder name: written under another name and renamed to this only once whole, so a partial
#: one is never listed.
_PUBLISHED = re.compile(r"step-(\d{8})")


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The published ``step-NNNNNNNN`` checkpoints in ``directory``, newest first (partial ones are never listed):
    what a restart resumes from and a rollback chooses among (here, below the checkpoint package, which imports
    the chaos hooks of this one)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _PUBLISHED.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def set_aside(path: Path, suffix: str) -> Path:
    """Rename checkpoint ``path`` to ``<name><suffix>``, or ``<name><suffix>-2``, ``-3``... where a rerun's checkpoint
    of the same step was set aside before; the new path."""
    target = path.with_name(path.name + suffix)
    again = 2
    while target.exists():
        target, again = path.with_name(f"{path.name}{suffix}-{again}"), again + 1
    path.rename(target)
    return target


def read_skip_file(directory: str | Path) -> list[int]:
    """The batches :data:`SKIP_FILE` of ``directory`` lists (none when there is no file)."""
    path = Path(directory) / SKIP_FILE
    return sorted(int(b) for b in json.loads(path.read_text())) if path.is_file() else []


def batches_of_step(step: int, accumulate: int, skip: frozenset[int]) -> list[int]:
    """The global batches step ``step`` (from 0) drew: ``accumulate`` of them, after ``step x accumulate`` drawn
    ones, none of ``skip``."""
    drawn, index, out = step * accumulate, 0, []
    while len(out) < accumulate:
        if index not in skip:
            if drawn == 0:
                out.append(index)
            else:
                drawn -= 1
        index += 1
    return out


@dataclass(frozen=True)
class Rollback:
    """What a rollback did: the steps skipped in the window, the batches added to the skip file, the checkpoints set
    aside and the one a restart resumes from (None: from the start)."""

    steps: list[int]
    batches: list[int]
    set_aside: list[Path]
    resume_from: Optional[Path]

    def describe(self) -> str:
        aside = ", ".join(p.name for p in self.set_aside) or "none"
        start = self.resume_from.name if self.resume_from is not None else "the start"
        return (f"rolling back: steps {self.steps} were skipped within the window; global batches {self.batches} "
                f"will be left out; checkpoints set aside: {aside}. Every rank stops; resume with "
                f"checkpoint.resume=auto from {start}")


class RollbackOnSkips(L.Callback):
    """Under ``MGPUStrategy`` with its step guard: ``after`` skipped steps within the last ``window`` steps roll the
    run back (see the module). Place it after the run's periodic checkpoint. :attr:`rollback` says what it did."""

    def __init__(self, after: int, window: int, checkpoint_dir: str | Path) -> None:
        if after < 1 or window < after:
            raise ValueError(f"after={after} and window={window}: need 1 <= after <= window")
        self.after, self.window, self.checkpoint_dir = after, window, Path(checkpoint_dir)
        self.rollback: Optional[Rollback] = None
        self._steps: Optional[list[int]] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        skipped = [s.step for s in getattr(trainer.strategy, "skipped_steps", [])]
        recent = [s for s in skipped if s > trainer.global_step - 1 - self.window]
        if self._steps is None and len(recent) >= self.after:
            self._steps = recent  # the same on every rank: the guard's verdicts are agreed
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        """After the periodic checkpoint has published its saves: set aside, record the batches, say so."""
        if self._steps is None:
            return
        skip = frozenset(getattr(trainer.datamodule, "skip_batches", ()))
        batches = sorted({b for s in self._steps for b in batches_of_step(s, trainer.accumulate_grad_batches, skip)})
        first = min(self._steps)  # checkpoint step-N holds N steps: those with N <= first predate the region
        suspect, resume_from = [], None
        for path in complete_checkpoints(self.checkpoint_dir):
            if int(path.name.split("-")[1]) > first:
                suspect.append(path)
            elif resume_from is None:
                resume_from = path
        moved = [path.with_name(path.name + ".rolledback") for path in suspect]  # as named on every rank but 0
        if trainer.is_global_zero:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            moved = [set_aside(path, ".rolledback") for path in suspect]
            listed = sorted(set(read_skip_file(self.checkpoint_dir)) | set(batches))
            (self.checkpoint_dir / SKIP_FILE).write_text(json.dumps(listed))
        self.rollback = Rollback(sorted(self._steps), batches, moved, resume_from)
        rank_zero_info(self.rollback.describe())
