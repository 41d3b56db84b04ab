"""The sums behind a ``transformers`` mixture of experts' load-balancing loss (``lightning_mgpu.hf.router_loss``),
without processes: formed layer by layer and carried from one group of layers to the next (as pipeline stages carry
them), they give the model's own ``aux_loss`` of the same call, with and without a padding mask, for each family whose
causal LM forms it that way; a model that forms it otherwise is refused where a layout splits its tokens or layers.
The distributed half (the reductions over ranks, the stages) is in ``tests/distributed/test_hf_experts.py``."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from lightning_mgpu.hf import find_hf_model
from lightning_mgpu.hf.router_loss import RouterLoss, router_loss_problems
from lightning_mgpu.layout import LayoutRequest

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True,
             router_aux_loss_coef=0.1)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=16, head_dim=8, **SHAPE),
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=8, head_dim=8, **SHAPE),
    "gpt_oss": lambda: transformers.GptOssConfig(num_local_experts=8, head_dim=8, **SHAPE),
    "granitemoe": lambda: transformers.GraniteMoeConfig(num_local_experts=8, **SHAPE),
}


class Holder(nn.Module):
    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.llm = llm


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_sums_carried_over_groups_of_layers_give_the_models_own_loss(family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(3, 10, dtype=torch.long)
    padding[0, :4], padding[2, :2] = 0, 0
    router = RouterLoss(model)
    for mask in (None, padding):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        first = router.statistics(out.router_logits[:1], mask, router.zeros(ids.device))  # a stage of one layer
        counts, probs = router.statistics(out.router_logits[1:], mask, first)  # the next stage, from what it received
        assert counts.dtype == torch.int64 and not counts.requires_grad and probs.requires_grad
        assert int(counts[-1]) == 3 * int(ids.numel() if mask is None else mask.sum())  # rows: layers x tokens counted
        assert int(counts[:-1].sum()) == 2 * int(counts[-1])  # top-2: two assignments a row
        whole = router.loss(counts, probs).item()
        assert whole == pytest.approx(out.aux_loss.item(), abs=1e-6)
        assert whole != pytest.approx(router.loss(*first).item(), abs=1e-6)  # one layer's alone is another number


def test_a_load_balancing_loss_formed_otherwise_is_refused_where_the_layout_splits_tokens_or_layers():
    """JetMoe's causal LM weighs its loss by ``aux_loss_coef``, not ``router_aux_loss_coef``: what it adds cannot be
    assumed to be the loss formed here, so pipeline stages, context and sequence parallelism are refused together."""
    config = transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, kv_channels=8, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, output_router_logits=True)
    found = find_hf_model(Holder(transformers.AutoModelForCausalLM.from_config(config)))
    layout = LayoutRequest(tensor_parallel_size=2, pipeline_parallel_size=2, context_parallel_size=2,
                           sequence_parallel=True).build(8)
    assert [str(p) for p in router_loss_problems(found, layout)] == [
        "output_router_logits=True with JetMoeForCausalLM: its load-balancing loss is not formed as transformers' "
        "mixtures of experts form it (num_experts, num_experts_per_tok, router_aux_loss_coef and "
        "load_balancing_loss_func), so it cannot be formed over the tokens and layers that pipeline_parallel_size=2 and "
        "context_parallel_size=2 and "
        "sequence_parallel=True split; set the model's config.output_router_logits=False, or a layout without "
        "pipeline_parallel_size, context_parallel_size, sequence_parallel"]
    assert router_loss_problems(found, LayoutRequest(tensor_parallel_size=2).build(2)) == []  # every token, every layer
    qwen = find_hf_model(Holder(transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]())))
    assert router_loss_problems(qwen, layout) == []
