"""Fault injection, shipped as a chaos hook: with one of the environment variables below set, ``mgpu-train`` kills,
stops or fails a chosen rank at a chosen step, or kills the whole job at a chosen point of a step or of a checkpoint
save. Without the variables nothing is added and nothing runs. Used by the crash-safety and lost-rank tests, and
available to anyone who wants to rehearse a failure on their own cluster (for example that ``checkpoint.resume=auto``
continues after the job is killed while a checkpoint is written). The fault matrix's kinds and phases
(``MGPU_FAULT``) are :mod:`lightning_mgpu.resilience.strikes`.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from lightning_mgpu.problems import format_problems
from lightning_mgpu.resilience.strikes import InjectedFault, hold_the_gil, in_next_collective, planned, say, strike

#: Fault injection, read by ``mgpu-train`` (see :func:`fault_callbacks`). ``<rank>:<step>``: that rank, as
#: optimizer step ``step`` begins, SIGKILLs itself (``kill``: its sockets close at once), SIGSTOPs itself (``stop``: it
#: hangs with its sockets open), or raises :class:`InjectedFault` inside that step's backward pass (``raise``); each
#: first prints ``MGPU fault: ... at time <unix time>`` on stderr. ``MGPU_SIGNAL_RANK_AT``: that rank sends
#: itself the signal ``MGPU_SIGNAL`` names (default ``SIGUSR2``, as SLURM before a time limit) inside that step's
#: backward pass (a preemption). ``MGPU_SPIN_RANK_AT``: that rank spins in Python forever as the step begins (alive,
#: its heartbeat going on, never entering a collective again). ``MGPU_SKIP_RANK_AT``: after that step, every other
#: rank enters one all-reduce on the default group that this rank skips. The last four print their time first.
#: Each of these takes several ``<rank>:<step>`` joined by commas too. ``MGPU_NAN_RANK_AT`` / ``MGPU_SPIKE_RANK_AT``:
#: that rank's loss of that step (every micro-batch's, through the
#: module's ``training_step``; not under pipeline parallelism, whose schedule computes the loss) is NaN / 1000 times
#: larger, its backward with it: a step the step guard (``bad_steps.*``) skips. ``MGPU_FLIP_RANK_AT``: as the step
#: begins, that rank flips bit 22 of the first element of its first parameter (silent data corruption, ``sdc.*``).
#: ``MGPU_GIL_RANK_AT``: as the step begins, that rank sleeps for an hour in C code that holds the GIL (no Python
#: thread of it runs again: neither its heartbeat nor its watchdog).
RANK_FAULTS = {"MGPU_KILL_RANK_AT": "kill", "MGPU_STOP_RANK_AT": "stop", "MGPU_RAISE_RANK_AT": "raise",
               "MGPU_SIGNAL_RANK_AT": "signal", "MGPU_SPIN_RANK_AT": "spin", "MGPU_SKIP_RANK_AT": "skip",
               "MGPU_NAN_RANK_AT": "nan", "MGPU_SPIKE_RANK_AT": "spike", "MGPU_FLIP_RANK_AT": "flip",
               "MGPU_GIL_RANK_AT": "gil"}
#: what the loss faults multiply a loss by
LOSS_FACTORS = {"nan": math.nan, "spike": 1000.0}
SIGNAL_VARIABLE = "MGPU_SIGNAL"
#: ``MGPU_FAULT_ATTEMPTS=every``: the faults act in every attempt of a restarted job, not only in the first (``first``,
#: the default): a failure that repeats where it is, as a crash loop does.
ATTEMPTS_VARIABLE = "MGPU_FAULT_ATTEMPTS"
#: ``MGPU_KILL_AT=<point>:<step>``: rank 0 SIGKILLs the whole job (its process group) at that point of that step.
KILL_JOB_VARIABLE = "MGPU_KILL_AT"
#: The points of ``MGPU_KILL_AT``, each with the step it counts (``trainer.global_step`` there).
KILL_POINTS = {
    "backward": "inside the backward pass of the step that starts at step",
    "step": "after the optimizer step that ends at step",
    "trained": "after a step that ends at a checkpoint step, before its save",
    "torn": "while writing the checkpoint of step: rank 0's first whole file half written",
    "staged": "checkpoint.async_save: the checkpoint of step snapshotted, its trainer state written, no tensor yet",
    "written": "checkpoint.async_save: rank 0's tensors of step written in the background, no checksums yet",
    "saving": "checkpoint of step written by every rank, not yet published",
    "published": "checkpoint of step published, older ones not yet deleted",
    "resume": "while restoring the checkpoint of step (read, not yet applied to the trainer)",
}


def _spec(name: str, value: str, first: str, example: str, problems: list[str]) -> Optional[tuple[str, int]]:
    parts = value.split(":")
    if len(parts) != 2 or not parts[1].isdigit() or (first == "rank" and not parts[0].isdigit()):
        problems.append(f"{name}={value!r} must be <{first}>:<step>, e.g. {name}={example}")
        return None
    return parts[0], int(parts[1])


def kill_job_at(point: str, step: int, rank: int) -> None:
    """A fault point: SIGKILL the whole job when ``MGPU_KILL_AT`` is ``<point>:<step>`` and this is rank 0."""
    if rank == 0 and os.environ.get(KILL_JOB_VARIABLE) == f"{point}:{step}":
        _kill_job(f"{point}:{step}")


def _kill_job(where: str) -> None:
    say(f"rank 0 kills the job (SIGKILL to its process group) at {where}")
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _in_backward(model: torch.nn.Module, action: Callable[[], None]) -> None:
    """Run ``action`` once, inside the next backward pass: from the gradient hook of the first trainable parameter
    (the embedding's gradient comes last, so most of the backward pass has run by then)."""
    param = next(p for p in model.parameters() if p.requires_grad)
    handles = []

    def hook(grad: torch.Tensor) -> None:
        handles[0].remove()
        action()

    handles.append(param.register_hook(hook))


def _tear_next_file(where: str) -> None:
    """Make this process's next ``torch.save`` to a path write half of its bytes, then kill the job."""
    import io

    save = torch.save

    def torn_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(f, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.fsync(out.fileno())
        _kill_job(f"{where} ({Path(f).name}: {len(data) // 2} of {len(data)} bytes written)")

    torch.save = torn_save


def _spoil_loss(module: Any, factor: float) -> Callable[[], None]:
    """Multiply every loss ``module.training_step`` returns by ``factor`` until the returned function is called."""
    had_own = "training_step" in vars(module)
    original = module.training_step

    def spoiled(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        return {**out, "loss": out["loss"] * factor} if isinstance(out, Mapping) else out * factor

    module.training_step = spoiled

    def restore() -> None:
        if had_own:
            module.training_step = original
        else:
            del module.training_step
    return restore


#: the bit ``MGPU_FLIP_RANK_AT`` flips: the highest of an fp32 mantissa (the value changes by up to half of itself)
FLIPPED_BIT = 22


@torch.no_grad()
def _flip_bit(param: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` (of an fp32 element; 16 lower for a 16-bit one) of ``param``'s first element in place, through an
    integer view of its storage."""
    wide = param.element_size() == 4
    bits = param.detach().view(torch.int32 if wide else torch.int16).view(-1)
    bits[0] ^= 1 << (bit if wide else bit - 16)


def _spin_forever() -> None:
    """Busy in Python, forever: the interpreter still switches to other threads (the heartbeat goes on)."""
    count = 0
    while True:
        count += 1


def fault_callbacks(environ: Optional[Mapping[str, str]] = None, attempt: int = 0) -> list:
    """The Lightning callbacks that inject the faults the environment asks for (none when no variable is set, and
    none in a restarted ``attempt`` > 0 unless ``MGPU_FAULT_ATTEMPTS=every``: a fault rehearses one failure, which the
    restart recovers from)."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    attempts = environ.get(ATTEMPTS_VARIABLE, "first")
    matrix = planned(environ, attempt, problems)  # MGPU_FAULT: the fault matrix's kinds and phases
    if attempts not in ("first", "every"):
        problems.append(f"{ATTEMPTS_VARIABLE}={attempts!r} must be first or every")
    elif attempt > 0 and attempts == "first":
        if problems:
            raise ValueError(format_problems("Invalid fault injection", problems))
        return [_fault_injection({}, None, matrix)] if matrix else []
    rank_faults = {}
    for name, action in RANK_FAULTS.items():  # each variable: one <rank>:<step>, or several joined by commas
        for value in environ[name].split(",") if name in environ else []:
            if spec := _spec(name, value, "rank", "1:3", problems):
                rank_faults[(int(spec[0]), spec[1])] = action
    kill_job = None
    if KILL_JOB_VARIABLE in environ:
        kill_job = _spec(KILL_JOB_VARIABLE, environ[KILL_JOB_VARIABLE], "point", "torn:4", problems)
        if kill_job and kill_job[0] not in KILL_POINTS:
            problems.append(f"{KILL_JOB_VARIABLE}={environ[KILL_JOB_VARIABLE]!r}: point {kill_job[0]!r} is unknown; "
                            f"choose one of {', '.join(KILL_POINTS)}")
    if problems:
        raise ValueError(format_problems("Invalid fault injection", problems))
    if not rank_faults and kill_job is None and not matrix:
        return []
    return [_fault_injection(rank_faults, kill_job, matrix)]


def _act(action: Optional[str], trainer: Any, rank: int, step: int) -> None:
    """What ``action`` does to this rank as step ``step`` begins (``skip`` acts after the step: see the callback)."""
    if action == "kill":
        say(f"rank {rank} kills itself (SIGKILL) at step {step} at time {time.time():.3f}")
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        say(f"rank {rank} stops (SIGSTOP) at step {step} at time {time.time():.3f}")
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "raise":
        def fail() -> None:
            where = f"in the backward pass of step {step}"
            say(f"rank {rank} raises InjectedFault {where} at time {time.time():.3f}")
            raise InjectedFault(f"injected on rank {rank} {where}")

        _in_backward(trainer.strategy.model, fail)
    elif action == "signal":
        name = os.environ.get(SIGNAL_VARIABLE, "SIGUSR2")

        def preempt() -> None:
            say(f"rank {rank} sends itself {name} in the backward pass of step {step}")
            os.kill(os.getpid(), signal.Signals[name])

        _in_backward(trainer.strategy.model, preempt)
    elif action == "flip":
        say(f"rank {rank} flips bit {FLIPPED_BIT} of its first parameter's first element at step {step}")
        _flip_bit(next(trainer.strategy.model.module.parameters()), FLIPPED_BIT)
    elif action == "gil":
        say(f"rank {rank} holds the GIL in C code at step {step} at time {time.time():.3f}")
        hold_the_gil(3600)
    elif action == "spin":
        say(f"rank {rank} spins in Python at step {step} at time {time.time():.3f}")
        _spin_forever()


def _fault_injection(rank_faults: dict[tuple[int, int], str], kill_job: Optional[tuple[str, int]],
                     matrix: dict[tuple[str, int, int], str]):
    import lightning as L

    class FaultInjection(L.Callback):
        restore: Optional[Callable[[], None]] = None

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            rank, step = trainer.global_rank, trainer.global_step
            action = rank_faults.get((rank, step))
            if action in LOSS_FACTORS:
                say(f"rank {rank} multiplies its loss of step {step} by {LOSS_FACTORS[action]}")
                self.restore = _spoil_loss(trainer.lightning_module, LOSS_FACTORS[action])
            else:
                _act(action, trainer, rank, step)
            if kill_job == ("backward", step) and rank == 0:
                _in_backward(trainer.strategy.model, lambda: _kill_job(f"backward:{step} (inside the backward pass)"))
            if kind := matrix.get(("backward", rank, step)):
                _in_backward(trainer.strategy.model,
                             lambda kind=kind: strike(kind, rank, f"in the backward pass of step {step}"))
            if kind := matrix.get(("collective", rank, step)):
                in_next_collective(lambda kind=kind: strike(kind, rank, f"inside its first collective of step {step}"))

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if self.restore is not None:
                self.restore()
                self.restore = None
            step = trainer.global_step - 1  # the step that just ended
            skipper = next((r for (r, s), a in rank_faults.items() if a == "skip" and s == step), None)
            if skipper is None:
                return
            if trainer.global_rank == skipper:
                say(f"rank {skipper} skips a collective after step {step} at time {time.time():.3f}")
            else:
                from lightning_mgpu.resilience.agreement import agree

                agree(trainer, [0])

        def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
            if kill_job == ("torn", trainer.global_step) and trainer.global_rank == 0:
                _tear_next_file(f"torn:{trainer.global_step}")

        def on_load_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
            kill_job_at("resume", checkpoint["global_step"], trainer.global_rank)
            if kind := matrix.get(("restore", trainer.global_rank, checkpoint["global_step"])):
                strike(kind, trainer.global_rank, f"while restoring the checkpoint of step {checkpoint['global_step']}")

    return FaultInjection()
