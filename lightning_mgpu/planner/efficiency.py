"""Seconds of a step's compute: the weight matmuls at a rate that grows with the tokens of a micro-batch, the attention
scores at a rate of their own.

A step's FLOPs are of two kinds that run at different fractions of a GPU's peak: the weight matmuls (large GEMMs,
cuBLAS) and the attention scores (``QK^T`` and ``PV`` inside a fused flash-attention kernel, whose softmax, masking
and tiling keep it further from the peak than a GEMM is). Counting both at one rate over-predicted long sequences,
where attention is a large share of the work: on published H100 runs at 32,768 tokens the one-rate planner was 60-70 %
fast. And a micro-batch of few tokens runs its matmuls slower than a large one: smaller GEMMs, and the per-layer work
that does not scale with tokens (kernel launches, sharded-weight gathers' hooks, norms) spread over fewer of them; on
published runs of one model, 2 x 2,048-token micro-batches reached 40 % of the peak where 40 x 1,024 reached 59 %
(hardware FLOPs). The matmuls' rate is ``achievable x m / (m + m0)`` for ``m`` tokens per micro-batch and rank
(``m0 = GPUSpec.saturation_tokens``): the form of a fixed cost per micro-batch beside work that grows with ``m``. The
fitting runs' micro-batches hold 4,096 to 65,536 tokens a rank; below that the form is extrapolated (at 128 tokens it
plans an eighth of the rate, where a GEMM held back by reading its weights would do better), so figures for
micro-batches of a few hundred tokens are the least trustworthy the planner prints.

No library gives these rates: FLOP counters (``torch.utils.flop_counter``, DeepSpeed's profiler) count operations, not
how fast each kind runs, so the split is a formula here and its constants are fitted to published runs
(:mod:`lightning_mgpu.planner.calibration`).
"""

from __future__ import annotations

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.hardware import GPUSpec
from lightning_mgpu.planner.model_stats import attended_keys


def attention_flops_per_token(cfg: LlamaConfig, seq_len: int, mode: str) -> float:
    """FLOPs per token of the causal attention scores: ``6 L s q`` for forward and backward (``q`` = heads x head
    width), ``2 L s q`` more when activation checkpointing (``selective`` or ``full``) runs the forward again; each
    layer over the keys it attends (a windowed layer's fewer: ``model_stats.attended_keys``). The same terms
    :func:`~lightning_mgpu.planner.model_stats.model_flops_per_token` and ``recompute_flops_per_token`` count."""
    per_key = 12.0 + (4.0 if mode in ("selective", "full") else 0.0)  # QK^T and PV: 4 q a key forward, 8 q backward
    return per_key * cfg.n_heads * cfg.head_dim * attended_keys(cfg, seq_len)


def compute_seconds(cfg: LlamaConfig, mode: str, flops: float, tokens: float, gpu: GPUSpec, achievable: float,
                    seq_len: int, micro_tokens: float) -> float:
    """Seconds of one rank's ``flops`` for ``tokens`` of sequences of ``seq_len``, in micro-batches of
    ``micro_tokens`` tokens on the rank: the attention scores' share at ``gpu.attention_achievable`` of the bf16 peak
    (the matmuls' fraction where a GPU has none), the rest at ``achievable`` scaled by the micro-batch's size."""
    attention = attention_flops_per_token(cfg, seq_len, mode) * tokens if gpu.attention_achievable else 0.0
    matmul_rate = achievable * micro_tokens / (micro_tokens + gpu.saturation_tokens)
    seconds = (flops - attention) / matmul_rate + attention / (gpu.attention_achievable or achievable)
    return seconds / gpu.bf16_peak_flops
