"""Parameter counts per rank and FLOPs per token of a Llama under a layout, from its shape alone (a mixture of
experts' terms: :mod:`lightning_mgpu.planner.experts`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.models.llama_plan import balanced_boundaries
from lightning_mgpu.buckets import persistence_threshold
from lightning_mgpu.planner.adapters import (largest_parameter, layer_adapter_matrices, persistent_parameters,
                                             saved_module_parameters)
from lightning_mgpu.planner.experts import (moe_dense_parameters, moe_layer_count, moe_recomputed_weights,
                                            routed_parameters)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_parameters(cfg: LlamaConfig, tp: int) -> int:
    """Parameters of one dense transformer block on one tensor-parallel rank (norms are replicated)."""
    mlp = 3 * cfg.dim * cfg.ffn_hidden // tp
    return _attention_and_norms(cfg, tp) + mlp


def _attention_and_norms(cfg: LlamaConfig, tp: int) -> int:
    hd = cfg.head_dim
    qk_norms = 2 * hd if getattr(cfg, "qk_norm", False) else 0  # per-head query and key norms, replicated
    return cfg.dim * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) // tp + 2 * cfg.dim + qk_norms + \
        _layer_extra(cfg, tp)[0]


def _layer_extra(cfg: LlamaConfig, tp: int) -> tuple[int, int]:
    """(parameters, of them vectors) a ``transformers`` family's layer holds beyond Llama's on one tensor-parallel
    rank (``TransformersShape``: Gemma 2's four norms, Qwen2's q/k/v biases); none for the package's model."""
    extras = getattr(cfg, "layer_extras", None)
    if extras is None:
        return 0, 0
    return extras.whole + extras.split // tp, extras.whole_vectors + extras.split_vectors // tp


@dataclass(frozen=True)
class RankParameters:
    """Parameters one rank holds: the routed experts (ZeRO partitions them over the ranks holding the same experts)
    and the rest ("dense": partitioned over every data x context rank)."""

    dense: int
    experts: int = 0
    #: of ``dense``, the vectors and tables no matrix optimizer steps (embeddings, head, norms, routers): what stays
    #: on AdamW under Muon (``lightning_mgpu.optim.choice.muon_steps``)
    vectors_and_tables: int = 0
    #: of ``dense``, the frozen base's (``adapters=lora``): stored, never given a gradient, master or optimizer state
    frozen: int = 0
    #: whether the routed experts are frozen too (the base of an adapter run)
    experts_frozen: bool = False
    #: of the trainable ones, those ZeRO-3 keeps whole on every rank beside their partition (below the engine's
    #: persistence threshold: LoRA's adapters, mostly)
    persistent: int = 0

    def muon(self) -> tuple[int, int]:
        """(dense, expert) parameters Muon steps: every expert, the dense ones but the vectors and tables."""
        return self.dense - self.vectors_and_tables, self.experts

    @property
    def total(self) -> int:
        return self.dense + self.experts


def rank_parameter_split(cfg: LlamaConfig, tp: int = 1, pp: int = 1, stages_per_rank: int = 1, pp_rank: int = 0,
                         stage_ids: Optional[Sequence[int]] = None, boundaries: Optional[Sequence[int]] = None,
                         ep: int = 1) -> RankParameters:
    """Parameters held by pipeline rank ``pp_rank`` on one tensor-parallel rank (and one of ``ep`` expert-parallel
    ranks): its stages are ``stage_ids`` (default: looped placement ``r, r+P, ...``) of ``pp * stages_per_rank``,
    split at ``boundaries`` (default: balanced)."""
    return _rank_parameter_split(cfg, tp, pp, stages_per_rank, pp_rank, _frozen(stage_ids), _frozen(boundaries), ep)


