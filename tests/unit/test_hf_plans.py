"""What ``lightning_mgpu.hf`` reads off a ``transformers`` model, without processes: the translated tensor-parallel plan
(hand-written expectations for Qwen3 and Qwen3-MoE), the refusals by name, and the pipeline batch convention."""

import pytest
import torch
import transformers
from hf_helpers import CausalLM, tiny_model

from lightning_mgpu.hf import find_hf_model
from lightning_mgpu.layout import LayoutRequest
from lightning_mgpu.hf.hooks import HFHooks
from lightning_mgpu.hf.stages import HFStage, hf_stages
from lightning_mgpu.hf.tensor_plan import hf_tp_plan


def test_qwen3_plan_translates_onto_the_package_styles():
    plan = hf_tp_plan(find_hf_model(CausalLM("qwen3")))
    layer = "llm.model.layers.*."
    expected = {
        "llm.lm_head": "vocab_output_enter", "llm.model.embed_tokens": "vocab_embedding_allreduce",
        layer + "self_attn": "enter_region", layer + "mlp": "enter_region",
        layer + "self_attn.q_proj": "colwise", layer + "self_attn.k_proj": "colwise",
        layer + "self_attn.v_proj": "colwise", layer + "self_attn.o_proj": "rowwise",
        layer + "self_attn.q_norm": "grad_sum", layer + "self_attn.k_norm": "grad_sum",
        layer + "mlp.gate_proj": "colwise", layer + "mlp.up_proj": "colwise", layer + "mlp.down_proj": "rowwise",
        layer + "input_layernorm": "grad_sum_sp", layer + "post_attention_layernorm": "grad_sum_sp",
        "llm.model.layers.0": "sequence_scatter", "llm.model.layers.1": "sequence_gather",
    }
    assert plan == expected


def test_gathered_outputs_and_split_inputs_translate_with_the_head_kept_split_over_the_vocabulary():
    """Phi-3 marks its fused q/k/v and gate/up ``colwise_gather_output``, as the head is marked: the head's logits stay
    split (the vocabulary-parallel loss), the others are gathered whole, and their holders enter the region."""
    plan = hf_tp_plan(find_hf_model(CausalLM("phi3")))
    layer = "llm.model.layers.*."
    assert {key: plan[key] for key in plan if key.startswith(layer) or key == "llm.lm_head"} == {
        "llm.lm_head": "vocab_output_enter",
        layer + "self_attn": "enter_region", layer + "mlp": "enter_region",
        layer + "self_attn.qkv_proj": "colwise_gather", layer + "self_attn.o_proj": "rowwise_split",
        layer + "mlp.gate_up_proj": "colwise_gather", layer + "mlp.down_proj": "rowwise_split",
        layer + "input_layernorm": "grad_sum_sp", layer + "post_attention_layernorm": "grad_sum_sp"}


def test_each_layer_part_gets_its_own_sequence_parallel_style_in_a_hybrid_model():
    """Nemotron-H's `mixer` is Mamba in layers 0 and 3, attention in 1, an MLP in 2: under sequence parallelism the
    ones that mix positions run on the whole sequence, the MLP on its shard, each named by its own layer (one style
    for all of them, read off one layer, would run Mamba or attention on a shard, or differ between ranks)."""
    plan = hf_tp_plan(find_hf_model(CausalLM("nemotron_h", n_layers=4)))
    mixers = {key: style for key, style in plan.items() if key.endswith(".mixer")}
    layer = "llm.model.layers."
    assert mixers == {layer + "0.mixer": "whole_sequence_sp", layer + "1.mixer": "whole_sequence_sp",
                      layer + "3.mixer": "whole_sequence_sp", layer + "2.mixer": "grad_sum_sp"}, mixers
    assert plan[layer + "*.norm"] == "grad_sum_sp"


def test_experts_stay_whole_and_sum_their_gradients_under_sequence_parallelism():
    plan = hf_tp_plan(find_hf_model(CausalLM("qwen3_moe")))
    assert not any("experts" in key or "gate_proj" in key for key in plan), plan
    assert plan["llm.model.layers.*.mlp"] == "grad_sum_sp"  # the block holding router and experts
    assert plan["llm.model.layers.*.self_attn.q_proj"] == "colwise"


def test_a_style_without_counterpart_is_refused_by_module_and_style():
    module = CausalLM("llama")
    module.llm._tp_plan = {**module.llm._tp_plan, "model.layers.*.mlp.up_proj": "local_colwise",
                           "model.norm": "sequence_parallel"}
    with pytest.raises(ValueError) as refused:
        hf_tp_plan(find_hf_model(module))
    message = str(refused.value)
    assert "llm.model.layers.*.mlp.up_proj: style 'local_colwise'" in message
    assert "llm.model.norm: style 'sequence_parallel'" in message and "tensor_parallel_plan()" in message


