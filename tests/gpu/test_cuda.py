"""GPU-only checks: run on a lent accelerator; skipped without CUDA."""

import lightning as L
import pytest
import torch
from helpers import OPTIM, TINY, datamodule

from lightning_mgpu import LLMModule, MGPUStrategy


@pytest.mark.gpu
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_bf16_training_on_one_gpu_with_nccl(token_file, zero_stage):
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MGPUStrategy(zero_stage=zero_stage),
                        precision="bf16-mixed", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0)
    module = LLMModule(TINY, **OPTIM)
    trainer.fit(module, datamodule(token_file))
    assert torch.distributed.get_backend() == "nccl"
    assert next(trainer.strategy.model.parameters()).is_cuda
    assert trainer.strategy.model.zero_overlap_comm() is (zero_stage >= 2)  # overlap is on by default on CUDA
    assert trainer.global_step == 5
