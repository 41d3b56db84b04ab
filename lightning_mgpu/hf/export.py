"""The exporters to a directory ``from_pretrained`` loads, written a shard at a time
(:func:`~lightning_mgpu.hf.shards.write_directory`): our Llama as a Llama, Mixtral or Qwen3-MoE (:func:`save_hf`), and
a checkpoint written while training a ``transformers`` model as it is (``model=hf``, :func:`export_trained_model`).

The checkpoint's parameters already carry the model's own names under the LightningModule's attribute (``llm.``), so
the tensors are the model's state dict, except where ``transformers`` packs a mixture of experts at load time
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``): its files keep one tensor per expert, and so
does this export (``save_pretrained`` reverses the packing the same way). ``config.json`` (and the tokenizer's files)
come from the directory the run trained from (``hyper_parameters['path']``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable, Collection, Mapping, Optional, Sequence

import torch

from lightning_mgpu.checkpoint.safe_reader import read_dcp_metadata
from lightning_mgpu.checkpoint.universal import read_parameters
from lightning_mgpu.hf.experts_names import MIXTRAL, QWEN3_MOE, is_stacked
from lightning_mgpu.hf.names import hf_names, parameter_names, to_hf_config
from lightning_mgpu.hf.shards import DEFAULT_MAX_SHARD_BYTES, write_directory
from lightning_mgpu.models.llama import LlamaConfig

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


def written_tensors(shapes: Mapping[str, torch.Size], config: Mapping,
                    packed_on_disk: bool = False) -> dict[str, tuple[Origin, tuple[int, ...]]]:
    """Each tensor the directory holds, in the checkpoint's order: its origin and shape. Mixtral's files name the
    block ``block_sparse_moe`` and an expert's weights ``w1`` (gate), ``w3`` (up), ``w2`` (down); the others keep the
    model's names. A family whose files keep the packed experts as they are (``packed_on_disk``: gpt-oss's
    ``experts.gate_up_proj [E, H, 2I]``, gate and up interleaved, with its biases) gets them packed. A tied head is not
    written (``tie_word_embeddings``: the embedding is)."""
    family = MIXTRAL if config.get("model_type") == MIXTRAL.model_type else QWEN3_MOE
    block_name, (gate, up, down) = family.block, family.expert_names
    out: dict[str, tuple[Origin, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        packed = None if packed_on_disk else _PACKED.fullmatch(name)
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


def _read_trained_shard(checkpoint: Path, keys: list[str], tensors: Mapping[str, tuple[Origin, tuple[int, ...]]],
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


def packed_on_disk(source: Path) -> bool:
    """Whether the directory's files keep a mixture of experts' packed weights under the model's names (gpt-oss's)
    rather than one tensor per expert (Qwen-MoE's, Mixtral's, DeepSeek's)."""
    from lightning_mgpu.hf.weights import opened_safetensors

    return any(_PACKED.fullmatch(key) for key in opened_safetensors(source))


def export_trained_model(checkpoint: Path, source: Path, out: Path, dtype: torch.dtype,
                         max_shard_bytes: int) -> list[Path]:
    """Write ``checkpoint`` (of a ``model=hf`` run from ``source``, whose ``config.json`` exists) to ``out``: the
    weights in shards, then the source's describing files. Returns the files written."""
    config = json.loads((source / "config.json").read_text())
    shapes = parameter_shapes(checkpoint)
    tensors = written_tensors(shapes, config, packed_on_disk(source))
    config["dtype"] = str(dtype).removeprefix("torch.")
    written = write_directory(out, {key: shape for key, (_, shape) in tensors.items()}, dtype, max_shard_bytes,
                              lambda keys: _read_trained_shard(checkpoint, list(keys), tensors, shapes, dtype), config)
    copied = [Path(shutil.copy(f, out / f.name)) for f in sorted(source.iterdir()) if f.is_file()
              and f.name != "config.json" and not any(f.match(pattern) for pattern in _WEIGHTS)]
    return [written[0], *copied, *written[1:]]


#: Reads some of our parameters whole, by name (a stacked parameter with all its experts).
ParameterReader = Callable[[list[str]], Mapping[str, torch.Tensor]]


def save_hf(read: ParameterReader, shapes: Mapping[str, Sequence[int]], cfg: LlamaConfig, out_dir: str | Path,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write our model as a Hugging Face directory: ``config.json`` and safetensors shards of at most
    ``max_shard_bytes`` in ``dtype`` (:mod:`~lightning_mgpu.hf.shards`). Each shard's parameters are read
    through ``read`` just before it is written and dropped after, so a model too big for one process's memory is
    written from a checkpoint read a shard at a time. ``shapes``: every parameter's shape (name -> shape). Returns the
    files written, ``config.json`` first."""
    config = to_hf_config(cfg)  # refuses a model no family holds before anything is written
    sources = hf_sources(shapes, cfg)
    return write_directory(out_dir, {key: shape for key, (_, shape) in sources.items()}, dtype, max_shard_bytes,
                           lambda keys: _read_shard(read, keys, sources, cfg, dtype), config)


def hf_sources(shapes: Mapping[str, Sequence[int]], cfg: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each Hugging Face tensor of our model: (our parameter it comes from, its shape as written), in our model's
    parameter order (so that a layer's tensors are neighbours in the shards); a stacked ``[E, a, b]`` parameter gives
    ``E`` tensors ``[b, a]``, and a tied head none (the embedding is written once). ``shapes``: name -> shape, of
    every parameter (else no complete model can be written)."""
    names = parameter_names(cfg)
    missing = [name for name in names if name not in shapes]
    if missing:
        raise ValueError(f"the weights lack {len(missing)} parameters of their model config (e.g. "
                         f"{', '.join(missing[:3])}), so no complete model can be written; export a checkpoint "
                         "that holds every parameter of its config")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in names:
        shape = tuple(shapes[name])
        keys = hf_names(name, cfg)
        written = [(shape[2], shape[1])] * len(keys) if is_stacked(name) else [shape]
        out.update({key: (name, one) for key, one in zip(keys, written)})
    return out


def _read_shard(read: ParameterReader, keys: Sequence[str], sources: Mapping[str, tuple[str, tuple[int, ...]]],
                cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors ``keys`` of one shard: their parameters read through ``read`` in one call (a stacked
    one whole, even when the shard holds only some of its experts: the others are not converted), then converted."""
    return hf_tensors(read(list(dict.fromkeys(sources[key][0] for key in keys))), cfg, dtype, set(keys))


def hf_tensors(state_dict: Mapping[str, torch.Tensor], cfg: LlamaConfig, dtype: torch.dtype = torch.float32,
               names: Optional[Collection[str]] = None) -> dict[str, torch.Tensor]:
    """Our state dict by Hugging Face names, in ``dtype``: stacked experts written one tensor per expert (each the
    transpose of ours, as ``nn.Linear`` keeps it), a tied head not written again. ``names``: only these Hugging Face
    tensors (a shard that holds some experts of a stacked parameter converts only those)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        for e, key in enumerate(hf_names(name, cfg)):
            if names is None or key in names:
                out[key] = (value[e].T if is_stacked(name) else value).detach().to(dtype).contiguous().cpu()
    return out
