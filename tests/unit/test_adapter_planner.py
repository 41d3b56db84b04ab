"""The planner's count of a LoRA run, worked by hand: the adapters' parameters per rank (A whole and B split over a
column-parallel base, A split and B whole over a row-parallel one), the base frozen (its storage only), ZeRO-3's
persistent adapters, and the ``adapters.*`` settings read from a composed config by the memory check and mgpu-plan.

The hand-worked shape: hidden 64, 4 query heads and 2 key/value heads of 16 (q = 64, kv = 32), MLP 128, vocabulary
100, 2 layers; LoRA rank 4."""

from dataclasses import replace

import pytest

from lightning_mgpu.buckets import persistence_threshold
from lightning_mgpu.hf.names import planning_shape
from lightning_mgpu.planner.adapters import LoraShape, layer_adapter_parameters, lora_shape, persistent_parameters
from lightning_mgpu.planner.memory import rank_model_state_bytes
from lightning_mgpu.planner.model_stats import RankParameters, rank_parameter_split

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
          "max_position_embeddings": 64, "tie_word_embeddings": False}
SHAPE = planning_shape(CONFIG)


def test_one_layers_adapters_by_hand():
    lora = LoraShape(4)
    # tp 1: r (in + out): q 4(64+64) + k 4(64+32) + v 4(64+32) + o 4(64+64) + gate, up 4(64+128) + down 4(128+64)
    assert layer_adapter_parameters(SHAPE, lora, 1) == 512 + 384 + 384 + 512 + 3 * 768 == 4096
    # tp 2, column-parallel (q, k, v, gate, up): A 4 x 64 whole, B out/2 x 4; row-parallel (o, down): A 4 x in/2, B whole
    assert layer_adapter_parameters(SHAPE, lora, 2) == (256 + 128) + 2 * (256 + 64) + (128 + 256) + 2 * (256 + 256) \
        + (256 + 256) == 2944
    assert layer_adapter_parameters(SHAPE, LoraShape(4, ("q_proj", "v_proj")), 1) == 512 + 384
    assert layer_adapter_parameters(SHAPE, lora, 1, moe=True) == 512 + 384 + 384 + 512  # attention only


def test_rank_split_freezes_the_base_and_adds_the_adapters():
    base = rank_parameter_split(SHAPE, tp=2)
    lora = rank_parameter_split(replace(SHAPE, adapters=LoraShape(4)), tp=2)
    assert (lora.total - base.total, lora.frozen) == (2 * 2944, base.dense)
    # a trained copy of the head (modules_to_save): 50 vocabulary rows x 64 on each tensor rank, on the last stage only
    saved = replace(SHAPE, adapters=LoraShape(4, modules_to_save=("lm_head",)))
    assert rank_parameter_split(saved, tp=2).total - lora.total == 50 * 64
    first, last = (rank_parameter_split(saved, tp=2, pp=2, pp_rank=r) for r in (0, 1))
    assert first.total - first.frozen == 2944 and last.total - last.frozen == 2944 + 50 * 64


def test_frozen_weights_cost_their_storage_only():
    held = RankParameters(dense=1_010_000, frozen=1_000_000)  # 10,000 trainable
    z1 = rank_model_state_bytes(held, 1, 2, precision="bf16-mixed")
    # parameters 2 B each; the trainable's bf16 gradients, fp32 master / 2, Adam 8 B / 2; one bucket of 1,010,000 / 4
    assert z1 == {"parameters": 2_020_000, "gradients": 20_000, "optimizer": 60_000, "buffers": 505_000}
    z3 = rank_model_state_bytes(replace(held, persistent=4_000), 3, 2, precision="bf16-mixed")
    # ZeRO-3: everything over the 2 ranks, and the 4,000 persistent adapter elements also whole, 2 B each
    assert z3 == {"parameters": 1_010_000 + 8_000, "gradients": 10_000, "optimizer": 60_000, "buffers": 505_000}


def test_zero3_keeps_small_adapters_whole():
    assert persistence_threshold(4096) == 512 and persistence_threshold(10**9) == 100_000
    assert persistent_parameters([100, 512, 513], 512) == 612
    # the shape at tp 2: largest parameter gate/up's 64 x 128 / 2 = 4096 -> threshold 512; every rank-4 matrix is
    # at most 4 x 64 = 256 elements, so all of one layer's 2,944 are kept whole, twice over for two layers
    assert rank_parameter_split(replace(SHAPE, adapters=LoraShape(4)), tp=2).persistent == 2 * 2944


