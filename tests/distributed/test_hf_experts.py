"""Expert parallelism for a ``transformers`` mixture of experts as it is, driven as a user drives it: a plain
LightningModule holding the model, ``Trainer(strategy=MGPUStrategy(expert_parallel_size=2, ...))``. Qwen3-MoE at ep2
under ZeRO-1 and ZeRO-3, over context-parallel ranks (cp2), with tensor and sequence parallelism (ZeRO-0: the experts,
whole on both tensor-parallel ranks, counted once in the package's global norm) and with pipeline stages (1F1B);
Mixtral (ZeRO-2); gpt-oss (expert biases, its clamped gate, attention sinks; ZeRO-1 and ZeRO-3, tp2 + SP, pp2 1F1B);
DeepSeek V3 (a dense first layer, a shared expert, group-limited routing, latent attention; ZeRO-0, tp2 + SP, pp2 under
1F1B and ZBV, cp2 at ZeRO-3; and 2 layers at pp2 under ZeRO 0, 1 and 3, where pipeline rank 0 holds the dense layer
alone and trains beside an expert placeholder whose gradient is zero). gpt-oss's attention sinks under context
parallelism are refused.

Each rank holds half the routed experts (local shapes asserted), tokens travel by all-to-all, and the model's router,
top-k, normalisation and load-balancing loss (``output_router_logits=True``, coefficient 0.1) are its own; where the
layout splits sequences (cp2, SP) or layers (pp2 under 1F1B, and ZBV without experts split: a V schedule) the loss is
formed over the whole micro-batch and every layer (``lightning_mgpu.hf.router_loss``). The reference is one process
running the same model from the same weights, written here as a plain loop: one call of the model with
transformers' own experts per micro-batch (each data rank's batch, under pipeline stages each pipeline micro-batch of
it), the mean of their losses (what data parallelism computes: the model's auxiliary loss counts each call's tokens),
the global gradient norm before clipping. Loss, gradient norm and the model's auxiliary loss (the router's statistics)
each step within 1e-5; under pipeline stages the auxiliary losses are those the last stage formed."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from helpers import in_turn, max_abs_diff
from hf_helpers import CLIP, MICRO, VOCAB, token_ids
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUStrategy, parameter_shape
from lightning_mgpu.hf import find_hf_model
from lightning_mgpu.hf.context import attention_sink_problems
from lightning_mgpu.parallel.frozen import EXPERT_PLACEHOLDER, is_placeholder
from lightning_mgpu.testing import run_distributed

EXPERTS = 8
STEPS = 3


def routed_config(family: str, n_layers: int, aux: bool) -> Any:
    """A tiny model of ``family`` with 8 experts, top-2; the load-balancing loss in the model's loss where ``aux``."""
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                 num_experts_per_tok=2, output_router_logits=aux, router_aux_loss_coef=0.1, attn_implementation="sdpa")
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=EXPERTS, **shape)
    if family == "gpt_oss":  # expert biases, its clamped gate, attention sinks; sliding and full attention in turn
        return transformers.GptOssConfig(num_local_experts=EXPERTS, **{**shape, "intermediate_size": 16,
                                                                         "attn_implementation": "eager"})
    if family == "deepseek_v3":  # a dense first layer, a shared expert, group-limited routing (4 groups, top 2)
        return transformers.DeepseekV3Config(
            n_routed_experts=EXPERTS, moe_intermediate_size=16, first_k_dense_replace=1, n_group=4, topk_group=2,
            n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, **{**shape, "num_key_value_heads": 4})
    return transformers.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=16, norm_topk_prob=True, **shape)


def routed_model(family: str, n_layers: int, aux: bool) -> torch.nn.Module:
    torch.manual_seed(11)
    return transformers.AutoModelForCausalLM.from_config(routed_config(family, n_layers, aux))


