"""Restarts: a job whose rank is killed completes by itself with the uninterrupted run's losses, under
``cluster=local`` (``cluster.max_restarts``, on torch's elastic agent) and under torchrun (``--max-restarts``); the
restart and the steps it lost are logged and recorded; a failure that repeats without progress stops with its own exit
status; a signal to the launching process reaches the ranks, which stop with an emergency checkpoint."""

import json
import os
import re
import signal
import subprocess
import time

from cli_helpers import BIN, RESTARTABLE, cli_args, read_losses, run
from forked_cli import popen_cli, run_cli

from lightning_mgpu.resilience.preemption import REQUEUE_EXIT
from lightning_mgpu.testing import free_port

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
    assert killed < ended["ended"] < restart["set_up"] < restart["restored"] < restart["stepped"]
    assert read_losses(again / "metrics.csv")[-2:] == uninterrupted_losses[-2:]
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


def test_torchrun_restarts_a_job_whose_rank_was_killed(token_file, tmp_path, uninterrupted_losses):
    """``torchrun --max-restarts=1``: rank 1 killed as step 4 begins, torchrun starts both ranks again (its restart
    count tells the attempt), and the job resumes from step 2 and completes with the uninterrupted run's losses."""
    # torchrun keeps its store across restarts: the strategy sees it through a prefix of the restart count
    # (lightning_mgpu.parallel.process_group.attempt_store), or the restarted ranks could read the failed attempt's
    # addresses
    args = [str(BIN / "torchrun"), "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "lightning_mgpu.train", "cluster=torchrun",
            *cli_args(token_file, 6), *RESTARTABLE, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, MGPU_KILL_RANK_AT="1:3", OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Restart 1: resumed at step 2; the attempt before reached step 3: 1 step(s) lost" in out, out[-3000:]
    assert read_losses(tmp_path / "run" / "metrics.csv")[-2:] == uninterrupted_losses[-2:]
