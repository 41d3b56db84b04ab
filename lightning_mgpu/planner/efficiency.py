"""Seconds of a step's compute, with the attention kernel at a rate of its own.

A step's FLOPs are of two kinds that run at different fractions of a GPU's peak: the weight matmuls (large GEMMs,
cuBLAS) and the attention scores (``QK^T`` and ``PV`` inside a fused flash-attention kernel, whose softmax, masking
and tiling keep it further from the peak on a Hopper GPU than a GEMM is). Counting both at one rate over-predicts long
sequences, where attention is a large share of the work: on published H100 runs at 32,768 tokens the one-rate planner
was 60-70 % fast. No library gives this split: FLOP counters (``torch.utils.flop_counter``, DeepSpeed's profiler) count
operations, not how fast each kind runs, so the split is a formula here and each rate is fitted to published runs
(:mod:`lightning_mgpu.planner.calibration`).
"""

from __future__ import annotations

from typing import Optional

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.hardware import GPUSpec


def attention_flops_per_token(cfg: LlamaConfig, seq_len: int, mode: str) -> float:
    """FLOPs per token of the causal attention scores: ``6 L s q`` for forward and backward (``q`` = heads x head
    width), ``2 L s q`` more when activation checkpointing (``selective`` or ``full``) runs the forward again. The same
    terms :func:`~lightning_mgpu.planner.model_stats.model_flops_per_token` and ``recompute_flops_per_token`` count."""
    q = cfg.n_heads * cfg.head_dim
    return (6.0 + (2.0 if mode in ("selective", "full") else 0.0)) * cfg.n_layers * seq_len * q


def compute_seconds(cfg: LlamaConfig, seq_len: int, mode: str, hardware_flops: float, tokens: int, world: int,
                    gpu: GPUSpec, achievable: float) -> float:
    """Seconds per step of ``hardware_flops`` spread over ``world`` GPUs: the attention scores' share at
    ``gpu.attention_achievable`` of the bf16 peak (the matmuls' fraction where a GPU has none), the rest at
    ``achievable``."""
    attention_rate: Optional[float] = gpu.attention_achievable
    attention = attention_flops_per_token(cfg, seq_len, mode) * tokens if attention_rate else 0.0
    matmul = hardware_flops - attention
    return (matmul / achievable + attention / (attention_rate or achievable)) / world / gpu.bf16_peak_flops
