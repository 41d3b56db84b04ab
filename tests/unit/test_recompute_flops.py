"""The FLOPs activation checkpointing adds, measured: forward + backward of this Llama's blocks under each mode, counted
by torch's FLOP counter with the math attention kernel (whose score matmuls it counts; it computes the masked half
too), against the planner's ``recompute_flops_per_token``, which the step-time estimate adds for selective
recomputation."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.models.llama import Llama, run_layers
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.planner.model_stats import recompute_flops_per_token


@pytest.mark.parametrize("cfg", [
    LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=64, max_seq_len=128),
    LlamaConfig(dim=96, n_layers=3, n_heads=6, n_kv_heads=6, ffn_hidden=320, vocab_size=64, max_seq_len=128),
], ids=["gqa", "mha"])
def test_recomputation_adds_the_planned_flops(cfg):
    b, s = 2, 96

    def flops(mode: str) -> int:
        model = Llama(cfg, init_seed=0).train()
        checkpoint_blocks(model.layers, mode)
        x = torch.randn(b, s, cfg.dim, requires_grad=True)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            run_layers(model.layers, x, model.rope_cos, model.rope_sin).sum().backward()
        return counter.get_total_flops()

    none = flops("none")
    scores = 2.0 * cfg.n_layers * s * cfg.dim  # the causal count; the math kernel computes twice that
    for mode in ("selective", "full"):
        extra = (flops(mode) - none) / (b * s)
        assert extra == pytest.approx(recompute_flops_per_token(cfg, s, mode) + scores, rel=1e-6), mode
    assert recompute_flops_per_token(cfg, s, "none") == 0
