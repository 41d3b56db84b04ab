"""The recipes of two published mixtures of experts, checked against their families' published ``config.json``:
gpt-oss-120b on 2 nodes (``recipes/gpt_oss_120b_hf_lora_2node.yaml``) and DeepSeek-V3 on 32 nodes
(``recipes/deepseek_v3_hf_32node.yaml``). The planner's parameter counts equal counts worked by hand; each recipe's
dry run equals the planner per rank in parameters and in state bytes; ``mgpu-plan`` finds the recipe's layout fits,
with the figures the recipe's comment states.

The fixtures (``tests/data/hf/<family>/config.json``, read by ``cli_helpers.recipe_overrides``) are the published
files without their ``quantization_config`` (training reads a bf16 copy of the weights) and DeepSeek's ``auto_map``:
- gpt-oss-120b: https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json (MXFP4 experts when published);
- DeepSeek-V3: https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (FP8 blocks when published).
"""

import json
import re

import pytest
from cli_helpers import HF_FAMILIES, REPO, composed, recipe_overrides

from lightning_mgpu.cli.dry_run import rank_shares
from lightning_mgpu.cli.plan import configured_layout_lines
from lightning_mgpu.cli.rules import plan_problems
from lightning_mgpu.cli.spec import config_problems, run_spec
from lightning_mgpu.hf.names import planning_shape
from lightning_mgpu.planner import GPUS, ClusterSpec
from lightning_mgpu.planner.model_stats import attention_matrices, model_flops_per_token


def gpt_oss_120b_by_hand() -> tuple[int, int]:
    """(all, active a token) of gpt-oss-120b as transformers builds it. OpenAI's model card says 116.8B and 5.1B
    active; its 5.13B leaves out the input embedding (a lookup): 5,711,982,912 - 201,088 x 2880 = 5,132,849,472."""
    h, layers, experts, top, vocab = 2880, 36, 128, 4, 201088
    attention = (h * 64 * 64 + 64 * 64) + 2 * (h * 8 * 64 + 8 * 64) + (64 * 64 * h + h) + 64  # q, k, v, o (biased), sinks
    expert = h * 2 * 2880 + 2 * 2880 + 2880 * h + h  # gate_up [h, 2I] + bias, down [I, h] + bias
    shared_by_all = attention + 2 * h + (experts * h + experts)  # two norms, the router (weight and bias)
    rest = 2 * vocab * h + h  # embedding, head (untied), final norm
    return (layers * (shared_by_all + experts * expert) + rest, layers * (shared_by_all + top * expert) + rest)


def deepseek_v3_by_hand() -> tuple[int, int]:
    """(all, active a token) of DeepSeek-V3 as transformers builds it: 61 layers, no multi-token-prediction module.
    DeepSeek publishes 671B + 14B of that module (685B on disk) and 37B active. The module holds one more expert layer
    (11,507,286,016), its projection of [embedding; hidden] (2 x 7168 x 7168) and its own embedding and head copies:
    13.46B by this count."""
    h, heads, vocab = 7168, 128, 129280
    mla = (h * 1536 + 1536 + 1536 * heads * (128 + 64)  # q_a, its norm, q_b to nope + rope dims
           + h * (512 + 64) + 512 + 512 * heads * (128 + 128)  # kv_a (latent + shared rope key), its norm, kv_b
           + heads * 128 * h)  # o_proj
    expert = 3 * h * 2048
    dense = mla + 2 * h + 3 * h * 18432
    moe_common = mla + 2 * h + 256 * h + expert  # the router's weight (its score bias is a buffer), one shared expert
    rest = 2 * vocab * h + h
    return (3 * dense + 58 * (moe_common + 256 * expert) + rest, 3 * dense + 58 * (moe_common + 8 * expert) + rest)


