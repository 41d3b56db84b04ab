"""Automatic restarts: ``cluster.max_restarts=N`` under ``cluster=local`` (torchrun's ``--max-restarts`` for
``cluster=torchrun``), and the record of what each restart lost.

Under ``cluster=local`` the command the user ran becomes a supervisor: it runs the job as a child process (the same
overrides, the same run directory, ``checkpoint.resume=auto``) and starts it again when it exits with a failure or
with the preemption status, at most ``N`` times. The supervisor holds no process group and no model, so a job whose
rank 0 dies is restarted like one whose other ranks do. Each attempt knows its number (``MGPU_ATTEMPT``; torchrun's
``TORCHELASTIC_RESTART_COUNT``); rank 0 of every attempt writes the last step it finished into the run directory, so
the next attempt can say how many steps the restart lost (the steps after the checkpoint it resumed from), and
appends it to ``restarts.jsonl``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.cli.errors import EXIT_REFUSED, refusal_message

#: The attempt number of a supervised job (0 first); torchrun's restart count plays the same part.
ATTEMPT_VARIABLE = "MGPU_ATTEMPT"
RESTART_COUNTS = (ATTEMPT_VARIABLE, "TORCHELASTIC_RESTART_COUNT")
PROGRESS, RESTARTS = "progress.json", "restarts.jsonl"


def attempt() -> int:
    """This job's attempt: 0 the first time, k after k restarts (by the supervisor or by torchrun)."""
    for name in RESTART_COUNTS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def restart_problems(max_restarts: object, launcher: str, resume: Optional[str], every_n_steps: object) -> list[str]:
    """``cluster.max_restarts``: an integer >= 0, for ``cluster=local`` (torchrun has ``--max-restarts``; SLURM
    requeues), with each restart resuming from the newest periodic checkpoint."""
    if max_restarts == 0:
        return []
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        return [f"cluster.max_restarts={max_restarts!r} must be an integer >= 0"]
    out = []
    if launcher != "local":
        out.append(f"cluster.max_restarts={max_restarts} restarts cluster=local jobs; with cluster={launcher} use "
                   + ("torchrun --max-restarts" if launcher == "torchrun" else "the scheduler's requeue"))
    if resume != "auto" or not every_n_steps:
        out.append(f"cluster.max_restarts={max_restarts} needs checkpoint.resume=auto and checkpoint.every_n_steps "
                   "(each restart continues from the newest checkpoint instead of from step 0)")
    return out


def supervise(run: Callable[[], object], command: list[str], run_dir: Path, max_restarts: int) -> int:
    """Run the job until it succeeds, is refused, or ``max_restarts`` restarts are used; return its exit status. A
    signal to the supervisor (Ctrl-C, a scheduler's SIGTERM) is passed to the job and ends the restarts. Each attempt
    is ``run()`` in a child forked from this process, which inherits torch, Lightning and DeepSpeed already imported
    (most of a restart's time on a small job: 5.5 s of 6.5 s measured on two CPU cores from a fresh interpreter);
    once this process has initialised CUDA (the memory check reads the GPU), which a forked child could not use again,
    it is ``command``, a fresh interpreter."""
    stopping: list[int] = []
    for number in range(max_restarts + 1):
        code = _attempt(run, command, number, stopping)
        if code in (0, EXIT_REFUSED) or stopping:
            break
        if number < max_restarts:
            print(f"mgpu-train: attempt {number + 1} exited with status {code}; restart {number + 1} of "
                  f"{max_restarts}", file=sys.stderr, flush=True)
    restarts = read_restarts(run_dir)
    lost = sum(r["lost_steps"] for r in restarts)
    code = code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
    print(f"mgpu-train: {len(restarts)} restart(s), {lost} step(s) lost; exit status {code}", flush=True)
    return code


def _attempt(run: Callable[[], object], command: list[str], number: int, stopping: list[int]) -> int:
    """One attempt, in a session of its own: when it ends, whatever of it is left (a rank forked by a rank 0 that
    was killed, blocked in a collective) is killed with it, so the next attempt starts clean. A signal to the
    supervisor goes to the whole attempt; if the supervisor dies, the attempt's first process gets SIGTERM (and
    stops after its step, as when preempted)."""
    children: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGTERM if signum == signal.SIGHUP else signum)

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in forwarded}  # before the child exists: no signal is missed
    sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is printed twice
    try:
        if _cuda_initialized():
            child = subprocess.Popen(command, env=dict(os.environ, **{ATTEMPT_VARIABLE: str(number)}),
                                     start_new_session=True, preexec_fn=_terminate_with_parent)
            children.append(child.pid)
            return child.wait()
        pid = os.fork()
        if pid == 0:
            _run_attempt(run, number, previous)  # never returns
        children.append(pid)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)


def _run_attempt(run: Callable[[], object], number: int, handlers: dict) -> None:
    """The forked child: a session of its own, the signal handlers of before, the attempt number; run, then exit
    with its status (the exit hooks run, this process's stack above the fork is never returned to)."""
    code = 1
    try:
        os.setsid()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        _terminate_with_parent()
        os.environ[ATTEMPT_VARIABLE] = str(number)
        run()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException as error:  # noqa: BLE001 - reported here: nothing above the fork may handle it
        message = refusal_message(error)
        if message is None:
            traceback.print_exc()
        else:  # refused (a checkpoint it may not read): said as mgpu-train says it, and not restarted
            print(message, file=sys.stderr)
            code = EXIT_REFUSED
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # loggers' and Hydra's exit hooks, as at a normal exit
            logging.shutdown()
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _terminate_with_parent() -> None:
    """In the child, before it runs: SIGTERM when the supervisor dies (Linux's PR_SET_PDEATHSIG; elsewhere none)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def read_restarts(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / RESTARTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


class RestartRecord(L.Callback):
    """Rank 0 writes the last finished step into ``run_dir`` after every optimizer step; a restarted attempt reads
    it at the start of training and records the steps it lost."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def on_train_start(self, trainer: L.Trainer, *args) -> None:
        number, progress = attempt(), self.run_dir / PROGRESS
        if number == 0 or not trainer.is_global_zero:
            return
        reached = json.loads(progress.read_text())["step"] if progress.is_file() else 0
        record = {"attempt": number + 1, "resumed_at": trainer.global_step, "previous_reached": reached,
                  "lost_steps": max(0, reached - trainer.global_step)}
        with (self.run_dir / RESTARTS).open("a") as out:
            out.write(json.dumps(record) + "\n")
        rank_zero_info(f"Restart {number}: resumed at step {trainer.global_step}; the attempt before reached step "
                       f"{reached}: {record['lost_steps']} step(s) lost")

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.is_global_zero and trainer.global_step != getattr(self, "_written", None):
            self._written = trainer.global_step
            path = self.run_dir / PROGRESS
            path.with_suffix(".tmp").write_text(json.dumps({"step": trainer.global_step, "attempt": attempt()}))
            os.replace(path.with_suffix(".tmp"), path)
