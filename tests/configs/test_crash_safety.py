"""Crash safety: SIGKILL of the whole job at ten moments (during steps and during saves); each time
``checkpoint.resume=auto`` continues from the newest complete checkpoint, and every loss any attempt logged
is bit-identical to an uninterrupted run (each attempt is a fresh process group, as a requeued job would be)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_launch import TINY_ARGS

BIN = Path(sys.executable).parent
#: (phase, step): after a plain step, before a save, with a save written but unpublished, right after publishing.
KILLS = [("step", 3), ("saving", 4), ("published", 4), ("trained", 6), ("step", 7), ("saving", 8),
         ("published", 8), ("step", 9), ("trained", 10), ("saving", 12)]


def attempt(token_file, tmp_path, name, checkpoints, kill=None):
    run_dir = tmp_path / name
    env = dict(os.environ, **({"MGPU_KILL_AT": f"{kill[0]}:{kill[1]}"} if kill else {}))
    proc = subprocess.run(
        [str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}", "trainer.max_steps=12",
         "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", f"checkpoint.dir={checkpoints}",
         "checkpoint.resume=auto", "trainer.throughput=false", *TINY_ARGS, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    if kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = run_dir / "metrics.csv"
    return read_losses_by_step(metrics) if metrics.exists() else {}


def read_losses_by_step(metrics):
    import csv

    return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")}


def test_killed_at_ten_moments_resumes_bit_identically(token_file, tmp_path):
    whole = attempt(token_file, tmp_path, "uninterrupted", tmp_path / "ckpt-uninterrupted")
    assert sorted(whole) == list(range(12))
    checkpoints = tmp_path / "ckpt"
    logged: dict[int, list[float]] = {}
    for i, kill in enumerate(KILLS):
        for step, loss in attempt(token_file, tmp_path, f"attempt{i}", checkpoints, kill).items():
            logged.setdefault(step, []).append(loss)
        complete = sorted(p.name for p in checkpoints.iterdir() if not p.name.endswith(".partial"))
        assert 1 <= len(complete) <= 3  # keep_last=2 (+1 when killed between publishing and pruning)
    final = attempt(token_file, tmp_path, "final", checkpoints)
    assert max(final) == 11 and min(final) == 10  # resumed from the checkpoint of step 10, the newest complete one
    for step, loss in final.items():
        logged.setdefault(step, []).append(loss)
    # A killed attempt loses the row of the step it died in; those steps are logged by a later attempt.
    assert len(logged) >= 10
    for step, losses in logged.items():
        assert all(loss == whole[step] for loss in losses), (step, losses, whole[step])
