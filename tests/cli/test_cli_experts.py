"""A mixture of experts through ``mgpu-train`` with expert parallelism, validation and checkpoints on; and the same
module under a plain Lightning Trainer on one device."""

from dataclasses import replace

import lightning as L
import torch
from cli_helpers import BIN, assert_cli_parity, cli_args, read_metric
from forked_cli import run_cli
from helpers import GLOBAL_BATCH, OPTIM, Recorder, datamodule, max_abs_diff
from moe_helpers import TINY_MOE, moe_reference

from lightning_mgpu import LLMModule
from lightning_mgpu.checkpoint.universal import read_model_weights

STEPS = 4
MOE_ARGS = ["model.num_experts=4", "model.experts_per_token=2", "model.shared_experts=1", "model.aux_loss_coeff=0.05",
            "model.z_loss_coeff=0.01", "model.router_bias_rate=0.01"]
#: Bias balancing on: validation (Lightning's sanity check before training, and after it) must not move the bias.
CLI_MOE = replace(TINY_MOE, router_bias_rate=0.01)


def test_cli_expert_parallel_trains_validates_and_checkpoints(token_file, tmp_path):
    run_dir = tmp_path / "run"
    args = [str(BIN / "mgpu-train"), *cli_args(token_file, STEPS), *MOE_ARGS, "parallel.expert_parallel_size=2",
            "parallel.zero_stage=2", "data.val_batches=1", "trainer.val_check_interval=2", "checkpoint.every_n_steps=2",
            f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "experts: 2 layers of 4 experts, 2 on each rank of 2 (expert parallel)" in proc.stdout + proc.stderr
    applied = [line for line in (proc.stdout + proc.stderr).splitlines() if "applied layout: rank 0" in line]
    # the line reads the built model: 2 layers x (w1, w2, w3), each holding 2 of its 4 experts on this rank
    assert len(applied) == 1 and "expert parallel over 2 ranks (6 expert weights split by expert)" in applied[0]
    optim = dict(lr=3e-3, warmup_steps=2, max_steps=STEPS, min_lr_ratio=0.1, weight_decay=0.1)
    ref = moe_reference(token_file, STEPS, model=CLI_MOE, optim=optim)
    metrics = run_dir / "metrics.csv"
    assert_cli_parity(metrics, ref)
    assert read_metric(metrics, "val/loss") and read_metric(metrics, "moe/load")[-1] >= 1.0
    _, weights = read_model_weights(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    for name, want in ref["experts"].items():  # the checkpoint holds all 4 experts of each layer, as trained
        assert weights[name].shape[0] == 4 and torch.allclose(weights[name], want, atol=1e-5), name


def test_plain_trainer_on_one_device_matches_the_reference(token_file):
    """No MGPUStrategy: the same losses as the reference, and the load is logged."""
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, gradient_clip_val=0.3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[recorder])
    trainer.fit(LLMModule(TINY_MOE, **OPTIM, global_batch_size=GLOBAL_BATCH), datamodule(token_file, micro_batch_size=8))
    ref = moe_reference(token_file, 3, chunk=8)
    assert max_abs_diff(recorder.losses, ref["losses"]) < 1e-5
    assert "moe/layers.1/aux_loss" in trainer.callback_metrics