class RoutedLM(L.LightningModule):
    """What a user writes: the model's own ``labels=`` loss; its auxiliary loss kept for the test to read."""

    def __init__(self, family: str, n_layers: int, aux: bool) -> None:
        super().__init__()
        self.llm = routed_model(family, n_layers, aux)
        self.aux_losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.llm(input_ids=batch, labels=batch)
        if out.aux_loss is not None:
            self.aux_losses.append(float(out.aux_loss.detach()))
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_ids(), batch_size=MICRO)


class Seen(L.Callback):
    def __init__(self) -> None:
        self.batches, self.losses, self.grad_norms = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch.clone())
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.grad_norms.append(trainer.strategy.last_grad_norm)
        router, pipeline = getattr(module.llm, "mgpu_router_loss", None), trainer.strategy.pipeline
        if router is not None and pipeline is not None and pipeline.has_last:  # the step's micro-batches, in order
            module.aux_losses += [float(v) for v in list(router.values)[-pipeline.n_microbatches:]]


def fit_routed(rank: int, devices: int, family: str = "qwen3_moe", n_layers: int = 2, aux: bool = True,
               **strategy: Any) -> dict:
    """One ``Trainer.fit`` of :class:`RoutedLM` on this rank: what it saw, its local shapes and coordinates."""
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**strategy), max_steps=STEPS,
                        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[seen])
    module = RoutedLM(family, n_layers, aux)
    trainer.fit(module)
    layout = trainer.strategy.layout
    return {"rank": rank, "batches": seen.batches, "losses": seen.losses, "grad_norms": seen.grad_norms,
            "aux": module.aux_losses, "shapes": {n: tuple(parameter_shape(p)) for n, p in module.named_parameters()},
            "coords": {axis: layout.rank(axis) for axis in ("tp", "pp", "dp", "ep")},
            "placeholders": {n.rpartition(".")[2]: (tuple(parameter_shape(p)), getattr(p, "expert_partition", None))
                             for n, p in trainer.strategy.model.module.named_parameters() if is_placeholder(n)},
            "implementation": module.llm.config._experts_implementation}


def reference(family: str, n_layers: int, aux: bool, micro_batches: list[list[torch.Tensor]]) -> dict:
    """One process, transformers' own experts: per step the mean of the micro-batches' losses (one call of the model
    each: the data ranks' batches, and under pipeline stages each pipeline micro-batch of them), their auxiliary losses,
    the global gradient norm before clipping at ``CLIP``, torch's AdamW."""
    model = routed_model(family, n_layers, aux)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms, auxes = [], [], []
    for parts in micro_batches:
        outs = [model(input_ids=part, labels=part) for part in parts]
        loss = sum(out.loss for out in outs) / len(outs)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        auxes.append([float(out.aux_loss.detach()) for out in outs] if aux else [])
    return {"losses": losses, "grad_norms": norms, "aux": auxes}


def micro_batches(results: list[dict], pieces: int = 1) -> list[list[torch.Tensor]]:
    """Each step's micro-batches, in dp order, each data-parallel coordinate's batch cut into ``pieces`` (the pipeline
    micro-batches)."""
    by_dp = {r["coords"]["dp"]: r["batches"] for r in sorted(results, key=lambda r: r["rank"])}
    return [[part for d in sorted(by_dp) for part in by_dp[d][step].tensor_split(pieces)] for step in range(STEPS)]


