"""Hugging Face interop, offline: ``config.json`` + ``*.safetensors`` in ``transformers``' layout, for Llama and (see
:mod:`~lightning_mgpu.checkpoint.hf_moe`) the Mixtral and Qwen3-MoE mixtures of experts.

Our :class:`~lightning_mgpu.models.llama.Llama` uses the same rotary convention as ``LlamaForCausalLM``
(rotate the two halves of each head), so weights map one to one by name, except stacked experts (one Hugging Face
tensor per expert); only the names and the config keys differ. Files are read with safetensors and JSON: nothing is
unpickled.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, ClassVar, Collection, Mapping, Optional, Sequence

import torch

from lightning_mgpu.checkpoint.hf_moe import (FAMILIES, family_of, is_stacked, moe_export_problems, moe_fields,
                                              moe_hf_config, moe_hf_names)
from lightning_mgpu.checkpoint.hf_layer_sizes import LayerExtras, built_counts, transformers_parameters
from lightning_mgpu.checkpoint.hf_shards import DEFAULT_MAX_SHARD_BYTES, plan_shards, write_shards
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.problems import format_problems

#: The ``model_type`` values of ``config.json`` that can be imported.
MODEL_TYPES = ("llama", *FAMILIES)

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_path(spec: str) -> Path:
    """The directory of ``hf:PATH`` (or a bare path)."""
    return Path(spec[3:] if spec.startswith("hf:") else spec)


def to_hf_name(name: str) -> str:
    """Our parameter name (``layers.3.attention.wq.weight``) -> Hugging Face's (``model.layers.3.self_attn...``)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def from_hf_name(name: str) -> str:
    """Inverse of :func:`to_hf_name`."""
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    if not m or m.group(2) not in inverse:
        raise KeyError(f"Hugging Face parameter {name!r} has no counterpart in lightning_mgpu's Llama")
    return f"layers.{m.group(1)}.{inverse[m.group(2)]}.weight"


def hf_names(name: str, cfg: LlamaConfig) -> list[str]:
    """The Hugging Face tensors our parameter ``name`` is made of: one, or one per expert for stacked experts (whose
    expert ``e`` is the transpose of the ``e``-th)."""
    family = family_of(cfg)
    moe = moe_hf_names(name, family, cfg.num_experts) if family is not None else None
    return moe if moe is not None else [to_hf_name(name)]


def export_problems(cfg: LlamaConfig) -> list[str]:
    """Every reason ``cfg`` has no Hugging Face family to be written as, before anything is written."""
    problems = moe_export_problems(cfg)
    if cfg.qk_norm and not cfg.num_experts:
        problems.append("qk_norm=True in a dense model: LlamaForCausalLM has no per-head q/k norms (a dense Qwen3 "
                        "export is not built); export a model with qk_norm=False, or a mixture of experts (Qwen3-MoE)")
    return problems


def to_hf_config(cfg: LlamaConfig) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with our model's shape (readable by transformers 4 and 5), or of a
    Mixtral / Qwen3-MoE for a mixture of experts; a model no family can hold is refused, every reason at once."""
    problems = export_problems(cfg)
    if problems:
        raise ValueError(format_problems("Cannot write this model as a Hugging Face checkpoint", problems))
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": int(cfg.head_dim), "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32", "initializer_range": cfg.init_std,
    }
    if family_of(cfg) is not None:
        del out["mlp_bias"]
        out.update(moe_hf_config(cfg))
    return out


def _attention_problems(hf: Mapping) -> list[str]:
    """What the attention and MLP keys of a Llama, Mixtral or Qwen3-MoE config ask that our model does not do."""
    problems = []
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(f"rope_type={rope.get('rope_type', rope.get('type'))!r}: only unscaled rotary embeddings "
                        "are supported")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, expected) != expected:
            problems.append(f"{key}={hf[key]!r}: lightning_mgpu's Llama needs {expected!r}")
    return problems


def _shape_fields(hf: Mapping) -> dict:
    """Our shape fields for the keys every family shares; ``head_dim`` kept only where it is not derived."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or 0
    if hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = 0
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(dim=hidden, n_layers=hf["num_hidden_layers"], n_heads=heads, head_dim=head_dim,
                n_kv_heads=hf.get("num_key_value_heads", heads), ffn_hidden=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                norm_eps=hf.get("rms_norm_eps", 1e-5), tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


@dataclass(frozen=True)
class TransformersShape(LlamaConfig):
    """The sizes of a ``transformers`` model: its q/k norms (Qwen3's) count among its parameters, and constrain no
    split, since it keeps them whole on every tensor-parallel rank and sums their gradients (``grad_sum``); its
    attention window refuses context parallelism, and so do its pipeline stages (``lightning_mgpu.hf.context``)."""

    sliding_window: int = 0
    #: per layer, beyond Llama's (:func:`~lightning_mgpu.checkpoint.hf_layer_sizes.layer_extras`): parameters whole
    #: on every tensor-parallel rank (norms) and split ones (biases)
    layer_extras: LayerExtras = LayerExtras()
    #: a mixture of experts' expert layer as built (its routed experts whole on every tensor-parallel rank), and which
    #: layers are expert layers (Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` place dense ones anywhere)
    moe_layer: Optional[LayerExtras] = None
    moe_layers: tuple[bool, ...] = ()

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_layers[index] if self.moe_layers else super().is_moe_layer(index)
    qk_norm_whole: ClassVar[bool] = True
    context_with_pipeline: ClassVar[bool] = False

    def num_parameters(self, active: bool = False) -> int:
        return transformers_parameters(self, active)


def sliding_window(hf: Mapping) -> int:
    """The attention window a ``config.json`` (or a ``transformers`` config's ``to_dict()``) sets, 0 for none."""
    return int((hf.get("sliding_window") or 0) if hf.get("use_sliding_window", True) else 0)


#: The families whose attention normalises each head's queries and keys (``q_norm``, ``k_norm``).
_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")


def planning_shape(hf: Mapping) -> LlamaConfig:
    """The sizes of any ``transformers`` decoder's ``config.json`` as a :class:`LlamaConfig`, for the layout rules, the
    planner, the memory check and the dry run of a model trained as it is (``model=hf``): what
    :func:`from_hf_config` refuses to import (biases, a sliding window, another family) does not change the sizes they
    count (the few bias elements aside)."""
    fields = _shape_fields(hf)
    fields.update(qk_norm=hf.get("model_type") in _QK_NORM_FAMILIES, sliding_window=sliding_window(hf))
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)
    if experts:
        fields.update(num_experts=experts, experts_per_token=int(hf.get("num_experts_per_tok", 2)),
                      expert_hidden=int(hf.get("moe_intermediate_size") or 0),
                      dense_layers=int(hf.get("first_k_dense_replace") or 0),
                      shared_experts=int(hf.get("n_shared_experts") or 0))
    shape = TransformersShape(**fields)
    return replace(shape, **built_counts(hf, shape))


