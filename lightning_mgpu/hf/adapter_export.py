"""A fine-tune's adapters out of a checkpoint, in PEFT's own format or merged into the base's weights.

A checkpoint of an adapter run holds the adapters (and any ``modules_to_save`` copy) with their optimizer state, and
records the PEFT configuration and the directory of the base (:func:`lightning_mgpu.hf.adapters.adapter_record`). Both
exports rebuild the PEFT model from that record on the meta device, where it costs no memory, and put the trained
tensors in it; PEFT then does its own part:

* ``--format peft``: ``save_pretrained`` writes ``adapter_model.safetensors`` and ``adapter_config.json`` under the
  names ``PeftModel.from_pretrained(base, DIR)`` reads;
* ``--merge``: each LoRA layer's ``get_delta_weight`` (``B @ A`` times its scaling, as PEFT's ``merge`` adds it) is
  added to its base weight, one shard of the base directory at a time (read from its memory-mapped safetensors,
  written with the same shard layout and index); a ``modules_to_save`` copy replaces its original. The base's other
  files (config, tokenizer) are copied. Only plain LoRA merges here: a layer PEFT does not merge linearly is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from lightning_mgpu.checkpoint.safe_reader import read_dcp_metadata
from lightning_mgpu.checkpoint.universal import read_parameters, read_trainer_state
from lightning_mgpu.hf.adapters import RECORD, saved_copy_wrapper, tuner_layer
from lightning_mgpu.hf.own_adapter_names import as_transformers_adapters
from lightning_mgpu.problems import format_problems


def adapter_source(checkpoint: Path, base: Optional[Path]) -> tuple[dict, Path]:
    """(the checkpoint's adapter record, the base directory: ``base`` if given, else the recorded one). Raises one
    ``ValueError`` naming every problem."""
    record = read_trainer_state(checkpoint).get(RECORD)
    if not record:
        raise ValueError(f"{checkpoint} holds no adapters (its run wrapped no model with PEFT); export it with "
                         "--format hf")
    where = base if base is not None else Path(record["base"]) if record["base"] else None
    problems = []
    if where is None:
        problems.append(f"{checkpoint}'s run built its base from a config, not a directory: give --base DIR, the "
                        "directory of the base model's config.json and weights")
    elif not (where / "config.json").is_file():
        problems.append(f"base {str(where)!r} has no config.json; give --base DIR, the directory the run's base "
                        "model was loaded from")
    if problems:
        raise ValueError(format_problems("Cannot export the adapters", problems))
    return record, where


def trained_tensors(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint trained under the PEFT model (names without ``prefix``), whole, in fp32."""
    shapes = {key[len("param/"):]: torch.Size(meta.size) for key, meta in
              read_dcp_metadata(checkpoint).state_dict_metadata.items()
              if key.startswith(f"param/{prefix}") and hasattr(meta, "size")}
    return {name[len(prefix):]: value for name, value in read_parameters(checkpoint, shapes, prefix="").items()}


def trained_adapters(checkpoint: Path, record: Mapping[str, Any], base: Path) -> tuple[dict, Path, dict]:
    """(the record, the base, the trained tensors) as :func:`rebuilt_peft_model` takes them; adapters trained on the
    package's own Llama (``kind: llama``) renamed as PEFT names them over ``LlamaForCausalLM``."""
    tensors = trained_tensors(checkpoint, record["prefix"])
    if record.get("kind") == "llama":
        record, tensors = as_transformers_adapters(record, tensors)
    return dict(record), base, tensors


def rebuilt_peft_model(record: Mapping[str, Any], base: Path, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The PEFT model of the record over the base's architecture, on the meta device but for the trained tensors."""
    from peft import PeftConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base, local_files_only=True)
    configs = {name: PeftConfig.from_peft_type(**json.loads(text)) for name, text in record["configs"].items()}
    first, *others = configs
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config), configs[first], adapter_name=first)
        for name in others:
            model.add_adapter(name, configs[name])
    params = dict(model.named_parameters())
    extra = sorted(set(tensors) - set(params))
    absent = sorted(name for name, p in params.items() if p.requires_grad and name not in tensors)
    problems = [f"the checkpoint's tensor {extra[0]} (and {len(extra) - 1} more) is not a parameter of the PEFT model "
                f"its record describes over {base}; give the base it was trained on (--base)"] if extra else []
    problems += [f"the checkpoint holds no {absent[0]} (and {len(absent) - 1} more) of what the PEFT model trains: it "
                 "was not written by this run's adapters"] if absent else []
    if problems:
        raise ValueError(format_problems("Cannot rebuild the adapters", problems))
    model.load_state_dict(dict(tensors), strict=False, assign=True)
    return model


