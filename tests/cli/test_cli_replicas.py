"""Replicas that step apart, driven through ``mgpu-train`` as a user runs them: ``local`` with validation and
periodic checkpoints, resumed from the middle of a round; ``async`` with a slow rank and validation."""

from cli_helpers import BIN, cli_args, read_losses, read_metric, run

LOCAL = ["parallel.replicas=2", "parallel.replica_update=local", "parallel.sync_every=3", "parallel.zero_stage=1",
         "data.val_batches=1", "trainer.val_check_interval=3", "checkpoint.every_n_steps=2"]


def test_cli_local_replicas_validate_checkpoint_and_resume_mid_round(token_file, tmp_path):
    """6 steps, H=3, a checkpoint every 2 steps and validation every 3; then a second run resumes from step 4 (in
    the middle of the second round) and logs the same losses for steps 5 and 6 and the same validation loss."""
    whole, again = tmp_path / "whole", tmp_path / "again"
    proc = run([str(BIN / "mgpu-train"), *cli_args(token_file, 6), *LOCAL, f"checkpoint.dir={whole / 'ckpt'}",
                f"hydra.run.dir={whole}"], tmp_path)
    assert "2 replicas stepping alone, an outer step over" in proc.stdout + proc.stderr
    run([str(BIN / "mgpu-train"), *cli_args(token_file, 6), *LOCAL, f"checkpoint.dir={again / 'ckpt'}",
         f"checkpoint.resume={whole / 'ckpt' / 'step-00000004'}", f"hydra.run.dir={again}"], tmp_path)
    assert read_losses(again / "metrics.csv") == read_losses(whole / "metrics.csv")[4:]
    assert read_metric(again / "metrics.csv", "val/loss")[-1] == read_metric(whole / "metrics.csv", "val/loss")[-1]
    assert len(read_metric(whole / "metrics.csv", "replica/outer_steps")) == 2  # the outer steps after steps 3, 6


def test_cli_async_replicas_with_a_slow_rank(token_file, tmp_path):
    proc = run([str(BIN / "mgpu-train"), *cli_args(token_file, 6), "parallel.replicas=2",
                "parallel.replica_update=async", "parallel.sync_every=2", "parallel.zero_stage=1",
                "parallel.slow_ranks={1: 3.0}", "data.val_batches=1", "trainer.val_check_interval=6",
                f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert "asynchronously: a push and a pull every 2 steps, at most 2 rounds ahead" in out
    assert "straggler report: straggler: rank 1 is busy" in out and "replica 1 staleness" in out
    assert read_metric(tmp_path / "run" / "metrics.csv", "val/loss")
    assert len(read_metric(tmp_path / "run" / "metrics.csv", "replica/staleness")) == 3
