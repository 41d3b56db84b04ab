"""PEFT's adapters under tensor parallelism: each adapter follows the split of the layer it adapts.

``peft.get_peft_model`` wraps each target ``nn.Linear`` in a ``lora.Linear`` that keeps the original as ``base_layer``
and adds ``lora_A[name]`` (rank x in) and ``lora_B[name]`` (out x rank), computing
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. PEFT's forward is kept as it is; the plan entry that named
the wrapper is rewritten into entries for its parts, so that the sum above is the one-process sum split over the ranks:

==================  ==============  ==================================  ==========================================
base style          ``base_layer``  ``lora_A``                          ``lora_B``
==================  ==============  ==================================  ==========================================
``colwise``         ``colwise``     whole; gradient summed (each rank   split by output like the base
                                    saw its output features)            (``colwise``): the sum stays split
``colwise_gather``  ``colwise_gather``  whole; gradient summed          split by output, gathered
``rowwise``         ``rowwise``     split by input like the base, its   whole; gradient summed under sequence
                                    rank-wide product summed over the   parallelism (each rank saw its positions)
                                    ranks (``rowwise``: all-reduce, or
                                    reduce-scatter to sequence shards)
``rowwise_split``   ``rowwise_split``  split input taken, then as above  as above
==================  ==============  ==================================  ==========================================

The adapters are split from the whole tensors PEFT initialised, so step 0 is one process's on every layout (PEFT
draws ``lora_A`` from the process's random stream: every rank draws the same when seeded alike, which Lightning's
``seed_everything`` does). A module PEFT keeps a trainable copy of (``modules_to_save``) gets the style of the module
it copies, on both the original and the copy. What has no rule here -- an adapter on an embedding or the output
head, DoRA's weight norm, another tuner (IA3, LoHa, prompt tuning ...) -- is refused by module and tuner before
anything is split.

``peft`` is not a dependency of the package: a model can only hold PEFT's layers if the user imported it, so its
classes are looked up in ``sys.modules``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Optional

from torch import nn

from lightning_mgpu.checkpoint.frozen_weights import ADAPTER_RECORD
from lightning_mgpu.parallel.plan import plan_pattern

#: base style -> (style of lora_A, style of lora_B)
ADAPTER_STYLES = {
    "colwise": ("grad_sum", "colwise"),
    "colwise_gather": ("grad_sum", "colwise_gather"),
    "rowwise": ("rowwise", "grad_sum_sp"),
    "rowwise_split": ("rowwise_split", "grad_sum_sp"),
}
#: Styles that keep the module whole and add hooks: the wrapper's parts get the same.
HOOK_STYLES = ("grad_sum", "grad_sum_sp", "enter_region", "sequence_scatter", "sequence_gather", "whole_sequence_sp")


def _peft_class(module: str, name: str) -> Optional[type]:
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of PEFT's adapter layers (a wrapper of a base layer)."""
    base = _peft_class("peft.tuners.tuners_utils", "BaseTunerLayer")
    return base is not None and isinstance(module, base)


def saved_copy_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's ``ModulesToSaveWrapper`` (a frozen original beside trainable copies)."""
    wrapper = _peft_class("peft.utils.other", "ModulesToSaveWrapper")
    return wrapper is not None and isinstance(module, wrapper)


def holds_adapters(model: nn.Module) -> bool:
    """Whether any of PEFT's adapter layers or trainable copies sit in ``model``."""
    return any(tuner_layer(m) or saved_copy_wrapper(m) for m in model.modules())


def unwrapped(module: nn.Module) -> nn.Module:
    """The module that computes: PEFT's active trainable copy of a ``modules_to_save`` module, else ``module``."""
    if saved_copy_wrapper(module) and module.active_adapters and not module.disable_adapters:
        return module.modules_to_save[module.active_adapters[0]]
    return module


