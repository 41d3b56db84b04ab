"""Finding the ``transformers`` model inside a user's LightningModule, and the parts of it that the parallel plans name.

``transformers`` is not a dependency of the package: a module can only hold one of its models if the user imported it,
so its model class is looked up in ``sys.modules`` instead of imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_mgpu.hf.decoder import DecoderParts, decoder_parts, layers_name
from lightning_mgpu.hf.names import sliding_window
from lightning_mgpu.layout import ModelShape
from lightning_mgpu.split_rules import HF_EXPERT_FAMILIES

#: The hook a LightningModule may define to name its model where it holds several: ``def hf_model(self): return
#: self.student``.
NAMING_HOOK = "hf_model"


def _pretrained_class() -> Optional[type]:
    """``transformers.PreTrainedModel`` if a model of it can exist in this process: its module is imported. (Reading
    the attribute off the ``transformers`` package would import that module lazily, 0.6 s, for every run.)"""
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "PreTrainedModel", None) if modeling is not None else None


@dataclass(frozen=True)
class HFModel:
    """A ``transformers`` causal LM found in a LightningModule: the model, its path in the module (``"llm."``), its
    decoder (``base``, at ``prefix + base_name + "."``) and the names of the decoder's parts in its pipeline plan."""

    model: nn.Module
    prefix: str
    base_name: str

    @property
    def base(self) -> nn.Module:
        return getattr(self.model, self.base_name)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def base_prefix(self) -> str:
        return f"{self.prefix}{self.base_name}."

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def layers_name(self) -> str:
        """The decoder's ``ModuleList`` of layers by its family's name (``layers``, GPT-J's ``h``); a decoder without
        one is refused by name."""
        name = layers_name(self.base, self.config)
        if name is None:
            raise ValueError(f"{self.prefix}{self.base_name} ({type(self.base).__name__}) holds no single ModuleList "
                             f"of its {self.n_layers} layers; write tensor_parallel_plan() and the pipeline hooks for it")
        return name

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.base, self.layers_name)

    @property
    def layers_prefix(self) -> str:
        """``llm.model.layers`` (GPT-J's ``llm.transformer.h``): the layers' names in the LightningModule."""
        return f"{self.base_prefix}{self.layers_name}"

    def parts(self) -> tuple[Optional[DecoderParts], list[str]]:
        """The decoder's parts as pipeline stages place them, or every reason they cannot be read."""
        return decoder_parts(self.base, self.config, type(self.model).__name__)

    def shape(self) -> ModelShape:
        """The numbers that constrain a split. ``qk_norm`` stays False: the q/k norms of a ``transformers`` model keep
        their weights whole and sum their gradients over the tensor-parallel group (``grad_sum``). Its attention
        window and its pipeline stages constrain context parallelism (``split_rules.context_model_problems``); its experts
        stay whole on every tensor-parallel rank (no ``expert_hidden`` to divide), and expert parallelism splits those of
        the families it covers (``split_rules.HF_EXPERT_FAMILIES``)."""
        c = self.config
        experts = int(getattr(c, "num_experts", 0) or getattr(c, "num_local_experts", 0)
                      or getattr(c, "n_routed_experts", 0) or 0)
        return ModelShape(n_layers=self.n_layers, n_heads=int(c.num_attention_heads),
                          n_kv_heads=int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
                          ffn_hidden=int(c.intermediate_size), vocab_size=int(c.vocab_size),
                          tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)), num_experts=experts,
                          sliding_window=sliding_window(c.to_dict()), context_with_pipeline=False,
                          experts_split=getattr(c, "model_type", None) in HF_EXPERT_FAMILIES)


def find_hf_model(module: nn.Module) -> Optional[HFModel]:
    """The causal LM ``module`` holds (``None`` when it holds no ``transformers`` model). Raises when it holds several
    and defines no ``hf_model()`` naming one."""
    pretrained = _pretrained_class()
    if pretrained is None:
        return None
    named = getattr(module, NAMING_HOOK, None)
    if callable(named):
        chosen = named()
        found = [(name, m) for name, m in module.named_modules() if m is chosen]
        if not found:
            raise ValueError(f"{type(module).__name__}.hf_model() returned a {type(chosen).__name__} that is not a "
                             "submodule of it; return the transformers model the module holds (e.g. self.llm)")
        return _described(*found[0])
    candidates = _outermost(module, pretrained)
    if len(candidates) > 1:
        raise ValueError(f"{type(module).__name__} holds {len(candidates)} transformers models "
                         f"({', '.join(name for name, _ in candidates)}); define hf_model() returning the one to "
                         "parallelise")
    return _described(*candidates[0]) if candidates else None


def _outermost(module: nn.Module, pretrained: type) -> list[tuple[str, nn.Module]]:
    """The ``PreTrainedModel`` submodules that are not inside another one (a causal LM holds its decoder)."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, pretrained) and not any(name.startswith(outer + ".") or outer == "" for outer, _ in found):
            found.append((name, m))
    return found


def _described(name: str, model: nn.Module) -> HFModel:
    prefix = f"{name}." if name else ""
    base_name = getattr(model, "base_model_prefix", "model")
    if not isinstance(getattr(model, base_name, None), nn.Module):
        raise ValueError(f"{prefix or 'the module'} ({type(model).__name__}) has no decoder at .{base_name}; pass a "
                         "causal language model (AutoModelForCausalLM), or write tensor_parallel_plan() and the "
                         "pipeline hooks for it")
    return HFModel(model, prefix, base_name)
