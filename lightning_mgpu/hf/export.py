"""``mgpu-export`` of a checkpoint written while training a ``transformers`` model as it is (``model=hf``): a directory
``from_pretrained`` loads, written a shard at a time.

The checkpoint's parameters already carry the model's own names under the LightningModule's attribute (``llm.``), so
the tensors are the model's state dict, except where ``transformers`` packs a mixture of experts at load time
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``): its files keep one tensor per expert, and so
does this export (``save_pretrained`` reverses the packing the same way). ``config.json`` (and the tokenizer's files)
come from the directory the run trained from (``hyper_parameters['path']``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Mapping

import torch

from lightning_mgpu.checkpoint.hf_shards import plan_shards, write_shards
from lightning_mgpu.checkpoint.safe_reader import read_dcp_metadata
from lightning_mgpu.checkpoint.universal import read_parameters
from lightning_mgpu.hf.weights import MIXTRAL_EXPERTS, QWEN_EXPERTS

#: The LightningModule attribute ``HFCausalLM`` keeps the model at.
PREFIX = "llm."
_PACKED = re.compile(r"(?P<layer>.+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)")
#: Files of the source directory that hold weights (or say where they are): every other file (the tokenizer's,
#: ``generation_config.json``, a chat template, ...) is copied beside the new shards.
_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")
#: The hyper-parameters that ``HFCausalLM`` saves and ``LLMModule`` does not (it saves ``model``).
_HF_MODULE_KEYS = {"path", "activation_checkpointing"}

#: One written tensor's origin: (the checkpoint's parameter, the expert or None, the rows of it or None).
Origin = tuple[str, "int | None", "slice | None"]


def trained_from(trainer_state: Mapping) -> "Path | None":
    """The ``transformers`` directory a ``model=hf`` run trained (None: the checkpoint is not of such a run)."""
    hparams = trainer_state.get("hyper_parameters") or {}
    return Path(hparams["path"]) if _HF_MODULE_KEYS <= hparams.keys() and "model" not in hparams else None


def parameter_shapes(checkpoint: Path) -> dict[str, torch.Size]:
    """The model's parameters in the checkpoint (without ``llm.``), with their whole shapes, from its metadata."""
    prefix = f"param/{PREFIX}"
    return {key[len(prefix):]: torch.Size(meta.size) for key, meta in read_dcp_metadata(checkpoint)
            .state_dict_metadata.items() if key.startswith(prefix) and hasattr(meta, "size")}


def written_tensors(shapes: Mapping[str, torch.Size], config: Mapping) -> dict[str, tuple[Origin, tuple[int, ...]]]:
    """Each tensor the directory holds, in the checkpoint's order: its origin and shape. Mixtral's files name the
    block ``block_sparse_moe`` and an expert's weights ``w1`` (gate), ``w3`` (up), ``w2`` (down); the others keep the
    model's names. A tied head is not written (``tie_word_embeddings``: the embedding is)."""
    mixtral = config.get("model_type") == "mixtral"
    block_name, (gate, up, down) = MIXTRAL_EXPERTS if mixtral else QWEN_EXPERTS
    out: dict[str, tuple[Origin, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        packed = _PACKED.fullmatch(name)
        if not packed:
            key = name.replace(".mlp.gate.", f".{block_name}.gate.")
            out[key] = ((name, None, None), tuple(shape))
            continue
        block = f"{packed['layer']}.{block_name}.experts"
        for e in range(shape[0]):
            if packed["kind"] == "down_proj":
                out[f"{block}.{e}.{down}.weight"] = ((name, e, None), tuple(shape[1:]))
                continue
            half = shape[1] // 2  # gate rows, then up rows
            for part, rows in ((gate, slice(0, half)), (up, slice(half, shape[1]))):
                out[f"{block}.{e}.{part}.weight"] = ((name, e, rows), (half, shape[2]))
    return out


def _read_shard(checkpoint: Path, keys: list[str], tensors: Mapping[str, tuple[Origin, tuple[int, ...]]],
                shapes: Mapping[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One shard's tensors: its parameters read from the checkpoint in one call, then cut and cast."""
    names = list(dict.fromkeys(tensors[key][0][0] for key in keys))
    params = read_parameters(checkpoint, {name: shapes[name] for name in names}, prefix=PREFIX)
    out = {}
    for key in keys:
        (name, expert, rows), _ = tensors[key]
        value = params[name] if expert is None else params[name][expert]
        out[key] = (value if rows is None else value[rows]).to(dtype).contiguous()
    return out


def export_trained_model(checkpoint: Path, source: Path, out: Path, dtype: torch.dtype,
                         max_shard_bytes: int) -> list[Path]:
    """Write ``checkpoint`` (of a ``model=hf`` run from ``source``, whose ``config.json`` exists) to ``out``: the
    weights in shards, then the source's describing files. Returns the files written."""
    config = json.loads((source / "config.json").read_text())
    shapes = parameter_shapes(checkpoint)
    tensors = written_tensors(shapes, config)
    plan = plan_shards([(key, math.prod(shape) * dtype.itemsize) for key, (_, shape) in tensors.items()],
                       max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    written = write_shards(out, plan, lambda keys: _read_shard(checkpoint, list(keys), tensors, shapes, dtype))
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = [Path(shutil.copy(f, out / f.name)) for f in sorted(source.iterdir()) if f.is_file()
              and f.name != "config.json" and not any(f.match(pattern) for pattern in _WEIGHTS)]
    return [out / "config.json", *copied, *written]
