"""Step time of a layout: compute at a stated fraction of peak, plus the communication it cannot hide.

* compute: ``flops_per_token * tokens`` per GPU plus what recomputation runs again
  (:func:`~lightning_mgpu.planner.model_stats.recompute_flops_per_token`, measured: full recomputation runs the blocks'
  forward again but their last matmul, selective the attention scores' forward, ``2 L s h`` per token; both repeat
  the tensor-parallel and context-parallel collectives of the forward), in seconds by
  :func:`~lightning_mgpu.planner.efficiency.compute_seconds`: the weight matmuls at ``achievable`` x the bf16 peak
  (default: the GPU's fraction) scaled down for micro-batches of few tokens, the attention scores at a fraction of
  their own; the constants fitted to published runs in :mod:`lightning_mgpu.planner.calibration`;
* communication: the bytes of each axis are :func:`lightning_mgpu.planner.communication.step_volume`'s for the
  pipeline rank that moves the most (tested equal to what a step issues, collective by collective), in seconds as
  ring collectives (:func:`~lightning_mgpu.planner.communication.seconds`): tensor parallelism over NVLink when the
  group fits a node, per block and micro-batch the equivalent of four all-reduces of ``s b h`` activations (six with
  recomputation), plus the embedding's, the final norm's and the loss's on the first and last stages;
* pipeline bubble: the schedule's bubble fraction ``f`` (``lightning_mgpu.layout.theoretical_bubble``)
  stretches compute + tensor-parallel time by ``1 / (1 - f)``; point-to-point sends between stages are
  ``s b h`` bytes per micro-batch and stage boundary each way (``/ t`` under sequence parallelism);
* data parallelism: ZeRO-0 and 1 all-reduce the gradients once a step, ZeRO-1 and 2 all-gather the updated weights,
  ZeRO-2 reduces every micro-batch's gradients and ZeRO-3 reduce-scatters them and gathers the weights in every
  forward and backward (one coalesced reduction under a pipeline); over the inter-node network when the job spans
  nodes. With ``overlap`` (the default on CUDA for ZeRO 2 and 3, see ``lightning_mgpu.engine.zero_config``) the
  reductions run behind the backward passes (two thirds of the compute) when there is no pipeline, and ZeRO-3's
  gathers behind the compute of the whole step (prefetch); only what exceeds that is counted. ``data_parallel_hidden``
  says how much was hidden. ZeRO 0 and 1 do not overlap. The gradients are reduced over the ``dp x C`` ranks holding
  the same weights (``C``: context parallelism);
* context parallelism: per block and micro-batch, one all-gather of the sequence's keys and values in the forward
  (another with recomputation) and one reduce-scatter of their gradients in the backward, each moving ``(C-1)/C``
  of ``2 s b (kv heads x head dim) / t`` bf16 values, over NVLink when ``t x C`` fits a node; not overlapped
  (``lightning_mgpu.parallel.context`` gathers before it computes). Compute, tensor-parallel and pipeline terms
  see ``s / C`` tokens per rank;
* mixture of experts (:mod:`lightning_mgpu.planner.experts`): compute counts the active parameters (the gate and
  ``k`` routed experts a token runs through); per MoE layer and micro-batch, expert parallelism's all-to-all
  (dispatch and combine, forward and backward: ``4 T k h w (Ep-1)/Ep`` bytes a rank sends, another forward's half with
  recomputation) over NVLink to the group's ranks in the node and the network to the others, not overlapped; under
  tensor parallelism the experts' outputs are all-reduced per assignment (``k T h`` elements in place of the MLP's
  ``T h``, counted in ``tensor_parallel``); the routed experts' gradients reduce over the ``dp x C / Ep`` ranks holding
  the same experts, the rest over ``dp x C``. At the mean load (balanced routing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.layout import theoretical_bubble
from lightning_mgpu.planner.communication import StepShape, busiest, seconds
from lightning_mgpu.planner.efficiency import compute_seconds
from lightning_mgpu.planner.experts import ExpertTraffic, expert_traffic
from lightning_mgpu.planner.hardware import ClusterSpec
from lightning_mgpu.planner.model_stats import (model_flops_per_token, recompute_flops_per_token,
                                               skipped_weight_gradient_flops_per_token)


@dataclass(frozen=True)
class StepTimeEstimate:
    """Seconds per optimizer step, by cause, and what they make of the hardware."""

    compute: float
    tensor_parallel: float
    pipeline_bubble: float
    pipeline_p2p: float
    data_parallel: float
    tokens_per_step: int
    world_size: int
    model_flops_per_step: float
    peak_flops: float
    data_parallel_hidden: float = 0.0  #: data-parallel communication run behind compute (not in ``total``)
    context_parallel: float = 0.0  #: key/value exchange of context parallelism
    expert_parallel: float = 0.0  #: the token all-to-all of expert parallelism
    #: what the experts move (bytes and seconds; the tensor-parallel all-reduce of their outputs is in
    #: ``tensor_parallel``), None for a dense model
    experts: Optional[ExpertTraffic] = None
    #: bytes per step by (axis, op) of the busiest pipeline rank (:func:`lightning_mgpu.planner.communication.step_volume`)
    volume: Optional[dict] = None

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_parallel + self.pipeline_bubble + self.pipeline_p2p + self.data_parallel
                + self.context_parallel + self.expert_parallel)

    @property
    def without_overlap(self) -> float:
        """The step if no communication ran behind compute: every term above with the hidden data-parallel
        communication counted in full (the bound a user can hold the overlapped estimate against)."""
        return self.total + self.data_parallel_hidden

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step / self.total / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.total * self.world_size * self.peak_flops)


def _ring(bytes_: float, n: int, bandwidth: float, all_reduce: bool = True) -> float:
    """Seconds of one ring all-reduce (or all-gather: ``all_reduce=False``) of ``bytes_`` over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (n - 1) / n * bytes_ / bandwidth


