"""Bytes one rank's collectives carry in one optimizer step, by axis and operation: the planner's communication
volume, in the units :class:`~lightning_mgpu.parallel.comm_count.CommCounter` counts (an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input, an all-to-all's input, a send's tensor), so that the two can be
compared term by term. Written from the package's layers; ``tests/distributed/test_comm_volume.py`` holds them equal
to what a step issues. Per micro-batch, with ``n = b s / C`` tokens on the rank and ``A = n dim w`` activation bytes:

* **tp** (``T > 1``), per block: without sequence parallelism four all-reduces, two of ``A`` forward (the attention's
  and the MLP's row-parallel outputs) and two of ``A + dim w`` backward (the norms' input gradients, their weight
  gradients packed behind); under sequence parallelism the same as all-gathers (two forward, two backward) and
  reduce-scatters (two forward of ``A``, two backward of ``A + T dim w``); a mixture-of-experts block all-reduces its
  experts' outputs forward, ``k A`` (``k`` experts a token), in place of a dense MLP's reduction unless it has shared
  experts (planned as the planner always did; not compared with a count yet). The first stage adds the embedding's
  reduction (forward; its adjoint backward under sequence parallelism), the last the final norm's and the loss's two
  all-reduces (the row maximum and the packed target logit and exponential sum, ``3 n`` fp32 values);
* **cp** (``C > 1``), per block: the keys and values all-gathered forward and reduce-scattered backward,
  ``2 b s kv_heads head_dim w / T`` each;
* **pp**: per micro-batch, each of the rank's stages sends its output forward unless it is the last and its input
  gradient backward unless it is the first; a neighbour on the same rank (ZBV's and DualPipeV's middle) takes it
  without a send. ``b s dim w / C`` bytes each (``/ T`` under sequence parallelism); receives mirror the sends;
* **dp_cp** (ZeRO over the ``dp x C`` ranks holding the same weights), ``P`` the rank's trainable parameter bytes
  (a frozen base, ``adapters=lora``, has no gradient; ZeRO-3 still gathers it):
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
    w = shape.element_bytes
    trained = ((held.dense - held.frozen) * w, 0 if held.experts_frozen else held.experts * w)
    stored = (held.dense * w, held.experts * w)
    for axis, size, index in (("dp_cp", shape.dp * shape.cp, 0), ("edp", shape.dp * shape.cp // shape.ep, 1)):
        if size > 1 and stored[index]:
            for key, value in _zero(shape, trained[index], stored[index], axis).items():
                out[key] += value
    if shape.replicas > 1:  # a step that ends a round
        out[("rep", "all_reduce")] += (held.dense - held.frozen + (0 if held.experts_frozen else held.experts)) * FP32
    return dict(out)


def seconds(volume: dict[tuple[str, str], float], axis: str, ranks: int, bandwidth: float) -> float:
    """Time of ``axis``'s bytes in ``volume`` over ring collectives of ``ranks`` at ``bandwidth`` bytes/s: an
    all-reduce moves ``2 (n-1)/n`` of its tensor per rank, an all-gather and a reduce-scatter ``(n-1)/n``, a send
    its tensor (receives run at the same time, the other way)."""
    if ranks <= 1:
        return 0.0
    share = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
             "reduce_scatter": (ranks - 1) / ranks, "send": 1.0}
    return sum(b * share.get(op, 0.0) for (a, op), b in volume.items() if a == axis) / bandwidth


def busiest(cfg: LlamaConfig, shape: StepShape) -> dict[tuple[str, str], float]:
    """:func:`step_volume` of the pipeline rank that moves the most bytes (the first or the last stage)."""
    return max((step_volume(cfg, shape, r) for r in range(shape.pp)), key=lambda v: sum(v.values()))


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
    blocks, moe = len(layers), moe_layer_count(cfg, layers)
    dense_mlps = blocks - (moe if replaced_mlp_reductions(cfg) else 0)
    # forward reductions: the attention's per block, the MLP's (or the shared experts') where there is one
    forward = (blocks + dense_mlps) * act
    experts = {("tp", "all_reduce"): fwd * moe * cfg.experts_per_token * act} if moe else {}
    if not shape.sequence_parallel:
        total = fwd * forward + blocks * 2 * (act + norm) + experts.get(("tp", "all_reduce"), 0.0)
        total += (fwd * act if first else 0.0) + (act + norm + LOSS_VALUES * tokens * FP32 if last else 0.0)
        return {("tp", "all_reduce"): total}
    gathers = fwd * 2 * blocks * act + 2 * blocks * act + (act if first else 0.0) + (fwd * act if last else 0.0)
    scatters = fwd * forward + 2 * blocks * (act + T * norm) + (fwd * act if first else 0.0) + (
        act + T * norm if last else 0.0)
    return {("tp", "all_gather"): gathers, ("tp", "reduce_scatter"): scatters,
            ("tp", "all_reduce"): (LOSS_VALUES * tokens * FP32 if last else 0.0) + experts.get(("tp", "all_reduce"), 0)}


def _zero(shape: StepShape, trained: float, stored: float, axis: str) -> dict[tuple[str, str], float]:
    """ZeRO's collectives over ``axis`` in one step: gradients of the ``trained`` bytes reduced, the updated ones
    gathered (ZeRO 1-2), or every ``stored`` weight gathered, a frozen base's too (ZeRO-3)."""
    M = shape.microbatches
    reductions = 1 if shape.pp > 1 else M  # a pipeline schedule runs inside one coalesced gradient reduction
    if shape.zero_stage == 0:
        out = {(axis, "all_reduce"): trained}
    elif shape.zero_stage == 1:
        out = {(axis, "all_reduce"): trained, (axis, "all_gather"): trained}
    elif shape.zero_stage == 2:
        out = {(axis, "all_reduce"): trained * reductions, (axis, "all_gather"): trained}
    else:
        out = {(axis, "all_gather"): 2 * M * stored, (axis, "reduce_scatter"): trained * reductions}
    return {key: value for key, value in out.items() if value}
