"""The planner counts attention layer by layer over the keys each layer attends: a sliding-window layer (gpt-oss's
alternate layers, Mistral's every layer, Gemma's patterns, Qwen2's upper layers) attends at most its window, not the
whole sequence. Figures worked by hand below; which keys a windowed query sees is transformers' own mask function.

The causal count the planner has always used is ``6 L s q`` FLOPs a token: ``s / 2`` keys a query, the triangle of
the ``s x s`` square with its diagonal counted half. A windowed layer is counted the same way: a query at position
``i`` attends ``min(i + 1, w)`` keys, their mean over the sequence less the same half key."""

import json
from dataclasses import replace

import pytest
import torch
from cli_helpers import HF_FAMILIES
from transformers.masking_utils import sliding_window_causal_mask_function

from lightning_mgpu.hf.names import attention_windows, planning_shape
from lightning_mgpu.layout import ModelShape
from lightning_mgpu.planner import GPUS, ClusterSpec
from lightning_mgpu.planner.efficiency import attention_flops_per_token, compute_seconds
from lightning_mgpu.planner.hardware import GPUSpec
from lightning_mgpu.planner.memory import estimate_memory
from lightning_mgpu.planner.model_stats import attended_keys, model_flops_per_token, recompute_flops_per_token
from lightning_mgpu.planner.time import estimate_step_time
from lightning_mgpu.split_rules import context_model_problems

#: 4 layers of 4 heads of 16 (q = 64); Qwen2 windows the layers from max_window_layers = 2 on, window 4.
QWEN2 = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             intermediate_size=128, vocab_size=256, use_sliding_window=True, sliding_window=4, max_window_layers=2)
GPT_OSS = json.loads((HF_FAMILIES / "gpt_oss_120b" / "config.json").read_text())


def test_each_family_windows_the_layers_its_config_says():
    """Written from each family's rule: Mistral windows every layer; Gemma 2 and gpt-oss alternate, starting with a
    windowed one; Gemma 3 keeps one full layer in six (the sixth); Qwen2 windows from ``max_window_layers`` on and not
    at all without ``use_sliding_window``; Qwen3-MoE's published config has the switch off; a family transformers
    does not know is read from its ``layer_types`` as written."""
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    assert attention_windows(dict(small, model_type="mistral", num_hidden_layers=3, sliding_window=8)) == (8, 8, 8)
    assert attention_windows(dict(small, model_type="mistral", num_hidden_layers=3, sliding_window=None)) == ()
    assert attention_windows(dict(small, model_type="gemma2", num_hidden_layers=4, sliding_window=8)) == (8, 0, 8, 0)
    gemma3 = dict(small, model_type="gemma3_text", num_hidden_layers=7, sliding_window=8)
    assert attention_windows(gemma3) == (8, 8, 8, 8, 8, 0, 8)
    assert attention_windows(QWEN2) == (0, 0, 4, 4)
    assert attention_windows(dict(QWEN2, use_sliding_window=False)) == ()
    assert attention_windows(GPT_OSS) == (128, 0) * 18
    assert attention_windows(json.loads((HF_FAMILIES / "qwen3_30b_a3b" / "config.json").read_text())) == ()
    unknown = dict(small, model_type="not_a_family", num_hidden_layers=2, sliding_window=8,
                   layer_types=["full_attention", "sliding_attention"])
    assert attention_windows(unknown) == (0, 8)