def estimate_step_time(cfg: LlamaConfig, cluster: ClusterSpec, seq_len: int, global_batch: int, micro_batch: int,
                       tp: int, pp: int, zero_stage: int, virtual: int = 1, schedule: str = "1f1b",
                       recompute: bool = False, achievable: Optional[float] = None,
                       overlap: bool = True, context: int = 1, selective: bool = False,
                       ep: int = 1, sequence_parallel: bool = True) -> StepTimeEstimate:
    gpu, world = cluster.gpu, cluster.world_size
    achievable = gpu.achievable if achievable is None else achievable
    dp = world // (tp * pp * context)
    tokens = global_batch * seq_len
    # a frozen base (adapters) needs no weight gradients: its MFU counts the FLOPs its step needs, not a full step's
    model_flops = (model_flops_per_token(cfg, seq_len) - skipped_weight_gradient_flops_per_token(cfg, seq_len)) * tokens
    mode = "full" if recompute else "selective" if selective else "none"
    hardware_flops = model_flops + recompute_flops_per_token(cfg, seq_len, mode) * tokens  # measured per mode
    compute = compute_seconds(cfg, mode, hardware_flops / world, tokens / world, gpu, achievable, seq_len,
                              micro_batch * seq_len / context)  # efficiency.py
    microbatches = global_batch // (micro_batch * dp)
    forward_passes = 2 if recompute or selective else 1
    shape = StepShape(seq_len, micro_batch, microbatches, tp, context, pp, dp, ep, zero_stage, schedule, virtual,
                      sequence_parallel and tp > 1, forward_passes)
    volume = busiest(cfg, shape)
    tp_bw = gpu.intra_node_bandwidth if tp <= cluster.gpus_per_node else gpu.inter_node_bandwidth
    moe = expert_traffic(cfg, cluster, seq_len / context * micro_batch, microbatches, tp, context, pp, ep,
                         forward_passes) if cfg.num_experts else None
    tensor_parallel = seconds(volume, "tp", tp, tp_bw)  # the experts' output reduction included
    all_to_all = moe.all_to_all_s if moe else 0.0
    bubble_fraction = theoretical_bubble(schedule, pp, microbatches, virtual) if pp > 1 else 0.0
    bubble = (compute + tensor_parallel + all_to_all) * bubble_fraction / (1 - bubble_fraction)
    pp_bw = gpu.inter_node_bandwidth if tp * pp > cluster.gpus_per_node else gpu.intra_node_bandwidth
    p2p = seconds(volume, "pp", pp, pp_bw)
    reduction, gathers, exposed = _data_parallel(volume, cluster, dp * context, ep, zero_stage, overlap, compute, pp)
    cp_bw = gpu.intra_node_bandwidth if tp * context <= cluster.gpus_per_node else gpu.inter_node_bandwidth
    context_parallel = seconds(volume, "cp", context, cp_bw)
    return StepTimeEstimate(compute, tensor_parallel, bubble, p2p, exposed, tokens, world, model_flops,
                            gpu.bf16_peak_flops, reduction + gathers - exposed, context_parallel, all_to_all, moe,
                            volume)


def _data_parallel(volume: dict, cluster: ClusterSpec, data_context: int, ep: int, zero_stage: int, overlap: bool,
                   compute: float, pp: int) -> tuple[float, float, float]:
    """(gradient reduction, ZeRO's parameter gathers, what of them is not hidden) in seconds, from the volume: the
    dense gradients over the ``data_context`` ranks, the routed experts' over the ``data_context / ep`` holding the
    same experts. With overlap (ZeRO 2 and 3) each micro-batch's reduction runs behind the backward passes (two thirds
    of the compute) when there is no pipeline, and ZeRO-3's gathers behind the whole step's compute (prefetch); ZeRO-1
    and 2 gather the updated weights after the optimizer step, where nothing hides them."""
    gpu = cluster.gpu
    dp_bw = gpu.inter_node_bandwidth if cluster.nodes > 1 else gpu.intra_node_bandwidth

    def over(ops: tuple[str, ...]) -> float:
        part = {key: b for key, b in volume.items() if key[1] in ops}
        return seconds(part, "dp_cp", data_context, dp_bw) + seconds(part, "edp", data_context // ep, dp_bw)

    reduction, gathers = over(("all_reduce", "reduce_scatter")), over(("all_gather",))
    exposed = reduction + gathers
    if overlap and zero_stage >= 2:
        backward = (2 / 3) * compute if pp == 1 else 0.0
        hidden_gathers = min(gathers, compute) if zero_stage == 3 else 0.0
        exposed = max(0.0, reduction - backward) + gathers - hidden_gathers
    return reduction, gathers, exposed