#: name -> (ranks, run arguments). Runs of one world size share one launch; between them every ZeRO stage.
RUNS = {
    "ep2_zero1": (2, dict(expert_parallel_size=2, zero_stage=1)),
    "ep2_zero3": (2, dict(expert_parallel_size=2, zero_stage=3)),
    "mixtral_ep2_zero2": (2, dict(family="mixtral", expert_parallel_size=2, zero_stage=2)),
    "mixtral_ep2_zero3": (2, dict(family="mixtral", expert_parallel_size=2, zero_stage=3)),
    "mixtral_ep2_tp2_sp_zero1": (4, dict(family="mixtral", expert_parallel_size=2, tensor_parallel_size=2,
                                         sequence_parallel=True, zero_stage=1)),
    "mixtral_ep2_pp2_1f1b_zero2": (4, dict(family="mixtral", expert_parallel_size=2, pipeline_parallel_size=2,
                                           num_microbatches=2, zero_stage=2)),
    "gpt_oss_ep2_zero1": (2, dict(family="gpt_oss", expert_parallel_size=2, zero_stage=1)),
    "deepseek_v3_ep2_zero0": (2, dict(family="deepseek_v3", expert_parallel_size=2, zero_stage=0, aux=False)),
    "ep2_cp2": (2, dict(expert_parallel_size=2, context_parallel_size=2, zero_stage=1)),
    "pp2_zbv": (2, dict(n_layers=4, pipeline_parallel_size=2, pipeline_schedule="zbv", virtual_pipeline_size=2,
                        num_microbatches=2, zero_stage=1)),
    "ep2_tp2_sp_zero0": (4, dict(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True, zero_stage=0)),
    "ep2_pp2_1f1b": (4, dict(expert_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2, zero_stage=1)),
    # gpt-oss: its plan splits the embedding only (attention with its sinks, and the experts, whole on each tp rank)
    "gpt_oss_ep2_tp2_sp_zero0": (4, dict(family="gpt_oss", expert_parallel_size=2, tensor_parallel_size=2,
                                         sequence_parallel=True, zero_stage=0, aux=False)),
    "gpt_oss_ep2_pp2_1f1b": (4, dict(family="gpt_oss", expert_parallel_size=2, pipeline_parallel_size=2,
                                     num_microbatches=2, zero_stage=1, aux=False)),
    "gpt_oss_ep2_zero3": (2, dict(family="gpt_oss", expert_parallel_size=2, zero_stage=3, aux=False)),
    # DeepSeek V3: MLA projections and the dense layer's MLP split by its plan
    "deepseek_v3_ep2_tp2_sp_zero0": (4, dict(family="deepseek_v3", expert_parallel_size=2, tensor_parallel_size=2,
                                             sequence_parallel=True, zero_stage=0, aux=False)),
    # 2 layers at pp2: pipeline rank 0 holds the dense layer alone, and an expert placeholder (ZeRO 0, 1 and 3)
    **{f"deepseek_v3_ep2_pp2_1f1b_dense_stage_zero{z}": (4, dict(
        family="deepseek_v3", expert_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2, zero_stage=z,
        aux=False)) for z in (0, 1, 3)},
    "deepseek_v3_ep2_pp2_zbv": (4, dict(family="deepseek_v3", n_layers=4, expert_parallel_size=2,
                                        pipeline_parallel_size=2, pipeline_schedule="zbv", virtual_pipeline_size=2,
                                        num_microbatches=2, zero_stage=1, aux=False)),
    "deepseek_v3_ep2_cp2_zero3": (2, dict(family="deepseek_v3", expert_parallel_size=2, context_parallel_size=2,
                                          zero_stage=3, aux=False)),
}
#: AdamW's learning rate here. Its first steps move every parameter by about the learning rate whatever the size of its
#: gradient, so gradients that differ from one process's only by fp32 rounding (a row-parallel all-reduce sums two
#: partial products) move the next loss by up to 1.15e-5 at 1e-2 on one CPU (AMD EPYC, ep2 x tp2 + SP; under 1e-5 on
#: an Intel Xeon); at 1e-3 the rounding stays far below the tolerance while each step still moves the next loss by
#: 7.7e-4 to 1.1e-2 in each family (77 to 1,100 times it: a wrong update shows).
LR = 1e-3
#: Each expert layer's local experts (half of 8, each whole) by family: the weights' shapes; and the router's weight.
LOCAL = {"qwen3_moe": {"gate_up_proj": (4, 32, 32), "down_proj": (4, 32, 16)},
         "mixtral": {"gate_up_proj": (4, 96, 32), "down_proj": (4, 32, 48)},
         "gpt_oss": {"gate_up_proj": (4, 32, 32), "gate_up_proj_bias": (4, 32), "down_proj": (4, 16, 32),
                     "down_proj_bias": (4, 32)},
         "deepseek_v3": {"gate_up_proj": (4, 32, 32), "down_proj": (4, 32, 16)}}