@pytest.mark.parametrize("settings, expected", [
    ({"kind": "none", "rank": 16}, None),
    ({"kind": "lora", "rank": 8, "targets": "all-linear"}, LoraShape(8)),
    ({"kind": "lora", "rank": 8, "targets": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
     LoraShape(8, ("q_proj", "v_proj"), ("lm_head",))),
    # the package's own model's names for the same linears (adapters=lora without model=hf)
    ({"kind": "lora", "rank": 8, "targets": ["wq", "wv", "w2"]}, LoraShape(8, ("q_proj", "v_proj", "down_proj"))),
])
def test_settings_become_the_planners_shape(settings, expected):
    assert lora_shape(settings) == expected


def test_data_parallel_reduces_only_what_trains():
    """Gradients are reduced for the 2 x 4,096 adapter parameters alone (tp 1), not the frozen base; ZeRO-3 still
    gathers every weight, the base's too: both in proportion to the parameters they move."""
    from lightning_mgpu.planner import GPUS, ClusterSpec
    from lightning_mgpu.planner.communication import StepShape, step_volume
    from lightning_mgpu.planner.time import _data_parallel

    cluster, base = ClusterSpec(1, 8, GPUS["h100_80gb"]), rank_parameter_split(SHAPE).dense
    lora = replace(SHAPE, adapters=LoraShape(4))
    step = StepShape(16, 1, 1, dp=8, zero_stage=3)
    full_reduction, full_gathers, _ = _data_parallel(step_volume(SHAPE, step), cluster, 8, 1, 3, False, 1.0, 1)
    reduction, gathers, _ = _data_parallel(step_volume(lora, step), cluster, 8, 1, 3, False, 1.0, 1)
    assert reduction == pytest.approx(full_reduction * 2 * 4096 / base, rel=1e-12)
    assert gathers == pytest.approx(full_gathers * (base + 2 * 4096) / base, rel=1e-12)


def test_the_planners_compute_leaves_out_the_frozen_weights_gradients():
    """Per token, a frozen weight's gradient (2 FLOPs per weight) is not computed; the adapters' 6 per element are.
    Matmul weights of the shape: per layer q 64x64, k and v 64x32, o 64x64, gate, up and down 64x128 -> 36,864; two
    layers and the head's 100 x 64 -> 80,128. Adapters: 2 x 4,096 (all-linear, rank 4)."""
    from lightning_mgpu.planner import GPUS, ClusterSpec
    from lightning_mgpu.planner.model_stats import model_flops_per_token, skipped_weight_gradient_flops_per_token
    from lightning_mgpu.planner.time import estimate_step_time

    lora = replace(SHAPE, adapters=LoraShape(4))
    assert skipped_weight_gradient_flops_per_token(SHAPE, 32) == 0
    assert skipped_weight_gradient_flops_per_token(lora, 32) == 2 * 80_128 - 6 * 8192
    # the head trained whole (modules_to_save) keeps its gradient
    saved = replace(SHAPE, adapters=LoraShape(4, modules_to_save=("lm_head",)))
    assert skipped_weight_gradient_flops_per_token(saved, 32) == 2 * (80_128 - 6400) - 6 * 8192
    # one rate for every FLOP (the attention scores, which adapters keep, run at a rate of their own otherwise)
    gpu = replace(GPUS["h100_80gb"], attention_achievable=None, saturation_tokens=0.0)
    cluster = ClusterSpec(nodes=1, gpus_per_node=1, gpu=gpu)
    full, adapted = (estimate_step_time(s, cluster, 32, 8, 8, 1, 1, 0).compute for s in (SHAPE, lora))
    total = model_flops_per_token(SHAPE, 32)
    assert adapted / full == pytest.approx((total - 2 * 80_128 + 6 * 8192) / total)
    # its MFU counts the FLOPs an adapter step needs (8 x 32 tokens), not a full step's
    assert estimate_step_time(lora, cluster, 32, 8, 8, 1, 1, 0).model_flops_per_step == \
        pytest.approx((total - 2 * 80_128 + 6 * 8192) * 256)


def test_an_adapter_runs_checkpoint_is_planned_at_the_size_of_what_trains():
    """12 bytes (weight, fp32 master, two moments) per trained parameter: 2 layers x 4,096 adapter elements, plus the
    head's 100 x 64 when it is trained whole; the whole model's otherwise."""
    from lightning_mgpu.cli.plan_run import checkpoint_bytes

    assert checkpoint_bytes(replace(SHAPE, adapters=LoraShape(4))) == 12 * 8192
    assert checkpoint_bytes(replace(SHAPE, adapters=LoraShape(4, modules_to_save=("lm_head",)))) == 12 * (8192 + 6400)
    assert checkpoint_bytes(SHAPE) == 12 * SHAPE.num_parameters()
