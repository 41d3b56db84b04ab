"""PEFT's adapter layers in a tensor-parallel plan (no processes): each LoRA wrapper's plan entry becomes entries for
its base layer and its A and B by the base's style, a ``modules_to_save`` copy gets its original's style, and what
has no split rule (DoRA, another tuner, LoRA on the embeddings) is refused by module and tuner, all at once."""

import pytest
import torch
from hf_helpers import tiny_model

from lightning_mgpu.hf.adapters import adapter_plan
from lightning_mgpu.hf.model import find_hf_model
from lightning_mgpu.hf.tensor_plan import hf_tp_plan

peft = pytest.importorskip("peft")

LAYER = "llm.base_model.model.model.layers.0"


def wrapped(config) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.llm = peft.get_peft_model(tiny_model("llama"), config)
    return holder


def plan_of(config) -> tuple[dict, list]:
    holder = wrapped(config)
    return adapter_plan(holder, hf_tp_plan(find_hf_model(holder)))


def test_lora_parts_follow_the_base_split():
    plan, problems = plan_of(peft.LoraConfig(r=4, target_modules="all-linear", modules_to_save=["lm_head"]))
    assert problems == []
    # column-parallel base: A whole (its gradient summed), B split like the base's output
    assert plan[f"{LAYER}.self_attn.q_proj.base_layer"] == "colwise"
    assert plan[f"{LAYER}.self_attn.q_proj.lora_A.default"] == "grad_sum"
    assert plan[f"{LAYER}.self_attn.q_proj.lora_B.default"] == "colwise"
    # row-parallel base: A split like the base's input (its product summed), B whole
    assert plan[f"{LAYER}.mlp.down_proj.base_layer"] == "rowwise"
    assert plan[f"{LAYER}.mlp.down_proj.lora_A.default"] == "rowwise"
    assert plan[f"{LAYER}.mlp.down_proj.lora_B.default"] == "grad_sum_sp"
    # the wrapper itself is no longer named; the head's trainable copy and its frozen original split alike
    assert f"{LAYER}.self_attn.q_proj" not in plan
    assert plan["llm.base_model.model.lm_head.original_module"] == "vocab_output_enter"
    assert plan["llm.base_model.model.lm_head.modules_to_save.default"] == "vocab_output_enter"


def test_what_has_no_split_rule_is_refused_by_module_and_tuner():
    _, problems = plan_of(peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], use_dora=True))
    assert len(problems) == 4 and all("DoRA" in p and "use_dora=False" in p for p in problems), problems
    assert any(f"{LAYER}.self_attn.o_proj" in p for p in problems)
    _, problems = plan_of(peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]))
    assert len(problems) == 4 and all("only LoRA adapters" in p and "LoraConfig" in p for p in problems), problems
    _, problems = plan_of(peft.LoraConfig(r=4, target_modules=["embed_tokens"]))
    assert len(problems) == 1 and "llm.base_model.model.model.embed_tokens" in problems[0], problems
    assert "vocab_embedding_allreduce" in problems[0] and "target_modules" in problems[0]


def test_a_quantized_base_is_refused_naming_the_module():
    """transformers marks a model loaded with a bitsandbytes quantization_config ``is_loaded_in_4bit``; a CPU cannot
    load one, so the mark is set as transformers sets it."""
    from lightning_mgpu.hf.hooks import adopt
    from lightning_mgpu.layout import LayoutRequest

    holder = wrapped(peft.LoraConfig(r=4, target_modules=["q_proj"]))
    holder.llm.get_base_model().is_loaded_in_4bit = True
    with pytest.raises(ValueError, match=r"Module\.llm\.base_model\.model is quantized.*QLoRA.*bf16"):
        adopt(holder, LayoutRequest())


def test_the_packages_model_refuses_adapters_it_cannot_build_listing_every_problem():
    from lightning_mgpu.module import LLMModule

    with pytest.raises(ValueError) as missing:
        LLMModule("tiny", adapters=dict(kind="lora", rank=4))
    assert "no 'alpha'" in str(missing.value) and "no 'targets'" in str(missing.value), missing.value
    with pytest.raises(ValueError, match="adapters.rank=0 must be at least 1"):
        LLMModule("tiny", adapters=dict(kind="lora", rank=0, alpha=8, dropout=0.0, targets="all-linear"))
