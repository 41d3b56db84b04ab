"""Crash safety: the whole job is SIGKILLed in four states that differ in memory and on disk, and each requeued
attempt (a fresh process group, ``checkpoint.resume=auto``) resumes from the checkpoint it should, and every loss any
attempt logged is bit-identical to an uninterrupted run.

With a checkpoint after every step (keep_last=2) and six steps, the attempts are:

1. killed inside the backward pass of step 2 (gradients half computed)      -> complete: 1, 2
2. resumed at 2; killed while writing the checkpoint of step 4, its trainer state half written (a torn
   ``step-00000004.partial``)                                               -> complete: 2, 3 + torn 4
3. resumed at 3 (the torn 4 ignored); killed after publishing 5, before pruning -> complete: 3, 4, 5
4. killed while restoring the checkpoint of step 5                           -> unchanged
5. resumed at 5, runs to the end                                             -> complete: 5, 6

A killed attempt loses the row of the step it died in (the logger writes it after the step's callbacks).
"""

import csv
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from forked_cli import run_cli
from cli_helpers import TINY_ARGS

from lightning_mgpu.callbacks import newest_checkpoint

BIN = Path(sys.executable).parent
STEPS = 6


def attempt(token_file, tmp_path, name, checkpoints, kill=None, every=1, extra=()):
    """One launch; returns its logged losses by step and the step it printed that it resumed at (None: fresh)."""
    run_dir = tmp_path / name
    env = dict(os.environ, **({"MGPU_KILL_AT": kill} if kill else {}))
    proc = run_cli(
        [str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}",
         f"trainer.max_steps={STEPS}", f"checkpoint.every_n_steps={every}", "checkpoint.keep_last=2", *extra,
         f"checkpoint.dir={checkpoints}", "checkpoint.resume=auto", "throughput.enabled=false", *TINY_ARGS,
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, timeout=240, start_new_session=True)
    output = proc.stdout + proc.stderr
    if kill:
        assert proc.returncode == -signal.SIGKILL, output[-3000:]
        assert f"MGPU fault: rank 0 kills the job (SIGKILL to its process group) at {kill}" in output, output[-3000:]
    else:
        assert proc.returncode == 0, output[-3000:]
    resumed = re.findall(r"Resumed at step (\d+) from (\S+)", output)
    assert all(Path(path).name == f"step-{int(step):08d}" for step, path in resumed), resumed
    metrics = run_dir / "metrics.csv"
    losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")} \
        if metrics.exists() else {}
    return losses, int(resumed[0][0]) if resumed else None


def on_disk(checkpoints):
    """(complete steps, partial steps) in the checkpoint directory."""
    names = [p.name for p in checkpoints.iterdir()]
    complete = sorted(int(n[5:]) for n in names if re.fullmatch(r"step-\d{8}", n))
    partial = sorted(int(n[5:13]) for n in names if re.fullmatch(r"step-\d{8}\.partial", n))
    return complete, partial


@pytest.fixture(scope="module")
def whole(token_file, tmp_path_factory):
    """The losses of the uninterrupted run."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    losses, resumed = attempt(token_file, tmp_path, "uninterrupted", tmp_path / "ckpt")
    assert sorted(losses) == list(range(STEPS)) and resumed is None
    return losses


def test_killed_in_four_states_resumes_from_the_right_checkpoint_bit_identically(token_file, tmp_path, whole):
    ckpt = tmp_path / "ckpt"
    logged = {}

    losses, resumed = attempt(token_file, tmp_path, "backward", ckpt, kill="backward:2")
    assert resumed is None and sorted(losses) == [0, 1]  # step 2 died in its backward pass
    assert on_disk(ckpt) == ([1, 2], [])
    logged["backward"] = losses

    losses, resumed = attempt(token_file, tmp_path, "torn", ckpt, kill="torn:4")
    assert resumed == 2 and sorted(losses) == [2]
    assert on_disk(ckpt) == ([2, 3], [4])
    torn = ckpt / "step-00000004.partial"
    assert (torn / ".metadata").is_file() and (torn / "trainer_state.pt").stat().st_size > 0
    with pytest.raises(Exception):  # half a file: the checkpoint is torn, not merely unpublished
        torch.load(torn / "trainer_state.pt", weights_only=True)
    assert newest_checkpoint(ckpt) == ckpt / "step-00000003"
    logged["torn"] = losses

    losses, resumed = attempt(token_file, tmp_path, "published", ckpt, kill="published:5")
    assert resumed == 3 and sorted(losses) == [3]  # not the torn 4; step 4 died in its checkpoint's publication
    assert on_disk(ckpt) == ([3, 4, 5], [])  # the torn partial was replaced; 3 not yet pruned
    logged["published"] = losses

    losses, resumed = attempt(token_file, tmp_path, "resume", ckpt, kill="resume:5")  # the fault fires only at 5
    assert resumed is None and losses == {}
    assert on_disk(ckpt) == ([3, 4, 5], [])
    logged["resume"] = losses

    losses, resumed = attempt(token_file, tmp_path, "final", ckpt)
    assert resumed == 5 and sorted(losses) == [5]
    assert on_disk(ckpt) == ([5, 6], [])
    logged["final"] = losses

    for name, losses in logged.items():
        for step, loss in losses.items():
            assert loss == whole[step], (name, step, loss, whole[step])
    assert sorted(step for losses in logged.values() for step in losses) == [0, 1, 2, 3, 5]


def test_background_saves_killed_while_staged_written_and_unpublished_resume_bit_identically(token_file, tmp_path,
                                                                                             whole):
    """``checkpoint.async_save=true``, every 2 steps: the job is killed with the checkpoint of step 4 snapshotted (its
    trainer state written, no tensor yet), with rank 0's tensors written in the background (no checksums), and with
    every rank's write finished but not yet published. Each time the checkpoint of step 2 is the newest complete one
    and the next attempt resumes from it, and every logged loss equals the uninterrupted run's (that the end of fit
    waits for the last save: ``tests/distributed/test_async_checkpoints.py``)."""
    ckpt, logged = tmp_path / "ckpt", {}
    background = ["checkpoint.async_save=true"]
    for number, kill in enumerate(["staged:4", "written:4", "saving:4"]):
        losses, resumed = attempt(token_file, tmp_path, kill.split(":")[0], ckpt, kill=kill, every=2, extra=background)
        assert resumed == (None if number == 0 else 2) and (number or sorted(losses) == [0, 1, 2]), (kill, losses)
        complete, partial = on_disk(ckpt)
        assert complete == [2] and partial == [4], (kill, complete, partial)
        files = {p.name for p in (ckpt / "step-00000004.partial").iterdir()}
        assert ("trainer_state.pt" in files, ".metadata" in files, "checksums.json" in files) == \
            [(True, False, False), (True, True, False), (True, True, True)][number], (kill, files)
        logged[kill] = losses
    for name, losses in logged.items():
        for step, loss in losses.items():
            assert loss == whole[step], (name, step, loss, whole[step])
