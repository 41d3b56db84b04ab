"""What a mixture-of-experts model (``LlamaConfig.num_experts > 0``, :mod:`lightning_mgpu.models.moe`) adds to the
planner: parameters split by expert and tensor parallelism, the activations of its layers, the token exchange of
expert parallelism and the FLOPs one token really runs. The other planner modules call these; a dense model gets
zeros (or its dense figures) from each.

Layout (``lightning_mgpu.parallel.experts``): expert parallelism of size ``Ep`` folds over the ``dp x cp`` ranks of a
replica. Each rank holds ``E / Ep`` routed experts of every mixture-of-experts layer, each expert's hidden width split
over the ``t`` tensor-parallel ranks; the router's gate ``[E, dim]`` is replicated and the shared experts are split
over ``t`` only. ZeRO partitions the routed experts' states over the ``dp x cp / Ep`` ranks holding the same experts
(the "edp" group), everything else over ``dp x cp``.

Per micro-batch, a rank holding ``T`` tokens (``s b / C``: under sequence parallelism the layer's input is gathered
whole on every tensor-parallel rank) sends each of its ``T k`` token-expert assignments to the rank holding the
expert and gets the outputs back: ``2 T k dim`` elements forward (dispatch and combine) and as many backward, the
share ``(Ep - 1) / Ep`` of them to other ranks. Under tensor parallelism the experts' partial outputs are all-reduced
per assignment, ``k T dim`` elements forward per layer instead of the dense MLP's ``T dim``.

Memory is planned for the busiest rank: with ``Ep > 1`` the tokens a rank receives for its experts are taken at
:data:`IMBALANCE` times the mean (the busiest expert's share of its layer's assignments over the mean share bounds
any rank's, which averages several experts), capped at ``capacity_factor`` where one drops tokens. With ``Ep = 1``
every rank runs every assignment of its own tokens: no imbalance. Time is planned at the mean load (balanced
routing: what the balancing losses aim at); a rank that receives more runs longer, and the others wait for it at the
combine, which the plan does not count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.hardware import ClusterSpec
from lightning_mgpu.split_rules import expert_problems

#: The busiest expert's tokens over the mean (an even split's) in one layer: what a rank's received tokens are
#: planned at when the experts are spread over ranks. 1.25 is the capacity factor commonly provisioned for balanced
#: training (Switch Transformer, GShard); with balancing losses or bias balancing loads settle near it, and a
#: ``capacity_factor`` caps them. An assumption, not a measurement on this project's runs.
IMBALANCE = 1.25


def moe_layer_count(cfg: LlamaConfig, layers: Iterable[int]) -> int:
    """How many of ``layers`` (block indices) are mixture-of-experts layers (the rest keep the dense MLP)."""
    return sum(1 for i in layers if cfg.is_moe_layer(i))


def routed_parameters(cfg: LlamaConfig, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one layer's routed experts on one rank: ``E / Ep`` whole experts (``w1``, ``w3``, ``w2``), each
    of hidden width ``expert_hidden / tp``."""
    return cfg.num_experts // ep * 3 * cfg.dim * (cfg.expert_ffn_hidden // tp)