def test_a_window_of_4_over_16_tokens_by_hand():
    """Window 4, sequence 16: the queries at 0, 1, 2 attend 1, 2, 3 keys and the other 13 attend 4: 58 / 16 = 3.625,
    3.125 in the causal count; a full layer 8. Two of each: 22.25 keys a token. Scores and weighted values cost
    ``12 q`` a key forward and backward: 12 x 64 x 22.25 = 17,088 FLOPs a token (24,576 = 6 x 4 x 16 x 64 with no
    window, 7,488 more); selective recomputation runs their forward again, 4 x 64 x 22.25 = 5,696."""
    mask = sliding_window_causal_mask_function(4)  # transformers' own: which keys a windowed query attends
    q, k = torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert int(mask(0, 0, q, k).sum()) == 58
    shape = planning_shape(QWEN2)
    whole = replace(shape, attention_windows=())
    assert attended_keys(shape, 16) == 22.25 and attended_keys(whole, 16) == 32
    assert model_flops_per_token(whole, 16) - model_flops_per_token(shape, 16) == 7_488
    assert attention_flops_per_token(shape, 16, "none") == 17_088
    assert attention_flops_per_token(shape, 16, "selective") == 17_088 + 5_696
    assert recompute_flops_per_token(shape, 16, "selective") == 5_696
    assert recompute_flops_per_token(whole, 16, "full") - recompute_flops_per_token(shape, 16, "full") == 4 * 64 * 9.75
    assert attended_keys(shape, 4) == attended_keys(whole, 4) == 8  # a window as long as the sequence: no change
    gpu = GPUSpec("test", 1e9, 1e12, 1e9, 1e9, achievable=0.5, attention_achievable=0.1, saturation_tokens=768)
    # 1,000 tokens: 1.7088e7 attention FLOPs at 0.1 of 1e12; the rest at 0.5 x 256 / (256 + 768) = 0.125
    expected = 1.7088e7 / 1e11 + (1e12 - 1.7088e7) / 1.25e11
    assert compute_seconds(shape, "none", 1e12, 1000, gpu, 0.5, 16, 256) == pytest.approx(expected, rel=1e-12)


def test_gpt_oss_120b_attends_its_window_in_half_its_layers():
    """At sequence 4096, the 18 full layers attend 2,048 keys a query and the 18 windowed ones (window 128) attend
    (128 x 129 / 2 + 3,968 x 128) / 4,096 - 0.5 = 125.515625: 39,123.28125 keys a token, whose scores cost
    12 x 4,096 x that = 1,922,987,520 FLOPs (3,623,878,656 counted as full). The weights a token runs through:
    5,711,982,912 active (tests/configs/test_published_moe_recipes.py) less the embedding (201,088 x 2,880) and the
    norms (2,880 x 73), 5,132,639,232, at 6 FLOPs each: 32.72 GFLOP a token in all, not 34.42. MFU counts those."""
    shape = planning_shape(GPT_OSS)
    assert attended_keys(shape, 4096) == 39_123.28125
    weights = 5_711_982_912 - 201_088 * 2880 - 2880 * 73
    assert model_flops_per_token(shape, 4096) == 6 * weights + 1_922_987_520 == 32_718_822_912
    assert model_flops_per_token(replace(shape, attention_windows=()), 4096) == 6 * weights + 3_623_878_656
    cluster = ClusterSpec(2, 8, GPUS["h100_80gb"])
    step = estimate_step_time(shape, cluster, 4096, 128, 2, 1, 1, 0, selective=True, ep=8)
    assert step.model_flops_per_step == 32_718_822_912 * 128 * 4096


def test_a_window_changes_neither_memory_nor_the_context_parallel_refusal():
    """The attention kernel keeps its output and log-sum-exp whatever the mask, so activations do not shrink with the
    window; context parallelism stays refused for a windowed model (its kernel does not mask a window)."""
    shape = planning_shape(GPT_OSS)
    whole = replace(shape, attention_windows=())
    for mode in ("none", "selective"):
        assert estimate_memory(shape, 4096, 2, 1, 1, 16, 0, mode=mode, ep=8) == \
            estimate_memory(whole, 4096, 2, 1, 1, 16, 0, mode=mode, ep=8)
    model = ModelShape.of(shape)
    refused = context_model_problems(2, 1, model.sliding_window, model.context_with_pipeline)
    assert len(refused) == 1 and "sliding_window=128" in refused[0].rule
    assert ModelShape.of(planning_shape(QWEN2)).sliding_window == 4
