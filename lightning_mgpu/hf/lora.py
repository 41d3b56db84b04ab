"""LoRA from the command line (``mgpu-train model=hf adapters=lora ...``): the ``adapters`` settings as PEFT's
``LoraConfig``, checked before launch, and the adapters' initial values as a function of the seed and the name.

PEFT builds the adapters (``get_peft_model``); the package splits them (:mod:`lightning_mgpu.hf.adapters`). A run that
builds on the meta device gives each rank only its slices, so an adapter's initial value cannot come from PEFT's
draw in the process: ``lora_A`` is drawn whole from a generator seeded by the seed and the parameter's name, with
PEFT's default (Kaiming-uniform, ``a = sqrt(5)``: uniform in +-1/sqrt(fan_in)), and ``lora_B`` is zero, as PEFT's
default makes it; every rank then holds its slice of the same whole tensor, on every layout. A run that builds the
model whole gets the same values (:func:`initialise_adapters`).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lightning_mgpu.hf.adapters import RECORD, base_fingerprint, plain_json
from lightning_mgpu.problems import raise_problems

#: What ``adapters.kind`` may be.
KINDS = ("none", "lora")
#: PEFT's names inside a wrapped model that the base's files do not have.
_PEFT_PARTS = re.compile(r"base_model\.model\.|\.base_layer(?=\.)|\.original_module(?=\.)|\.modules_to_save\.[^.]+(?=\.)")


def lora_config(settings: Mapping[str, Any]) -> Any:
    """PEFT's ``LoraConfig`` of the ``adapters`` settings (rank, alpha, dropout, targets, modules_to_save)."""
    from peft import LoraConfig

    targets = settings["targets"]
    return LoraConfig(r=int(settings["rank"]), lora_alpha=float(settings["alpha"]), lora_dropout=float(settings["dropout"]),
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      modules_to_save=list(settings["modules_to_save"]) if settings.get("modules_to_save") else None)


def with_lora(model: nn.Module, settings: Mapping[str, Any]) -> nn.Module:
    """``model`` wrapped by PEFT with the settings' LoRA adapters."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(settings))


def base_name(name: str) -> str:
    """The name in the base model's files of a parameter of the PEFT-wrapped model (``base_model.model.``,
    ``.base_layer``, ``.original_module`` and a ``modules_to_save`` copy's part dropped: a copy starts as its base)."""
    return _PEFT_PARTS.sub("", name)


def is_adapter(name: str) -> bool:
    """Whether ``name`` is a LoRA matrix (not in the base's files)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The whole initial value of LoRA matrix ``name``: ``lora_A`` Kaiming-uniform from (seed, name), ``lora_B`` zero."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=generator) * (2 * bound) - bound


def initialise_adapters(model: nn.Module, seed: int, prefix: str = "") -> None:
    """Give every LoRA matrix of a model built whole the value :func:`adapter_value` gives ``prefix + name``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(adapter_value(prefix + name, param.shape, seed))


def settings_problems(settings: Mapping[str, Any]) -> list[str]:
    """What is wrong with the ``adapters`` settings themselves (no model read)."""
    kind = settings.get("kind", "none")
    if kind not in KINDS:
        return [f"adapters.kind={kind!r} is unknown; choose one of {', '.join(KINDS)} (adapters=lora)"]
    if kind == "none":
        return []
    out = []
    if int(settings["rank"]) < 1:
        out.append(f"adapters.rank={settings['rank']} must be at least 1 (LoRA's rank r); e.g. adapters.rank=16")
    if float(settings["alpha"]) <= 0:
        out.append(f"adapters.alpha={settings['alpha']} must be positive (the scale is alpha / rank); e.g. 2 x rank")
    if not 0 <= float(settings["dropout"]) < 1:
        out.append(f"adapters.dropout={settings['dropout']} must be in [0, 1)")
    if not settings["targets"]:
        out.append("adapters.targets is empty; give all-linear or a list of module names, e.g. [q_proj,v_proj]")
    return out