ROUTER = {"gpt_oss": "router.weight"}
#: Dense layers before the first with experts (DeepSeek V3's ``first_k_dense_replace``).
DENSE_FIRST = {"deepseek_v3": 1}


@functools.cache
def launch(ranks: int) -> dict[str, list[dict]]:
    calls = {name: (fit_routed, (ranks,), kw) for name, (n, kw) in RUNS.items() if n == ranks}
    results = run_distributed(in_turn, ranks, calls)
    return {name: [r[name] for r in results] for name in calls}


@pytest.mark.parametrize("name", list(RUNS))
def test_expert_parallel_equals_one_process(name):
    ranks, kw = RUNS[name]
    results = launch(ranks)[name]
    family, aux, n_layers = kw.get("family", "qwen3_moe"), kw.get("aux", True), kw.get("n_layers", 2)
    pp, ep = kw.get("pipeline_parallel_size", 1), kw.get("expert_parallel_size", 1)
    pieces = kw.get("num_microbatches", 1) if pp > 1 else 1
    expected = reference(family, n_layers, aux, micro_batches(results, pieces))
    by_stage: dict[int, set[int]] = {}  # each pipeline rank's layers: disjoint, together every layer
    for r in results:
        shapes = {n.removeprefix("llm."): s for n, s in r["shapes"].items()}
        held = sorted({int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")})
        assert held and by_stage.setdefault(r["coords"]["pp"], set(held)) == set(held)
        with_experts = set(held) & set(range(DENSE_FIRST.get(family, 0), n_layers))
        for layer in with_experts if ep > 1 else ():  # half the experts, whole
            block = f"model.layers.{layer}.mlp"
            assert {w: shapes[f"{block}.experts.{w}"] for w in LOCAL[family]} == LOCAL[family]
            assert shapes[f"{block}.{ROUTER.get(family, 'gate.weight')}"] == (EXPERTS, 32)  # it sees every expert
        assert (r["implementation"] == "mgpu_expert_parallel") == (ep > 1)
        # a pipeline rank without experts holds one expert placeholder, tagged as its expert-parallel rank's shard
        without = ep > 1 and pp > 1 and not with_experts
        assert r["placeholders"] == ({EXPERT_PLACEHOLDER: ((1,), (r["coords"]["ep"], ep))} if without else {})
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (name, r["losses"], expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5, (name, r["grad_norms"],
                                                                              expected["grad_norms"])
        if aux and (pp == 1 or r["aux"]):  # the model's load-balancing loss of each of this rank's micro-batches
            dp = r["coords"]["dp"]
            mine = [a for step in expected["aux"] for a in step[dp * pieces:(dp + 1) * pieces]]
            assert len(r["aux"]) == len(mine) and max_abs_diff(r["aux"], mine) < 1e-5, (name, r["aux"], mine)
    if aux and pp > 1:  # under pipeline stages the ranks of the last stage form it (each data and tensor coordinate)
        assert len([r for r in results if r["aux"]]) == ranks // pp
    assert sorted(i for layers in by_stage.values() for i in layers) == list(range(n_layers))


def test_attention_sinks_under_context_parallelism_are_refused():
    """gpt-oss adds a learned sink logit per head to its softmax; the context-parallel kernel has none (its sliding
    window, the layout refuses first: with the window set to null only the sinks remain)."""
    module = RoutedLM("gpt_oss", 2, aux=False)
    module.llm.config.sliding_window = None
    found = find_hf_model(module)
    assert [str(p) for p in attention_sink_problems(found, 2)] == [
        "context_parallel_size=2 cannot split GptOssForCausalLM's attention, which adds learned sink logits to its "
        "softmax (2 layers: llm.model.layers.0.self_attn.sinks, ...): the context-parallel kernel has no sink term and "
        "would attend without them; use context_parallel_size=1 (tensor, pipeline, expert and data parallelism split "
        "it)"]
    assert attention_sink_problems(found, 1) == []
    assert attention_sink_problems(find_hf_model(RoutedLM("deepseek_v3", 2, aux=False)), 2) == []
