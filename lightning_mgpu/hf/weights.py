"""Each rank reads only its slices of a ``from_pretrained`` directory's safetensors, into a model built on the meta
device.

``transformers``' own loader (``from_pretrained``) reads every tensor of the checkpoint on every process, or shards
them with its own DTensor plans, which are not this package's split. Here the strategy builds the model on the meta
device, splits it (tensor plan, pipeline stages), then asks :class:`PretrainedSlices` for each parameter's part
(:meth:`~lightning_mgpu.contract.ParallelModule.initial_value`): a safetensors slice is read from the memory-mapped
file, so no rank reads the tensors it does not keep.

Most tensors have the same name in the file as in the model. ``transformers`` packs a mixture of experts' weights into
``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]`` at load time while its files keep one tensor
per expert (``experts.{e}.gate_proj.weight`` ..., Mixtral's ``block_sparse_moe.experts.{e}.w1.weight`` ...): those are
assembled here from the experts the slice asks for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from lightning_mgpu.checkpoint.hf import opened_safetensors, read_slice
from lightning_mgpu.problems import format_problems

#: Where a family's files keep a mixture of experts: the block's name and an expert's (gate, up, down) weights. The
#: model itself names the block ``mlp`` and packs the experts (``experts.gate_up_proj``, ``experts.down_proj``).
QWEN_EXPERTS = ("mlp", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_EXPERTS = ("block_sparse_moe", ("w1", "w3", "w2"))
_EXPERT_NAMES = (QWEN_EXPERTS[1], MIXTRAL_EXPERTS[1])
_PACKED = re.compile(r"(?P<block>.+)\.experts\.(?P<kind>gate_up_proj|down_proj)")


class PretrainedSlices:
    """``initial_value`` for a ``transformers`` model held at ``prefix`` (``"llm."``) in a LightningModule: part
    ``index`` of parameter ``name`` read from the directory ``path``. Counts the elements it read (``read``)."""

    def __init__(self, path: str | Path, model: nn.Module, prefix: str) -> None:
        self.path, self.prefix = Path(path), prefix
        self._files = opened_safetensors(self.path)
        self.total = sum(p.numel() for p in model.parameters())
        self.read = 0
        #: What the directory lacks, found before any slice is read and raised by the first read on every rank alike
        #: (a dry run builds the structure from ``config.json`` alone and reads nothing).
        self.problems = self._coverage_problems(model) if self._files else [
            "no *.safetensors weights (pickled .bin files are not read): save the model with save_pretrained(DIR), "
            "whose default is safetensors"]

    def __call__(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        if self.problems:
            raise ValueError(format_problems(f"{self.path} does not hold the weights of the model its config.json "
                                             "describes", self.problems))
        key = name.removeprefix(self.prefix)
        packed = _PACKED.fullmatch(key)
        value = self._experts(packed, shape, index) if packed and key not in self._files else self._slice(key, shape,
                                                                                                        index)
        self.read += value.numel()
        return value

    def _source(self, key: str) -> Optional[str]:
        """The checkpoint's name of the model's tensor ``key``: the same, or Mixtral's ``block_sparse_moe``."""
        for candidate in (key, key.replace(f".{QWEN_EXPERTS[0]}.", f".{MIXTRAL_EXPERTS[0]}.")):
            if candidate in self._files:
                return candidate
        return None

    def _slice(self, key: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        source = self._source(key)
        if source is None:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        return read_slice(self._files[source], source, key, shape, index, self.path)

    def _expert_keys(self, block: str, expert: int, kind: str) -> list[str]:
        """The checkpoint's names of expert ``expert``'s part of ``kind``, in the naming of the family whose gate
        weight the directory holds (the first one otherwise); a name the directory lacks is returned as it would be."""
        wanted = (0, 1) if kind == "gate_up_proj" else (2,)
        family = next((names for names in _EXPERT_NAMES if self._source(f"{block}.experts.{expert}.{names[0]}.weight")),
                      _EXPERT_NAMES[0])
        keys = [f"{block}.experts.{expert}.{family[i]}.weight" for i in wanted]
        return [self._source(key) or key for key in keys]

    def _experts(self, packed: re.Match, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Experts ``index[0]`` of a packed weight, each from its own tensors: ``gate_up_proj[e]`` is expert ``e``'s
        gate rows then its up rows, ``down_proj[e]`` its down weight; then the rest of ``index``."""
        parts = []
        for expert in range(shape[0])[index[0]]:
            names = self._expert_keys(packed["block"], expert, packed["kind"])
            whole = torch.cat([self._files[name].get_tensor(name) for name in names])
            parts.append(whole[index[1:]])
        return torch.stack(parts)

    def _coverage_problems(self, model: nn.Module) -> list[str]:
        """Every tensor of ``model`` the directory cannot give, by the name it lacks, all at once, before any rank
        reads a slice."""
        problems = []
        for name, param in model.named_parameters():
            packed = _PACKED.fullmatch(name)
            if self._source(name) is not None:
                continue
            if not packed:
                problems.append(f"missing {name} {tuple(param.shape)}")
                continue
            problems += [f"missing {key} (for {name})" for e in range(param.shape[0])
                         for key in self._expert_keys(packed["block"], e, packed["kind"]) if key not in self._files]
        return problems

    def close(self) -> None:
        """Drop the memory-mapped files (the shards are materialised)."""
        self._files = {}


def real_buffers(model: nn.Module) -> None:
    """Give the buffers a meta-device build left without storage (rotary ``inv_freq`` tables: computed from the
    config, never in a checkpoint) their values on the CPU, the way ``transformers`` does after its own meta-device
    load: an empty tensor, then the model's ``_init_weights`` of the module that owns it."""
    owners = sorted({name.rpartition(".")[0] for name, buffer in model.named_buffers() if buffer.is_meta})
    init: Callable[[nn.Module], None] = model._init_weights  # type: ignore[assignment]
    with torch.device("cpu"):
        for owner_name in owners:
            owner = model.get_submodule(owner_name)
            for key, buffer in list(owner.named_buffers(recurse=False)):
                if buffer.is_meta:
                    setattr(owner, key, torch.empty_like(buffer, device="cpu"))  # stays a buffer, persistent or not
            init(owner)

