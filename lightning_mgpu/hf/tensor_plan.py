"""A ``transformers`` model's own tensor-parallel plan, translated onto the package's styles.

``transformers`` configs carry ``base_model_tp_plan`` (its causal-LM classes add the head, the model instance holds
both as ``_tp_plan`` under full names). Each entry becomes a style of :mod:`lightning_mgpu.parallel.plan`:

=================================  ===================================================================================
``colwise``                        ``colwise``; the module holding it (attention, MLP) gets ``enter_region``, so its
                                   input enters the region once for all its column-parallel linears
``rowwise``                        ``rowwise``
``replicated_with_grad_allreduce`` ``grad_sum`` (Qwen3's per-head q/k norms: each rank normalises its own heads)
``embedding_rowwise``              ``vocab_embedding_allreduce`` (whole sequence out: the model reads positions off it)
``colwise_gather_output`` (head)   ``vocab_output_enter``: logits stay sharded over the vocabulary, and the model's
                                   ``labels=`` loss becomes the vocabulary-parallel one (:mod:`lightning_mgpu.hf.loss`)
``colwise_gather_output`` (other)  ``colwise_gather``, and ``enter_region`` on the module holding it: the output is
                                   whole on every rank (OLMo 2's q/k norms span every head; Phi-3's fused q/k/v)
``rowwise_split_input``            ``rowwise_split``: each rank takes its chunk of the whole input
``moe_tp_experts``, ``packed_*``   nothing: the experts stay whole on every tensor-parallel rank (expert parallelism
                                   splits them by expert: :mod:`lightning_mgpu.hf.expert_parallel`)
=================================  ===================================================================================

With sequence parallelism the residual stream between a run of decoder layers is cut along the sequence: the first
layer's input is scattered (``sequence_scatter``), the last layer's output gathered (``sequence_gather``), every
other part of a layer that computes each position on its own (its norms, a mixture of experts) sees only a shard and
sums its gradients (``grad_sum_sp``), and a part that mixes positions and holds no split layer (DeepSeek's attention,
which its plan leaves whole) runs on the whole sequence (``whole_sequence_sp``). Any other style is refused by module
and name.
"""

from __future__ import annotations

from torch import nn

from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.parallel.plan import plan_pattern
from lightning_mgpu.problems import format_problems

#: transformers' style -> this package's style (the head's ``colwise_gather_output`` is :data:`HEAD_STYLE`).
STYLE_OF = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "replicated_with_grad_allreduce": "grad_sum",
    "embedding_rowwise": "vocab_embedding_allreduce",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
}
#: The output embeddings' style: logits stay split over the vocabulary for the vocabulary-parallel loss.
HEAD_STYLE = "vocab_output_enter"
#: Styles whose module's holder (attention, MLP) enters the tensor-parallel region for them.
ENTERED_BY_HOLDER = ("colwise", "colwise_gather_output")
#: transformers' styles of mixture-of-experts weights: the experts stay whole on every tensor-parallel rank (each rank
#: computes every expert for the whole sequence; under sequence parallelism for its shard, summing the gradients).
KEPT_WHOLE = ("moe_tp_experts", "packed_colwise", "packed_rowwise")


