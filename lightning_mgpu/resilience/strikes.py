"""The fault matrix's chaos hook: ``MGPU_FAULT=<kind>@<phase>:<rank>:<step>`` (several joined by commas) makes that
rank fail in one of the ways a process fails (:data:`KINDS`) at one of the places where a failure hurts
(:data:`PHASES`). Without the variable nothing is added and nothing runs. ``benchmarks/fault_matrix.py`` runs every
kind at every phase on rank 0 and on another rank under the elastic agent and checks that each run ends on the
fault-free run's weights.

Each fault acts in one attempt of a restarted job: the first (attempt 0), except a ``restore`` fault, which acts in
the first restart (attempt 1: the first attempt that restores a checkpoint; the run needs another fault to end
attempt 0, e.g. ``MGPU_KILL_RANK_AT``); with ``MGPU_FAULT_ATTEMPTS=every``, in every attempt.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Mapping, Optional

from lightning_mgpu.resilience.restarts import attempt

FAULT_VARIABLE = "MGPU_FAULT"
#: How a process fails. Signals are sent by the process to itself (the handlers it has then decide what they do:
#: SIGTERM is a preemption, SIGINT Lightning's KeyboardInterrupt shutdown, SIGSEGV faulthandler's dump and death).
KINDS = {
    "raise": "raises InjectedFault (an exception in the training code)",
    "exit": "calls sys.exit(1) (SystemExit: exceptions handlers and finally blocks run)",
    "_exit": "calls os._exit(1) (no handler, no finally block, no flush)",
    "SIGINT": "sends itself SIGINT (Ctrl-C)",
    "SIGTERM": "sends itself SIGTERM (a preemption or a scheduler's stop)",
    "SIGKILL": "sends itself SIGKILL (the out-of-memory killer, a lost node)",
    "SIGSTOP": "sends itself SIGSTOP (a hung process: alive, sockets open)",
    "SIGSEGV": "sends itself SIGSEGV (a crash in native code)",
    "gil": "sleeps for an hour in C code holding the GIL (no thread of it runs again)",
    "abort": "aborts its default process group (torch's abort of a communicator after an error) and goes on",
}
#: Where the fault acts, with the step it counts.
PHASES = {
    "backward": "inside the backward pass of the step that starts at step",
    "collective": "inside the first collective the rank enters once step starts: posted, not yet waited for",
    "save": "inside the synchronous save of the checkpoint of step, this rank's files written, not yet published",
    "flush": "checkpoint.async_save: in the background writer of the checkpoint of step, this rank's files written",
    "emergency": "inside the emergency save of step (a preempted run's), this rank's files written",
    "restore": "while restoring the checkpoint of step (read, not yet applied), in the first restart",
}


class InjectedFault(RuntimeError):
    """The exception of the ``raise`` kind (and of ``MGPU_RAISE_RANK_AT``)."""


def say(message: str) -> None:
    print(f"MGPU fault: {message}", file=sys.stderr, flush=True)


def planned(environ: Optional[Mapping[str, str]] = None, this_attempt: Optional[int] = None,
            problems: Optional[list[str]] = None) -> dict[tuple[str, int, int], str]:
    """``{(phase, rank, step): kind}`` of ``MGPU_FAULT`` that acts in this attempt. Each malformed entry is added to
    ``problems`` (raised by the caller with the others) or, without a list, raised here."""
    environ = os.environ if environ is None else environ
    number = attempt() if this_attempt is None else this_attempt
    every = environ.get("MGPU_FAULT_ATTEMPTS") == "every"
    found, own = {}, problems is None
    problems = [] if problems is None else problems
    for value in filter(None, environ.get(FAULT_VARIABLE, "").split(",")):
        kind, _, where = value.partition("@")
        phase, *numbers = where.split(":")
        if kind not in KINDS or phase not in PHASES or len(numbers) != 2 or not all(n.isdigit() for n in numbers):
            problems.append(f"{FAULT_VARIABLE}={value!r} must be <kind>@<phase>:<rank>:<step>, e.g. "
                            f"{FAULT_VARIABLE}=SIGKILL@collective:1:3, with kind one of {', '.join(KINDS)} and phase "
                            f"one of {', '.join(PHASES)}")
            continue
        if every or number == (1 if phase == "restore" else 0):
            found[(phase, int(numbers[0]), int(numbers[1]))] = kind
    if own and problems:
        from lightning_mgpu.problems import format_problems

        raise ValueError(format_problems("Invalid fault injection", problems))
    return found


def strike(kind: str, rank: int, where: str) -> None:
    """Fail as ``kind`` says, now, in this thread."""
    say(f"rank {rank} {KINDS[kind].split(' (')[0]} {where} at time {time.time():.3f}")
    if kind == "raise":
        raise InjectedFault(f"injected on rank {rank} {where}")
    if kind == "exit":
        sys.exit(1)
    if kind == "_exit":
        os._exit(1)
    if kind.startswith("SIG"):
        os.kill(os.getpid(), signal.Signals[kind])
    elif kind == "gil":
        hold_the_gil(3600)
    elif kind == "abort":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()


def hold_the_gil(seconds: int) -> None:
    """libc's ``sleep`` called as the C-API calls Python's own functions (``ctypes.PyDLL``): without releasing the
    GIL, as a C extension's call that never returns would."""
    import ctypes

    ctypes.PyDLL(None).sleep(seconds)


def strike_at(phase: str, step: int, rank: int) -> None:
    """A fault point of the checkpoint code (``save``, ``flush``, ``emergency``): strike if ``MGPU_FAULT`` asks for
    this phase, step and rank (nothing is read or done without the variable)."""
    if FAULT_VARIABLE not in os.environ:
        return
    kind = planned().get((phase, rank, step))
    if kind is not None:
        strike(kind, rank, f"at {phase} of step {step}")


#: The collectives of ``torch.distributed`` that the ``collective`` phase wraps (what DeepSpeed and the package call).
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
               "reduce_scatter", "all_gather_object", "barrier")


def in_next_collective(action: Callable[[], None]) -> None:
    """Run ``action`` once, inside the next collective this process enters through ``torch.distributed``: the
    collective is posted (its peers can be in it already), then ``action`` runs, then it is waited for. Looked up at
    call time, so DeepSpeed's calls through ``torch.distributed`` are caught too."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name: str) -> Callable:
        def posted(*args, **kwargs):
            for other, original in originals.items():
                setattr(dist, other, original)
            if name in ("all_gather_object", "barrier") or kwargs.get("async_op"):
                action()  # no handle to wait for here: the fault comes as the collective is entered
                return originals[name](*args, **kwargs)
            work = originals[name](*args, **{**kwargs, "async_op": True})
            action()
            if work is not None:
                work.wait()
        return posted

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))