def moe_dense_parameters(cfg: LlamaConfig, tp: int = 1) -> int:
    """The rest of one layer's feed-forward on one rank: the replicated router gate and the shared experts, whose
    hidden width ``shared_experts x expert_hidden`` is split over ``tp``."""
    return cfg.dim * cfg.num_experts + 3 * cfg.dim * (cfg.shared_experts * cfg.expert_ffn_hidden // tp)


def moe_recomputed_weights(cfg: LlamaConfig, mode: str) -> int:
    """Matmul weights per token that recomputation runs again in a mixture-of-experts feed-forward. The experts run
    as grouped matmuls, which selective checkpointing (it keeps ``mm`` outputs) does not keep, so both modes recompute
    them: every routed projection (the combine weights the last one's output) and the shared experts' ``w1``, ``w3``
    (their ``w2`` output is needed by nothing, and torch's checkpoint stops before it); ``full`` also the gate."""
    if mode not in ("selective", "full"):
        return 0
    h, f = cfg.dim, cfg.expert_ffn_hidden
    experts = 3 * h * f * cfg.experts_per_token + 2 * h * f * cfg.shared_experts
    return experts + (h * cfg.num_experts if mode == "full" else 0)


def expert_load(cfg: LlamaConfig, ep: int, imbalance: float = IMBALANCE) -> float:
    """The busiest rank's received assignments over the mean: 1 without expert parallelism (a rank runs all of its
    own), else ``imbalance``, at most ``capacity_factor`` (no expert takes more than that times an even share)."""
    if ep <= 1 or cfg.num_experts == 0:
        return 1.0
    return imbalance if cfg.capacity_factor is None else min(imbalance, cfg.capacity_factor)


def _router_bytes(cfg: LlamaConfig, w: int) -> float:
    """Per token, what the fp32 router keeps: its fp32 input (a copy unless the activations are fp32), the scores
    (``4 E``), the stable sort's ``[T, E]`` int64 order (the chosen experts are a view of it, ``8 E``), the top-k
    weights and their sum; the z-loss also keeps the logits."""
    z = 4 * cfg.num_experts + 8 if cfg.z_loss_coeff > 0 else 0
    return (4 * cfg.dim if w != 4 else 0) + 12 * cfg.num_experts + 4 * cfg.experts_per_token + 8 + z


def moe_mlp_activation_bytes(cfg: LlamaConfig, tokens: float, tp: int = 1, mode: str = "none",
                             element_bytes: int = 2, ep: int = 1, imbalance: float = IMBALANCE) -> float:
    """Bytes one mixture-of-experts feed-forward keeps for backward on one rank for ``tokens`` tokens (its input, the
    norm's output, is the block's). Derived from what ``models/moe.py`` saves, tensor by tensor, and equal to the
    measured bytes at ``tp = Ep = 1`` (``tests/unit/test_planner_experts.py``). Per token, ``w`` element bytes:

    * ``none``: the router (:func:`_router_bytes`); per assignment on the sending rank the combined output, the
      weighted output (``index_add`` keeps it), the weight and three int64 indices, ``2 w h + w + 24``; per
      assignment received (``k x`` :func:`expert_load`), the experts' input and SwiGLU's four hidden-wide tensors,
      ``w h + 4 w f / t`` (plus two int64 regrouping indices under expert parallelism); the shared experts' four,
      ``4 w S f / t``.
    * ``selective``: the router's fp32 logits (its matmul's output, ``4 E``) and the chosen routes the router keeps
      for the load report (the ``8 E`` int64 order they view).
    * ``full``: the routes only.
    """
    E, k, h, w = cfg.num_experts, cfg.experts_per_token, cfg.dim, element_bytes
    routes = 8 * E
    if mode == "full":
        return tokens * routes
    if mode == "selective":
        return tokens * (4 * E + routes)
    received = w * h + 4 * w * cfg.expert_ffn_hidden / tp + (16 if ep > 1 else 0)
    sent = 2 * w * h + w + 24
    shared = 4 * w * cfg.shared_experts * cfg.expert_ffn_hidden / tp
    return tokens * (_router_bytes(cfg, w) + k * sent + k * expert_load(cfg, ep, imbalance) * received + shared)


def ep_peers(cluster: ClusterSpec, tp: int, cp: int, pp: int, ep: int) -> tuple[int, int]:
    """(other ranks of an expert-parallel group inside its node, those on other nodes). The group is ``Ep``
    consecutive data x context ranks: context ranks ``tp`` apart, then data ranks ``tp x cp x pp`` apart
    (``lightning_mgpu.rank_grid``); every group is a shifted copy of rank 0's."""
    ranks = [(j % cp) * tp + (j // cp) * tp * cp * pp for j in range(ep)]
    same = sum(1 for r in ranks[1:] if r // cluster.gpus_per_node == 0)
    return same, ep - 1 - same


@dataclass(frozen=True)
class ExpertTraffic:
    """What expert parallelism and the experts' tensor parallelism move per optimizer step on one rank."""

    all_to_all_bytes: float  #: sent to other ranks of the ep group: dispatch and combine, forward and backward
    all_to_all_s: float
    across_nodes: bool  #: the ep group spans nodes (its slowest peers are on the network)
    tp_reduce_bytes: float  #: the all-reduce of the experts' partial outputs over tp (forward only)
    tp_reduce_s: float
    moe_layers: float  #: mixture-of-experts layers per rank (``moe layers / pp``)


def all_to_all_bytes(cfg: LlamaConfig, tokens: float, ep: int, element_bytes: int = 2) -> float:
    """Bytes one rank sends to the other ranks of its expert-parallel group per mixture-of-experts layer and
    micro-batch of ``tokens`` tokens: ``4 T k dim w (Ep - 1) / Ep`` (dispatch and combine, forward and backward)."""
    return 4 * tokens * cfg.experts_per_token * cfg.dim * element_bytes * (ep - 1) / ep if ep > 1 else 0.0


def all_to_all_seconds(bytes_: float, ep: int, peers: tuple[int, int], cluster: ClusterSpec) -> float:
    """One rank's all-to-all of ``bytes_``, an even share to each of its ``Ep - 1`` peers, over NVLink to those in its
    node and the network to the others at once: the slower of the two."""
    if ep <= 1:
        return 0.0
    inside, outside = peers
    share = bytes_ / (ep - 1)
    gpu = cluster.gpu
    return max(inside * share / gpu.intra_node_bandwidth, outside * share / gpu.inter_node_bandwidth)


def _ring_all_reduce(bytes_: float, n: int, bandwidth: float) -> float:
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * bytes_ / bandwidth


def expert_traffic(cfg: LlamaConfig, cluster: ClusterSpec, tokens: float, microbatches: int, tp: int, cp: int,
                   pp: int, ep: int, forward_passes: int = 1, element_bytes: int = 2) -> ExpertTraffic:
    """Per step on one rank, ``tokens`` per micro-batch: the all-to-all (``forward_passes = 2`` when recomputation runs
    each forward again, collectives included) and the tensor-parallel all-reduce of the experts' outputs, ``k T dim``
    elements per layer and forward, both at the mean load, over NVLink where the group fits a node."""
    layers = moe_layer_count(cfg, range(cfg.n_layers)) / pp
    per_layer = all_to_all_bytes(cfg, tokens, ep, element_bytes)
    a2a = per_layer * layers * microbatches * (forward_passes + 1) / 2  # half of it is the backward's
    peers = ep_peers(cluster, tp, cp, pp, ep)
    reduce_layer = cfg.experts_per_token * tokens * cfg.dim * element_bytes if tp > 1 else 0.0
    reduce = reduce_layer * layers * microbatches * forward_passes
    tp_bw = cluster.gpu.intra_node_bandwidth if tp <= cluster.gpus_per_node else cluster.gpu.inter_node_bandwidth
    return ExpertTraffic(a2a, all_to_all_seconds(a2a, ep, peers, cluster), peers[1] > 0, reduce,
                         _ring_all_reduce(reduce, tp, tp_bw), layers)


def replaced_mlp_reductions(cfg: LlamaConfig) -> int:
    """Mixture-of-experts layers whose forward has no dense-MLP all-reduce of ``T dim`` under tensor parallelism
    (the experts' all-reduce replaces it; with shared experts their own all-reduce stays)."""
    return 0 if cfg.shared_experts else moe_layer_count(cfg, range(cfg.n_layers))


def expert_parallel_sizes(cfg: LlamaConfig, data_context_ranks: int) -> list[int]:
    """The expert-parallel sizes a search tries: those :func:`lightning_mgpu.split_rules.expert_problems` accepts for
    these data x context ranks and experts (1 alone for a dense model, or for experts the package does not split: a
    ``transformers`` mixture of experts' outside ``split_rules.HF_EXPERT_FAMILIES``)."""
    if cfg.num_experts == 0:
        return [1]
    return [d for d in range(1, data_context_ranks + 1) if not expert_problems(
        d, data_context_ranks, cfg.num_experts, experts_split=bool(getattr(cfg, "experts_split", True)))]
