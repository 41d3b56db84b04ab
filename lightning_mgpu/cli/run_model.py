"""The ``model`` group of a run resolved into its :class:`~lightning_mgpu.models.LlamaConfig`: a named shape with
overrides, or the shape of ``model.init_from``'s checkpoint, with the data's end-of-document id where the run masks
documents."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.cli.config import ModelConfig
from lightning_mgpu.cli.run_data import RunData
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner.adapters import LoraShape, lora_shape

#: ``model.<key>`` overrides of a named shape: every ``ModelConfig`` field that is a ``LlamaConfig`` field, by the
#: same name (the options applied from outside, recomputation and compilation, are passed apart).
MODEL_OVERRIDES = tuple(name for name in ModelConfig.__dataclass_fields__ if name in LlamaConfig.__dataclass_fields__
                        and name not in ("activation_checkpointing", "compile", "compile_backend"))


def resolve_model(cfg: DictConfig, data: RunData) -> LlamaConfig:
    """The model of ``cfg``; with ``data.document_mask`` it carries the data's end-of-document id
    (``LlamaConfig.eod_token_id``), which is what turns the document mask on in the model, the loss and the planner.
    Left without one where the data has none, or an id the vocabulary lacks: validation refuses such a run before it
    starts (``document_mask_problems``, ``vocabulary_problems``), naming the data rather than this field."""
    m = cfg.model
    if m.name == "hf":  # a transformers model trained as it is: the sizes of its config.json
        from lightning_mgpu.hf.names import planning_shape

        model = replace(planning_shape(json.loads((Path(m.path) / "config.json").read_text())),
                        activation_checkpointing=m.activation_checkpointing)  # HFCausalLM applies it to the layers
    elif m.init_from:  # the checkpoint's shape, whatever model.name says
        from lightning_mgpu.hf.names import from_hf_config, hf_path

        hf = json.loads((hf_path(m.init_from) / "config.json").read_text())
        model = replace(from_hf_config(hf), activation_checkpointing=m.activation_checkpointing, compile=m.compile,
                        compile_backend=m.compile_backend)
    else:
        overrides = {k: m[k] for k in MODEL_OVERRIDES if m[k] is not None}
        model = LlamaConfig.from_name(m.name, activation_checkpointing=m.activation_checkpointing, compile=m.compile,
                                      compile_backend=m.compile_backend, **overrides)
    model = with_adapters(model, _adapters(cfg))
    if cfg.data.get("document_mask"):  # .get: a schema without the key reads as false
        eod = data.eod_token_id()[0]
        if eod is not None and eod < model.vocab_size:
            model = replace(model, eod_token_id=eod)
    return model


@dataclass(frozen=True)
class AdaptedLlama(LlamaConfig):
    """The package's own model with ``adapters=lora`` as the planner, the memory check and the dry run count it: the
    base frozen, the adapters trained (a transformers model's shape carries the same field). The module is built from
    :func:`plain_model`: the adapters are its own argument, not part of the model's config."""

    adapters: Optional[LoraShape] = None


def with_adapters(model: LlamaConfig, adapters: Optional[LoraShape]) -> LlamaConfig:
    """``model`` carrying ``adapters`` for the planner's count (unchanged without them)."""
    if "adapters" in {f.name for f in fields(model)}:
        return replace(model, adapters=adapters)
    return model if adapters is None else AdaptedLlama(**model.to_dict(), adapters=adapters)


def plain_model(model: LlamaConfig) -> LlamaConfig:
    """The package's own :class:`LlamaConfig` of a resolved model, without what only the planner reads."""
    own = {f.name for f in fields(LlamaConfig)}
    return model if type(model) is LlamaConfig else LlamaConfig(**{k: v for k, v in model.to_dict().items() if k in own})


def _adapters(cfg: DictConfig) -> Optional[LoraShape]:
    """``adapters.*`` as the planner counts them (the base frozen, the adapters trained); ``None`` without adapters or
    for a config composed without the group."""
    group = cfg.get("adapters")
    return None if group is None else lora_shape(OmegaConf.to_container(group, resolve=True))