def hf_tp_plan(found: HFModel) -> dict[str, str]:
    """``{module name pattern in the LightningModule: style}`` from the model's own plan. Raises one ``ValueError``
    naming every entry whose style has no counterpart here."""
    source = dict(getattr(found.model, "_tp_plan", None) or {})
    if not source:
        raise ValueError(f"{type(found.model).__name__}'s config carries no tensor-parallel plan (base_model_tp_plan); "
                         "define tensor_parallel_plan() on the LightningModule returning {module name pattern: style} "
                         "(styles of lightning_mgpu.parallel.plan), or pass MGPUStrategy(tensor_parallel_plan=...)")
    source = {key: style for key, style in source.items() if _matches_a_module(found.model, key)}
    unknown = [f"{found.prefix}{key}: style {style!r} has no counterpart here (known: {', '.join(STYLE_OF)}); "
               f"write the plan by hand with tensor_parallel_plan(), splitting that module with this package's styles "
               f"or leaving it out (whole on every rank)" for key, style in source.items()
               if style not in STYLE_OF and style not in KEPT_WHOLE]
    if unknown:
        raise ValueError(format_problems(f"Cannot translate {type(found.model).__name__}'s tensor-parallel plan",
                                         unknown))
    head = _head_name(found.model)
    plan = {found.prefix + key: HEAD_STYLE if key == head else STYLE_OF[style] for key, style in source.items()
            if style in STYLE_OF}
    names = [name for name, _ in found.model.named_modules()]
    for key, style in source.items():
        if style in ENTERED_BY_HOLDER and key != head:
            holders = {name.rpartition(".")[0] for name in names if plan_pattern(key).fullmatch(name)}
            plan.update({found.prefix + k: "enter_region" for k in _as_keys(key.rpartition(".")[0], holders, names)})
    return {**plan, **_sequence_parallel_entries(found, plan)}


def _as_keys(pattern: str, matched: set[str], names: list[str]) -> list[str]:
    """``pattern`` when it matches exactly the modules ``matched``, else their names one by one: a holder pattern
    (``layers.*.mlp``) must not also match the mixture-of-experts blocks of a model whose first layers are dense
    (DeepSeek's), which compute their experts whole and would sum their input gradient once per rank."""
    if {name for name in names if plan_pattern(pattern).fullmatch(name)} == matched:
        return [pattern]
    return sorted(matched)


def _head_name(model: nn.Module) -> str:
    """The name of the model's output embeddings (``lm_head``) among its modules."""
    head = model.get_output_embeddings()
    return next((name for name, module in model.named_modules() if module is head), "lm_head")


def _matches_a_module(model: nn.Module, key: str) -> bool:
    """A plan is written for a family: entries for parts a given config lacks (the dense MLP of a model whose every
    layer holds experts, or a parameter such as ``experts.down_proj`` rather than a module) match nothing."""
    return any(plan_pattern(key).fullmatch(name) for name, _ in model.named_modules())


def _sequence_parallel_entries(found: HFModel, plan: dict[str, str]) -> dict[str, str]:
    """Under sequence parallelism (the styles below do nothing without it): the run of layers in and out, and the
    layers' own parameters outside the entered regions."""
    layers = found.layers_prefix
    entries = {f"{layers}.0": "sequence_scatter", f"{layers}.{found.n_layers - 1}": "sequence_gather"}
    covered = [plan_pattern(key) for key in plan]
    # (a layer's child, its style) -> the layers' modules of that name and style with parameters outside the regions;
    # the style is each module's own (a hybrid model's `mixer` is attention in some layers, an MLP in others)
    uncovered: dict[tuple[str, str], set[str]] = {}
    names = []
    for index, layer in found.layers.named_children():
        for child, module in layer.named_children():
            name = f"{layers}.{index}.{child}"
            names.append(name)
            if any(True for _ in module.parameters()) and not any(p.fullmatch(name) for p in covered):
                style = "grad_sum_sp" if _token_wise(child, module) else "whole_sequence_sp"
                uncovered.setdefault((child, style), set()).add(name)
    for (child, style), matched in uncovered.items():
        entries.update({key: style for key in _as_keys(f"{layers}.*.{child}", matched, names)})
    return entries


#: Parts of a name (the child's or its class's, lower case) that mark a module computing each position on its own.
TOKEN_WISE = ("norm", "mlp", "moe", "expert", "feed_forward", "feedforward")


def _token_wise(child: str, module: nn.Module) -> bool:
    """Whether a layer's child computes each position on its own (a norm, an MLP, a mixture of experts), so that under
    sequence parallelism it runs on this rank's shard and sums its gradients; anything else (an attention the plan
    leaves whole, a convolution along the sequence) runs on the whole sequence on every rank."""
    names = (child.lower(), type(module).__name__.lower())
    if any("norm" in name for name in names):
        return True
    if any("attn" in name or "attention" in name for name in names):  # GraniteMoeAttention: "moe" in a family name
        return False
    return any(part in name for part in TOKEN_WISE for name in names)
