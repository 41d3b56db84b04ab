"""Expert parallelism for a ``transformers`` mixture of experts as it is: each rank of the layout's expert-parallel
group (``Ep`` consecutive data x context ranks) keeps ``num_experts / Ep`` of every MoE block's routed experts, and the
tokens routed to the others travel there and back by all-to-all.

The model's own code decides everything but where an expert runs. transformers 5 routes its fused experts
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) through a pluggable experts interface
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, chosen by ``config._experts_implementation``); the model's
``base_model_ep_plan`` names the experts modules (``ep_dispatch_experts``) and their weights split by expert
(``grouped_gemm``). Here one more implementation is registered there: it takes the block's top-k experts and weights
as the model's router computed them (its softmax, top-k, normalisation; its router logits and load-balancing loss stay
the model's), sends each assignment's token to the rank holding its expert (the exchange of the package's own MoE,
:class:`lightning_mgpu.parallel.experts.ExpertWiring`: ``all_to_all_single`` with uneven splits, differentiable),
runs the local experts with the implementation the model had (eager, ``grouped_mm``, ``batched_mm``: transformers'
own code, given the local experts' weights), sends the outputs back and weighs them by the router's weights on the
token's own rank, so the router's gradient never leaves it.

Why not transformers' own expert parallelism (``DistributedConfig(enable_expert_parallel=True)``): it shards the
weights as DTensors over a device mesh of its own, which composes with neither DeepSpeed's ZeRO nor this package's
tensor plans and pipeline stages. The weights kept here are plain local tensors tagged ``expert_partition`` as the
package's own experts are, so the engine reduces and partitions them over the expert-data-parallel ranks, the
checkpoints save them as shards of the whole tensor, and each rank reads only its experts from a ``from_pretrained``
directory. Under tensor parallelism the experts stay whole on every tensor-parallel rank, as without expert
parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.hf.router_loss import router_loss_problems
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.experts import ExpertWiring
from lightning_mgpu.parallel.plan import plan_pattern
from lightning_mgpu.problems import Problem, raise_problems
from lightning_mgpu.split_rules import HF_EXPERT_FAMILIES

#: The name of this package's implementation in transformers' experts interface.
IMPLEMENTATION = "mgpu_expert_parallel"
#: ``base_model_ep_plan`` styles: the experts module, and a weight stacked by expert along its first dimension.
MODULE_STYLE, WEIGHT_STYLE = "ep_dispatch_experts", "grouped_gemm"


@dataclass
class Exchange:
    """What one experts module needs to run split: the layout's exchange and the implementation the model had."""

    wiring: ExpertWiring
    inner: str


def hf_expert_problems(found: HFModel, Ep: int) -> list[Problem]:
    """Why ``found``'s experts cannot be split over ``Ep`` ranks (none when ``Ep`` is 1 or the family is supported)."""
    model_type = getattr(found.config, "model_type", "?")
    if Ep == 1 or model_type in HF_EXPERT_FAMILIES:
        return []
    return [Problem("expert_parallel_size", Ep, f"cannot split the experts of a transformers {model_type} model: "
                    f"expert parallelism covers {', '.join(HF_EXPERT_FAMILIES)} only",
                    "use expert_parallel_size=1 (ZeRO-3 shards the experts' weights over the data-parallel ranks)")]


def expert_modules(found: HFModel) -> dict[str, tuple[nn.Module, list[str]]]:
    """``{name in the decoder: (experts module, its weights split by expert)}`` from ``base_model_ep_plan``."""
    plan = dict(getattr(found.config, "base_model_ep_plan", None) or {})
    holders = [key for key, style in plan.items() if style == MODULE_STYLE]
    weights = [key.rpartition(".") for key, style in plan.items() if style == WEIGHT_STYLE]
    out = {}
    for name, module in found.base.named_modules():
        if any(plan_pattern(key).fullmatch(name) for key in holders):
            out[name] = (module, [w for holder, _, w in weights if plan_pattern(holder).fullmatch(name)])
    return out