def test_a_model_without_plans_is_refused_tensor_parallelism_and_staged_by_its_structure():
    """No tp plan: refused with the hook to write. No pp plan: a Llama's stages come from its one ModuleList of layers,
    its embeddings and its final norm (stage 0 of 2 keeps layer 0 and the embeddings, not the norm or the head)."""
    module = CausalLM("llama")
    module.llm._tp_plan = {}
    module.llm.config.base_model_pp_plan = None
    found = find_hf_model(module)
    with pytest.raises(ValueError, match="carries no tensor-parallel plan.*tensor_parallel_plan"):
        hf_tp_plan(found)
    hf_stages(found, [0], 2)
    kept = {name.split(".")[1] + (f".{name.split('.')[2]}" if ".layers." in name else "")
            for name, _ in module.llm.named_parameters()}
    assert kept == {"embed_tokens", "layers.0"}, kept


def test_a_decoder_part_no_stage_can_place_is_refused_by_name():
    """GPT-2 has no pipeline plan, and its position embeddings ``wpe`` are added inside its forward: refused by name,
    with the hooks to write instead."""
    module = torch.nn.Module()
    module.llm = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                      n_positions=32))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel's config carries no base_model_pp_plan and its decoder "
                                         r"holds \['wpe'\] beside its embeddings \(wte\), layers \(h\).*pipeline_stages"):
        hf_stages(find_hf_model(module), [0], 2)


@pytest.mark.parametrize("family, layers", [("gptj", "llm.transformer.h"), ("gpt_neox", "llm.gpt_neox.layers")])
def test_the_layers_under_their_familys_name_are_cut_along_the_sequence(family, layers):
    """GPT-J keeps its layers as ``h`` (a tensor plan that looked for ``layers`` raised AttributeError)."""
    plan = hf_tp_plan(find_hf_model(CausalLM(family)))
    assert plan[f"{layers}.0"] == "sequence_scatter" and plan[f"{layers}.1"] == "sequence_gather"


def test_tied_embeddings_are_refused_pipeline_stages():
    found = find_hf_model(CausalLM("llama", tied=True))
    with pytest.raises(ValueError, match="tie"):
        hf_stages(found, [0], 2)


def refusals(family: str, **sizes) -> list[str]:
    """What the layout rules say of ``sizes`` (4 ranks) for the shape of a tiny ``family`` model."""
    return [str(p) for p in LayoutRequest(**sizes).problems_with(4, find_hf_model(CausalLM(family)).shape())]


def test_context_parallelism_is_refused_a_sliding_window_and_pipeline_stages():
    """Mistral's window (6 tokens) is not masked by the context-parallel kernel; a transformers model's stages do not
    cut the sequence into chunks; Qwen2's window is switched off by default (use_sliding_window=False)."""
    assert refusals("mistral", context_parallel_size=2) == [
        "context_parallel_size=2 cannot split a model that attends within a sliding window (sliding_window=6): the "
        "context-parallel kernel does not mask one; use context_parallel_size=1 for this model"]
    assert refusals("qwen2", context_parallel_size=2) == []
    assert refusals("llama", context_parallel_size=2, pipeline_parallel_size=2) == [
        "context_parallel_size=2 with pipeline_parallel_size=2: a transformers model's pipeline stages do not cut the "
        "sequence into chunks yet; use one of them"]


def test_expert_parallelism_of_a_transformers_mixture_of_experts_is_refused_outside_the_families_it_splits():
    """Qwen3-MoE's and DeepSeek V3's (n_routed_experts) experts are split (lightning_mgpu.hf.expert_parallel), with
    tensor parallelism too (its experts stay whole on the tensor-parallel ranks: no hidden width to divide);
    GraniteMoE would keep every expert on every rank under expert_parallel_size=2: refused, with the rule and the fix,
    rather than accepted and ignored; size 1 is accepted."""
    for family in ("qwen3_moe", "deepseek_v3"):
        assert refusals(family, expert_parallel_size=2, zero_stage=1) == [], family
    assert refusals("qwen3_moe", expert_parallel_size=2, tensor_parallel_size=2, zero_stage=1) == []
    refused = ("expert_parallel_size=2 cannot split the 4 experts of this transformers mixture of experts (each rank "
               "would still hold every expert): expert parallelism splits those of qwen3_moe, mixtral, gpt_oss, "
               "deepseek_v3 models only; use expert_parallel_size=1 (ZeRO-3 shards the experts' weights over the "
               "data-parallel ranks), or the package's own MoE model (model.num_experts), which expert parallelism "
               "splits")
    assert refusals("granitemoe", expert_parallel_size=2, zero_stage=1) == [refused]
    assert refusals("granitemoe", zero_stage=1) == []


