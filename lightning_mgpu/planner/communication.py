"""Bytes one rank's collectives carry in one optimizer step, by axis and operation: the planner's communication
volume, in the units :class:`~lightning_mgpu.parallel.comm_count.CommCounter` counts (an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input, an all-to-all's input, a send's tensor), so that the two can be
compared term by term. Written from the package's layers; ``tests/distributed/test_comm_volume.py`` holds them equal
to what a step issues. Per micro-batch, with ``n = b s / C`` tokens on the rank and ``A = n dim w`` activation bytes:

* **tp** (``T > 1``), per block: without sequence parallelism four all-reduces, two of ``A`` forward (the attention's
  and the MLP's row-parallel outputs) and two of ``A + dim w`` backward (the norms' input gradients, their weight
  gradients packed behind); under sequence parallelism the same as all-gathers (two forward, two backward) and
  reduce-scatters (two forward of ``A``, two backward of ``A + T dim w``). The first stage adds the embedding's
  reduction (forward; its adjoint backward under sequence parallelism), the last the final norm's and the loss's two
  all-reduces (the row maximum and the packed target logit and exponential sum, ``3 n`` fp32 values);
* **cp** (``C > 1``), per block: the keys and values all-gathered forward and reduce-scattered backward,
  ``2 b s kv_heads head_dim w / T`` each;
* **pp**: per micro-batch, each of the rank's stages sends its output forward unless it is the last and its input
  gradient backward unless it is the first; a neighbour on the same rank (ZBV's and DualPipeV's middle) takes it
  without a send. ``b s dim w / C`` bytes each (``/ T`` under sequence parallelism); receives mirror the sends;
* **dp_cp** (ZeRO over the ``dp x C`` ranks holding the same weights), ``P`` the rank's trainable parameter bytes:
  ZeRO-0 all-reduces ``P`` once a step; ZeRO-1 all-reduces ``P`` and all-gathers the updated ``P``; ZeRO-2 reduces
  every micro-batch's gradients (they are partitioned as they are made: ``M P``) unless a pipeline schedule runs
  under one coalesced reduction (``P``), then all-gathers ``P``; ZeRO-3 all-gathers ``P`` in each forward and each
  backward (``2 M P``) and reduce-scatters ``M P`` (``P`` under a pipeline). DeepSpeed 0.19.8's ZeRO-1/2 reduce
  with an all-reduce of each bucket, each rank keeping its partition: what it issues is what is counted. Tensors
  ZeRO-3 pads to a multiple of the group size and those it keeps whole (below its persistence threshold) are not
  told apart: within 1 % for the models the package trains;
* **ep** (``E_p > 1``), per mixture-of-experts layer and micro-batch: the dispatch and combine forward and their
  adjoints backward, ``4 n k dim w`` at the mean load (each rank's dispatch input is exactly its ``n k``
  assignments; its combine input is what it received, which routing decides, so only the group's sum is exact);
  the routed experts' gradients go over ``edp`` as the dense ones over ``dp_cp``;
* **rep** (``replica_update="local"``): on a step that ends a round (every ``sync_every``-th), the outer step
  all-reduces the rank's fp32 master weights' change, ``4`` bytes per trainable parameter whatever the precision.

Scalars (the gradient norm, the loss broadcast from the last stage, DeepSpeed's overflow checks, the experts' token
counts and balancing statistics) are not counted: each is a few values a step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_mgpu.layout import stage_ids as placed_stages
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.experts import moe_layer_count, replaced_mlp_reductions
from lightning_mgpu.planner.model_stats import rank_parameter_split
from lightning_mgpu.models.llama_plan import balanced_boundaries

#: Bytes of the loss's fp32 values per token under tensor parallelism: the row maximum, then target logit and sum.
LOSS_VALUES = 3
FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """One step of one layout, as the volume needs it."""

    seq_len: int
    micro_batch: int
    microbatches: int  #: micro-batches per step on each data-parallel rank
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1  #: data-parallel ranks (``dp x cp`` share ZeRO's group)
    ep: int = 1
    zero_stage: int = 0
    schedule: str = "1f1b"
    virtual: int = 1
    sequence_parallel: bool = False
    forward_passes: int = 1  #: 2 with recomputation (the forward's collectives run again)
    element_bytes: int = 2  #: activations and gradients on the wire (2 in bf16, 4 in fp32)
    replicas: int = 1  #: replicas stepping alone (``replica_update="local"``), each of ``dp`` ranks


def step_volume(cfg: LlamaConfig, shape: StepShape, pp_rank: int = 0,
                boundaries: Optional[Sequence[int]] = None) -> dict[tuple[str, str], float]:
    """``{(axis, op): bytes}`` of pipeline rank ``pp_rank`` for one optimizer step (see the module docstring)."""
    stages = placed_stages(shape.pp, shape.virtual, shape.schedule, pp_rank) if shape.pp > 1 else [0]
    n_stages = shape.pp * len(stages) if shape.pp > 1 else 1
    bounds = list(boundaries) if boundaries is not None else balanced_boundaries(cfg.n_layers, n_stages)
    layers = [j for s in stages for j in range(bounds[s], bounds[s + 1])]
    out: dict[tuple[str, str], float] = defaultdict(float)
    M = shape.microbatches
    for key, value in _tensor_parallel(cfg, shape, layers, 0 in stages, n_stages - 1 in stages).items():
        out[key] += M * value
    if shape.cp > 1:
        kv = 2.0 * shape.micro_batch * shape.seq_len * cfg.n_kv_heads * cfg.head_dim / shape.tp * shape.element_bytes
        out[("cp", "all_gather")] += M * len(layers) * kv * shape.forward_passes
        out[("cp", "reduce_scatter")] += M * len(layers) * kv
    if shape.pp > 1:
        sends = sum((s != n_stages - 1 and _owner(s + 1, stages) is None) + (s != 0 and _owner(s - 1, stages) is None)
                    for s in stages)
        act = shape.micro_batch * shape.seq_len / shape.cp * cfg.dim * shape.element_bytes
        act /= shape.tp if shape.sequence_parallel else 1
        out[("pp", "send")] += M * sends * act
        out[("pp", "recv")] += M * sends * act
    if shape.ep > 1:
        tokens = shape.micro_batch * shape.seq_len / shape.cp
        out[("ep", "all_to_all")] += M * moe_layer_count(cfg, layers) * (
            4 * tokens * cfg.experts_per_token * cfg.dim * shape.element_bytes)
    held = rank_parameter_split(cfg, shape.tp, shape.pp, len(stages), pp_rank, stage_ids=stages,
                                boundaries=bounds, ep=shape.ep)
    dense = (held.dense - held.frozen) * shape.element_bytes
    experts = 0 if held.experts_frozen else held.experts * shape.element_bytes
    for axis, size, params in (("dp_cp", shape.dp * shape.cp, dense), ("edp", shape.dp * shape.cp // shape.ep,
                                                                         experts)):
        if size > 1 and params:
            for key, value in _zero(shape, params, axis).items():
                out[key] += value
    if shape.replicas > 1:  # a step that ends a round
        out[("rep", "all_reduce")] += (held.dense - held.frozen + (0 if held.experts_frozen else held.experts)) * FP32
    return dict(out)


def _owner(stage: int, stages: Sequence[int]) -> Optional[int]:
    """The stage itself when this rank holds it (its neighbour's activation passes without a send), else None."""
    return stage if stage in stages else None


def _tensor_parallel(cfg: LlamaConfig, shape: StepShape, layers: list[int], first: bool,
                     last: bool) -> dict[tuple[str, str], float]:
    """Per micro-batch, the tensor-parallel collectives of the rank's blocks, embedding, final norm and loss."""
    T = shape.tp
    if T == 1:
        return {}
    w, fwd = shape.element_bytes, shape.forward_passes
    tokens = shape.micro_batch * shape.seq_len / shape.cp
    act, norm = tokens * cfg.dim * w, cfg.dim * w
    blocks = len(layers)
    dense_mlps = blocks - (replaced_mlp_reductions(cfg) and moe_layer_count(cfg, layers))
    # forward reductions: the attention's per block, the MLP's per dense block; the experts' (k per token) per MoE block
    forward = (blocks + dense_mlps) * act + (blocks - dense_mlps) * cfg.experts_per_token * act
    if not shape.sequence_parallel:
        total = fwd * forward + blocks * 2 * (act + norm)
        total += (fwd * act if first else 0.0) + (act + norm + LOSS_VALUES * tokens * FP32 if last else 0.0)
        return {("tp", "all_reduce"): total}
    gathers = fwd * 2 * blocks * act + 2 * blocks * act + (act if first else 0.0) + (fwd * act if last else 0.0)
    scatters = fwd * forward + 2 * blocks * (act + T * norm) + (fwd * act if first else 0.0) + (
        act + T * norm if last else 0.0)
    return {("tp", "all_gather"): gathers, ("tp", "reduce_scatter"): scatters,
            ("tp", "all_reduce"): LOSS_VALUES * tokens * FP32 if last else 0.0}


def _zero(shape: StepShape, params: float, axis: str) -> dict[tuple[str, str], float]:
    """ZeRO's collectives of ``params`` bytes over ``axis`` in one step."""
    M = shape.microbatches
    coalesced = shape.pp > 1  # a pipeline schedule runs inside one coalesced gradient reduction
    if shape.zero_stage == 0:
        return {(axis, "all_reduce"): params}
    if shape.zero_stage == 1:
        return {(axis, "all_reduce"): params, (axis, "all_gather"): params}
    if shape.zero_stage == 2:
        return {(axis, "all_reduce"): params * (1 if coalesced else M), (axis, "all_gather"): params}
    return {(axis, "all_gather"): 2 * M * params, (axis, "reduce_scatter"): params * (1 if coalesced else M)}
