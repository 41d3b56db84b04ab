"""The ranks of a local job on torch's elastic agent, the agent torchrun runs: ``cluster.max_restarts=N`` under
``cluster=local``.

The command the user ran becomes the agent (:class:`LocalJobAgent`). It starts the job's ranks: on CPU forked from
itself, after it has imported torch, Lightning and DeepSpeed, so that no rank imports them again; once CUDA is in use
(a forked process could not use it again), or with ``cluster.fork_on_cpu=false``, each a fresh interpreter running
the command it is given (``mgpu-train``'s: ``python -m lightning_mgpu.cli.worker``). It watches them, and when one
fails or is preempted it stops the others and starts all of them again, at most N times. The ranks see what torchrun's see (``RANK``, ``WORLD_SIZE``, the agent's store as
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``), so they set up their process group as under
``cluster=torchrun``. A signal to the agent (SIGTERM, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2; SIGHUP as SIGTERM) is passed
to the ranks and ends the job; after SIGTERM, SIGUSR1 or SIGUSR2 they stop after their step with an emergency
checkpoint and the job exits with the requeue status.

The agent stops restarting where a restart cannot help, with an exit status of its own: an attempt that was refused
(:data:`EXIT_REFUSED`: a checkpoint it may not read), a rank whose device corrupts its weights again on a rerun
(:data:`EXIT_FAULTY_DEVICE`) and a crash loop (:data:`EXIT_CRASH_LOOP`: attempts in a row that
failed without a new optimizer step, :class:`~lightning_mgpu.resilience.restarts.CrashLoop`). Out of restarts, it
exits with the last failure's own status (128 + the signal's number for a rank killed by one).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Callable, Iterator, Optional

from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from typing_extensions import override

from lightning_mgpu.resilience.preemption import REQUEUE_EXIT
from lightning_mgpu.resilience.restarts import (EXIT_CRASH_LOOP, EXIT_FAULTY_DEVICE, EXIT_REFUSED, CrashLoop,
                                                read_faulty_device, read_restarts)

#: The agent's record of the attempts that failed, in the run directory: one JSON line each.
ATTEMPTS = "attempts.jsonl"
#: Seconds between two looks of the agent at its ranks (torch's default): the most a death waits to be noticed.
MONITOR_S = 0.1
#: The signals the agent passes to its ranks; those that mean "stop soon" make the job exit with the requeue status.
SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
PREEMPTING = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def exit_status(code: int) -> int:
    """A process's exit code as a shell reports it: 128 + the signal's number for one killed by a signal."""
    return 128 - code if code < 0 else code


def ended_with(pid: int) -> Optional[int]:
    """The exit code of the child ``pid`` if it has ended (negative: the signal that killed it), else None. It is
    left to be reaped by torch, which owns it (``WNOWAIT``)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


class LocalJobAgent(LocalElasticAgent):
    """torch's local agent, which says each failure (and records it in ``attempts.jsonl``), stops the other ranks of a
    failed attempt at once, and stops restarting where a restart cannot help (a refused attempt, a crash loop);
    :attr:`stopped_with` is then the job's exit status."""

    def __init__(self, spec: WorkerSpec, run_dir: Path, crash_loop: CrashLoop, start_method: str) -> None:
        super().__init__(spec, DefaultLogsSpecs(), start_method=start_method)
        self.run_dir, self.crash_loop, self.attempts = Path(run_dir), crash_loop, 1
        self.stopped_with: Optional[int] = None
        self.failure: Optional[ProcessFailure] = None  # the first failure of the last attempt that failed

    @override
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        first = self._first_failure(worker_group)
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            self.failure = first or min(result.failures.items())[1]
            rank = next(w.global_rank for w in worker_group.workers if w.id == self.failure.pid)
            result.failures = {rank: result.failures.get(rank, self.failure)}  # not a rank this agent killed
            self._judge(rank, self.failure, worker_group.spec.max_restarts)
        return result

    def _first_failure(self, worker_group: WorkerGroup) -> Optional[ProcessFailure]:
        """The first rank seen to have failed, if any; unless it was preempted (the others stop after their own
        checkpoint), the others are SIGKILLed now: what they hold is lost with the failed rank, and torch would
        give them SIGTERM and up to 30 s (a rank blocked in a collective with the dead one spends seconds on its
        hang report)."""
        ended = [(w, code) for w in worker_group.workers if (code := ended_with(w.id)) not in (None, 0)]
        if not ended:
            return None
        worker, code = ended[0]
        if code != REQUEUE_EXIT:
            for other in worker_group.workers:
                if other is not worker and ended_with(other.id) is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other.id, signal.SIGKILL)
        return ProcessFailure(worker.local_rank, worker.id, code, error_file="")

    @override
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # SIGHUP (the terminal went away) stops the ranks as a preemption does, not by its default action
        super()._shutdown(signal.SIGTERM if death_sig == signal.SIGHUP else death_sig, timeout)

    def _judge(self, rank: int, failure: ProcessFailure, max_restarts: int) -> None:
        """After a failed attempt: say it, record it, and take the restarts left away where a restart cannot help
        (as torch's own agent does for a rank stuck in the kernel)."""
        status, looping = exit_status(failure.exitcode), self.crash_loop.failed()
        said = f"mgpu-train: attempt {self.attempts} failed: rank {rank} exited with status {status}"
        then = "out of restarts"
        faulty = read_faulty_device(self.run_dir) if status == EXIT_FAULTY_DEVICE else None
        if status in (EXIT_REFUSED, EXIT_FAULTY_DEVICE):
            self.stopped_with, then = status, "refused" if status == EXIT_REFUSED else "faulty device"
            said = f"{said} ({then}); not restarted" + ("" if faulty is None else (
                f"; persistent: rank(s) {sorted(int(r) for r in faulty['ranks'])} on host(s) "
                f"{sorted(set(faulty['ranks'].values()))} corrupted their weights again on the rerun"
                + (f" ({faulty['where']})" if faulty.get("where") else "")))
        elif looping:
            self.stopped_with, then = EXIT_CRASH_LOOP, "crash loop"
            said = (f"{said}; {self.crash_loop.in_a_row} attempts in a row ended without a new optimizer step (none "
                    f"beyond step {self.crash_loop.best}): a crash loop, which a restart or a requeue would repeat; "
                    f"stopping with exit status {EXIT_CRASH_LOOP}")
        elif self._remaining_restarts > 0:
            used = max_restarts - self._remaining_restarts + 1
            said, then = f"{said}; restart {used} of {max_restarts}", "restart"
        if self.stopped_with is not None:
            self._remaining_restarts = 0
        print(said, file=sys.stderr, flush=True)
        record = {"attempt": self.attempts, "ended": time.time(), "rank": rank, "status": status,
                  "reached": self.crash_loop.reached, "then": then,
                  **({"persistent": faulty["ranks"]} if faulty is not None else {})}
        with (self.run_dir / ATTEMPTS).open("a") as out:
            out.write(json.dumps(record) + "\n")
        self.attempts += then == "restart"


