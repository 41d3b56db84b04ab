"""Memory per GPU of a layout: model states as DeepSpeed allocates them, activations as this Llama keeps them.

Model states, per parameter held by the rank (``w`` = 2 bytes in bf16-mixed, 4 in fp32; ``N`` = data-parallel
size), measured on this project's engine (tests/distributed/test_planner_memory.py checks them to 5%):

========  ==========  ===========  =========================  ==========  =========================
ZeRO      parameters  gradients    fp32 master                Adam        buffers
========  ==========  ===========  =========================  ==========  =========================
0         w           w            4 (bf16), none (fp32)      8           none
1         w           w (pp: w/N)  4 / N                      8 / N       one bucket of w elements (pp: none)
2         w           w / N        4 / N                      8 / N       none
3         w / N       w / N        4 / N                      8 / N       one bucket of w-byte elements
========  ==========  ===========  =========================  ==========  =========================

DeepSpeed keeps a separate fp32 master partition even in fp32 training (measured with DeepSpeed 0.19.8: ZeRO-3 fp32
is 20 bytes per parameter over N, not 12), hence the 4 / N.

Activations are this Llama's, derived tensor by tensor for the run's precision, tensor and sequence parallelism and
activation-checkpointing mode (:func:`block_activation_bytes`, :func:`head_activation_bytes`); they match what the
model keeps for backward to 1% (tests/unit/test_activation_formulas.py, tests/distributed/test_activation_memory.py).
Grouped-query attention does not shrink them: the keys and values are expanded to every query head before attention,
which keeps the expanded copies. With pipeline parallelism the first stage holds ``P`` micro-batches in flight under
1F1B (``P (1 + (P - 1) / (P V))`` with ``V`` interleaved stages per rank); with recomputation one block's full
activations exist again while it is recomputed.

Packed documents (``LlamaConfig.eod_token_id``) add, per micro-batch and stage chunk in flight (not per block), the
``[b, 1, s, s]`` attention bias in the activations' dtype and the per-token rotary tables (cos and sin, fp32,
``4 b s d_head`` bytes): every block of a chunk shares them, and ``scaled_dot_product_attention`` saves a bias of the
query's dtype as it is. Measured with saved-tensor hooks on this Llama (fp32, CPU, torch 2.13): masked minus
unmasked saved bytes are exactly ``4 b s^2 + 4 b s d_head`` at 2 and 4 blocks alike
(tests/unit/test_packed_documents.py). Neither is split by tensor or sequence parallelism: attention sees whole
sequences.

Context parallelism over ``C`` ranks (``context``) gives each rank ``s / C`` tokens of every sequence: the per-block
terms and the logits above are taken at ``s / C``. Each block also keeps the keys and values of the rest of the
sequence gathered from the other ranks, ``2 (s - s / C) b (heads x head dim) / t`` elements: expanded to every query
head, as the CUDA kernel keeps them (on CPU the kernel keeps the key/value heads only, which this over-counts). Model
states partition over the ``dp x C`` ranks that hold the same weights.

A mixture of experts (:mod:`lightning_mgpu.planner.experts`): each rank holds ``E / Ep`` routed experts per layer,
their hidden width split over tp; ZeRO partitions their states over the ``dp x C / Ep`` ranks holding the same experts
(:func:`rank_model_state_bytes`), the rest over ``dp x C``. A mixture-of-experts layer keeps its router's, its
assignments' and its experts' tensors in place of the dense MLP's (:func:`layer_activation_bytes`, equal to what the
layer keeps at ``tp = Ep = 1``), the received ones at :data:`~lightning_mgpu.planner.experts.IMBALANCE` times the mean
under expert parallelism.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

from typing import Callable, Optional, Sequence

from lightning_mgpu.buckets import bucket_elements_for
from lightning_mgpu.layout import stage_ids
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.models.llama_plan import balanced_boundaries
from lightning_mgpu.planner.experts import moe_mlp_activation_bytes
from lightning_mgpu.planner.model_stats import RankParameters, rank_parameter_split


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def model_state_bytes(n_params: int, zero_stage: int, dp: int, precision: str = "bf16-mixed",
                      pipelined: bool = False, overlap: bool = False, muon: int = 0) -> dict[str, float]:
    """Parameters, gradients, optimizer state and buffers (bytes) for ``n_params`` parameters held by one rank.

    ``overlap`` (the engine's default on CUDA, ZeRO 2 and 3 only: ``lightning_mgpu.engine.zero_config``) adds the second
    reduce bucket DeepSpeed allocates to reduce one bucket while the next fills (measured on CPU at ZeRO-2, dp 2:
    0.52 -> 1.05 MB of buckets).

    With pipeline parallelism ZeRO-1 holds what ZeRO-2 holds (measured): the schedule runs inside
    DeepSpeed's coalesced reduction, which reduces every gradient into its partition, frees the rest and keeps
    no bucket.

    ``muon`` of the parameters are Muon's: one fp32 momentum (4 bytes) where Adam keeps two moments (8).
    """
    w = 4 if precision == "32-true" else 2
    partitioned_grads = zero_stage >= 2 or (pipelined and zero_stage == 1)
    master = (0 if w == 4 else 4) if zero_stage == 0 else 4 / dp
    partition = 1 if zero_stage == 0 else dp
    bucket = bucket_elements_for(n_params) * w
    return {
        "parameters": n_params * (w / dp if zero_stage == 3 else w),
        "gradients": n_params * (w / dp if partitioned_grads else w),
        "optimizer": n_params * master + ((n_params - muon) * 8 + muon * 4) / partition,
        "buffers": float(bucket if zero_stage == 3 or (zero_stage == 1 and not pipelined) else 0)
                   + float(bucket if overlap and zero_stage >= 2 else 0),
    }


#: What ``torch.utils.checkpoint`` keeps per checkpointed call besides tensors: the CPU random generator's state
#: (5,056 bytes, measured; on CUDA also the device generator's), to replay dropout identically.
CHECKPOINT_STATE_BYTES = 5056


def _norm_bytes(h: int, w: int, t: int, sequence_parallel: bool) -> float:
    """Per token, what an ``RMSNorm`` whose output feeds projections keeps: its input in fp32 (``x.float()``, the input
    itself in fp32), the normalised value and the output in the activations' dtype, and the fp32 ``rsqrt``. Under
    sequence parallelism the input and ``rsqrt`` are on the rank's sequence shard, and the normalised value is
    all-gathered before the weight multiplies it (``lightning_mgpu.parallel.regions.ScaledGather``), so it and the
    output are kept whole."""
    if sequence_parallel:
        return (4 * h + 4) / t + 2 * w * h
    return 4 * h + 2 * w * h + 4


def block_activation_bytes(cfg: LlamaConfig, tokens: float, tp: int = 1, sequence_parallel: bool = False,
                           mode: str = "none", element_bytes: int = 2) -> float:
    """Bytes one :class:`~lightning_mgpu.models.llama.Block` keeps for backward on one rank for ``tokens`` tokens
    (sequence x micro-batch), activations of ``element_bytes`` (2: bf16, 4: fp32).

    Derived from what this Llama's forward saves, tensor by tensor (and checked against measurement within 10%,
    ``tests/distributed/test_activation_memory.py``). Per token, with ``h`` = dim, ``f`` = ffn_hidden, ``w`` =
    element bytes, ``t`` = tensor-parallel size:

    * ``none``: two norms (:func:`_norm_bytes`); attention keeps the rotated queries, the keys and values expanded to
      every query head (grouped-query attention does not shrink them here), the kernel's output and the contiguous
      copy the output projection reads, ``5 w h / t``, and its fp32 log-sum-exp, ``4 n_heads / t``; SwiGLU keeps
      ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product, ``4 w f / t``. The projections' inputs are the norms'
      outputs (counted there) and the rotary tables are buffers.
    * ``selective``: the block's input (``w h``, a sequence shard under sequence parallelism) and the outputs of its
      seven projections: ``w (h + 2 kv + 2 f) / t`` for the column-parallel ones (``kv`` = n_kv_heads x head_dim) and
      ``2 w h`` for the two row-parallel ones, whose output is the whole partial sum before its reduction.
    * ``full``: the block's input only.

    Checkpointed modes also keep :data:`CHECKPOINT_STATE_BYTES` per block.
    """
    h, w, t = cfg.dim, element_bytes, tp
    q = cfg.n_heads * cfg.head_dim  # the attention's width: dim, unless head_dim is set apart (Qwen3)
    shard = t if sequence_parallel else 1
    mlp = _dense_mlp_bytes(cfg, tokens, tp, mode, w)
    if mode == "full":
        return tokens * w * h / shard + CHECKPOINT_STATE_BYTES
    if mode == "selective":
        kv = cfg.n_kv_heads * cfg.head_dim
        return tokens * (w * h / shard + w * (q + 2 * kv) / t + w * h) + mlp + CHECKPOINT_STATE_BYTES
    return tokens * (2 * _norm_bytes(h, w, t, sequence_parallel) + (5 * w * q + 4 * cfg.n_heads) / t) + mlp


def _dense_mlp_bytes(cfg: LlamaConfig, tokens: float, tp: int, mode: str, w: int) -> float:
    """The SwiGLU MLP's share of :func:`block_activation_bytes` (what a mixture-of-experts layer has instead)."""
    if mode == "none":
        return tokens * 4 * w * cfg.ffn_hidden / tp
    if mode == "selective":
        return tokens * (2 * w * cfg.ffn_hidden / tp + w * cfg.dim)
    return 0.0