def _frozen(values: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
    return None if values is None else tuple(values)


@functools.lru_cache(maxsize=1 << 16)
def _rank_parameter_split(cfg: LlamaConfig, tp: int, pp: int, stages_per_rank: int, pp_rank: int,
                          stage_ids: Optional[tuple[int, ...]], boundaries: Optional[tuple[int, ...]],
                          ep: int) -> RankParameters:
    """:func:`rank_parameter_split`, remembered: the planner's search asks it for the same split of every layout that
    differs only in batch, ZeRO stage or recomputation (205,000 times for the 405B recipe's 7,489 layouts)."""
    stages = pp * stages_per_rank
    bounds = list(boundaries) if boundaries is not None else balanced_boundaries(cfg.n_layers, stages)
    ids = list(stage_ids) if stage_ids is not None else [pp_rank + k * pp for k in range(stages_per_rank)]
    vocab_rows = _padded(cfg.vocab_size, tp) // tp
    dense = experts = vectors = 0
    norms = 2 * cfg.dim + (2 * cfg.head_dim if getattr(cfg, "qk_norm", False) else 0) + _layer_extra(cfg, tp)[1]
    built = getattr(cfg, "moe_layer", None)  # a transformers mixture of experts: its expert layer as built
    for s in ids:
        blocks = bounds[s + 1] - bounds[s]
        moe = moe_layer_count(cfg, range(bounds[s], bounds[s + 1]))
        dense += (blocks - moe) * block_parameters(cfg, tp)
        if built is None:
            dense += moe * (_attention_and_norms(cfg, tp) + moe_dense_parameters(cfg, tp))
            experts += moe * routed_parameters(cfg, tp, ep)
            vectors += blocks * norms + moe * cfg.dim * cfg.num_experts  # norms, router gates
        else:  # the routed experts split by expert parallelism, whole on every tensor-parallel rank
            routed = built.routed if ep > 1 else 0
            dense += moe * (built.whole - routed + built.split // tp)
            experts += moe * routed // ep
            vectors += (blocks - moe) * norms + moe * (built.whole_vectors + built.split_vectors // tp)
        if s == 0:
            dense += vocab_rows * cfg.dim
            vectors += vocab_rows * cfg.dim
        if s == stages - 1:
            head = cfg.dim + (0 if cfg.tie_embeddings and stages == 1 else vocab_rows * cfg.dim)
            dense, vectors = dense + head, vectors + head
    return _with_adapters(cfg, RankParameters(dense, experts, vectors), tp, bounds, ids, stages)


def _with_adapters(cfg: LlamaConfig, base: RankParameters, tp: int, bounds: list[int], ids: list[int],
                   stages: int) -> RankParameters:
    """``base`` frozen and the rank's LoRA adapters added, when the shape carries ``adapters`` (``adapters=lora``:
    :mod:`lightning_mgpu.planner.adapters`); ``base`` as it is otherwise."""
    lora = getattr(cfg, "adapters", None)
    if lora is None:
        return base
    first, last = 0 in ids, stages - 1 in ids
    layers = [j for s in ids for j in range(bounds[s], bounds[s + 1])]
    matrices = [m for j in layers for m in layer_adapter_matrices(cfg, lora, tp, cfg.is_moe_layer(j))]
    added = sum(matrices) + saved_module_parameters(cfg, lora, tp, first, last)
    persistent = persistent_parameters(matrices, persistence_threshold(largest_parameter(cfg, tp, first, last)))
    return RankParameters(base.dense + added, base.experts, base.vectors_and_tables, frozen=base.dense,
                          experts_frozen=True, persistent=persistent)


def rank_parameters(cfg: LlamaConfig, tp: int = 1, pp: int = 1, stages_per_rank: int = 1,
                    pp_rank: int = 0, stage_ids: Optional[Sequence[int]] = None,
                    boundaries: Optional[Sequence[int]] = None, ep: int = 1) -> int:
    """All parameters :func:`rank_parameter_split` counts for the rank."""
    return rank_parameter_split(cfg, tp, pp, stages_per_rank, pp_rank, stage_ids, boundaries, ep).total


def max_rank_split(cfg: LlamaConfig, tp: int, pp: int, stages_per_rank: int = 1, ep: int = 1) -> RankParameters:
    """The split of the rank holding the most parameters (memory is sized by the fullest rank)."""
    return max((rank_parameter_split(cfg, tp, pp, stages_per_rank, r, ep=ep) for r in range(pp)),
               key=lambda held: held.total)


def max_rank_parameters(cfg: LlamaConfig, tp: int, pp: int, stages_per_rank: int = 1, ep: int = 1) -> int:
    """The most parameters any rank holds."""
    return max_rank_split(cfg, tp, pp, stages_per_rank, ep).total


def recompute_flops_per_token(cfg: LlamaConfig, seq_len: int, mode: str) -> float:
    """FLOPs per token that activation checkpointing adds in backward by running forward parts of the blocks again:
    ``selective`` keeps the projections' outputs and recomputes attention, whose scores' forward is ``2 L s h`` for a
    causal kernel with no window (over :func:`attended_keys`; ``4 L s h`` for one that computes the masked half too, as
    torch's math kernel does); ``full`` recomputes each block's forward, ``2 x`` its matmul weights plus the same
    scores, except the MLP's down projection: torch's non-reentrant checkpoint stops recomputing once it has every
    tensor backward needs, and the block's last matmul produces none (measured). ``none`` adds nothing. The
    element-wise work recomputed with them is not counted (it is memory-bound, not FLOPs). A mixture-of-experts layer's
    experts run as grouped matmuls, which selective checkpointing does not keep: both modes run them again
    (:func:`~lightning_mgpu.planner.experts.moe_recomputed_weights`, derived, not measured)."""
    scores = 4.0 * cfg.n_heads * cfg.head_dim * attended_keys(cfg, seq_len)  # 2 L s q without a window
    moe = moe_layer_count(cfg, range(cfg.n_layers))
    experts = 2.0 * moe * moe_recomputed_weights(cfg, mode)  # grouped matmuls: recomputed in both modes
    if mode == "selective":
        return scores + experts
    if mode == "full":
        attention = attention_matrices(cfg)
        dense_mlp = 2 * cfg.dim * cfg.ffn_hidden  # all but w2
        return 2.0 * (cfg.n_layers * attention + (cfg.n_layers - moe) * dense_mlp) + experts + scores
    return 0.0


def attention_matrices(cfg: LlamaConfig) -> int:
    """One layer's attention weights that a token multiplies: ``dim (2 q + 2 kv)`` of a Llama layer, or those of a
    ``transformers`` layer as built (``layer_extras.attention``: latent attention's down and up projections)."""
    built = [getattr(cfg, "moe_layer", None), getattr(cfg, "layer_extras", None)]
    counted = next((extras.attention for extras in built if getattr(extras, "attention", 0)), 0)
    return counted or cfg.dim * (2 * cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim)


def skipped_weight_gradient_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """What an adapter run (``adapters=lora``) does not compute of :func:`model_flops_per_token`, per token: a frozen
    weight's gradient (``2`` FLOPs per weight a token runs through; its input's gradient is still computed, for what
    trains before it), less what the adapters add (``6`` per adapter element, as any trained weight). 0 without
    adapters. A trained copy of the head (``modules_to_save``) keeps its gradient."""
    lora = getattr(cfg, "adapters", None)
    if lora is None:
        return 0.0
    attention_scores = attention_score_flops_per_token(cfg, seq_len)
    frozen = (model_flops_per_token(cfg, seq_len) - attention_scores) / 6.0
    if "lm_head" in lora.modules_to_save and not cfg.tie_embeddings:
        frozen -= cfg.vocab_size * cfg.dim
    adapters = sum(sum(layer_adapter_matrices(cfg, lora, 1, cfg.is_moe_layer(j))) for j in range(cfg.n_layers))
    return 2.0 * frozen - 6.0 * adapters


def model_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token the model needs (forward + backward, no recomputation), the numerator of MFU:
    ``6 N`` for the matmul weights a token runs through (a mixture of experts: its active ones, the gate and ``k``
    routed experts, not all) plus the attention scores over the keys each layer attends
    (:func:`attention_score_flops_per_token`: ``6 * n_layers * seq_len * q`` without a window). A windowed layer's
    keys outside its window are masked work a kernel need not do, so MFU does not count them."""
    n_matmul = cfg.num_parameters(active=True) - cfg.dim * (2 * cfg.n_layers + 1)  # norm weights do no matmul
    if not cfg.tie_embeddings:
        n_matmul -= cfg.vocab_size * cfg.dim  # the embedding is a lookup, not a matmul
    return 6.0 * n_matmul + attention_score_flops_per_token(cfg, seq_len)


def attention_score_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of the attention scores and weighted values: ``QK^T`` and ``PV`` each
    ``2 q`` a key forward and ``4 q`` backward (``q`` = heads x head width, the dim unless ``head_dim`` is set apart),
    ``12 q`` a key over :func:`attended_keys`; ``6 L s q`` for causal attention with no window (half of the full
    ``12 L s q``)."""
    return 12.0 * cfg.n_heads * cfg.head_dim * attended_keys(cfg, seq_len)


def attended_keys(cfg: LlamaConfig, seq_len: int) -> float:
    """The keys a query attends, averaged over a sequence's positions and summed over the layers, in the causal count
    ``6 L s q`` states (``s / 2`` keys a query in a layer with no window: the triangle of the ``s x s`` square, whose
    diagonal it counts half). A query at position ``i`` of a layer with window ``w`` (``TransformersShape
    .attention_windows``: gpt-oss's alternate layers, Mistral's every layer) attends ``min(i + 1, w)`` keys; their
    mean over ``s`` positions is ``(w (w + 1) / 2 + (s - w) w) / s``, less the same half key of the diagonal: ``s / 2``
    again when ``w >= s``. A model without windows (the package's Llama): ``n_layers * s / 2``. Counted here because
    torch's FLOP counter counts an attention call by its shapes alone, the whole ``s x s`` square whatever the mask."""
    windows = getattr(cfg, "attention_windows", ()) or (0,) * cfg.n_layers
    return sum(_mean_keys(w, seq_len) for w in windows)


def _mean_keys(window: int, seq_len: int) -> float:
    if window <= 0 or window >= seq_len:
        return seq_len / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len - 0.5
