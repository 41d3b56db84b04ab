"""Automatic restarts: ``cluster.max_restarts=N`` under ``cluster=local`` (torchrun's ``--max-restarts`` for
``cluster=torchrun``), the record of what each restart lost, and when restarting stops helping.

Under ``cluster=local`` the command the user ran runs the job's ranks on torch's elastic agent
(:mod:`lightning_mgpu.resilience.elastic`), which starts them all again when one fails or is preempted. Each attempt knows
its number from the agent (``TORCHELASTIC_RESTART_COUNT``, as under torchrun); rank 0 of every attempt writes the last
step it finished into the run directory (``progress.json``), so the next attempt can say how many steps the restart
lost (the steps after the checkpoint it resumed from) and append it to ``restarts.jsonl`` with the times its restart
took, and the agent can tell a crash loop (attempts that end without a new optimizer step) from failures a restart
recovers from.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

#: The attempt number of a job under torch's elastic agent (0 first), set by the agent for every rank it starts.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
PROGRESS, RESTARTS = "progress.json", "restarts.jsonl"
#: Rank 0's log of every optimizer step of every attempt, a line each: ``attempt,step,unix time at its end``. A line
#: is one ``write`` to a file opened for appending (no buffer a SIGKILL could lose), a few microseconds a step.
STEP_LOG = "steps.csv"
#: In the run directory, written by every rank before it exits with :data:`EXIT_FAULTY_DEVICE`: the ranks named
#: persistent and their hosts, which the agent copies into its record of the attempt (``attempts.jsonl``).
FAULTY_DEVICE = "faulty-device.json"
#: Exit status of a refused configuration, command line or checkpoint (as argparse uses for a bad command line): a
#: restart would be refused again.
EXIT_REFUSED = 2
#: Exit status of a job that failed again and again without a new optimizer step (a crash loop): restarting or
#: requeueing it would repeat the failure. Not 75, the preemption status that asks a scheduler to requeue.
EXIT_CRASH_LOOP = 76
#: Exit status of a job whose rank corrupted its copy of the weights again when the steps since the copies last agreed
#: were run again (a persistent fault of that rank's device, :mod:`lightning_mgpu.resilience.fingerprint`): a restart on
#: the same machines would meet it again; requeue without the host named.
EXIT_FAULTY_DEVICE = 77


def attempt() -> int:
    """This job's attempt: 0 the first time, k after k restarts (by the elastic agent of ``cluster=local`` or of
    torchrun)."""
    value = os.environ.get(RESTART_COUNT, "")
    return int(value) if value.isdigit() else 0


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


def reached_step(run_dir: Path) -> int:
    """The last optimizer step rank 0 finished in ``run_dir`` (``progress.json``); 0 before the first."""
    try:
        return int(json.loads((Path(run_dir) / PROGRESS).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


class CrashLoop:
    """Counts the failed attempts in a row that ended without a new optimizer step (no step beyond the highest any
    attempt of this run directory had reached): a failure that repeats where it is, which restarts or a requeue only
    repeat."""

    def __init__(self, run_dir: Path, limit: int) -> None:
        self.run_dir, self.limit = Path(run_dir), limit
        self.best = reached_step(self.run_dir)  # a requeued job starts from what the job before it reached
        self.in_a_row = self.reached = 0

    def failed(self) -> bool:
        """After a failed attempt: whether ``limit`` attempts in a row have now failed without progress."""
        self.reached = reached_step(self.run_dir)
        self.in_a_row = 0 if self.reached > self.best else self.in_a_row + 1
        self.best = max(self.best, self.reached)
        return self.limit > 0 and self.in_a_row >= self.limit


def record_faulty_device(run_dir: Path, finding: dict, rank: int) -> None:
    """Before exiting with :data:`EXIT_FAULTY_DEVICE`: write ``finding`` (the step, the ranks named and their hosts)
    as :data:`FAULTY_DEVICE`. Every rank writes the same finding (atomically, each through its own temporary file), so
    whichever rank's exit the agent sees first, the record is already there."""
    path = Path(run_dir) / FAULTY_DEVICE
    tmp = path.with_suffix(f".{rank}.tmp")
    tmp.write_text(json.dumps({**finding, "persistent": True}))
    os.replace(tmp, path)


