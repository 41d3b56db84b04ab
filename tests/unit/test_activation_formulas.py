"""The planner's activation bytes against what this Llama keeps for backward, one process: three shapes (dim, heads,
key/value heads, ffn width, sequence), fp32 and bf16, each activation-checkpointing mode, per block and for the whole
model with its logits and loss (tensor and sequence parallelism: tests/distributed/test_activation_memory.py)."""

from dataclasses import replace

import pytest
import torch

from lightning_mgpu import LLMModule
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner.memory import block_activation_bytes, head_activation_bytes
from lightning_mgpu.measure import kept_forward_bytes

#: (shape, sequence): GQA 3:1, plain multi-head attention, and GQA 8:1 with a wide MLP
SHAPES = [(LlamaConfig(dim=96, n_heads=6, n_kv_heads=2, ffn_hidden=160, vocab_size=50, max_seq_len=128), 40),
          (LlamaConfig(dim=128, n_heads=4, n_kv_heads=4, ffn_hidden=352, vocab_size=300, max_seq_len=128), 64),
          (LlamaConfig(dim=64, n_heads=8, n_kv_heads=1, ffn_hidden=256, vocab_size=64, max_seq_len=128), 96)]
BATCH = 2


def kept(cfg: LlamaConfig, n_layers: int, mode: str, dtype: torch.dtype, seq: int) -> int:
    """Bytes one training forward of LLMModule's loss keeps, the model in ``dtype`` as MGPUStrategy runs it."""
    module = LLMModule(replace(cfg, n_layers=n_layers, activation_checkpointing=mode))
    module.configure_model()  # applies the checkpointing mode to the blocks, as parallelize does
    module.model.to(dtype).train()
    batch = torch.randint(0, cfg.vocab_size, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
    module.loss(batch).backward()  # a first step allocates what every later one reuses (kernels' caches)
    return kept_forward_bytes(lambda: module.loss(batch))


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_planned_activations_match_what_the_model_keeps(shape, dtype):
    cfg, seq = SHAPES[shape]
    w, tokens = dtype.itemsize, BATCH * seq
    for mode in ("none", "selective", "full"):
        one, two = kept(cfg, 1, mode, dtype, seq), kept(cfg, 2, mode, dtype, seq)
        block = block_activation_bytes(cfg, tokens, mode=mode, element_bytes=w)
        whole = 2 * block + head_activation_bytes(cfg, tokens, element_bytes=w)
        assert abs((two - one) / block - 1) < 0.10, (mode, two - one, block)
        assert abs(two / whole - 1) < 0.10, (mode, two, whole)