def layer_activation_bytes(cfg: LlamaConfig, index: int, tokens: float, tp: int = 1, sequence_parallel: bool = False,
                           mode: str = "none", element_bytes: int = 2, ep: int = 1) -> float:
    """What block ``index`` keeps for backward on one rank: :func:`block_bytes_for`'s figure, and in a
    mixture-of-experts layer of this Llama its experts'
    (:func:`~lightning_mgpu.planner.experts.moe_mlp_activation_bytes`) in place of the dense MLP's."""
    base = block_bytes_for(cfg)(tokens, tp, sequence_parallel, mode, element_bytes)
    if not cfg.is_moe_layer(index) or callable(getattr(cfg, "block_activation_bytes", None)):
        return base
    return (base - _dense_mlp_bytes(cfg, tokens, tp, mode, element_bytes)
            + moe_mlp_activation_bytes(cfg, tokens, tp, mode, element_bytes, ep))


#: ``(tokens, tp, sequence_parallel, mode, element_bytes) -> bytes``: what one block keeps for backward on one rank.
BlockBytes = Callable[[float, int, bool, str, int], float]


def block_bytes_for(cfg: LlamaConfig) -> BlockBytes:
    """The per-block activation figure the planner uses for ``cfg``: the model's own, when its config defines
    ``block_activation_bytes(tokens, tp, sequence_parallel, mode, element_bytes)`` (a custom model described by a
    ``LlamaConfig`` subclass for its sizes, with numbers measured for its own block, e.g. by
    :func:`lightning_mgpu.measure.block_bytes_per_token`), else :func:`block_activation_bytes`, derived for
    this Llama's block."""
    own = getattr(cfg, "block_activation_bytes", None)
    if callable(own):
        return own
    return lambda tokens, tp, sp, mode, w: block_activation_bytes(cfg, tokens, tp, sp, mode, w)


