"""Start the local ranks of a job with a fixed worker instead of re-running the calling script.

Lightning's subprocess launcher starts ranks 1..N-1 by re-running ``sys.argv``; under Hydra each child then
composes and resolves its own config (its own ``${now:...}``), and under a multirun sweep each child would
start the whole sweep again. With a worker (``mgpu-train`` passes one that loads the run directory's resolved
``config.yaml``) every rank uses the one config and the one directory. The environment handed to children is
Lightning's: ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE`` and each child's ``LOCAL_RANK``;
the loop is restated here because Lightning builds the command inside it.

A worker is started in one of two ways. ``command`` runs a fresh interpreter per rank, which imports torch,
Lightning and DeepSpeed again (4-6 s of CPU per rank, measured here, while the first rank waits at the
rendezvous). ``fork_entry`` forks the launching process instead, after it has imported all of that, and runs the
function in the child; that is only safe where no accelerator runtime has started, so the strategy uses it for
CPU jobs only (CUDA cannot be used in a child forked from a process that initialised it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override


class ForkedRank:
    """The parent's handle on a forked local rank, with the part of ``subprocess.Popen`` Lightning's launcher and
    its child-process observer use (``pid``, ``poll``, ``returncode``, ``send_signal``, ``kill``, ``wait``)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def _reap(self, flags: int) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: report it as gone
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        return self._reap(0)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_forked(entry: Callable[[], object]) -> None:
    """The body of a forked rank: run ``entry`` and leave the process with its status, never returning into the
    parent's call stack (and not running the parent's ``atexit`` handlers)."""
    code = 0
    try:
        entry()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class WorkerCommandLauncher(_SubprocessScriptLauncher):
    """A ``_SubprocessScriptLauncher`` whose children run ``command`` (from ``cwd``), or ``fork_entry`` in a fork."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, command: Sequence[str],
                 cwd: str | None = None, fork_entry: Optional[Callable[[], object]] = None) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.command, self.cwd, self.fork_entry = list(command), cwd, fork_entry

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ.update({"MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port),
                           "NODE_RANK": str(env.node_rank()), "LOCAL_RANK": str(env.local_rank()),
                           "WORLD_SIZE": str(self.num_processes * self.num_nodes)})
        for local_rank in range(1, self.num_processes):
            if self.fork_entry is None:
                child_env = dict(os.environ, LOCAL_RANK=str(local_rank))
                self.procs.append(subprocess.Popen(self.command, env=child_env, cwd=self.cwd))
                continue
            sys.stdout.flush()  # or the child would print what the parent has buffered
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.environ["LOCAL_RANK"] = str(local_rank)
                if self.cwd is not None:
                    os.chdir(self.cwd)
                run_forked(self.fork_entry)
            self.procs.append(ForkedRank(pid))


def choose_launcher(cluster_environment: Any, num_processes: int, num_nodes: int,
                    worker_command: Optional[Sequence[str]], fork_entry: Optional[Callable[[], object]],
                    on_cpu: bool) -> Any:
    """The launcher of a job whose processes this one starts: a fixed worker where the CLI gives one (forked on CPU
    when it gives a fork entry, after preloading what every rank imports), else Lightning's own."""
    if not worker_command:
        return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)
    fork_entry = fork_entry if on_cpu else None
    if fork_entry is not None and num_processes > 1:
        from lightning_mgpu import engine

        engine.preload()  # once, in the process every local rank is forked from
    return WorkerCommandLauncher(cluster_environment, num_processes, num_nodes, worker_command, fork_entry=fork_entry)
