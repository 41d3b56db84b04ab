"""``mgpu-train`` skips a step whose loss is NaN on one rank, and one whose loss is a thousand times too large on
another, and ends with the weights, bit for bit, of a run that never drew those two global batches
(``data.skip_batches``); the log names each step and the rank whose loss was not finite."""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from cli_helpers import BIN, cli_args
from forked_cli import run_cli

from lightning_mgpu.callbacks import newest_checkpoint

STEPS, NAN_AT, SPIKE_AT = 8, 3, 5  # steps counted from 0, as metrics.csv counts them
# a constant LR (the schedule's length is max_steps, one of which differs below); a spike rule that measures from 2
# accepted steps, as 8 steps leave little history
COMMON = ["optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "bad_steps.loss_spike.min_history=2",
          "bad_steps.loss_spike.window=8", "checkpoint.save_last=true", "checkpoint.save_consolidated_weights=true",
          "throughput.enabled=false"]


def final_weights(token_file, run_dir: Path, steps: int, extra: list, env: dict) -> tuple[dict, str]:
    proc = run_cli([str(BIN / "mgpu-train"), *cli_args(token_file, steps), *COMMON, *extra,
                    f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=dict(os.environ, **env), timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    return load_file(newest_checkpoint(run_dir / "checkpoints") / "model.safetensors"), output


def test_nan_and_spike_steps_are_skipped_as_if_never_drawn(token_file, tmp_path):
    faulty, output = final_weights(token_file, tmp_path / "faulty", STEPS, [],
                                   {"MGPU_NAN_RANK_AT": f"1:{NAN_AT}", "MGPU_SPIKE_RANK_AT": f"0:{SPIKE_AT}"})
    never_drawn, clean = final_weights(token_file, tmp_path / "never_drawn", STEPS - 2,
                                       [f"data.skip_batches=[{NAN_AT},{SPIKE_AT}]"], {})
    assert f"step {NAN_AT} skipped on every rank: the loss was not finite on rank(s) [1]" in output, output[-3000:]
    # one rank's loss x1000: the cross-rank rule names it, with its loss and the other rank's
    assert f"step {SPIKE_AT} skipped on every rank: the loss of rank(s) [0] is more than 10x the median of the " \
           "other ranks' losses of the step (" in output, output[-3000:]
    assert "skipped on every rank" not in clean
    # a run whose steps never stopped leaves no stacks file of faulthandler's behind
    assert not list((tmp_path / "faulty").glob("stall-rank*-native-stacks.txt"))
    assert faulty.keys() == never_drawn.keys()
    for name, expected in never_drawn.items():
        assert torch.equal(faulty[name], expected), name
        assert torch.isfinite(faulty[name]).all(), name


def test_repeated_bad_steps_roll_back_and_leave_their_batches_out(token_file, tmp_path):
    """Two skipped steps (NaN on rank 1 at steps 3 and 4) with bad_steps.rollback_after=2: the checkpoints after step 3
    are set aside, batches 3 and 4 go to the skip file, the run exits with 75; the restart resumes at step 3 and ends
    with the weights, bit for bit, of a run that never drew batches 3 and 4 (with the run's own LR schedule: the same
    steps)."""
    rolling = ["bad_steps.rollback_after=2", "bad_steps.rollback_window=4", "checkpoint.every_n_steps=1",
               "checkpoint.keep_last=4", "checkpoint.resume=auto", "optim.warmup_steps=2"]
    run_dir = tmp_path / "run"
    proc = run_cli([str(BIN / "mgpu-train"), *cli_args(token_file, STEPS), *COMMON, *rolling,
                    f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=dict(os.environ, MGPU_NAN_RANK_AT="1:3,1:4"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 75, output[-3000:]
    assert ("rolling back: steps [3, 4] were skipped within the window; global batches [3, 4] will be left out; "
            "checkpoints set aside: step-00000005.rolledback, step-00000004.rolledback") in output, output[-3000:]
    assert json.loads((run_dir / "checkpoints" / "skip_batches.json").read_text()) == [3, 4]
    resumed, output = final_weights(token_file, run_dir, STEPS, rolling, {})  # the restart
    assert "Resumed at step 3 from" in output, output[-3000:]
    never_drawn, _ = final_weights(token_file, tmp_path / "never_drawn", STEPS,
                                   ["data.skip_batches=[3,4]", "optim.warmup_steps=2"], {})
    for name, expected in never_drawn.items():
        assert torch.equal(resumed[name], expected), name