def run_local_job(entry: Callable[[], object], run_dir: Path, processes: int, max_restarts: int,
                  crash_loop_attempts: int, worker: Optional[tuple[str, ...]]) -> int:
    """Run the job's ``processes`` ranks under the agent until they succeed, are refused, loop or use up
    ``max_restarts``; return the job's exit status. Without ``worker``, ranks are forked and run ``entry()``; with
    it, each is a fresh interpreter run with those arguments (``mgpu-train``'s worker module and ``run_dir``, which
    trains from the config written there). A rank that exits with :data:`EXIT_REFUSED` or :data:`EXIT_FAULTY_DEVICE`
    is not restarted."""
    port = find_free_network_port()
    spec = WorkerSpec(
        role="mgpu-train", local_world_size=processes, max_restarts=max_restarts, monitor_interval=MONITOR_S,
        entrypoint=sys.executable if worker else forked_rank,
        args=tuple(worker) if worker else (entry,),
        rdzv_handler=StaticTCPRendezvous("127.0.0.1", port, 0, 1, f"mgpu-{uuid.uuid4().hex}", timeout=600),
        master_addr="127.0.0.1", master_port=port)
    agent = LocalJobAgent(spec, run_dir, CrashLoop(run_dir, crash_loop_attempts), start_method="fork")
    sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is printed again by a forked rank
    with _signals_passed_on():
        try:
            result = agent.run()
        except SignalException as stop:
            code = REQUEUE_EXIT if stop.sigval in PREEMPTING else 128 + stop.sigval
            return _summary(run_dir, agent, code)
    if result is None or not result.is_failed():
        return _summary(run_dir, agent, 0)
    print(ChildFailedError(spec.get_entrypoint_name(), result.failures).format_msg(), file=sys.stderr, flush=True)
    code = agent.stopped_with or exit_status(agent.failure.exitcode)
    return _summary(run_dir, agent, code)


def _summary(run_dir: Path, agent: LocalJobAgent, code: int) -> int:
    lost = sum(r["lost_steps"] for r in read_restarts(run_dir))
    print(f"mgpu-train: {agent.attempts - 1} restart(s), {lost} step(s) lost; exit status {code}", flush=True)
    return code


@contextlib.contextmanager
def _signals_passed_on() -> Iterator[None]:
    """The agent installs its handlers (raising ``SignalException``) for the signals it is told to pass on; they are
    put back as they were once the job ends, for the next job of a sweep."""
    names = [name for name in SIGNALS if hasattr(signal, name)]
    before = {name: signal.getsignal(getattr(signal, name)) for name in names}
    told = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(names)
    try:
        yield
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
        if told is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = told


def forked_rank(entry: Callable[[], object]) -> object:
    """A rank forked by the agent: SIGTERM when the agent dies (it then stops after its step with a checkpoint),
    ``entry()``, and the exit hooks (loggers') as at a normal exit, which a forked process leaves without. What the
    agent holds (torch, Lightning and DeepSpeed imported, the config) is kept out of the rank's garbage collections
    (``gc.freeze``, as Python's documentation advises before a fork without exec): a full collection walks every
    object and writes to each, which copies every page of the agent's heap the rank shares. The finalizers of the
    agent's objects stay the agent's: at the rank's exit they would run again (torch's operator libraries unregistered
    one by one, 0.1 s of every rank's exit measured here, or a temporary directory the agent still uses removed)."""
    gc.freeze()
    for finalizer in list(weakref.finalize._registry):  # those alive at the fork: the agent's
        finalizer.atexit = False
    _terminate_with_parent()
    try:
        return entry()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            logging.shutdown()


def _terminate_with_parent() -> None:
    """SIGTERM when the agent dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing): torch's own is SIGINT."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
