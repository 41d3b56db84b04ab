"""Restarts and preemption through ``mgpu-train``: a job whose rank is killed completes by itself with the uninterrupted
run's losses under ``cluster=local`` (``cluster.max_restarts``, on torch's elastic agent; torchrun's
``--max-restarts``: tests/cli/test_launch.py); the restart and the steps it lost are logged and recorded; a failure
that repeats without progress stops with its own exit status; a signal to the launching process reaches the ranks,
which stop with an emergency checkpoint; a preempted run exits for a requeue and resumes with no step lost. In one
file: they share the uninterrupted run (a session fixture, made once per pytest worker)."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from cli_helpers import BIN, RESTARTABLE, cli_args, read_losses, run
from forked_cli import popen_cli, run_cli

from lightning_mgpu.resilience.preemption import REQUEUE_EXIT
from lightning_mgpu.resilience.restarts import read_step_log

CRASH_LOOP_EXIT = 76  # docs/reference/refusals.md


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_local_job_with_a_killed_rank_restarts_and_completes(token_file, tmp_path, uninterrupted_losses):
    """Rank 0 (a worker of the agent, which is the process that started the job) SIGKILLs itself as step 4 begins;
    the agent starts both ranks again, which resume from step 2's checkpoint and finish: 1 restart, 1 step lost
    (step 3), and the losses of steps 5 and 6 are the uninterrupted run's."""
    again = tmp_path / "again"
    proc = run([str(BIN / "mgpu-train"), *cli_args(token_file, 6), *RESTARTABLE, "cluster.max_restarts=2",
                f"hydra.run.dir={again}"], tmp_path, env=dict(os.environ, MGPU_KILL_RANK_AT="0:3"), fork=False)
    out = proc.stdout + proc.stderr
    assert "mgpu-train: attempt 1 failed: rank 0 exited with status 137; restart 1 of 2" in out, out[-3000:]
    assert "Restart 1: resumed at step 2; the attempt before reached step 3: 1 step(s) lost" in out
    assert "mgpu-train: 1 restart(s), 1 step(s) lost; exit status 0" in out
    [ended] = records(again / "attempts.jsonl")
    assert {k: ended[k] for k in ("attempt", "rank", "status", "reached", "then")} == \
        {"attempt": 1, "rank": 0, "status": 137, "reached": 3, "then": "restart"}
    [restart] = records(again / "restarts.jsonl")
    assert {k: restart[k] for k in ("attempt", "resumed_at", "previous_reached", "lost_steps")} == \
        {"attempt": 2, "resumed_at": 2, "previous_reached": 3, "lost_steps": 1}
    killed = float(re.search(r"kills itself \(SIGKILL\) at step 3 at time ([\d.]+)", out).group(1))
    assert killed < ended["ended"] < restart["forked"] < restart["built"] < restart["grouped"] < restart["set_up"] \
        < restart["restored"] < restart["stepped"]
    # rank 0's step log: steps 1-3 of the first attempt (it died as step 4 began), 3-6 of the second, in time order
    logged = read_step_log(again)
    assert [s for s, _ in logged[0]] == [1, 2, 3] and [s for s, _ in logged[1]] == [3, 4, 5, 6], logged
    assert logged[0][-1][1] < killed and logged[1][0][1] == pytest.approx(restart["stepped"], abs=1e-5)
    # every step once: metrics.csv kept the first attempt's steps 0-1, and the restart's 2-5 equal the uninterrupted run's
    assert read_losses(again / "metrics.csv") == uninterrupted_losses
    # nothing of the killed attempt is left (its rank 1, blocked in a collective, was killed by the agent)
    left = subprocess.run(["pgrep", "-f", f"hydra.run.dir={again}"], capture_output=True, text=True).stdout
    assert left.strip() == "", left


def test_a_failure_that_repeats_without_progress_stops_as_a_crash_loop(token_file, tmp_path):
    """Rank 1 is killed as the first step of every attempt begins (``MGPU_FAULT_ATTEMPTS=every``): with
    ``cluster.crash_loop_attempts=2`` the job stops after its second attempt with the crash-loop status, not the
    requeue status (75) nor the failure's own (137), although restarts were left."""
    proc = run_cli([str(BIN / "mgpu-train"), *cli_args(token_file, 4), *RESTARTABLE, "cluster.max_restarts=5",
                    "cluster.crash_loop_attempts=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=240,
                   env=dict(os.environ, MGPU_KILL_RANK_AT="1:0", MGPU_FAULT_ATTEMPTS="every"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == CRASH_LOOP_EXIT, out[-3000:]
    assert "2 attempts in a row ended without a new optimizer step (none beyond step 0): a crash loop" in out
    assert [(r["attempt"], r["rank"], r["status"], r["then"]) for r in records(tmp_path / "run" / "attempts.jsonl")] \
        == [(1, 1, 137, "restart"), (2, 1, 137, "crash loop")]
    assert "mgpu-train: 1 restart(s), 0 step(s) lost; exit status 76" in out


def test_a_signal_to_the_launching_process_stops_every_rank_with_a_checkpoint(token_file, tmp_path):
    """SIGTERM to the agent (a scheduler stopping the job) is passed to both ranks, which stop after their step with an
    emergency checkpoint; the job exits with the requeue status and leaves no process behind."""
    run_dir = tmp_path / "run"
    proc = popen_cli([str(BIN / "mgpu-train"), *cli_args(token_file, 200), *RESTARTABLE, "cluster.max_restarts=2",
                      f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step-00000002").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT, (out + err)[-3000:]
    step = int(re.search(r"Preempted: SIGTERM reached rank \d; every rank stopped after step (\d+)", out + err).group(1))
    assert (run_dir / "checkpoints" / f"step-{step:08d}").is_dir() and step < 200
    assert "mgpu-train: 0 restart(s), 0 step(s) lost; exit status 75" in out + err


def test_cli_preempted_run_exits_for_a_requeue_and_resumes_with_no_step_lost(token_file, tmp_path,
                                                                             uninterrupted_losses):
    """SIGUSR2 (SLURM's warning before a time limit) to rank 1 in the middle of a step, without periodic checkpoints:
    the job exits with the requeue status after an emergency checkpoint, the only one, and ``checkpoint.resume=auto``
    in the same run directory finishes with the uninterrupted run's losses."""
    args = [str(BIN / "mgpu-train"), *cli_args(token_file, 6), "parallel.zero_stage=1", "checkpoint.resume=auto"]
    again = tmp_path / "again"
    env = dict(os.environ, MGPU_SIGNAL_RANK_AT="1:3")
    first = run_cli([*args, f"hydra.run.dir={again}"], cwd=tmp_path, timeout=240, env=env)
    out = first.stdout + first.stderr
    assert first.returncode == REQUEUE_EXIT, out[-3000:]
    assert "Preempted: SIGUSR2 reached rank 1; every rank stopped after step 4; emergency checkpoint" in out
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["step-00000004"]
    assert "val/loss" not in (again / "metrics.csv").read_text()  # no validation pass on the way out
    second = run([*args, f"hydra.run.dir={again}"], tmp_path)  # the requeued job: same command, same directory
    assert "Loaded the checkpoint of step 4" in second.stdout + second.stderr
    assert read_losses(again / "metrics.csv") == uninterrupted_losses  # steps 0-3 kept from the first run