def head_activation_bytes(cfg: LlamaConfig, tokens: float, tp: int = 1, sequence_parallel: bool = False,
                          element_bytes: int = 2) -> float:
    """Bytes kept outside the blocks, on the ranks that hold them: the token ids the embedding reads (int64), the
    final norm, and the loss over the vocabulary: fp32 log-probabilities (``F.cross_entropy`` of the fp32 logits)
    and the targets, or under tensor parallelism the vocabulary shard's fp32 exponentials, the targets and two
    boolean masks (``lightning_mgpu.parallel.cross_entropy``)."""
    ids = 8.0 if tp == 1 else 8.0 + 1.0  # the embedding's ids (and, split by vocabulary, its out-of-shard mask)
    loss = 4 * cfg.vocab_size + 8 if tp == 1 else 4 * cfg.vocab_size / tp + 8 + 2
    return tokens * (ids + _norm_bytes(cfg.dim, element_bytes, tp, sequence_parallel) + loss)


def activation_bytes(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, virtual: int,
                     sequence_parallel: bool, recompute: bool, context: int = 1, precision: str = "bf16-mixed",
                     mode: str | None = None, pp_rank: Optional[int] = None, schedule: str = "1f1b",
                     boundaries: Optional[Sequence[int]] = None, microbatches: Optional[int] = None,
                     ep: int = 1) -> float:
    """Activation memory of pipeline rank ``pp_rank``: its blocks (stage ``boundaries``, default balanced) times the
    micro-batches it holds in flight, and the head's logits and loss if it holds the last stage. Without ``pp_rank``,
    an upper bound for any rank: the first rank's in-flight micro-batches over ``ceil(n_layers / pp)`` of the largest
    blocks, and the head. ``mode`` (``none``, ``selective``, ``full``) overrides ``recompute`` (``full`` when true);
    ``ep``: expert-parallel ranks (a mixture-of-experts layer's received tokens, :func:`layer_activation_bytes`).

    In flight: :func:`in_flight_chunks` stage chunks' activations, each ``1 / V`` of the rank's blocks;
    ``microbatches`` (per step and replica) caps them (default: enough to fill the pipeline)."""
    return _activation_bytes(cfg, seq_len, micro_batch, tp, pp, virtual, sequence_parallel, recompute, context,
                             precision, mode, pp_rank, schedule, None if boundaries is None else tuple(boundaries),
                             microbatches, ep)


