"""Restarts: a job whose rank is killed completes by itself with the uninterrupted run's losses, under
``cluster=local`` (``cluster.max_restarts``) and under torchrun (``--max-restarts``); the restart and the steps it
lost are logged and recorded."""

import json
import os
import subprocess

from cli_helpers import BIN, RESTARTABLE, cli_args, read_losses, run

from lightning_mgpu.testing import free_port


def test_local_job_with_a_killed_rank_restarts_and_completes(token_file, tmp_path, uninterrupted_losses):
    """Rank 0 (the process that started the job, under a plain launch) SIGKILLs itself as step 4 begins; the
    supervisor starts the job again, which resumes from step 2's checkpoint and finishes: 1 restart, 1 step lost
    (step 3), and the losses of steps 5 and 6 are the uninterrupted run's."""
    again = tmp_path / "again"
    proc = run([str(BIN / "mgpu-train"), *cli_args(token_file, 6), *RESTARTABLE, "cluster.max_restarts=2",
                f"hydra.run.dir={again}"], tmp_path, env=dict(os.environ, MGPU_KILL_RANK_AT="0:3"), fork=False)
    out = proc.stdout + proc.stderr
    assert "attempt 1 exited with status" in out and "restart 1 of 2" in out, out[-3000:]
    assert "Restart 1: resumed at step 2; the attempt before reached step 3: 1 step(s) lost" in out
    assert "mgpu-train: 1 restart(s), 1 step(s) lost; exit status 0" in out
    records = [json.loads(line) for line in (again / "restarts.jsonl").read_text().splitlines()]
    assert records == [{"attempt": 2, "resumed_at": 2, "previous_reached": 3, "lost_steps": 1}]
    assert read_losses(again / "metrics.csv")[-2:] == uninterrupted_losses[-2:]
    # nothing of the killed attempt is left (its rank 1, blocked in a collective, was killed with its session)
    left = subprocess.run(["pgrep", "-f", f"hydra.run.dir={again}"], capture_output=True, text=True).stdout
    assert left.strip() == "", left


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