def apply_hf_expert_parallel(found: HFModel, layout: ParallelLayout) -> list[str]:
    """Keep this rank's experts of every experts module of ``found`` and route them through the exchange; the note
    worth reporting (none when ``expert_parallel_size`` is 1). Raises first what the layout cannot do with the model's
    experts or its load-balancing loss (:func:`router_loss_problems`), whatever the expert-parallel size."""
    Ep = layout.size("ep")
    raise_problems("Invalid layout for this mixture of experts", hf_expert_problems(found, Ep) +
                   router_loss_problems(found, layout))
    if Ep == 1:
        return []
    modules, where = expert_modules(found), found.prefix.rstrip(".") or "the model"
    if not modules:
        raise ValueError(f"{where} ({type(found.model).__name__}): its config's base_model_ep_plan names no experts "
                         f"module ({MODULE_STYLE!r}) of the model; use expert_parallel_size=1")
    inner = found.config._experts_implementation or "eager"
    if inner == IMPLEMENTATION:
        raise ValueError(f"{where} is split by expert parallelism already")
    for module, weights in modules.values():
        total = int(module.num_experts)
        module.mgpu_exchange = Exchange(ExpertWiring(layout, total), inner)
        for weight in weights:
            _keep_experts(module, weight, layout, total)
        module.num_experts = total // Ep  # what transformers' implementations read: the experts this rank holds
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, exchanged_experts_forward)
    found.model.set_experts_implementation(IMPLEMENTATION)
    held = next(iter(modules.values()))[0].num_experts
    return [f"experts ({type(found.model).__name__}): {len(modules)} blocks of {held * Ep} experts, {held} on each "
            f"rank of {Ep} (expert parallel, all-to-all dispatch; local experts by {inner})"]


def _keep_experts(module: nn.Module, name: str, layout: ParallelLayout, total: int) -> None:
    """Replace ``module.name`` (stacked by expert along dimension 0) by this rank's experts, tagged with where they
    belong (``expert_partition``: the engine, the checkpoints and ``initial_value`` read it)."""
    whole = getattr(module, name)
    Ep, rank = layout.size("ep"), layout.rank("ep")
    local = total // Ep
    if whole.is_meta:
        kept = nn.Parameter(torch.empty((local, *whole.shape[1:]), device="meta", dtype=whole.dtype),
                            requires_grad=whole.requires_grad)
    else:
        kept = nn.Parameter(whole.detach().narrow(0, rank * local, local).clone(), requires_grad=whole.requires_grad)
    kept.expert_partition = (rank, Ep)  # experts [rank * local, (rank + 1) * local) of ``total``
    setattr(module, name, kept)


def _inner_forward(module: nn.Module, inner: str) -> Callable[..., torch.Tensor]:
    """The implementation ``inner`` of transformers' experts interface, or the class's own (eager) forward."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if inner != "eager" and inner in ALL_EXPERTS_FUNCTIONS:
        return ALL_EXPERTS_FUNCTIONS[inner]
    return type(module).forward.__wrapped__  # the forward that ``use_experts_implementation`` wrapped


def exchanged_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under expert parallelism: ``hidden_states [T, H]``, each token's experts
    ``top_k_index [T, k]`` (of all experts) and router weights ``top_k_weights [T, k]``, as the block's router gave
    them; the weighted sum of each token's experts' outputs ``[T, H]``, as the model's own implementation returns."""
    exchange: Exchange = self.mgpu_exchange
    wiring, k = exchange.wiring, top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # assignments by expert, then token
    counts = torch.bincount(flat, minlength=wiring.local * wiring.Ep)
    rows, local_counts, handle = wiring.dispatch(hidden_states[order // k], counts)
    local = torch.repeat_interleave(torch.arange(wiring.local, device=rows.device), local_counts,
                                    output_size=rows.shape[0])
    ones = rows.new_ones(rows.shape[0], 1, dtype=top_k_weights.dtype)  # weighed below, on the token's own rank
    out = _inner_forward(self, exchange.inner)(self, rows, local.unsqueeze(-1), ones)
    if rows.shape[0] == 0:  # no token for these experts: their weights still get a (zero) gradient
        out = out + sum(p.reshape(-1)[:0].sum() for p in self.parameters())
    back = wiring.combine(out, handle)
    weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
    return hidden_states.new_zeros(hidden_states.shape).index_add(0, order // k, weighted.to(hidden_states.dtype))