def export_peft(checkpoint: Path, out: Path, base: Optional[Path] = None) -> list[Path]:
    """Write the checkpoint's adapters to ``out`` as PEFT's ``save_pretrained`` does; return the files written."""
    record, where = adapter_source(checkpoint, base)
    model = rebuilt_peft_model(*trained_adapters(checkpoint, record, where))
    for config in model.peft_config.values():
        config.base_model_name_or_path = str(where)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return sorted(path for path in out.rglob("*") if path.is_file())


def merged_deltas(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the base's weight name, as its files name it -> what the adapters add to it; -> the trained copy that replaces
    it, for ``modules_to_save``)."""
    base_prefix = "base_model.model."
    out: dict[str, torch.Tensor] = {}
    replaced: dict[str, torch.Tensor] = {}
    problems = []
    for name, module in model.named_modules():
        where = name.removeprefix(base_prefix)
        if tuner_layer(module) and hasattr(module, "lora_A"):
            if getattr(module, "lora_variant", None) or not isinstance(module.get_base_layer(), torch.nn.Linear):
                problems.append(f"{where}: only plain LoRA on a linear layer merges here; export with --format peft "
                                "and merge with PEFT's merge_and_unload")
                continue
            out[f"{where}.weight"] = sum(module.get_delta_weight(a).detach() for a in module.active_adapters)
        elif saved_copy_wrapper(module):
            copy = module.modules_to_save[module.active_adapters[0]]
            replaced.update({f"{where}.{key}": value.detach() for key, value in copy.state_dict().items()})
    if problems:
        raise ValueError(format_problems("Cannot merge the adapters", problems))
    return out, replaced


def export_merged(checkpoint: Path, out: Path, base: Optional[Path] = None) -> list[Path]:
    """Write the base with the adapters merged to ``out``, one of the base's safetensors shards at a time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    record, where = adapter_source(checkpoint, base)
    moved = sorted(name for name, text in record["configs"].items()
                   if str(json.loads(text).get("init_lora_weights", True)).lower() not in ("true", "false", "gaussian"))
    if moved:
        raise ValueError(f"adapter(s) {moved} were initialised by an init_lora_weights that changes the base's weights "
                         "(PiSSA, OLoRA, ...): merging them onto the base directory's files would be wrong; export "
                         "with --format peft and convert with PEFT")
    deltas, replaced = merged_deltas(rebuilt_peft_model(*trained_adapters(checkpoint, record, where)))
    out.mkdir(parents=True, exist_ok=True)
    written, used = [], set()
    for file in sorted(where.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors = {key: _merged(handle.get_tensor(key), deltas.get(key), replaced.get(key)) for key in handle.keys()}
            metadata = handle.metadata()
        used.update(key for key in tensors if key in deltas or key in replaced)
        save_file(tensors, str(out / file.name), metadata=metadata or {"format": "pt"})
        written.append(out / file.name)
    unplaced = sorted((set(deltas) | set(replaced)) - used)
    if unplaced:
        raise ValueError(f"{where}'s safetensors files hold no {unplaced[0]} (and {len(unplaced) - 1} more) that the "
                         "adapters change; give the base directory the run was trained on (--base)")
    written += [Path(shutil.copy(f, out / f.name)) for f in sorted(where.iterdir())
                if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt", ".pth")]
    return written


def _merged(weight: torch.Tensor, delta: Optional[torch.Tensor], replacement: Optional[torch.Tensor]) -> torch.Tensor:
    if replacement is not None:
        return replacement.to(weight.dtype).contiguous()
    if delta is None:
        return weight
    if delta.shape != weight.shape:
        raise ValueError(f"an adapter's change has shape {tuple(delta.shape)}, its base weight {tuple(weight.shape)}")
    if weight.dtype == torch.float32 or delta.dtype == weight.dtype:
        return (weight + delta.to(weight.dtype)).contiguous()
    return (weight.float() + delta.float()).to(weight.dtype).contiguous()