@functools.lru_cache(maxsize=1 << 16)
def _activation_bytes(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, virtual: int,
                      sequence_parallel: bool, recompute: bool, context: int, precision: str, mode: str | None,
                      pp_rank: Optional[int], schedule: str, boundaries: Optional[tuple[int, ...]],
                      microbatches: Optional[int], ep: int) -> float:
    """:func:`activation_bytes`, remembered: the planner's search asks it again for every layout that differs only in
    the ZeRO stage or the data-parallel size (102,508 times for the 405B recipe's 7,489 layouts)."""
    mode = mode or ("full" if recompute else "none")
    w = 4 if precision == "32-true" else 2
    s, b = seq_len / context, micro_batch
    tokens = s * b
    # context parallelism: the rest of the sequence's keys and values, gathered, as the CUDA kernel keeps them
    # (expanded to every query head: lightning_mgpu.parallel.context.ContextParallelAttention.attend; the CPU kernel
    # keeps the key/value heads only, so this is an upper bound there). Kept per block, or with recomputation
    # recomputed with the block.
    gathered = w * 2 * (seq_len - s) * b * cfg.n_heads * cfg.head_dim / tp
    kinds = [i for i in (0, cfg.dense_layers) if i < cfg.n_layers]  # a dense block's index and a MoE block's
    kept_by = {cfg.is_moe_layer(i): layer_activation_bytes(cfg, i, tokens, tp, sequence_parallel, mode, w, ep)
               + (gathered if mode == "none" else 0.0) for i in kinds}
    # one block's full activations while it is recomputed in backward
    working = max(layer_activation_bytes(cfg, i, tokens, tp, sequence_parallel, "none", w, ep) for i in kinds) \
        + gathered if mode != "none" else 0.0
    outside = head_activation_bytes(cfg, tokens, tp, sequence_parallel, w)
    if virtual > 1 and schedule in ("gpipe", "1f1b"):  # several chunks per rank: the default's interleaved form
        schedule = "interleaved_1f1b"
    if pp == 1:
        kept, in_flight = sum(kept_by[cfg.is_moe_layer(i)] for i in range(cfg.n_layers)), 1.0
    elif pp_rank is None:  # the first rank holds the most in flight under every schedule measured
        kept = -(-cfg.n_layers // pp) * max(kept_by.values())
        in_flight = in_flight_chunks(schedule, pp, virtual, 0, microbatches) / virtual
    else:
        ids = stage_ids(pp, virtual, schedule, pp_rank)
        stages = pp * len(ids)
        bounds = list(boundaries) if boundaries is not None else balanced_boundaries(cfg.n_layers, stages)
        kept = sum(kept_by[cfg.is_moe_layer(j)] for i in ids for j in range(bounds[i], bounds[i + 1]))
        in_flight = in_flight_chunks(schedule, pp, len(ids), pp_rank, microbatches) / len(ids)
        outside = outside if stages - 1 in ids else 0.0
    # in_flight counts whole ranks' activations; a rank holds `virtual` chunks, each with its own document bias (under
    # context parallelism its s/C queries' rows over the whole sequence's keys, and their s/C rotary rows)
    documents = document_mask_bytes(cfg, seq_len, b) / context * in_flight * virtual
    return kept * in_flight + working + outside + documents


def in_flight_chunks(schedule: str, pp: int, virtual: int, pp_rank: int, microbatches: Optional[int] = None) -> int:
    """The most stage chunks' activations pipeline rank ``pp_rank`` holds at once during a step of ``schedule`` (``P``
    ranks, ``V`` chunks each, ``M`` micro-batches; ``M`` unknown: enough to fill the pipeline, ``2 P``).

    Measured from the actions torch's schedules ran (``lightning_mgpu.parallel.timeline.chunks_in_flight``; P = 4,
    M = 4, 8, 16: ``benchmarks/pipeline_in_flight.py``; 1F1B and interleaved 1F1B are asserted by
    ``tests/distributed/test_pipeline_parallel.py::test_pp4_matches_single_process``): GPipe holds all ``M``, looped
    BFS all ``M V``; 1F1B ``min(M, P - r)``; interleaved 1F1B ``min(M V, 2 (P - r - 1) + (V - 1) P + 1)``, all exact.
    The zero-bubble schedules held 5-9 chunks (interleaved zero bubble and ZBV at most ``2 P``, DualPipeV ``2 P + 1``,
    varying with the rank and ``M``): their bound, ``min(M V, 2 P + 1)``, is counted for every rank."""
    M = microbatches if microbatches is not None else 2 * pp
    if schedule == "gpipe":
        return M
    if schedule == "looped_bfs":
        return M * virtual
    if schedule == "1f1b":
        return min(M, pp - pp_rank)
    if schedule == "interleaved_1f1b":
        return min(M * virtual, 2 * (pp - pp_rank - 1) + (virtual - 1) * pp + 1)
    return min(M * virtual, 2 * pp + 1)


def document_mask_bytes(cfg: LlamaConfig, seq_len: int, micro_batch: int, element_bytes: int = 2) -> float:
    """Bytes one stage chunk keeps for backward per micro-batch for packed documents: the ``[b, 1, s, s]`` attention
    bias of ``element_bytes`` per element (2: the bf16 activations the formulas above are written for) and the fp32
    per-token rotary tables; 0 without ``eod_token_id``."""
    if cfg.eod_token_id is None:
        return 0.0
    s, b = seq_len, micro_batch
    return element_bytes * b * s * s + 4 * b * s * cfg.head_dim


def rank_model_state_bytes(held: RankParameters, zero_stage: int, data_context: int, ep: int = 1,
                           precision: str = "bf16-mixed", pipelined: bool = False,
                           overlap: bool = False, optimizer: str = "adamw") -> dict[str, float]:
    """:func:`model_state_bytes` of a rank's parameters: the dense ones partitioned over the ``data_context`` ranks
    holding the same weights, the routed experts over the ``data_context / ep`` holding the same experts (the edp
    group); the buckets, one engine's, sized from all of them. ``optimizer="muon"``: the matrices keep one momentum."""
    if held.frozen or held.experts_frozen:
        return _adapter_run_state_bytes(held, zero_stage, data_context, ep, precision, pipelined, overlap)
    muon_dense, muon_experts = held.muon() if optimizer == "muon" else (0, 0)
    dense = model_state_bytes(held.dense, zero_stage, data_context, precision, pipelined, overlap, muon_dense)
    if not held.experts:
        return dense
    experts = model_state_bytes(held.experts, zero_stage, max(1, data_context // ep), precision, pipelined, overlap,
                                muon_experts)
    out = {key: dense[key] + experts[key] for key in dense}
    out["buffers"] = model_state_bytes(held.total, zero_stage, data_context, precision, pipelined, overlap)["buffers"]
    return out


def frozen_parameter_bytes(n_params: int, zero_stage: int, dp: int, precision: str = "bf16-mixed") -> float:
    """A frozen parameter's only cost: its storage, ``w`` bytes (``w / N`` under ZeRO-3, which partitions it with the
    rest). The engine gives the optimizer only what trains, so a frozen weight has no gradient, no fp32 master and no
    optimizer state (tests/distributed/test_adapters.py measures it)."""
    w = 4 if precision == "32-true" else 2
    return n_params * (w / dp if zero_stage == 3 else w)


def _adapter_run_state_bytes(held: RankParameters, zero_stage: int, data_context: int, ep: int, precision: str,
                             pipelined: bool, overlap: bool) -> dict[str, float]:
    """:func:`rank_model_state_bytes` of a rank whose base is frozen (``adapters=lora``): the trainable parameters
    (adapters, saved modules) cost everything :func:`model_state_bytes` counts, the frozen ones their storage alone;
    the buckets are sized from all the rank holds, as the engine sizes them (``lightning_mgpu.engine.config``). At
    ZeRO-3 the adapters below the persistence threshold are also held whole (measured: their partition and a whole
    copy, tests/distributed/test_adapter_memory.py)."""
    out = model_state_bytes(held.dense - held.frozen, zero_stage, data_context, precision, pipelined, overlap)
    out["parameters"] += frozen_parameter_bytes(held.frozen, zero_stage, data_context, precision)
    if zero_stage == 3:  # DeepSpeed keeps a parameter below its persistence threshold whole, beside its partition
        out["parameters"] += held.persistent * (4 if precision == "32-true" else 2)
    if held.experts:
        out["parameters"] += frozen_parameter_bytes(held.experts, zero_stage, max(1, data_context // ep), precision)
    out["buffers"] = model_state_bytes(held.total, zero_stage, data_context, precision, pipelined, overlap)["buffers"]
    return out


def stage_memory(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, dp: int, zero_stage: int,
                 virtual: int = 1, sequence_parallel: bool = False, recompute: bool = False,
                 precision: str = "bf16-mixed", overlap: bool = False, context: int = 1, mode: str | None = None,
                 schedule: str = "1f1b", boundaries: Optional[Sequence[int]] = None,
                 microbatches: Optional[int] = None, ep: int = 1, optimizer: str = "adamw") -> list[MemoryEstimate]:
    """Peak memory per GPU of each pipeline rank: its own parameters' model states and its activations
    (``microbatches``: per step and replica, see :func:`in_flight_chunks`; ``ep``: expert-parallel ranks)."""
    out = []
    for r in range(pp):
        ids = stage_ids(pp, virtual, schedule, r)
        held = rank_parameter_split(cfg, tp, pp, len(ids), r, stage_ids=ids, boundaries=boundaries, ep=ep)
        states = rank_model_state_bytes(held, zero_stage, dp * context, ep, precision, pp > 1, overlap, optimizer)
        acts = activation_bytes(cfg, seq_len, micro_batch, tp, pp, len(ids), sequence_parallel, recompute, context,
                                precision, mode, pp_rank=r, schedule=schedule, boundaries=boundaries,
                                microbatches=microbatches, ep=ep)
        out.append(MemoryEstimate(activations=acts, **states))
    return out


def estimate_memory(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, dp: int, zero_stage: int,
                    virtual: int = 1, sequence_parallel: bool = False, recompute: bool = False,
                    precision: str = "bf16-mixed", overlap: bool = False, context: int = 1,
                    mode: str | None = None, schedule: str = "1f1b",
                    boundaries: Optional[Sequence[int]] = None, microbatches: Optional[int] = None,
                    ep: int = 1, optimizer: str = "adamw") -> MemoryEstimate:
    """Peak memory per GPU of the most loaded pipeline rank (:func:`stage_memory`; ``overlap``: as the engine runs on
    CUDA, see :func:`model_state_bytes`; ``dp`` replicas of ``context`` ranks each, ``ep`` of which split the
    experts)."""
    stages = stage_memory(cfg, seq_len, micro_batch, tp, pp, dp, zero_stage, virtual, sequence_parallel, recompute,
                          precision, overlap, context, mode, schedule, boundaries, microbatches, ep, optimizer)
    return max(stages, key=lambda m: m.total)
