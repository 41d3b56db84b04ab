"""Each rank reads only its slices of a Hugging Face directory's safetensors: the one slice reader, for a
``transformers`` model as it is (:class:`PretrainedSlices`) and for our Llama from a Llama, Mixtral or Qwen3-MoE
directory (:class:`HFWeights`, :func:`load_hf`).

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

import json
import re
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from lightning_mgpu.hf.experts_names import MIXTRAL, QWEN3_MOE, is_stacked
from lightning_mgpu.hf.names import completeness_problems, from_hf_config, hf_names, parameter_names, to_hf_name
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.problems import format_problems

#: The expert weight names (gate, up, down) of each family's files; the model itself names the block ``mlp`` (Qwen's
#: block name) and packs the experts (``experts.gate_up_proj``, ``experts.down_proj``).
_EXPERT_NAMES = (QWEN3_MOE.expert_names, MIXTRAL.expert_names)
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
        for candidate in (key, key.replace(f".{QWEN3_MOE.block}.", f".{MIXTRAL.block}.")):
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


def opened_safetensors(path: Path) -> dict:
    """Every tensor name of the directory's ``*.safetensors`` files, to the open (memory-mapped) file that holds it;
    pickled ``*.bin`` files are never read."""
    from safetensors import safe_open

    handles = {}
    for file in sorted(path.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        handles.update({key: handle for key in handle.keys()})
    return handles


def read_slice(handle, key: str, name: str, shape: torch.Size, index: tuple[slice, ...], where: Path) -> torch.Tensor:
    """Part ``index`` of tensor ``key`` of an open safetensors file (``handle``), read alone from the memory-mapped
    file, once its shape is the model's ``name``'s ``shape``."""
    piece = handle.get_slice(key)
    if tuple(piece.get_shape()) != tuple(shape):
        raise ValueError(f"{where}: {key} has shape {tuple(piece.get_shape())}, the model's {name} has {tuple(shape)}; "
                         "give the directory whose config.json describes this model")
    return piece[index]


class HFWeights:
    """Reads slices of a Hugging Face Llama directory's tensors by our parameter names, without loading the rest: a
    rank reads only its shard (safetensors slices are read from the memory-mapped file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = from_hf_config(json.loads((self.path / "config.json").read_text()))
        self._files = opened_safetensors(self.path)
        problems = completeness_problems(self._files, self.config)
        if problems:
            raise ValueError(format_problems(f"{self.path} does not fit the model its config.json describes", problems))

    def read(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Part ``index`` of our parameter ``name`` (the output head falls back to the embedding when tied); of a
        stacked expert weight, only the experts of ``index[0]`` are read."""
        keys = hf_names(name, self.config)
        if is_stacked(name):
            return self._read_experts(name, keys, shape, index)
        key = keys[0]
        if key not in self._files and name == "output.weight" and self.config.tie_embeddings:
            key = to_hf_name("tok_embeddings.weight")
        if key not in self._files:
            raise KeyError(f"{self.path} has no tensor {key!r} for parameter {name!r}")
        return read_slice(self._files[key], key, name, shape, index, self.path)

    def _read_experts(self, name: str, keys: list[str], shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Experts ``index[0]`` of a stacked weight ``[E, a, b]``: of each expert's ``[b, a]`` tensor only the part
        ``index[2], index[1]`` is read (a rank's hidden slice under tensor parallelism), then transposed."""
        experts, rows, cols = index
        if len(keys) != shape[0]:
            raise ValueError(f"{self.path}: {name} has {shape[0]} experts, config.json {len(keys)}")
        parts = []
        for key in keys[experts]:
            piece = self._files[key].get_slice(key)
            if tuple(piece.get_shape()) != (shape[2], shape[1]):
                raise ValueError(f"{self.path}: {key} has shape {tuple(piece.get_shape())}, an expert of the model's "
                                 f"{name} needs {(shape[2], shape[1])} (the transpose of {tuple(shape[1:])})")
            parts.append(piece[cols, rows].T)
        return torch.stack(parts)


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` (an unsplit Llama), naming every missing, extra or mis-shaped tensor."""
    own = dict(model.state_dict())
    problems = [f"missing {k}" for k in own if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in own]
    problems += [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                 for k in own if k in state and state[k].shape != own[k].shape]
    if problems:
        raise ValueError(format_problems("Checkpoint does not fit the model", problems))
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k].to(v.dtype))


def _assembled(name: str, pieces: list[torch.Tensor], where: Path) -> torch.Tensor:
    """Our parameter from its Hugging Face tensors: stacked experts are each transposed and stacked."""
    if not is_stacked(name):
        return pieces[0]
    shapes = sorted({tuple(p.shape) for p in pieces})
    if len(shapes) > 1:
        raise ValueError(f"{where}: the experts of {name} have different shapes {shapes}; each must be the same")
    return torch.stack([p.T for p in pieces])


def load_hf(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(config, our state dict) of a Hugging Face Llama directory (one or several ``*.safetensors`` files)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: give a Hugging Face Llama directory")
    cfg = from_hf_config(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (pickled .bin files are not loaded)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    problems = completeness_problems(tensors, cfg)
    if problems:
        raise ValueError(format_problems(f"{path} does not fit the model its config.json describes", problems))
    state = {name: _assembled(name, [tensors[k] for k in hf_names(name, cfg)], path) for name in parameter_names(cfg)}
    if cfg.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    return cfg, state
