"""Hugging Face names, offline: our Llama's parameters and ``config.json`` keys in ``transformers``' naming, for Llama
and (see :mod:`~lightning_mgpu.hf.experts_names`) the Mixtral and Qwen3-MoE mixtures of experts; and the sizes of any
``transformers`` decoder's ``config.json`` for the layout rules, the planner and the memory check.

Our :class:`~lightning_mgpu.models.llama.Llama` uses the same rotary convention as ``LlamaForCausalLM``
(rotate the two halves of each head), so weights map one to one by name, except stacked experts (one Hugging Face
tensor per expert); only the names and the config keys differ. Reading the weights is :mod:`lightning_mgpu.hf.weights`,
writing them :mod:`lightning_mgpu.hf.export`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Mapping, Optional

import torch

from lightning_mgpu.hf.experts_names import (FAMILIES, family_of, moe_export_problems, moe_fields, moe_hf_config,
                                             moe_hf_names)
from lightning_mgpu.hf.layer_sizes import LayerExtras, built_counts, transformers_parameters
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.problems import format_problems
from lightning_mgpu.split_rules import HF_EXPERT_FAMILIES

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
    #: per layer, the keys back a query attends (its window; 0: the whole sequence before it), which the planner's
    #: attention FLOPs count layer by layer (:func:`attention_windows`); empty: no layer has a window
    attention_windows: tuple[int, ...] = ()
    #: per layer, beyond Llama's (:func:`~lightning_mgpu.hf.layer_sizes.layer_extras`): parameters whole
    #: on every tensor-parallel rank (norms) and split ones (biases)
    layer_extras: LayerExtras = LayerExtras()
    #: a mixture of experts' expert layer as built (its routed experts whole on every tensor-parallel rank), and which
    #: layers are expert layers (Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` place dense ones anywhere)
    moe_layer: Optional[LayerExtras] = None
    moe_layers: tuple[bool, ...] = ()
    #: ``adapters=lora``: the adapters' shape (:class:`lightning_mgpu.planner.adapters.LoraShape`), which freezes the
    #: rest in the planner's count; ``None``: every weight trains
    adapters: Optional[object] = None

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_layers[index] if self.moe_layers else super().is_moe_layer(index)
    qk_norm_whole: ClassVar[bool] = True
    context_with_pipeline: ClassVar[bool] = False
    #: the family (``config.json``'s ``model_type``): expert parallelism splits the experts of some
    model_type: str = ""

    @property
    def experts_split(self) -> bool:
        """Whether expert parallelism splits its routed experts (``split_rules.HF_EXPERT_FAMILIES``; every rank holds
        every expert of the others)."""
        return self.model_type in HF_EXPERT_FAMILIES

    def num_parameters(self, active: bool = False) -> int:
        return transformers_parameters(self, active)


def sliding_window(hf: Mapping) -> int:
    """The attention window a ``config.json`` (or a ``transformers`` config's ``to_dict()``) sets, 0 for none."""
    return int((hf.get("sliding_window") or 0) if hf.get("use_sliding_window", True) else 0)


def attention_windows(hf: Mapping) -> tuple[int, ...]:
    """Per layer, the window of keys a query attends (0: every key before it), where ``transformers`` puts them: a
    ``sliding_attention`` layer of its config's ``layer_types`` (gpt-oss's and Gemma 2's alternation, Gemma 3's and
    Cohere 2's patterns, Qwen2's layers from ``max_window_layers`` on) attends ``sliding_window`` keys; a family with
    no ``layer_types`` (Mistral, Mixtral, Phi-3, Qwen3-MoE) windows every layer when its config keeps a
    ``sliding_window``. The config is built by ``transformers`` so that each family's defaults and switches
    (``use_sliding_window``) are its own; the keys as written stand for a family it cannot build. Other layer kinds
    (chunked, linear attention) count as whole-sequence attention. Empty when no layer has a window."""
    windows = _attention_windows(json.dumps(dict(hf), sort_keys=True, default=str))
    return windows if any(windows) else ()


@functools.lru_cache(maxsize=64)
def _attention_windows(config_json: str) -> tuple[int, ...]:
    hf = json.loads(config_json)
    try:
        import transformers

        kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}
        built = transformers.AutoConfig.for_model(hf.get("model_type", "llama"), **kwargs)
        window, kinds = int(getattr(built, "sliding_window", None) or 0), getattr(built, "layer_types", None)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError):  # a family transformers lacks
        window, kinds = sliding_window(hf), hf.get("layer_types")
    layers = int(hf["num_hidden_layers"])
    if kinds is None:
        return (window,) * layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


#: The families whose attention normalises each head's queries and keys (``q_norm``, ``k_norm``).
_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")


def planning_shape(hf: Mapping) -> LlamaConfig:
    """The sizes of any ``transformers`` decoder's ``config.json`` as a :class:`LlamaConfig`, for the layout rules, the
    planner, the memory check and the dry run of a model trained as it is (``model=hf``): what
    :func:`from_hf_config` refuses to import (biases, a sliding window, another family) does not change the sizes they
    count (the few bias elements aside)."""
    fields = _shape_fields(hf)
    fields.update(qk_norm=hf.get("model_type") in _QK_NORM_FAMILIES, sliding_window=sliding_window(hf),
                  attention_windows=attention_windows(hf), model_type=str(hf.get("model_type") or ""))
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


def parameter_names(cfg: LlamaConfig) -> list[str]:
    """Our model's parameter names (a tied head once, as the embedding), from a model built on the meta device."""
    from lightning_mgpu.models.llama import Llama

    with torch.device("meta"):
        return [name for name, _ in Llama(cfg).named_parameters()]


#: Tensors some Hugging Face checkpoints hold that are not weights (rotary tables, computed from the config).
_NOT_WEIGHTS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def completeness_problems(keys, cfg: LlamaConfig) -> list[str]:
    """Every tensor the model needs that ``keys`` (a checkpoint's tensor names) lacks, and every tensor it holds that
    the model has no place for: all at once, before any rank reads a slice. Each rank reads only its own slices, so a
    checkpoint with an extra layer or a missing one would otherwise load without a word on the ranks that skip it."""
    needed = {key for name in parameter_names(cfg) for key in hf_names(name, cfg)}
    if cfg.tie_embeddings:
        needed.discard(to_hf_name("output.weight"))
    present = {key for key in keys if not _NOT_WEIGHTS.fullmatch(key)}
    problems = [f"missing {key}" for key in sorted(needed - present)]
    problems += [f"unexpected {key} (the model has no such parameter)" for key in sorted(present - needed)
                 if not (cfg.tie_embeddings and key == to_hf_name("output.weight"))]
    return problems
