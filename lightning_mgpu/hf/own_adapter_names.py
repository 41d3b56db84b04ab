"""Adapters trained on the package's own Llama, named as PEFT names them over ``LlamaForCausalLM``.

``adapters=lora`` without ``model=hf`` injects PEFT's layers into the package's Llama
(:class:`~lightning_mgpu.hf.lora.ModelAdapters`), so its checkpoint names them after the package's modules
(``layers.0.attention.wq.lora_A.default.weight``) and its record's configuration names the package's module suffixes
(``wq``). The same weights are a ``LlamaForCausalLM``'s (:mod:`lightning_mgpu.hf.names` maps one to one), so the
adapters are a PEFT adapter of that model once renamed: each tensor under the PEFT model's name
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``), and the configuration's targets and
trained copies as the full names of the modules they were found on (PEFT matches a full name exactly), so that no
suffix of one naming has to mean the same modules in the other.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import torch

from lightning_mgpu.hf.names import to_hf_name
from lightning_mgpu.problems import format_problems

#: A PEFT part of a parameter name: (module, part, adapter, tensor).
_PART = re.compile(r"(?P<module>.+)\.(?P<part>lora_A|lora_B|modules_to_save)\.(?P<adapter>[^.]+)\.(?P<tensor>weight|bias)")
#: The PEFT model's prefix before the transformers model's own names.
PEFT_PREFIX = "base_model.model."


def hf_module_name(module: str) -> str:
    """The ``LlamaForCausalLM`` module of one of the package's Llama modules (``layers.0.attention.wq`` ->
    ``model.layers.0.self_attn.q_proj``); ``KeyError`` where there is none."""
    return to_hf_name(f"{module}.weight").removesuffix(".weight")


def as_transformers_adapters(record: Mapping[str, Any],
                             tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the record with each configuration's targets and trained copies named as ``LlamaForCausalLM``'s modules, the
    tensors under the PEFT model's names). Raises one ``ValueError`` naming every tensor with no such name."""
    renamed: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    copies: set[str] = set()
    problems = []
    for name, value in tensors.items():
        found = _PART.fullmatch(name)
        try:
            if found is None:
                raise KeyError(name)
            module = hf_module_name(found["module"])
        except KeyError:
            problems.append(f"{name} has no name in transformers' Llama (mixture-of-experts layers, for one, map to "
                            "no single module)")
            continue
        (copies if found["part"] == "modules_to_save" else targets).add(module)
        renamed[f"{PEFT_PREFIX}{module}.{found['part']}.{found['adapter']}.{found['tensor']}"] = value
    if problems:
        raise ValueError(format_problems("Cannot name the adapters as a transformers Llama's", problems))
    configs = {}
    for adapter, text in record["configs"].items():
        config = json.loads(text)
        config.update(target_modules=sorted(targets), modules_to_save=sorted(copies) or None)
        configs[adapter] = json.dumps(config, sort_keys=True)
    return {**record, "configs": configs, "prefix": ""}, renamed
