"""Pipeline stages of a ``transformers`` causal LM, cut where its ``base_model_pp_plan`` says it can be cut.

A ``transformers`` config's pipeline plan names the decoder's parts in order (``embed_tokens`` -> ``layers`` ->
``norm``, then the causal LM's ``lm_head``; other families name them otherwise, and a config without a plan has them
read off its structure: :mod:`lightning_mgpu.hf.decoder`). A stage here is a *view* of the model: a shallow copy of
the causal LM whose decoder holds only the stage's layers (under their original indices), its embeddings (and what
runs on them before the layers, dropout) only on the first stage and its final norm and head only on the last; a
later stage's decoder does not scale the hidden states it receives as it scales embeddings (Granite's
``embedding_multiplier``). Each stage runs the
decoder's own ``forward`` (so its masks, rotary tables and model-specific scaling are its own): the first stage from
``input_ids``, the others from ``inputs_embeds=`` the hidden states received. The last stage runs the causal LM's own
``forward``, whose logits may be more than the head's output (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
Gemma 2's ``final_logit_softcapping``).
Written here because ``torch.distributed.pipelining``'s tracer-based split does not follow a ``transformers``
forward's Python control flow (caches, mask functions), and its manual ``PipelineStage`` needs a module per stage.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_mgpu.hf.decoder import DecoderParts
from lightning_mgpu.hf.documents import position_arguments
from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.hf.router_loss import ATTRIBUTE, RouterLoss
from lightning_mgpu.layout import stage_count_problems, tied_embedding_problems
from lightning_mgpu.models.llama_plan import balanced_boundaries, boundary_problems
from lightning_mgpu.problems import format_problems

#: Attributes of a decoder that scale the embeddings in its forward: a later stage's decoder, given hidden states,
#: does not scale them again.
EMBEDDING_SCALES = ("embedding_multiplier",)


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

    def __init__(self, found: HFModel, start: int, end: int, parts: Optional[DecoderParts] = None) -> None:
        super().__init__()
        parts = parts or _readable_parts(found)
        self.first, self.last = start == 0, end == found.n_layers
        view = copy.copy(found.model)
        view._modules = dict(found.model._modules)
        base = copy.copy(found.base)
        base._modules = dict(found.base._modules)
        base.config = _stage_config(found.base.config, start, end)
        base._modules[parts.layers] = KeptLayers({i: found.layers[i] for i in range(start, end)})
        if not self.first:
            base._modules[parts.embedding] = None
            base._modules.update({name: nn.Identity() for name in parts.before})
            for scale in EMBEDDING_SCALES:
                if hasattr(base, scale):
                    setattr(base, scale, 1.0)
        if not self.last:
            base._modules.update({name: nn.Identity() for name in parts.after})
            view._modules[_head_name(found)] = None
        view._modules[found.base_name] = base
        self.base_name, self.head_name, self.layers_name = found.base_name, _head_name(found), parts.layers
        self.add_module(found.base_name, base)
        if self.last:
            self.add_module(self.head_name, view._modules[self.head_name])
        self._view = [view]  # in a list: the view is not a submodule (its parameters are the stage's own)
        self.router: Optional[RouterLoss] = getattr(found.model, ATTRIBUTE, None)

    def forward(self, x: torch.Tensor, *received: torch.Tensor) -> Any:
        """Logits on the last stage, hidden states elsewhere. After ``x`` come ``positions`` (``[batch, seq]``, the
        model's ``position_ids``; without a ``padding`` mask a break in them (not one more than the token before)
        starts a document that attends only to itself, as ``transformers`` reads packed ``position_ids``; with one, the
        model masks the padding itself) and ``padding``, where given. A stage that is not the last hands ``(hidden
        states, positions[, padding])`` on: they are ``seq`` times smaller than the mask each stage builds. Where the
        model forms its load-balancing loss (:mod:`lightning_mgpu.hf.router_loss`), every stage but the first receives
        and every stage but the last hands on its running sums last, and the last stage gives ``(logits, that loss)``."""
        router, sums = self.router, None
        if router is not None and not self.first:
            received, sums = received[:-2], tuple(received[-2:])
        positions, padding = (*received, None, None)[:2]
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if positions is not None and padding is None:
            dtype = x.dtype if x.is_floating_point() else next(self.parameters()).dtype
            given.update(position_arguments(positions, dtype))
        elif positions is not None:
            given.update(position_ids=positions, attention_mask=padding)
        if not self.last:
            out = getattr(self, self.base_name)(**given, use_cache=False)
            handed = (out.last_hidden_state, *(t for t in (positions, padding) if t is not None))
            if router is not None:
                handed += router.statistics(out.router_logits, padding, sums or router.zeros(x.device))
            return handed if len(handed) > 1 else handed[0]
        view = self._view[0]
        view._modules[self.head_name] = getattr(self, self.head_name)  # the head a tensor-parallel plan swapped in
        if router is None:
            return type(view).forward(view, **given, use_cache=False).logits
        # the model forms no loss of its own on a stage's layers (the decoder still captures their router logits)
        out = type(view).forward(view, **given, use_cache=False, output_router_logits=False)
        aux = router.loss(*router.statistics(out.router_logits, padding, sums or router.zeros(x.device)))
        return out.logits, aux.reshape(1)  # one dimension: the schedule concatenates the micro-batches' outputs


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


def _readable_parts(found: HFModel) -> DecoderParts:
    parts, problems = found.parts()
    if parts is None:
        raise ValueError(format_problems("Cannot split the model into pipeline stages", problems))
    return parts


def _head_name(found: HFModel) -> str:
    plan = getattr(found.model, "_pp_plan", None) or {}
    heads = [name for name in plan if "." not in name]
    return heads[0] if heads else "lm_head"


def hf_stages(found: HFModel, stage_ids: Sequence[int], num_stages: int,
              boundaries: Optional[Sequence[int]] = None) -> dict[int, HFStage]:
    """This rank's stages (``stage id -> HFStage``), balanced by layer count unless ``boundaries`` says where each
    starts. The model keeps only what these stages hold: the other layers, and the embeddings, norm and head of
    stages on other ranks, are dropped from it."""
    n = found.n_layers
    tied = bool(getattr(found.config, "tie_word_embeddings", False))
    parts, problems = found.parts()
    if problems:
        problems = [f"{problem}; define pipeline_stages, pipeline_batch and pipeline_loss on the LightningModule (see "
                    "LLMModule), or use pipeline_parallel_size=1" for problem in problems]
    problems += stage_count_problems(num_stages, n) + tied_embedding_problems(num_stages, tied)
    problems += boundary_problems(boundaries, n, num_stages) if boundaries is not None else []
    if problems:
        raise ValueError(format_problems("Cannot split the model into pipeline stages", problems))
    b = list(boundaries) if boundaries is not None else balanced_boundaries(n, num_stages)
    stages = {i: HFStage(found, b[i], b[i + 1], parts) for i in stage_ids}
    _keep_only(found, parts, stages, [i for s in stage_ids for i in range(b[s], b[s + 1])])
    return stages


def _keep_only(found: HFModel, parts: DecoderParts, stages: dict[int, HFStage], layers: list[int]) -> None:
    base = found.base
    setattr(base, parts.layers, KeptLayers({i: found.layers[i] for i in sorted(layers)}))
    if not any(stage.first for stage in stages.values()):
        for name in (parts.embedding, *parts.before):
            setattr(base, name, None)
    if not any(stage.last for stage in stages.values()):
        for name in parts.after:
            setattr(base, name, None)
        setattr(found.model, _head_name(found), None)
