"""Context parallelism: each sequence of a micro-batch is split over the ``C`` ranks of a context-parallel group.

**Chunks.** A sequence of ``S`` tokens is cut into ``2C`` equal chunks and context rank ``r`` holds chunks ``r`` and
``2C - 1 - r`` (an early and a late one). Under a causal mask a query chunk ``g`` attends to ``g + 1`` key chunks, so
rank ``r`` does ``(r + 1) + (2C - r) = 2C + 1`` chunk-pairs of work whatever ``r`` is: no rank idles on masked blocks.
With ``balanced=False`` (kept for the benchmark) rank ``r`` holds the single contiguous chunk ``r`` of ``C`` and does
``r + 1`` chunk-pairs of work: the last rank does ``C`` times the first one's.

**Keys and values are all-gathered**, not passed around a ring. Both move the same bytes per rank, ``(C - 1) / C`` of
the sequence's keys and values, and under grouped-query attention those are small next to the queries
(``2 kv_heads / heads`` of their size: 1/2 for Llama-3 8B, 1/4 for 70B). The gather is one collective per layer, runs
on every backend (gloo included) and with every attention kernel, because it needs nothing from the kernel: a ring
merges partial results by their log-sum-exp, which CPU ``scaled_dot_product_attention`` does not return (PyTorch's
experimental context-parallel API needs CUDA kernels for the same reason). What the ring would add is overlap of the
transfer with compute and holding two key/value blocks at a time instead of the whole sequence's; that matters at
large ``C`` or with full multi-head attention, and is not done here. The backward of the gather is a reduce-scatter: each rank gets the sum, over all query chunks, of the
gradients of its own keys and values.

This module is written by hand because it must run over this project's process groups on CPU/gloo as well as
CUDA/NCCL, inside DeepSpeed engines and ``torch.distributed.pipelining`` stages, which hold plain tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from lightning_mgpu.split_rules import sequence_problems
from lightning_mgpu.models.llama import apply_rope, expand_kv
from lightning_mgpu.parallel.regions import GatherSequence


def chunk_ids(rank: int, size: int, balanced: bool = True) -> list[int]:
    """The chunks context rank ``rank`` of ``size`` holds, in the order it holds them (see the module docstring)."""
    return [rank, 2 * size - 1 - rank] if balanced and size > 1 else [rank]


def _chunks(size: int, balanced: bool) -> int:
    return 2 * size if balanced and size > 1 else size


def chunk_positions(seq_len: int, rank: int, size: int, balanced: bool = True,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Positions in the whole sequence of the ``seq_len / size`` tokens context rank ``rank`` holds, in order."""
    n = _chunks(size, balanced)
    if seq_len % n:
        problems = sequence_problems(seq_len, size, key="sequence length") if balanced else \
            [f"sequence length {seq_len} does not split into {n} equal contiguous chunks; use a multiple of {n}"]
        raise ValueError("; ".join(problems))
    length = seq_len // n
    return torch.cat([torch.arange(g * length, (g + 1) * length, device=device) for g in chunk_ids(rank, size,
                                                                                                   balanced)])


def shard_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """This context rank's tokens of ``x`` (whole sequences along ``dim``), in :func:`chunk_positions` order."""
    if size == 1:
        return x
    return x.index_select(dim, chunk_positions(x.shape[dim], rank, size, balanced, device=x.device))


