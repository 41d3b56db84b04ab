"""The planner for mixture-of-experts models, without processes: parameters per rank (routed experts apart), model
states partitioned over the ranks holding the same experts, activations against what the layer really keeps, the
all-to-all's bytes and where it runs, FLOPs of the active parameters, and the search over expert parallelism."""

import gc
from dataclasses import replace

import pytest
import torch

from lightning_mgpu.models import Llama, LlamaConfig
from lightning_mgpu.models.llama import Block, rope_tables
from lightning_mgpu.models.llama_plan import llama_stages
from lightning_mgpu.models.moe import moe_layers
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.planner import GPUS, ClusterSpec, plan_layouts
from lightning_mgpu.planner.experts import (IMBALANCE, all_to_all_bytes, ep_peers, expert_load, expert_traffic,
                                            moe_mlp_activation_bytes)
from lightning_mgpu.measure import kept_forward_bytes
from lightning_mgpu.planner.memory import (block_activation_bytes, estimate_memory, layer_activation_bytes,
                                           model_state_bytes, rank_model_state_bytes)
from lightning_mgpu.planner.model_stats import (RankParameters, model_flops_per_token, rank_parameter_split,
                                                recompute_flops_per_token)
from lightning_mgpu.planner.search import Candidate, evaluate
from lightning_mgpu.split_rules import expert_problems

#: A DeepSeek-like small MoE: a dense first layer, shared experts, 8 routed experts top-2.
MOE = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=96, max_seq_len=64,
                  num_experts=8, experts_per_token=2, expert_hidden=32, shared_experts=1, dense_layers=1)
H100 = GPUS["h100_80gb"]


def _counts(module) -> RankParameters:
    """What the module holds: experts, the rest, and of the rest what Muon leaves to AdamW (by the optimizer's own
    split rule, applied to the real parameters)."""
    from lightning_mgpu.optim.choice import muon_steps

    experts = sum(p.numel() for layer in moe_layers(module) for p in layer.experts.parameters())
    vectors = sum(p.numel() for n, p in module.named_parameters() if not muon_steps(n, p.shape))
    return RankParameters(sum(p.numel() for p in module.parameters()) - experts, experts, vectors)


