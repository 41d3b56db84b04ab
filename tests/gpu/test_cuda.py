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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_parallel_attention_of_a_late_chunk_matches_whole_causal_attention_on_cuda(dtype):
    """The CUDA branch of the context-parallel kernel (torch's lower-right causal mask, key/value heads expanded):
    the last query chunk attending to all keys equals the last rows of causal attention over the whole sequence."""
    import torch.nn.functional as F

    from lightning_mgpu.parallel.context import ContextParallelAttention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 256, 64, generator=g) for heads in (8, 2, 2))
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    kernel = ContextParallelAttention(group=None, rank=0, size=2)
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q[:, :, 192:], k, v)]
    late = kernel.attend(*inputs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(late.float().cpu(), whole[:, :, 192:], atol=tol, rtol=tol)
    # and the gradients: of the late queries, and of every key and value they see
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(leaves[0], *(t.repeat_interleave(4, 1) for t in leaves[1:]),
                                               is_causal=True)[:, :, 192:]
    reference.sum().backward()
    late.sum().backward()
    for got, want in zip(inputs, (leaves[0].grad[:, :, 192:], leaves[1].grad, leaves[2].grad)):
        torch.testing.assert_close(got.grad.float().cpu(), want, atol=tol, rtol=tol)