class ContextParallelAttention:
    """An attention kernel (``lightning_mgpu.models.llama.AttentionKernel``) for a sequence split over a context
    group: rotary embeddings at the tokens' positions in the whole sequence, keys and values all-gathered from the
    group, and causal attention of each local query chunk over the key chunks up to its own."""

    def __init__(self, group: Any, rank: int, size: int, balanced: bool = True) -> None:
        self.group, self.rank, self.size, self.balanced = group, rank, size, balanced
        self._cache: dict = {}

    def _layout(self, local_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(this rank's positions, the index putting the gathered sequence in order, per local chunk: its slice of the
        local queries and how many keys it sees), cached per local length and device."""
        key = (local_len, device)
        if key not in self._cache:
            C, seq = self.size, local_len * self.size
            positions = chunk_positions(seq, self.rank, C, self.balanced, device=device)
            per_rank = len(chunk_ids(0, C, self.balanced))
            length = local_len // per_rank
            where = {g: (r * per_rank + i) * length for r in range(C)
                     for i, g in enumerate(chunk_ids(r, C, self.balanced))}
            order = torch.cat([torch.arange(where[g], where[g] + length, device=device)
                               for g in range(_chunks(C, self.balanced))])
            queries = []
            for i, g in enumerate(chunk_ids(self.rank, C, self.balanced)):
                keys = (g + 1) * length
                queries.append((slice(i * length, (i + 1) * length), keys))
            self._cache[key] = (positions, order, queries)
        return self._cache[key]

    def _bias(self, length: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive mask of a query chunk over its keys, ``[1, 1, length, keys]`` in the activations' dtype: causal,
        aligned to the last key (query ``j`` sees keys up to ``keys - length + j``). Built once and shared by every
        block: a boolean mask would be converted into a new bias, saved for backward, in each block."""
        key = ("bias", length, keys, dtype, device)
        if key not in self._cache:
            allowed = torch.arange(keys, device=device) <= torch.arange(keys - length, keys, device=device)[:, None]
            bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            self._cache[key] = bias[None, None]  # 4-d: the kernel saves it without a copy
        return self._cache[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a query chunk over keys that end where it ends (``k`` may be longer than ``q``).

        On CUDA, torch's ``causal_lower_right`` mask, which its fused kernels apply without building the
        ``length x keys`` mask (for 131,072 tokens over 4 ranks that mask would be 4 GB per chunk); the key/value heads
        are expanded to the query heads first, the form every one of those kernels takes. Elsewhere a shared additive
        mask, with ``enable_gqa`` so that what is saved for backward is the gathered key/value heads, not a copy
        expanded to every query head (identical results, checked on CPU)."""
        length, keys = q.shape[2], k.shape[2]
        if length == keys:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        if q.device.type == "cuda":
            k, v = expand_kv(k, v, q.shape[1])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(length, keys))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._bias(length, keys, q.dtype, q.device),
                                              enable_gqa=k.shape[1] != q.shape[1])

    def document_inputs(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, bias) of packed documents for this rank's tokens, as ``lightning_mgpu.models.llama.
        document_inputs`` makes them for a whole sequence: ``positions`` ``[b, s/C]`` are each local token's position
        in its document (computed from the whole sequence, then split like the tokens), the rotary tables are gathered
        at them, and the bias ``[b, 1, s/C, s]`` lets the query at sequence index ``g`` see the keys of the whole
        sequence from its document's start ``g - position`` up to ``g``."""
        where = self._layout(positions.shape[1], positions.device)[0]  # each local token's index in the sequence
        keys = torch.arange(positions.shape[1] * self.size, device=positions.device)
        first = (where - positions).unsqueeze(-1)  # [b, s/C, 1]
        allowed = (keys <= where.unsqueeze(-1)) & (keys >= first)  # [b, s/C, s]
        bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, float("-inf"))
        rows = positions.clamp(0, cos.shape[0] - 1)
        return cos[rows].unsqueeze(1), sin[rows].unsqueeze(1), bias.unsqueeze(1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if bias is not None:  # documents: cos, sin and bias from document_inputs; every query over every key
            k_all, v_all = self.gather_keys_values(apply_rope(k, cos, sin), v)
            return F.scaled_dot_product_attention(apply_rope(q, cos, sin), k_all, v_all, attn_mask=bias.to(q.dtype),
                                                  enable_gqa=k.shape[1] != q.shape[1])
        positions = self._layout(q.shape[2], q.device)[0]
        cos, sin = cos[positions], sin[positions]
        return self.attend_local(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)

    def attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: Optional[float] = None) -> torch.Tensor:
        """Causal attention of this rank's queries ``[b, heads, s/C, d]`` (rotary embeddings already at their positions
        in the whole sequence, :func:`chunk_positions`) over the whole sequence's keys and values, gathered here.
        ``scale`` is the softmax scale (default ``1 / sqrt(d)``)."""
        if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            q = q * (scale * q.shape[-1] ** 0.5)  # the kernels' default scale, times the asked-for one
        queries = self._layout(q.shape[2], q.device)[2]
        k_all, v_all = self.gather_keys_values(k, v)
        out = [self.attend(q[:, :, rows], k_all[:, :, :keys], v_all[:, :, :keys]) for rows, keys in queries]
        return torch.cat(out, dim=2)

    def gather_keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sequence's keys and values ``[b, kv_heads, s, d]``, in order, from this rank's ``[b, kv_heads,
        s/C, d]``: one all-gather for both (its backward a reduce-scatter)."""
        order = self._layout(k.shape[2], k.device)[1]
        kv = torch.cat([k, v], dim=-1).transpose(1, 2)  # [b, s/C, kv_heads, 2 head_dim]: one gather for both
        whole = GatherSequence.apply(kv, self.group).index_select(1, order).transpose(1, 2)
        return whole.split(k.shape[-1], dim=-1)


def apply_context_parallel(module: nn.Module, group: Any, rank: int, size: int, balanced: bool = True) -> int:
    """Give every attention of ``module`` that exposes a replaceable ``kernel`` the context-parallel kernel (one
    instance for all of them, so they share its masks and index tables); return how many were changed (0 means the
    module cannot be context-parallel)."""
    kernel, changed = ContextParallelAttention(group, rank, size, balanced), 0
    for m in module.modules():
        if callable(getattr(m, "kernel", None)) and not isinstance(m.kernel, ContextParallelAttention):
            m.kernel = kernel
            changed += 1
    return changed
