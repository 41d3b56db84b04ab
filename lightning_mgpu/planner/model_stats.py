"""Parameter counts per rank and FLOPs per token of a Llama under a layout, from its shape alone."""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.models.llama_plan import balanced_boundaries


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_parameters(cfg: LlamaConfig, tp: int) -> int:
    """Parameters of one transformer block on one tensor-parallel rank (norms are replicated)."""
    hd = cfg.head_dim
    attention = cfg.dim * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) // tp
    mlp = 3 * cfg.dim * cfg.ffn_hidden // tp
    return attention + mlp + 2 * cfg.dim


def rank_parameters(cfg: LlamaConfig, tp: int = 1, pp: int = 1, stages_per_rank: int = 1,
                    pp_rank: int = 0, stage_ids: Optional[Sequence[int]] = None,
                    boundaries: Optional[Sequence[int]] = None) -> int:
    """Parameters held by pipeline rank ``pp_rank`` on one tensor-parallel rank: its stages are ``stage_ids`` (default:
    looped placement ``r, r+P, ...``) of ``pp * stages_per_rank``, split at ``boundaries`` (default: balanced)."""
    stages = pp * stages_per_rank
    bounds = list(boundaries) if boundaries is not None else balanced_boundaries(cfg.n_layers, stages)
    ids = list(stage_ids) if stage_ids is not None else [pp_rank + k * pp for k in range(stages_per_rank)]
    vocab_rows = _padded(cfg.vocab_size, tp) // tp
    total = 0
    for s in ids:
        total += (bounds[s + 1] - bounds[s]) * block_parameters(cfg, tp)
        if s == 0:
            total += vocab_rows * cfg.dim
        if s == stages - 1:
            total += cfg.dim + (0 if cfg.tie_embeddings and stages == 1 else vocab_rows * cfg.dim)
    return total


def max_rank_parameters(cfg: LlamaConfig, tp: int, pp: int, stages_per_rank: int = 1) -> int:
    """The most parameters any rank holds (memory is sized by the fullest rank)."""
    return max(rank_parameters(cfg, tp, pp, stages_per_rank, r) for r in range(pp))


def recompute_flops_per_token(cfg: LlamaConfig, seq_len: int, mode: str) -> float:
    """FLOPs per token that activation checkpointing adds in backward by running forward parts of the blocks again:
    ``selective`` keeps the projections' outputs and recomputes attention, whose scores' forward is ``2 L s h`` for a
    causal kernel (``4 L s h`` for one that computes the masked half too, as torch's math kernel does); ``full``
    recomputes each block's forward, ``2 x`` its matmul weights plus the same scores, except the MLP's down
    projection: torch's non-reentrant checkpoint stops recomputing once it has every tensor backward needs, and the
    block's last matmul produces none (measured). ``none`` adds nothing. The element-wise work recomputed with them is
    not counted (it is memory-bound, not FLOPs)."""
    scores = 2.0 * cfg.n_layers * seq_len * cfg.dim
    if mode == "selective":
        return scores
    if mode == "full":
        kv = cfg.n_kv_heads * cfg.head_dim
        recomputed_weights = cfg.dim * (2 * cfg.dim + 2 * kv) + 2 * cfg.dim * cfg.ffn_hidden  # all but w2
        return 2.0 * cfg.n_layers * recomputed_weights + scores
    return 0.0


def model_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recomputation): ``6 N`` for the matmul weights plus
    ``6 * n_layers * seq_len * dim`` for causal attention scores (half of the full ``12 L s h``)."""
    n_matmul = cfg.num_parameters() - cfg.dim * (2 * cfg.n_layers + 1)  # norm weights do no matmul
    if not cfg.tie_embeddings:
        n_matmul -= cfg.vocab_size * cfg.dim  # the embedding is a lookup, not a matmul
    return 6.0 * n_matmul + 6.0 * cfg.n_layers * seq_len * cfg.dim
