"""Preemption: SIGTERM, SIGUSR1 or SIGUSR2 delivered to any rank once ``fit`` has started stops every rank at the next
optimizer step boundary, by agreement, after an emergency checkpoint written through the atomic path; then the job
exits with :data:`REQUEUE_EXIT` so that its scheduler or launcher starts it again, and ``checkpoint.resume=auto``
continues at the next step: no step is lost.

The handler is installed when ``fit`` starts (and again before the sanity check and training, since Lightning
registers its own in between; before ``fit`` starts a signal ends the process as usual), and only sets a flag. Saving inside the handler (Lightning's SLURM requeue does) can interrupt a
collective or a write halfway and hang; exiting from it (submitit's) leaves the other ranks blocked in their next
collective until the timeout. After every optimizer step the ranks all-reduce the flag (two elements: the signal and
the highest rank that received one), which replaces the check Lightning makes before every batch, which reads rank 0's
flag alone. Replicas that step apart (``replica_update="local"``) meet only at their outer steps, so they agree there
(an emergency checkpoint waits for the end of the round); ``async`` runs cannot be checkpointed, so this callback
leaves them to Lightning's own handling (each replica stops on its own SIGTERM).

Under SLURM (``cluster=slurm``), rank 0 asks for the requeue itself, once (``scontrol requeue $SLURM_JOB_ID``), after
the emergency checkpoint is published; the sbatch script asks SLURM for SIGUSR2 ahead of the time limit
(``hydra.launcher.signal_delay_s``).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.resilience.agreement import agree, at_boundary

#: The signals that mean "stop soon": SLURM's preemption and time limit, torchrun's and Kubernetes' shutdown.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
#: Exit status of a preempted run (EX_TEMPFAIL: try again later): what a launcher restarts on.
REQUEUE_EXIT = 75


class EmergencySave(Protocol):
    """What the emergency checkpoint is written through: the run's periodic checkpoint
    (:class:`~lightning_mgpu.callbacks.PeriodicCheckpoint`), whose atomic path a preemption reuses. A protocol, so that
    failure handling does not import the callbacks built on it."""

    directory: Path

    def save(self, trainer: L.Trainer, step: int, blocking: bool = False) -> Path: ...


@dataclass(frozen=True)
class Preempted:
    """What stopped the run: the signal, the rank it reached (the highest, if several), the last step, the emergency
    checkpoint (None without a checkpoint directory) and whether the job was requeued."""

    signal: str
    rank: int
    step: int
    checkpoint: Optional[Path]
    requeued: bool

    def describe(self) -> str:
        saved = f"emergency checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint directory: not saved"
        return (f"Preempted: {self.signal} reached rank {self.rank}; every rank stopped after step {self.step}; "
                f"{saved}; {'job requeued; ' if self.requeued else ''}exiting with {REQUEUE_EXIT}")


class Preemption(L.Callback):
    """Place after the run's :class:`~lightning_mgpu.callbacks.PeriodicCheckpoint` (``checkpoint``) in the
    callbacks: a step it has just saved is not saved twice. ``requeue``: the command rank 0 runs once after the emergency checkpoint (SLURM's,
    :func:`slurm_requeue_command`). After ``fit``, :attr:`preempted` says what happened (None: not preempted)."""

    def __init__(self, checkpoint: Optional[EmergencySave] = None, signals: Sequence[int] = SIGNALS,
                 requeue: Optional[list[str]] = None) -> None:
        self.checkpoint, self.signals, self.requeue = checkpoint, tuple(signals), requeue
        self.received: int = 0
        self.received_at: Optional[float] = None
        self.preempted: Optional[Preempted] = None
        self._previous: dict[int, Any] = {}
        self._step_seen = -1
        self._limit_val: Optional[Any] = None

    def on_fit_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._install(trainer)

    def on_sanity_check_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._install(trainer)  # again: Lightning registers its own handlers between fit start and the sanity check

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._install(trainer)
        self._step_seen = trainer.global_step  # the first boundary is the end of the first optimizer step
        loop = trainer.fit_loop.epoch_loop
        if self._previous and "_broadcast_sigterm_tensor" not in vars(loop):  # Lightning's rank-0-only check
            loop._broadcast_sigterm_tensor = lambda: None

    def _install(self, trainer: L.Trainer) -> None:
        """Make this callback's handler the one for every signal (idempotent); remember the handlers it replaced
        first, to put back at the end of training."""
        if _replica_update(trainer) == "async" or threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            if signal.getsignal(signum) != self._handle:
                self._previous.setdefault(signum, signal.signal(signum, self._handle))

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.received:
            self.received, self.received_at = signum, time.time()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step == self._step_seen or not self._previous or not at_boundary(trainer):
            return  # not an optimizer step (gradient accumulation), or replicas between outer steps
        self._step_seen = step
        signum, rank = self._agree(trainer)
        if signum:
            self._stop(trainer, signum, rank, step)

    def _agree(self, trainer: L.Trainer) -> tuple[int, int]:
        """(the signal, the highest rank that received one), the same on every rank; (0, -1) when none did."""
        signum, rank = agree(trainer, [self.received, trainer.global_rank if self.received else -1])
        return signum, rank

    def _stop(self, trainer: L.Trainer, signum: int, rank: int, step: int) -> None:
        if 0 < trainer.max_steps <= step:  # the run ends here anyway, with its own saves: nothing to resume
            rank_zero_info(f"{signal.Signals(signum).name} reached rank {rank} in the last step: the run ends as planned")
            return
        path = None
        if self.checkpoint is not None:
            path = self.checkpoint.directory / f"step-{step:08d}"
            if not path.is_dir():  # the periodic checkpoint of this step, if any, is already published
                path = self.checkpoint.save(trainer, step, blocking=True)
        requeued = bool(self.requeue)
        if self.requeue and trainer.is_global_zero:
            try:  # a failed requeue must not leave rank 0 behind the others: it is reported, and the job still exits
                subprocess.run(self.requeue, check=True)
            except (OSError, subprocess.CalledProcessError) as error:
                requeued = False
                rank_zero_info(f"Preempted, but {' '.join(self.requeue)} failed ({error}): requeue the job yourself")
        self.preempted = Preempted(signal.Signals(signum).name, rank, step, path, requeued)
        rank_zero_info(self.preempted.describe())
        trainer.should_stop = True
        # Lightning validates a run that stops early (an early stop ends it); a preempted run resumes instead, and a
        # pass over the validation set would only delay the exit the scheduler waits for (put back at fit's end)
        self._limit_val = trainer.limit_val_batches
        trainer.limit_val_batches = 0

    def on_fit_end(self, trainer: L.Trainer, *args: Any) -> None:
        """Put back the handlers of before ``fit`` (after Lightning's teardown, which puts back the ones it found
        when it registered its own: this callback's)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._limit_val is not None:
            trainer.limit_val_batches, self._limit_val = self._limit_val, None

    def on_exception(self, trainer: L.Trainer, *args: Any) -> None:
        self.on_fit_end(trainer)


def _replica_update(trainer: L.Trainer) -> str:
    layout = getattr(trainer.strategy, "layout", None)
    return getattr(layout, "replica_update", "sync")


def slurm_requeue_command(environ: dict) -> Optional[list[str]]:
    """``scontrol requeue <job id>`` inside a SLURM job, else None."""
    job = environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID") and \
        f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}" or environ.get("SLURM_JOB_ID")
    return ["scontrol", "requeue", job] if job else None
