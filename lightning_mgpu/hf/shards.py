"""Safetensors shards in the layout ``transformers``' ``save_pretrained`` writes and ``from_pretrained`` reads.

A model of hundreds of gigabytes cannot be written as one file from one process's memory, so its tensors are split
into consecutive groups of at most ``max_shard_bytes`` each (``model-00001-of-00003.safetensors``, ...), and
``model.safetensors.index.json`` maps every tensor to its file. A model that fits in one shard is written as one
``model.safetensors`` without an index, as ``transformers`` does. The writer asks for one shard's tensors at a time
and drops them once written, so at most one shard is held in memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

#: ``transformers``' default ``max_shard_size`` ("5GB", decimal units).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: The file of a model written as one shard; the stem every shard's name starts with.
SINGLE_FILE = "model.safetensors"
#: Which shard holds each tensor, beside the shards of a model written as several.
INDEX_FILE = "model.safetensors.index.json"

#: Reads the tensors of one shard: given their names (in plan order), returns exactly those tensors.
ShardReader = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[list[str]]:
    """The tensor names of each shard: ``sizes`` (name, bytes in the output dtype), in order, cut into consecutive
    groups of at most ``max_shard_bytes``. A tensor bigger than the limit cannot be split across files, so it gets a
    shard of its own. Consecutive, so that the parameters of one layer land in one or two neighbouring files."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} is not positive: a shard holds at least one byte; give "
                         f"e.g. {DEFAULT_MAX_SHARD_BYTES} (5 GB)")
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_names(count: int) -> list[str]:
    """The file of each of ``count`` shards, named as ``transformers`` names them (one shard: ``model.safetensors``)."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def remove_stale_shards(out: Path) -> list[Path]:
    """Delete the shards and index an earlier export left in ``out``: a loader reads every ``*.safetensors`` file it
    finds (``transformers`` without an index, :func:`~lightning_mgpu.hf.weights.load_hf` always), so an old shard
    left beside new ones would mix old tensors into the model. Returns the files removed."""
    stale = sorted(out.glob("model*.safetensors")) + ([out / INDEX_FILE] if (out / INDEX_FILE).exists() else [])
    for path in stale:
        path.unlink()
    return stale


def _tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write_one(path: Path, names: Sequence[str], read: ShardReader) -> int:
    """Read shard ``names`` through ``read``, write it to ``path``; its bytes. A reader that returns other tensors
    than asked would leave the index wrong, so that is an error naming the difference."""
    from safetensors.torch import save_file

    tensors = dict(read(names))
    if set(tensors) != set(names):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise RuntimeError(f"shard {path.name}: the reader returned other tensors than asked (missing {missing[:5]}, "
                           f"extra {extra[:5]}); it must return exactly the names it is given")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return _tensor_bytes(tensors)


def write_shards(out: str | Path, plan: Sequence[Sequence[str]], read: ShardReader) -> list[Path]:
    """Write the shards of ``plan`` (from :func:`plan_shards`) into ``out``, reading each through ``read`` just before
    it is written, and with several shards the index; return the files written, the index last. Stale shards of an
    earlier export are removed first (:func:`remove_stale_shards`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_shards(out)
    files = shard_file_names(len(plan))
    total, weight_map = 0, {}
    for names, file in zip(plan, files):
        total += _write_one(out / file, names, read)  # the shard's tensors are dropped on return
        weight_map.update(dict.fromkeys(names, file))
    written = [out / file for file in files]
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / INDEX_FILE)
    return written


def write_directory(out: str | Path, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype, max_shard_bytes: int,
                    read: ShardReader, config: Mapping) -> list[Path]:
    """The one writer of a Hugging Face directory, for every exporter: the tensors ``shapes`` (name -> shape as
    written, in order) in shards of at most ``max_shard_bytes`` in ``dtype``, each read through ``read`` just before
    it is written, then ``config``  as ``config.json``. Returns the files written, ``config.json`` first."""
    out = Path(out)
    plan = plan_shards([(key, math.prod(shape) * dtype.itemsize) for key, shape in shapes.items()], max_shard_bytes)
    written = write_shards(out, plan, read)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / "config.json", *written]
