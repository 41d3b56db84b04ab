"""Preemption through ``mgpu-train``: SIGUSR2 (SLURM's warning before a time limit) to rank 1 in the middle of a step;
the job exits with the requeue status after an emergency checkpoint, and ``checkpoint.resume=auto`` in the same run
directory finishes with the uninterrupted run's losses."""

import os

from forked_cli import run_cli
from cli_helpers import BIN, cli_args, read_losses, run

from lightning_mgpu.resilience.preemption import REQUEUE_EXIT


def test_cli_preempted_run_exits_for_a_requeue_and_resumes_with_no_step_lost(token_file, tmp_path,
                                                                             uninterrupted_losses):
    """Without periodic checkpoints: the emergency checkpoint is the only one."""
    args = [str(BIN / "mgpu-train"), *cli_args(token_file, 6), "parallel.zero_stage=1", "checkpoint.resume=auto"]
    again = tmp_path / "again"
    env = dict(os.environ, MGPU_SIGNAL_RANK_AT="1:3")
    first = run_cli([*args, f"hydra.run.dir={again}"], cwd=tmp_path, timeout=240, env=env)
    out = first.stdout + first.stderr
    assert first.returncode == REQUEUE_EXIT, out[-3000:]
    assert "Preempted: SIGUSR2 reached rank 1; every rank stopped after step 4; emergency checkpoint" in out
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["step-00000004"]
    second = run([*args, f"hydra.run.dir={again}"], tmp_path)  # the requeued job: same command, same directory
    assert "Loaded the checkpoint of step 4" in second.stdout + second.stderr
    assert read_losses(again / "metrics.csv")[-2:] == uninterrupted_losses[-2:]
