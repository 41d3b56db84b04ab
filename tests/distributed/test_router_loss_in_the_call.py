"""The model's own load-balancing loss asked for as users may ask for it, on layouts that split tokens or layers:

1. ``output_router_logits=True`` given in the call (as ``transformers`` allows) with the config's left False, under cp2
   and tp2 + SP: formed over the whole sequence as one process forms it (before, each rank formed it over its own
   shard: 3.2e-3 and 1.3e-2 off in the aux loss, with no refusal).
2. Doge's causal LM has ``num_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef`` and a
   ``load_balancing_loss_func``, but its function routes by product keys (logits ``[2, tokens, sqrt(E)]``): refused by
   name before launch (before, a RuntimeError at the first pipeline step)."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from helpers import in_turn, max_abs_diff
from hf_helpers import CLIP
from test_hf_experts import LR, STEPS, RoutedLM, Seen, micro_batches, routed_model
from torch import nn

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.hf import find_hf_model
from lightning_mgpu.hf.router_loss import RouterLoss, router_loss_problems
from lightning_mgpu.layout import LayoutRequest
from lightning_mgpu.testing import run_distributed

#: name -> layout, each of 2 ranks; the model's config has output_router_logits=False.
LAYOUTS = {"cp2": dict(expert_parallel_size=2, context_parallel_size=2, zero_stage=1),
           "tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=0)}


class AskedInTheCall(RoutedLM):
    """The loss asked for in the call, the config's ``output_router_logits`` left False."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.llm(input_ids=batch, labels=batch, output_router_logits=True)
        self.aux_losses.append(float(out.aux_loss.detach()))
        return out.loss


def fit_asked(rank: int, **strategy: Any) -> Any:
    """What this rank saw, or the message of a refusal."""
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(**strategy), max_steps=STEPS,
                        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[seen])
    module = AskedInTheCall("qwen3_moe", 2, aux=False)
    try:
        trainer.fit(module)
    except ValueError as error:
        return str(error)
    return {"batches": seen.batches, "losses": seen.losses, "aux": module.aux_losses,
            "dp": trainer.strategy.layout.rank("dp")}


def one_process(steps: list[list[torch.Tensor]]) -> dict:
    """Each step's mean loss and each call's load-balancing loss, the loss asked for in the call."""
    model = routed_model("qwen3_moe", 2, aux=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, auxes = [], []
    for parts in steps:
        outs = [model(input_ids=part, labels=part, output_router_logits=True) for part in parts]
        loss = sum(out.loss for out in outs) / len(outs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        auxes.append([float(out.aux_loss.detach()) for out in outs])
    return {"losses": losses, "aux": auxes}


@functools.cache
def launch() -> dict[str, list[Any]]:
    results = run_distributed(in_turn, 2, {name: (fit_asked, (), kw) for name, kw in LAYOUTS.items()})
    return {name: [r[name] for r in results] for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_loss_asked_for_in_the_call_is_formed_over_the_whole_sequence(name):
    results = launch()[name]
    assert not any(isinstance(r, str) for r in results), results  # Qwen3-MoE forms it as transformers' families do
    expected = one_process(micro_batches([{"rank": i, "coords": {"dp": r["dp"]}, **r}
                                          for i, r in enumerate(results)]))
    for r in results:
        assert max_abs_diff(r["aux"], [step[r["dp"]] for step in expected["aux"]]) < 1e-5, (r["aux"], expected["aux"])
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (r["losses"], expected["losses"])


class Holder(nn.Module):
    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.llm = llm


def test_a_family_whose_loss_is_formed_otherwise_is_refused_or_formed_as_it_forms_it():
    config = transformers.DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     is_moe=True, num_experts=16, num_experts_per_tok=2, output_router_logits=True,
                                     router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if router_loss_problems(find_hf_model(Holder(model)), LayoutRequest(pipeline_parallel_size=2).build(2)):
        return  # refused before launch
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    router = RouterLoss(model)
    assert router.loss(*router.statistics(out.router_logits, None, router.zeros(ids.device))).item() == \
        pytest.approx(out.aux_loss.item(), abs=1e-6)