def _lora_problem(name: str, style: str, layer: nn.Module) -> Optional[str]:
    kind = type(layer).__name__
    if not hasattr(layer, "lora_A") or not hasattr(layer, "lora_B"):
        return (f"{name!r} is PEFT's {type(layer).__module__}.{kind}: only LoRA adapters are split over tensor-parallel "
                f"ranks; use LoraConfig, or tensor_parallel_size=1 (ZeRO and pipeline stages take any tuner)")
    if style not in ADAPTER_STYLES:
        return (f"{name!r} (LoRA on a layer of style {style!r}) has no split rule: adapters follow column- and "
                f"row-parallel linears ({', '.join(ADAPTER_STYLES)}); leave this module out of target_modules (to "
                f"train the embeddings or the head, name them in modules_to_save: trained whole, split like the "
                f"original)")
    if getattr(layer, "lora_embedding_A", None):
        return f"{name!r}: LoRA on an embedding is not split here; leave it out of target_modules"
    if getattr(layer, "lora_variant", None):
        variants = sorted({type(v).__name__ for v in layer.lora_variant.values()})
        return (f"{name!r} uses {', '.join(variants)} (DoRA's weight norm spans the split features): under tensor "
                "parallelism use plain LoRA (use_dora=False), or tensor_parallel_size=1")
    return None