def read_faulty_device(run_dir: Path) -> Optional[dict]:
    """The finding :func:`record_faulty_device` wrote into ``run_dir``, or None."""
    try:
        return json.loads((Path(run_dir) / FAULTY_DEVICE).read_text())
    except (OSError, ValueError):
        return None


def read_restarts(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / RESTARTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def read_step_log(run_dir: Path) -> dict[int, list[tuple[int, float]]]:
    """``{attempt: [(step, unix time at its end), ...]}`` from :data:`STEP_LOG` (attempts counted from 0, as
    :func:`attempt`); a line cut short by a SIGKILL is left out."""
    out: dict[int, list[tuple[int, float]]] = {}
    path = Path(run_dir) / STEP_LOG
    for line in path.read_text().splitlines() if path.is_file() else []:
        fields = line.split(",")
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit():
            with contextlib.suppress(ValueError):
                out.setdefault(int(fields[0]), []).append((int(fields[1]), float(fields[2])))
    return out


def process_started() -> Optional[float]:
    """The unix time this process began (forked or started), from Linux's ``/proc/self/stat`` (clock ticks after
    boot, 10 ms apart): when the agent forked this rank, which nothing in the rank can note earlier; None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


class RestartRecord(L.Callback):
    """Rank 0 writes the last finished step into ``run_dir`` after every optimizer step (``progress.json``, with the
    time) and logs it (:data:`STEP_LOG`); a restarted attempt skips validation's sanity check, says at the start of
    training where it resumed, and at the end of its first optimizer step appends to ``restarts.jsonl`` what it lost
    and, in wall-clock seconds, when its process began (``forked``), when the run's objects were built (``built``:
    config checks, strategy, data and model), when its process group was up (``grouped``: Lightning's setup hooks
    run after it), when its engine was built (``set_up``), when the checkpoint was restored (``restored``) and when
    it stepped again (``stepped``): what each part of a restart costs, beside the time of the failure."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._times = {"forked": process_started(), "built": time.time()}  # built just before the Trainer
        self._record: Optional[dict] = None
        self._written: Optional[int] = None
        self._log: Optional[int] = None

    def setup(self, trainer: L.Trainer, *args, **kwargs) -> None:
        self._times["grouped"] = time.time()  # Lightning calls this after the strategy's process group

    def on_fit_start(self, trainer: L.Trainer, *args) -> None:
        self._times["set_up"] = time.time()  # the strategy restores a checkpoint after this: the engine exists
        if attempt() > 0:  # asked now, when the ranks have agreed on the number: before, nodes may differ
            trainer.num_sanity_val_steps = 0  # a restart does not check again what its first attempt checked

    def on_train_start(self, trainer: L.Trainer, *args) -> None:
        number = attempt()
        if trainer.is_global_zero:
            self._log = os.open(self.run_dir / STEP_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if number == 0 or not trainer.is_global_zero:
            return
        reached = reached_step(self.run_dir)
        self._record = {"attempt": number + 1, "resumed_at": trainer.global_step, "previous_reached": reached,
                        "lost_steps": max(0, reached - trainer.global_step), **self._times, "restored": time.time()}
        rank_zero_info(f"Restart {number}: resumed at step {trainer.global_step}; the attempt before reached step "
                       f"{reached}: {self._record['lost_steps']} step(s) lost")

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if not trainer.is_global_zero or trainer.global_step == self._written:
            return
        now, self._written = time.time(), trainer.global_step
        if self._log is not None:
            os.write(self._log, f"{attempt()},{trainer.global_step},{now:.6f}\n".encode())
        path = self.run_dir / PROGRESS
        path.with_suffix(".tmp").write_text(json.dumps({"step": trainer.global_step, "attempt": attempt(), "time": now}))
        os.replace(path.with_suffix(".tmp"), path)
        if self._record is not None:  # the first optimizer step of a restarted attempt
            with (self.run_dir / RESTARTS).open("a") as out:
                out.write(json.dumps({**self._record, "stepped": now}) + "\n")
            self._record = None

    def on_train_end(self, trainer: L.Trainer, *args) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def on_exception(self, trainer: L.Trainer, *args) -> None:
        self.on_train_end(trainer)