def test_the_planner_counts_gpt_oss_and_deepseek_v3_as_worked_by_hand():
    """Packed experts with biases and attention sinks (gpt-oss), latent attention, a shared expert and dense first
    layers (DeepSeek-V3): the planner's counts, all and active, equal the hand counts above."""
    for family, (whole, active) in (("gpt_oss_120b", gpt_oss_120b_by_hand()), ("deepseek_v3", deepseek_v3_by_hand())):
        shape = planning_shape(json.loads((HF_FAMILIES / family / "config.json").read_text()))
        assert (shape.num_parameters(), shape.num_parameters(active=True)) == (whole, active), family
    assert gpt_oss_120b_by_hand() == (116_829_156_672, 5_711_982_912)
    assert deepseek_v3_by_hand() == (671_026_404_352, 37_552_282_624)


def test_the_planner_counts_latent_attention_by_its_own_widths():
    """DeepSeek-V3's attention: 128 heads whose scores run over 128 + 64 dims and whose values are 128 wide (not
    7168 / 128 = 56), so a token's scores and weighted values cost ``2 x 128 x (192 + 128)`` multiply-adds per key,
    and a full recomputation runs the layer's latent projections again, 187,105,280 weights (worked by hand below)."""
    shape = planning_shape(json.loads((HF_FAMILIES / "deepseek_v3" / "config.json").read_text()))
    assert 2 * shape.n_heads * shape.head_dim == 128 * (128 + 64 + 128)  # QK^T over 192, PV over 128
    h = 7168
    by_hand = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * 256 + 128 * 128 * h  # q_a, q_b, kv_a, kv_b, o
    assert attention_matrices(shape) == by_hand == 187_105_280  # its two latent norms (1536 + 512) are no matmul
    seq = 4096
    assert model_flops_per_token(shape, seq) - model_flops_per_token(shape, 1) == 6.0 * 61 * (seq - 1) * 128 * 160


def figure(comment: str, pattern: str) -> str:
    found = re.search(pattern, comment)
    assert found, f"the recipe's comment states no {pattern!r}"
    return found.group(1)


@pytest.mark.parametrize("recipe", ["gpt_oss_120b_hf_lora_2node", "deepseek_v3_hf_32node"])
def test_a_published_moe_recipe_dry_runs_as_planned_fits_and_states_the_plans_figures(recipe):
    """The recipe at its published shape: accepted before launch; every rank built on the meta device holds the
    planner's parameters (routed experts apart) and the planner's weight, gradient and optimizer bytes; mgpu-plan's
    figures for its layout (fits; GB per GPU; step) are those its comment states. (Every command mgpu-plan prints for
    a recipe, mgpu-train accepts: tests/configs/test_plan_agrees.py, for every recipe.)"""
    overrides = [*recipe_overrides(recipe), "cluster=local"]
    cfg = composed(*overrides)
    assert config_problems(cfg, launching=False) == []
    layout, shares = rank_shares(run_spec(cfg, launching=False))
    model, _ = plan_problems(cfg)
    cluster = ClusterSpec(cfg.trainer.num_nodes, cfg.trainer.devices, GPUS[cfg.plan.gpu])
    row, lines = configured_layout_lines(cfg, model, cluster, str(cfg.trainer.precision), [])
    planned = {key: getattr(row.memory, key) for key in ("parameters", "gradients", "optimizer", "buffers")}
    assert [(s.parameters, s.experts, s.bytes) for s in shares] == [(s.planned, s.planned_experts, planned)
                                                                    for s in shares]
    mine = next(line for line in lines if line.startswith("this configuration:"))  # as mgpu-plan prints it
    assert "; fits;" in mine and row.fits, mine
    comment = (REPO / "recipes" / f"{recipe}.yaml").read_text()
    stated = (figure(comment, r"([\d.]+) GB per 80 GB GPU"), figure(comment, r"step ([\d.]+) s"))
    assert stated == (figure(mine, r"([\d.]+) GB per GPU"), figure(mine, r"step ([\d.]+) s")), (
        f"{recipe}'s comment states {stated}; mgpu-plan prints: {mine}")
