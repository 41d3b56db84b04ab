"""Pipeline stages of a ``transformers`` causal LM, cut where its ``base_model_pp_plan`` says it can be cut.

A ``transformers`` config's pipeline plan names the decoder's parts in order (``embed_tokens`` -> ``layers`` ->
``norm``, then the causal LM's ``lm_head``) with the names of what flows between them. A stage here is a *view* of
the model: a shallow copy of the causal LM whose decoder holds only the stage's layers (under their original
indices), its embeddings only on the first stage and its final norm and head only on the last. Each stage runs the
decoder's own ``forward`` (so its masks, rotary tables and model-specific scaling are its own): the first stage from
``input_ids``, the others from ``inputs_embeds=`` the hidden states received. The last stage runs the causal LM's own
``forward``, whose logits may be more than the head's output (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
Gemma 2's ``final_logit_softcapping``).
Written here because ``torch.distributed.pipelining``'s tracer-based split does not follow a ``transformers``
forward's Python control flow (caches, mask functions), and its manual ``PipelineStage`` needs a module per stage.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import nn

from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.layout import stage_count_problems, tied_embedding_problems
from lightning_mgpu.models.llama_plan import balanced_boundaries, boundary_problems
from lightning_mgpu.problems import format_problems

#: The parts of the decoder a pipeline plan must name, in order, for the stages below.
DECODER_PARTS = ("embed_tokens", "layers", "norm")


class KeptLayers(nn.ModuleList):
    """Some of a decoder's layers under their original indices (``layers.5`` stays ``layers.5`` in parameter names, so
    checkpoints do not depend on the split). Iteration and slicing give the layers in order, as a ``ModuleList``'s."""

    def __init__(self, layers: Optional[dict[int, nn.Module] | Sequence[nn.Module]] = None) -> None:
        super().__init__()
        items = layers.items() if isinstance(layers, dict) else enumerate(layers or [])
        for index, layer in items:
            self.add_module(str(index), layer)


class HFStage(nn.Module):
    """Layers ``[start, end)`` of a ``transformers`` causal LM, with its embeddings first and its norm and head last."""

    def __init__(self, found: HFModel, start: int, end: int) -> None:
        super().__init__()
        self.first, self.last = start == 0, end == found.n_layers
        view = copy.copy(found.model)
        view._modules = dict(found.model._modules)
        base = copy.copy(found.base)
        base._modules = dict(found.base._modules)
        base.config = _stage_config(found.base.config, start, end)
        base._modules["layers"] = KeptLayers({i: found.base.layers[i] for i in range(start, end)})
        if not self.first:
            base._modules["embed_tokens"] = None
        if not self.last:
            base._modules["norm"] = nn.Identity()
            view._modules[_head_name(found)] = None
        view._modules[found.base_name] = base
        self.base_name, self.head_name = found.base_name, _head_name(found)
        self.add_module(found.base_name, base)
        if self.last:
            self.add_module(self.head_name, view._modules[self.head_name])
        self._view = [view]  # in a list: the view is not a submodule (its parameters are the stage's own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if not self.last:
            return getattr(self, self.base_name)(**given, use_cache=False).last_hidden_state
        view = self._view[0]
        view._modules[self.head_name] = getattr(self, self.head_name)  # the head a tensor-parallel plan swapped in
        return type(view).forward(view, **given, use_cache=False).logits


def _stage_config(config: object, start: int, end: int) -> object:
    """The decoder's config for a stage of layers ``[start, end)``, each per-layer list (one entry a layer) cut to the
    stage's: ``transformers``' decoders look a layer's entry up by its place in their loop, which in a stage is not its
    index in the model (``layer_types``: sliding or full attention, its mask, Gemma 3's rotary table; Granite's
    ``layer_rope_theta``; Nemotron-H's ``layers_block_type``). The layers themselves read their entries by their own
    index when built, from the model's config, which stays whole."""
    n = getattr(config, "num_hidden_layers", None)
    per_layer = {key: value for key, value in vars(config).items() if isinstance(value, (list, tuple)) and
                 len(value) == n and n not in (None, 0)}
    if not per_layer:
        return config
    local = copy.copy(config)
    for key, value in per_layer.items():
        setattr(local, key, type(value)(value[start:end]))
    return local


def _head_name(found: HFModel) -> str:
    plan = getattr(found.model, "_pp_plan", None) or {}
    heads = [name for name in plan if "." not in name]
    return heads[0] if heads else "lm_head"


def pp_plan_problems(found: HFModel) -> list[str]:
    """Why the model's pipeline plan does not describe the decoder the stages above cut (empty when it does)."""
    plan = getattr(found.config, "base_model_pp_plan", None)
    kind = type(found.model).__name__
    if not plan:
        return [f"{kind}'s config carries no base_model_pp_plan, so its pipeline stages are unknown; define "
                "pipeline_stages, pipeline_batch and pipeline_loss on the LightningModule (see LLMModule), or use "
                "pipeline_parallel_size=1"]
    if tuple(plan) != DECODER_PARTS or not isinstance(getattr(found.base, "layers", None), nn.ModuleList):
        return [f"{kind}'s base_model_pp_plan names {list(plan)}; the stages cut a decoder of "
                f"{list(DECODER_PARTS)} with its layers in a ModuleList; define pipeline_stages, pipeline_batch and "
                "pipeline_loss for this model, or use pipeline_parallel_size=1"]
    return []


def hf_stages(found: HFModel, stage_ids: Sequence[int], num_stages: int,
              boundaries: Optional[Sequence[int]] = None) -> dict[int, HFStage]:
    """This rank's stages (``stage id -> HFStage``), balanced by layer count unless ``boundaries`` says where each
    starts. The model keeps only what these stages hold: the other layers, and the embeddings, norm and head of
    stages on other ranks, are dropped from it."""
    n = found.n_layers
    tied = bool(getattr(found.config, "tie_word_embeddings", False))
    problems = pp_plan_problems(found) + stage_count_problems(num_stages, n) + tied_embedding_problems(num_stages, tied)
    problems += boundary_problems(boundaries, n, num_stages) if boundaries is not None else []
    if problems:
        raise ValueError(format_problems("Cannot split the model into pipeline stages", problems))
    b = list(boundaries) if boundaries is not None else balanced_boundaries(n, num_stages)
    stages = {i: HFStage(found, b[i], b[i + 1]) for i in stage_ids}
    _keep_only(found, stages, [i for s in stage_ids for i in range(b[s], b[s + 1])])
    return stages


def _keep_only(found: HFModel, stages: dict[int, HFStage], layers: list[int]) -> None:
    base = found.base
    base.layers = KeptLayers({i: base.layers[i] for i in sorted(layers)})
    if not any(stage.first for stage in stages.values()):
        base.embed_tokens = None
    if not any(stage.last for stage in stages.values()):
        base.norm = None
        setattr(found.model, _head_name(found), None)