def target_problems(settings: Mapping[str, Any], model: nn.Module, path: str, own: bool = False) -> list[str]:
    """Whether PEFT finds the targets in ``model``, the model of ``path`` built on the meta device (``own``: the
    package's own model, which :class:`ModelAdapters` adapts)."""
    names = [name for name, _ in model.named_modules()]
    asked = {"targets": [] if isinstance(settings["targets"], str) else list(settings["targets"]),
             "modules_to_save": list(settings.get("modules_to_save") or [])}
    unmatched = [f"adapters.{key}: {target!r} names no module of {path} (PEFT matches a module's name or its last "
                 f"parts, e.g. q_proj; its modules look like {', '.join(names[-4:])})"
                 for key, targets in asked.items() for target in targets
                 if not any(name == target or name.endswith(f".{target}") for name in names)]
    if unmatched:
        return unmatched
    try:
        ModelAdapters(settings, seed=0).inject(model) if own else with_lora(model, settings)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        first = str(error).splitlines()[0]
        return [f"adapters.targets={_shown(settings['targets'])} (or adapters.modules_to_save): {first}; name modules "
                "of the model (e.g. q_proj, v_proj), or all-linear"]
    return []


class ModelAdapters:
    """LoRA over a model the package builds itself (``LLMModule``'s Llama), from the same ``adapters`` settings.

    PEFT's layers are injected in place (``peft.inject_adapter_in_model``) rather than wrapped in a ``PeftModel``: the
    model stays the package's Llama, so its tensor-parallel plan (rewritten by :func:`~lightning_mgpu.hf.adapters.
    adapter_plan`), its pipeline stages and its names keep working, with PEFT's ``.base_layer`` and
    ``.lora_A.default`` parts in them. ``all-linear`` leaves the output head out, as PEFT does for a transformers
    causal LM (PEFT cannot tell a custom model's head from its other linears).
    """

    #: The settings it needs (the CLI's ``adapters`` group has them all; ``modules_to_save`` and ``seed`` may be left out).
    KEYS = ("kind", "rank", "alpha", "dropout", "targets")

    def __init__(self, settings: Mapping[str, Any], seed: int, base: str = "") -> None:
        missing = [key for key in self.KEYS if key not in settings]
        problems = [f"adapters has no {key!r}; give every one of {', '.join(self.KEYS)}, e.g. "
                    "dict(kind='lora', rank=16, alpha=32, dropout=0.0, targets='all-linear')" for key in missing]
        raise_problems("Invalid adapters", problems or settings_problems(settings))
        self.settings, self.seed, self.base = dict(settings), seed, base
        self.config: Any = None

    def inject(self, model: nn.Module, head: str = "output") -> nn.Module:
        """``model`` with PEFT's LoRA layers in place of its targets; the base frozen, as PEFT freezes it."""
        from peft import inject_adapter_in_model

        self.config = lora_config(self.settings)
        targets = self.config.target_modules
        if isinstance(targets, str) and targets.lower() == "all-linear":
            self.config.target_modules = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                                                 if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] != head})
        return inject_adapter_in_model(self.config, model)

    def initial_value(self, name: str, shape: torch.Size, index: tuple[slice, ...],
                      base_value: Callable[[str, torch.Size, tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
        """Part ``index`` of ``name``: an adapter's from :func:`adapter_value`, a base part's (and a trained copy's:
        it starts as its original) from ``base_value`` under the name the model has without adapters."""
        if is_adapter(name):
            return adapter_value(name, shape, self.seed)[index]
        return base_value(base_name(name), shape, index)

    def record(self, prefix: str) -> dict[str, Any]:
        """The checkpoint record (:func:`lightning_mgpu.hf.adapters.adapter_record`'s fields, ``kind`` naming the
        package's own model): a checkpoint with it holds only what trains."""
        configs = {"default": json.dumps(self.config.to_dict(), default=plain_json, sort_keys=True)}
        return {RECORD: {"prefix": prefix, "base": self.base, "configs": configs, "kind": "llama",
                         "fingerprint": base_fingerprint(self.base)}}


def _shown(targets: Any) -> str:
    return targets if isinstance(targets, str) else f"[{','.join(map(str, targets))}]"