def test_several_models_need_the_naming_hook():
    module = CausalLM("llama")
    module.teacher = tiny_model("qwen2")
    with pytest.raises(ValueError, match="holds 2 transformers models .*llm, teacher.*hf_model"):
        find_hf_model(module)
    module.hf_model = lambda: module.teacher
    assert find_hf_model(module).prefix == "teacher."


def test_a_pipeline_batch_is_token_ids_or_ids_and_labels_in_the_loaders_container():
    """Bare, in a TensorDataset's list or a tuple, or a mapping: the same (ids, labels); a mask, a third element or
    labels of another shape refused, every problem named at once, with what the stages take."""
    hooks = HFHooks(find_hf_model(CausalLM("llama")), None, None)
    ids, labels = torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    assert hooks.pipeline_batch(ids)[1] is ids
    assert hooks.pipeline_batch({"input_ids": ids, "labels": labels})[1] is labels
    for container in (list, tuple):
        assert hooks.pipeline_batch(container([ids])) == (ids, ids)
        assert hooks.pipeline_batch(container([ids, labels])) == (ids, labels)
    with pytest.raises(ValueError, match=r"keys \['token_type_ids'\] that cannot travel between stages.*Fix: yield"):
        hooks.pipeline_batch({"input_ids": ids, "token_type_ids": ids})
    with pytest.raises(ValueError, match=r"got list\(Tensor\[2, 4\], Tensor\[2, 4\], Tensor\[2, 4\]\): 3 elements"):
        hooks.pipeline_batch([ids, labels, ids])
    with pytest.raises(ValueError, match=r"the labels have shape \[2, 3\], the token ids \[2, 4\]"):
        hooks.pipeline_batch((ids, labels[:, :3]))
    with pytest.raises(ValueError, match=r"no input_ids; the labels are str, not a 2-D tensor"):
        hooks.pipeline_batch({"labels": "text"})


def test_a_window_switched_off_in_config_json_does_not_refuse_context_parallelism():
    """Qwen2.5's files carry ``"sliding_window": 32768`` with ``"use_sliding_window": false``: no window."""
    from lightning_mgpu.hf.names import planning_shape

    qwen25 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "sliding_window": 32768,
              "use_sliding_window": False}
    assert planning_shape(qwen25).sliding_window == 0
    assert planning_shape({**qwen25, "use_sliding_window": True}).sliding_window == 32768


def test_stages_in_turn_compute_the_whole_model_with_per_layer_config_lists():
    """Granite SWA reads each layer's rotary base from `layer_rope_theta` (0: no rotary) by the layer's place in its
    decoder's loop: two stages in turn must give the whole model's logits (stage 2 holds layers 2 and 3, whose entry is
    0; read by place it would be layers 0 and 1's)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GraniteSWAConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
                                           layer_types=["full_attention"] * 4, layer_rope_theta=[1e4, 1e4, 0.0, 0.0],
                                           tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    owner = torch.nn.Module()
    owner.llm = model
    found = find_hf_model(owner)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        staged = HFStage(found, 2, 4)(HFStage(found, 0, 2)(ids))
    assert torch.allclose(staged, whole, atol=1e-6), (staged - whole).abs().max()


def test_an_attention_named_after_its_mixture_of_experts_family_runs_on_the_whole_sequence():
    """GraniteMoE's attention class is ``GraniteMoeAttention``: "moe" in the family's name does not make it compute each
    position on its own. Its plan leaves it whole, so under sequence parallelism it runs on the gathered sequence; its
    norms (``post_attention_layernorm`` names attention) on this rank's shard."""
    import torch
    from hf_helpers import tiny_model

    from lightning_mgpu.hf.model import find_hf_model
    from lightning_mgpu.hf.tensor_plan import hf_tp_plan

    holder = torch.nn.Module()
    holder.llm = tiny_model("granitemoe")
    plan = hf_tp_plan(find_hf_model(holder))
    assert plan["llm.model.layers.*.self_attn"] == "whole_sequence_sp"
    assert plan["llm.model.layers.*.post_attention_layernorm"] == "grad_sum_sp"
    assert plan["llm.model.layers.*.block_sparse_moe"] == "grad_sum_sp"
