"""The ``model`` group of a run resolved into its :class:`~lightning_mgpu.models.LlamaConfig`: its source's shape
(:mod:`lightning_mgpu.cli.model_source`) with the adapters the planner counts and the data's end-of-document id where
the run masks documents."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.cli.run_data import RunData
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner.adapters import LoraShape, lora_shape


def resolve_model(cfg: DictConfig, data: RunData) -> LlamaConfig:
    """The model of ``cfg``; with ``data.document_mask`` it carries the data's end-of-document id
    (``LlamaConfig.eod_token_id``), which is what turns the document mask on in the model, the loss and the planner.
    Left without one where the data has none, or an id the vocabulary lacks: validation refuses such a run before it
    starts (``document_mask_problems``, ``vocabulary_problems``), naming the data rather than this field."""
    model = with_adapters(model_source(cfg).shape(), _adapters(cfg))
    if cfg.data.get("document_mask"):  # .get: a schema without the key reads as false
        eod = data.eod_token_id()[0]
        if eod is not None and eod < model.vocab_size:
            model = replace(model, eod_token_id=eod)
    return model


@dataclass(frozen=True)
class AdaptedLlama(LlamaConfig):
    """The package's own model with ``adapters=lora`` as the planner, the memory check and the dry run count it: the
    base frozen, the adapters trained (a transformers model's shape carries the same field). The module is built from
    :func:`~lightning_mgpu.cli.model_source.plain_model`: the adapters are its own argument, not part of the model's
    config."""

    adapters: Optional[LoraShape] = None


def with_adapters(model: LlamaConfig, adapters: Optional[LoraShape]) -> LlamaConfig:
    """``model`` carrying ``adapters`` for the planner's count (unchanged without them)."""
    if "adapters" in {f.name for f in fields(model)}:
        return replace(model, adapters=adapters)
    return model if adapters is None else AdaptedLlama(**model.to_dict(), adapters=adapters)


def _adapters(cfg: DictConfig) -> Optional[LoraShape]:
    """``adapters.*`` as the planner counts them (the base frozen, the adapters trained); ``None`` without adapters or
    for a config composed without the group."""
    group = cfg.get("adapters")
    return None if group is None else lora_shape(OmegaConf.to_container(group, resolve=True))