def quantized_base_problems(model: nn.Module, where: str) -> list[str]:
    """A base quantized to 4 or 8 bits (``from_pretrained(..., quantization_config=...)``, QLoRA) is not split or
    partitioned here: its packed weights are not the tensors the plans, ZeRO and the checkpoints address."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None and not any(getattr(model, f"is_loaded_in_{bits}bit", False) for bits in (4, 8)):
        return []
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "4/8-bit")
    return [f"{where} is quantized ({getattr(method, 'value', method)}): a quantized base (QLoRA) is not supported by "
            "MGPUStrategy; load the base in bf16 (from_pretrained(..., dtype=torch.bfloat16), no quantization_config) "
            "and train LoRA over it"]


#: Why a prompt-learning tuner cannot run split over each axis it is refused on (PEFT's tuner -> axis -> reason).
_PROMPT_LEARNING_REFUSALS = {
    "pp": "the pipeline stages run the model's layers, never PEFT's forward, which is where the virtual tokens are "
          "prepended (they would be left out: the base model's loss)",
    "cp": "the virtual tokens change the sequence the context ranks split",
    "tp_prefix": "its cached keys and values span every attention head, which tensor parallelism splits",
}


def prompt_learning_problems(model: nn.Module, sizes: dict[str, int], where: str) -> list[str]:
    """A prompt-learning tuner (prompt tuning, P-tuning, prefix tuning: PEFT's ``is_prompt_learning``) under an axis
    it cannot be split over, named by tuner and axis: under pipeline and context parallelism any of them, under tensor
    parallelism prefix tuning (prompt tuning only prepends embeddings, which tensor parallelism keeps whole)."""
    found = peft_model(model)
    if found is None:
        return []
    out = []
    for name, config in found[1].peft_config.items():
        if not getattr(config, "is_prompt_learning", False):
            continue
        tuner = type(config).__name__.removesuffix("Config")
        axes = [axis for axis in ("pp", "cp") if sizes.get(axis, 1) > 1]
        axes += ["tp_prefix"] if tuner == "PrefixTuning" and sizes.get("tp", 1) > 1 else []
        out += [f"{where}: PEFT's {tuner} (adapter {name!r}) under {axis.removesuffix('_prefix')}="
                f"{sizes[axis.removesuffix('_prefix')]}: {_PROMPT_LEARNING_REFUSALS[axis]}; use LoRA (LoraConfig), "
                f"or {axis.removesuffix('_prefix')}=1" for axis in axes]
    return out


def adapter_plan(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``plan`` (``{name pattern: style}`` over ``model``'s module names) with every entry that names one of PEFT's
    wrappers rewritten into entries for the wrapper's parts, by :data:`ADAPTER_STYLES`; and the problems (every
    wrapper the rules cannot split). Entries that name no wrapper are kept as they are."""
    names = [(name, m) for name, m in model.named_modules() if name]
    out: dict[str, str] = {}
    problems: list[str] = []
    for key, style in plan.items():
        matched = [(name, m) for name, m in names if plan_pattern(key).fullmatch(name)]
        if not any(tuner_layer(m) or saved_copy_wrapper(m) for _, m in matched):
            out[key] = style
            continue
        for name, m in matched:
            out.update(_parts(name, style, m, problems))
    return out, problems


def _parts(name: str, style: str, module: nn.Module, problems: list[str]) -> dict[str, str]:
    """The plan entries of one module the plan matched: itself, or the parts of PEFT's wrapper."""
    if saved_copy_wrapper(module):
        return {f"{name}.original_module": style, **{f"{name}.modules_to_save.{k}": style
                                                     for k in module.modules_to_save}}
    if not tuner_layer(module):
        return {name: style}
    if style in HOOK_STYLES:
        return {name: style}
    problem = _lora_problem(name, style, module)
    if problem:
        problems.append(problem)
        return {}
    a_style, b_style = ADAPTER_STYLES[style]
    entries = {f"{name}.base_layer": style}
    for adapter in module.lora_A:
        entries[f"{name}.lora_A.{adapter}"] = a_style
        entries[f"{name}.lora_B.{adapter}"] = b_style
    return entries


#: The checkpoint record's key (``checkpoint_record``): what :mod:`lightning_mgpu.hf.adapter_export` reads, and what
#: tells a checkpoint to leave the frozen base out.
RECORD = ADAPTER_RECORD


def peft_model(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """(its name in ``module`` with a trailing dot, the model) of the outermost ``peft.PeftModel`` ``module`` holds."""
    wrapper = _peft_class("peft.peft_model", "PeftModel")
    if wrapper is None:
        return None
    return next(((f"{name}." if name else "", m) for name, m in module.named_modules() if isinstance(m, wrapper)), None)


def adapter_record(module: nn.Module) -> dict[str, Any]:
    """``{RECORD: {prefix, base, configs}}`` for a module holding a PEFT model (empty otherwise): where the PEFT model
    sits, the directory its base was loaded from (``from_pretrained``'s path; empty for a model built from a config),
    and each adapter's configuration as PEFT writes it (``adapter_config.json``), so that a checkpoint that holds only
    the adapters names what it adapts and can be exported in PEFT's format."""
    found = peft_model(module)
    if found is None:
        return {}
    prefix, model = found
    base = getattr(getattr(model.get_base_model(), "config", None), "_name_or_path", "") or ""
    configs = {name: json.dumps(config.to_dict(), default=plain_json, sort_keys=True)
               for name, config in model.peft_config.items()}
    return {RECORD: {"prefix": prefix, "base": str(base), "configs": configs, "fingerprint": base_fingerprint(base)}}


#: Bytes read from each end of each weights file for :func:`base_fingerprint`.
_ENDS = 1 << 20


@functools.lru_cache(maxsize=8)
def base_fingerprint(directory: str) -> str:
    """A checksum of the base's weights files: each ``*.safetensors`` file's name and size and its first and last MiB
    (its header, and weights at both ends), not all of it (a 70B base is 140 GB). Other weights of the same shapes
    change those bytes; "" for a base built from a config (no directory, or no weights files in it)."""
    files = sorted(Path(directory).glob("*.safetensors")) if directory else []
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(_ENDS))
            handle.seek(max(0, size - _ENDS))
            digest.update(handle.read(_ENDS))
    return digest.hexdigest() if files else ""


def plain_json(value: Any) -> Any:
    """JSON for what a PEFT config holds besides JSON's own types (sets of module names, enums)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return getattr(value, "value", str(value))