def from_hf_config(hf: Mapping) -> LlamaConfig:
    """Our :class:`LlamaConfig` for a Hugging Face Llama, Mixtral or Qwen3-MoE ``config.json``; what we cannot
    represent is an error that names every such key at once."""
    model_type = hf.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise ValueError(format_problems("Cannot import this Hugging Face config", [
            f"model_type={model_type!r} is not supported; give a checkpoint of one of {', '.join(MODEL_TYPES)}"]))
    problems = _attention_problems(hf)
    fields = _shape_fields(hf)
    if model_type in FAMILIES:
        fields.update(moe_fields(hf, problems))
    if problems:
        raise ValueError(format_problems(f"Cannot import this Hugging Face {model_type} config", problems))
    return LlamaConfig(**fields)


#: Reads some of our parameters whole, by name (a stacked parameter with all its experts).
ParameterReader = Callable[[list[str]], Mapping[str, torch.Tensor]]


def save_hf(read: ParameterReader, shapes: Mapping[str, Sequence[int]], cfg: LlamaConfig, out_dir: str | Path,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write our model as a Hugging Face directory: ``config.json`` and safetensors shards of at most
    ``max_shard_bytes`` in ``dtype`` (:mod:`~lightning_mgpu.checkpoint.hf_shards`). Each shard's parameters are read
    through ``read`` just before it is written and dropped after, so a model too big for one process's memory is
    written from a checkpoint read a shard at a time. ``shapes``: every parameter's shape (name -> shape). Returns the
    files written, ``config.json`` first."""
    config = to_hf_config(cfg)  # refuses a model no family holds before anything is written
    sources = hf_sources(shapes, cfg)
    plan = plan_shards([(key, math.prod(shape) * dtype.itemsize) for key, (_, shape) in sources.items()],
                       max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = write_shards(out, plan, lambda keys: _read_shard(read, keys, sources, cfg, dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / "config.json", *written]


def hf_sources(shapes: Mapping[str, Sequence[int]], cfg: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each Hugging Face tensor of our model: (our parameter it comes from, its shape as written), in our model's
    parameter order (so that a layer's tensors are neighbours in the shards); a stacked ``[E, a, b]`` parameter gives
    ``E`` tensors ``[b, a]``, and a tied head none (the embedding is written once). ``shapes``: name -> shape, of
    every parameter (else no complete model can be written)."""
    names = _parameter_names(cfg)
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


def _parameter_names(cfg: LlamaConfig) -> list[str]:
    """Our model's parameter names (a tied head once, as the embedding), from a model built on the meta device."""
    from lightning_mgpu.models.llama import Llama

    with torch.device("meta"):
        return [name for name, _ in Llama(cfg).named_parameters()]


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
    state = {name: _assembled(name, [tensors[k] for k in hf_names(name, cfg)], path) for name in _parameter_names(cfg)}
    if cfg.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    return cfg, state


#: Tensors some Hugging Face checkpoints hold that are not weights (rotary tables, computed from the config).
_NOT_WEIGHTS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def completeness_problems(keys, cfg: LlamaConfig) -> list[str]:
    """Every tensor the model needs that ``keys`` (a checkpoint's tensor names) lacks, and every tensor it holds that
    the model has no place for: all at once, before any rank reads a slice. Each rank reads only its own slices, so a
    checkpoint with an extra layer or a missing one would otherwise load without a word on the ranks that skip it."""
    needed = {key for name in _parameter_names(cfg) for key in hf_names(name, cfg)}
    if cfg.tie_embeddings:
        needed.discard(to_hf_name("output.weight"))
    present = {key for key in keys if not _NOT_WEIGHTS.fullmatch(key)}
    problems = [f"missing {key}" for key in sorted(needed - present)]
    problems += [f"unexpected {key} (the model has no such parameter)" for key in sorted(present - needed)
                 if not (cfg.tie_embeddings and key == to_hf_name("output.weight"))]
    return problems


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