def test_parameters_per_rank_split_routed_experts_from_the_rest_per_stage():
    model = Llama(MOE)
    assert rank_parameter_split(MOE) == _counts(model) and rank_parameter_split(MOE).total == MOE.num_parameters()
    stages = llama_stages(model, [0, 1], 2)
    for rank in range(2):
        assert rank_parameter_split(MOE, pp=2, pp_rank=rank) == _counts(stages[rank])
    # ep x tp: each rank holds E / Ep experts of hidden / tp per MoE layer; the gate whole, the shared experts / tp
    held = rank_parameter_split(MOE, tp=2, ep=4)
    assert held.experts == 3 * (8 // 4) * 64 * (32 // 2) * 3  # 3 MoE layers
    assert held.dense == rank_parameter_split(MOE, tp=2, ep=1).dense
    dense_model = replace(MOE, num_experts=0, experts_per_token=2, expert_hidden=0, shared_experts=0, dense_layers=0)
    split = rank_parameter_split(dense_model, tp=2, pp=2)
    assert split == RankParameters(split.dense, 0, split.vectors_and_tables) and split.experts == 0


def test_flops_count_the_active_parameters_and_recomputation_the_grouped_experts():
    tokens_weights = MOE.num_parameters(active=True) - MOE.vocab_size * MOE.dim - MOE.dim * (2 * MOE.n_layers + 1)
    assert model_flops_per_token(MOE, 64) == 6 * tokens_weights + 6 * MOE.n_layers * 64 * MOE.dim
    assert MOE.num_parameters(active=True) < MOE.num_parameters()
    # the experts are grouped matmuls, which selective checkpointing does not keep: both modes run them again
    experts = 2 * 3 * (3 * 64 * 32 * 2 + 2 * 64 * 32 * 1)  # 3 MoE layers: k routed (3 matmuls), shared (w1, w3)
    assert recompute_flops_per_token(MOE, 64, "selective") == 2 * MOE.n_layers * 64 * MOE.dim + experts
    dense = replace(MOE, num_experts=0, expert_hidden=0, shared_experts=0, dense_layers=0)
    assert recompute_flops_per_token(MOE, 64, "full") > recompute_flops_per_token(MOE, 64, "selective") > \
        recompute_flops_per_token(dense, 64, "selective")


def test_zero_partitions_routed_experts_over_the_ranks_holding_the_same_experts():
    held = RankParameters(dense=1_000_000, experts=4_000_000)
    states = rank_model_state_bytes(held, 1, 8, ep=4)  # experts over 8 / 4 = 2 ranks, the rest over 8
    dense, experts = model_state_bytes(held.dense, 1, 8), model_state_bytes(held.experts, 1, 2)
    assert states["optimizer"] == dense["optimizer"] + experts["optimizer"] == 12 * 1e6 / 8 + 12 * 4e6 / 2
    assert states["buffers"] == model_state_bytes(held.total, 1, 8)["buffers"]  # one engine's bucket
    assert rank_model_state_bytes(RankParameters(5_000_000), 3, 8) == model_state_bytes(5_000_000, 3, 8)


def _kept_per_token(cfg: LlamaConfig, mode: str, dtype: torch.dtype) -> float:
    """What one MoE block keeps for backward per token (the slope between 64 and 128 tokens), measured."""
    gc.freeze()  # every object made before: out of the collections below (0.25 s each over the whole session's)
    try:
        return _slope(cfg, mode, dtype)
    finally:
        gc.unfreeze()


def _slope(cfg: LlamaConfig, mode: str, dtype: torch.dtype) -> float:
    points = []
    for n in (64, 128):
        torch.manual_seed(0)
        block = Block(cfg, cfg.dense_layers).to(dtype).train()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
        checkpoint_blocks([block], mode)
        cos, sin = rope_tables(cfg.head_dim, n, cfg.rope_theta)
        x = torch.randn(1, n, cfg.dim, dtype=dtype, requires_grad=True)
        (block(x, cos, sin) * torch.randn_like(x)).sum().backward()  # a first pass allocates the kernels' caches
        block.feed_forward.router.routes, block.feed_forward.stats = None, {}  # freed here, not while measured
        gc.collect()  # nor the previous block's graph
        points.append(kept_forward_bytes(lambda: block(x, cos, sin)) + x.untyped_storage().nbytes())
    return (points[1] - points[0]) / 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_block_activations_equal_what_the_layer_keeps(dtype):
    """Two shapes (shared experts; sigmoid scores with a z-loss), each checkpointing mode: exact, but for bf16 with
    shared experts and no checkpointing, where the forward keeps one more dim-wide bf16 tensor per token than the
    saved tensors account for (2.4%)."""
    shapes = [replace(MOE, dim=96, n_heads=6, num_experts=16, experts_per_token=4, expert_hidden=48, shared_experts=2),
              replace(MOE, n_kv_heads=4, num_experts=32, experts_per_token=3, shared_experts=0, router_score="sigmoid",
                      z_loss_coeff=1e-3)]
    for cfg in shapes:
        for mode in ("none", "selective", "full"):
            planned = layer_activation_bytes(cfg, cfg.dense_layers, 1, mode=mode, element_bytes=dtype.itemsize)
            if mode != "none":
                planned -= block_activation_bytes(cfg, 0, mode=mode)  # the checkpoint's state, once per block
            assert _kept_per_token(cfg, mode, dtype) == pytest.approx(planned, rel=0.03), (cfg.num_experts, mode)


def test_received_tokens_are_planned_at_the_imbalance_capped_by_the_capacity():
    assert expert_load(MOE, 1) == 1.0 and expert_load(MOE, 2) == IMBALANCE == 1.25
    assert expert_load(replace(MOE, capacity_factor=1.1), 4) == 1.1
    even, busy = (moe_mlp_activation_bytes(MOE, 1000, ep=ep, element_bytes=2) for ep in (1, 2))
    received = 2 * 1000 * (2 * 64 + 4 * 2 * 32)  # k x tokens x (input + SwiGLU's four)
    assert busy - even == pytest.approx(received * (IMBALANCE - 1) + 2 * 1000 * 16 * IMBALANCE)
    dense_block = block_activation_bytes(MOE, 1000, element_bytes=2)
    assert layer_activation_bytes(MOE, 0, 1000, element_bytes=2) == dense_block  # the dense first layer


def test_all_to_all_bytes_and_where_the_expert_parallel_group_sits():
    T, k, h = 4096, MOE.experts_per_token, MOE.dim
    assert all_to_all_bytes(MOE, T, 4) == 4 * T * k * h * 2 * 3 / 4 and all_to_all_bytes(MOE, T, 1) == 0
    two_nodes = ClusterSpec(2, 8, H100)
    assert ep_peers(two_nodes, tp=1, cp=1, pp=1, ep=8) == (7, 0)  # 8 consecutive data-parallel ranks: one node
    assert ep_peers(two_nodes, tp=2, cp=1, pp=1, ep=8) == (3, 4)  # 16 ranks apart by tp: half on the other node
    assert ep_peers(two_nodes, tp=1, cp=2, pp=2, ep=4) == (3, 0)  # context ranks, then data ranks tp x cp x pp apart
    inside = expert_traffic(MOE, two_nodes, T, 8, tp=1, cp=1, pp=1, ep=8)
    across = expert_traffic(MOE, two_nodes, T, 8, tp=2, cp=1, pp=1, ep=8)
    assert not inside.across_nodes and across.across_nodes and across.all_to_all_s > 5 * inside.all_to_all_s
    assert inside.all_to_all_bytes == 3 * 8 * all_to_all_bytes(MOE, T, 8)  # MoE layers x micro-batches
    recomputed = expert_traffic(MOE, two_nodes, T, 8, tp=2, cp=1, pp=1, ep=8, forward_passes=2)
    assert recomputed.all_to_all_bytes == 1.5 * across.all_to_all_bytes  # the forward's half again
    assert across.tp_reduce_bytes == 3 * 8 * k * T * h * 2 and inside.tp_reduce_bytes == 0  # k x T x dim per layer


def test_search_tries_every_expert_parallel_size_the_rules_allow_and_mfu_counts_active_parameters():
    cfg = LlamaConfig.from_name("llama3_1b", num_experts=8, experts_per_token=2, expert_hidden=2048)
    cluster = ClusterSpec(1, 8, H100)
    rows = plan_layouts(cfg, cluster, 4096, 64)
    sizes = {r.candidate.ep for r in rows}
    assert sizes == {1, 2, 4, 8}
    for r in rows:
        c = r.candidate
        assert not expert_problems(c.ep, c.dp * c.cp, cfg.num_experts, c.tp, cfg.expert_ffn_hidden)
        assert f"parallel.expert_parallel_size={c.ep}" in c.overrides()
        assert r.time.model_flops_per_step == model_flops_per_token(cfg, 4096) * 64 * 4096
    one, eight = (evaluate(cfg, cluster, 4096, 64, Candidate(1, 1, 8, 1, 1, ep=ep)) for ep in (1, 8))
    assert one.time.expert_parallel == 0 < eight.time.expert_parallel
    assert eight.memory.parameters < one.memory.parameters  # each rank holds 1 of 8 experts of every layer
    assert eight.time.data_parallel < one.time.data_parallel  # and reduces only the dense gradients over all 8
    assert eight.memory == estimate_memory(cfg, 4096, 1, 1, 1, 8, 1, overlap=True, microbatches=8, ep=8)
