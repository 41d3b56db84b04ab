"""Run a console script of the package (``mgpu-train``, ``mgpu-plan``, ``mgpu-export``, ``mgpu-prepare``) in a child
process forked from the test process, instead of a fresh interpreter.

The child is a separate process running the script's real ``main()`` with its own arguments, working directory,
environment, standard streams and exit status, as ``subprocess.run`` gives them; what it skips is importing torch,
Lightning and DeepSpeed again (about 5 s of the 7-10 s of a launch on two cores). The installed ``mgpu-train`` console
script still starts a fresh interpreter in ``tests/cli/test_cli_restarts.py`` (``fork=False``), and
``tests/cli/test_cli.py::test_cli_after_non_editable_install`` trains from a non-editable install, so the entry points
themselves stay tested.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

#: console script -> the module whose ``main()`` it runs (as pyproject.toml's [project.scripts] says).
ENTRY_POINTS = {"mgpu-train": "lightning_mgpu.cli.train", "mgpu-plan": "lightning_mgpu.cli.plan",
                "mgpu-export": "lightning_mgpu.cli.export", "mgpu-prepare": "lightning_mgpu.cli.prepare"}


def entry_point(program: str) -> Optional[str]:
    """The module behind ``program`` (a path or name of one of the console scripts), else None."""
    return ENTRY_POINTS.get(Path(program).name)


def _child(module: str, argv: list[str], cwd: Optional[str], env: Optional[dict], out: int, err: int,
           new_session: bool, preexec: Optional[Callable[[], None]]) -> None:
    """In the forked child: become the console script, run it, exit with its status (never returns)."""
    code = 1
    try:
        if new_session:
            os.setsid()
        if preexec is not None:
            preexec()
        signal.alarm(0)  # the parent's pending alarms (pytest-timeout) are not this process's
        gc.freeze()  # the test session's heap stays out of this process's (and its forked ranks') collections
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        _log_to_these_streams()
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        sys.argv = [argv[0], *argv[1:]]
        try:
            importlib.import_module(module).main()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - any failure is this process's exit status, as in a fresh interpreter
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _log_to_these_streams() -> None:
    """Logging handlers made at import time (Lightning's) write to the streams of that time, pytest's captures here:
    point them at this process's stderr, and drop pytest's own capture handlers."""
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                        if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed


def run_cli(args: Sequence[str], cwd=None, timeout: float = 240, env: Optional[dict] = None,
            start_new_session: bool = False, preexec_fn: Optional[Callable[[], None]] = None
            ) -> subprocess.CompletedProcess:
    """``subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=...,
    preexec_fn=...)`` for a console script of the package, forked from this process (see the module docstring)."""
    module = entry_point(args[0])
    if module is None:
        raise ValueError(f"{args[0]} is not one of the package's console scripts {sorted(ENTRY_POINTS)}")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(module, [str(a) for a in args], None if cwd is None else str(cwd), env, out.fileno(), err.fileno(),
                   start_new_session, preexec_fn)
        code = _wait(pid, timeout, args)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(args), code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


class ForkedCli:
    """What ``subprocess.Popen(args, stdout=PIPE, stderr=PIPE, text=True, ...)`` gives, for a console script forked by
    :func:`popen_cli`: ``pid``, line-buffered text ``stdout``/``stderr``, ``wait``, ``communicate`` and
    ``returncode``."""

    def __init__(self, args: Sequence[str], pid: int, stdout, stderr) -> None:
        self.args, self.pid, self.stdout, self.stderr = list(args), pid, stdout, stderr
        self.returncode: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = _wait(self.pid, float("inf") if timeout is None else timeout, self.args, kill=False)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        out, err = self.stdout.read(), self.stderr.read()  # until the child (and what it started) closes them
        self.wait(timeout)
        return out, err


def popen_cli(args: Sequence[str], cwd=None, env: Optional[dict] = None,
              start_new_session: bool = False) -> ForkedCli:
    """``subprocess.Popen`` of a console script of the package with both streams piped, forked from this process."""
    module = entry_point(args[0])
    if module is None:
        raise ValueError(f"{args[0]} is not one of the package's console scripts {sorted(ENTRY_POINTS)}")
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        _child(module, [str(a) for a in args], None if cwd is None else str(cwd), env, out_w, err_w,
               start_new_session, None)
    os.close(out_w)
    os.close(err_w)
    return ForkedCli(args, pid, os.fdopen(out_r, "r", errors="replace"), os.fdopen(err_r, "r", errors="replace"))


def _wait(pid: int, timeout: float, args: Sequence[str], kill: bool = True) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            if kill:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(list(args), timeout)
        time.sleep(0.05)
