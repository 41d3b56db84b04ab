"""What one decoder layer of a ``transformers`` family holds beyond the Llama layer the planner counts.

The planner counts a layer as Llama's: q/k/v/o and gate/up/down split over the tensor-parallel ranks, two norms of
``hidden_size`` (and Qwen3's per-head q/k norms) whole on every rank. Families add parameters of their own: Gemma 2's
four norms, OLMo 2's q/k norms over every head, Qwen2's q/k/v biases (split with their projections). The layer is
built here from ``config.json`` on the meta device by ``transformers`` itself (with one layer, so that a 405B config
costs what a small one does), and each of its parameters is split or whole by the style of the family's own
tensor-parallel plan, as :mod:`lightning_mgpu.hf.tensor_plan` splits it. Counting by hand per family would have to
follow every family ``transformers`` adds; building the layer follows them all.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from lightning_mgpu.parallel.plan import plan_pattern

#: transformers' styles that split a module's weight and bias by output features.
SPLIT_WITH_BIAS = ("colwise", "colwise_gather_output")
#: Styles that split a module's weight by input features and keep its bias whole.
SPLIT_WEIGHT_ONLY = ("rowwise", "rowwise_split_input")
#: Keys of ``config.json`` that depend on the number of layers, dropped to build one.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers", "sliding_window_pattern", "layer_rope_theta")


@dataclass(frozen=True)
class LayerExtras:
    """Parameters of one layer beyond the planner's Llama layer: ``whole`` on every tensor-parallel rank and ``split``
    over them, and of each the vectors (1-D: norms, biases), which no matrix optimizer steps."""

    whole: int = 0
    split: int = 0
    whole_vectors: int = 0
    split_vectors: int = 0
    #: of ``whole``, the routed experts' weights (``base_model_ep_plan``'s ``grouped_gemm``): what expert
    #: parallelism splits by expert (``lightning_mgpu.hf.expert_parallel``)
    routed: int = 0
    #: the attention's matrices as built (``self_attn``'s 2-D parameters; 0 where not built): what a full
    #: recomputation runs again, which for latent attention (DeepSeek's MLA) no Llama count of heads gives
    attention: int = 0


def built_counts(hf: Mapping, shape: Any) -> dict:
    """The fields of a ``TransformersShape`` counted from layers ``transformers`` builds: a dense layer's extras over
    the planner's Llama layer, and for a mixture of experts its expert layer and which layers hold experts."""
    if hf.get("kv_lora_rank"):  # latent attention: scores over qk_nope + qk_rope dims, values of v_head_dim
        shape = replace(shape, head_dim=latent_head_dim(hf))
    hd = shape.head_dim
    counted_whole = 2 * shape.dim + (2 * hd if shape.qk_norm else 0)
    counted_split = shape.dim * hd * (2 * shape.n_heads + 2 * shape.n_kv_heads) + 3 * shape.dim * shape.ffn_hidden
    head = dict(head_dim=shape.head_dim)
    if not shape.num_experts:
        return dict(head, layer_extras=layer_extras(hf, counted_whole, counted_split, 0))
    experts = moe_layer_pattern(hf, shape.n_layers)
    dense = next((i for i, moe in enumerate(experts) if not moe), None)
    return dict(head, layer_extras=layer_extras(hf, counted_whole, counted_split, dense) if dense is not None
                else LayerExtras(), moe_layer=layer_sizes(hf, experts.index(True)) if any(experts) else None,
                moe_layers=experts)


def latent_head_dim(hf: Mapping) -> int:
    """The head width the planner counts for latent attention (DeepSeek's MLA): the mean of a query/key head's
    ``qk_nope_head_dim + qk_rope_head_dim`` and a value head's ``v_head_dim``, so that ``2 x heads x width`` is what
    its scores and its weighted values multiply per key (``QK^T`` over 192, ``PV`` over 128 for DeepSeek-V3: 160) and
    the q, k, v and output activations it keeps sum to what the model keeps. The planner's parameter counts stay those
    of the layer as built (:func:`layer_extras` takes the difference)."""
    return (int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]) + int(hf["v_head_dim"])) // 2


def moe_layer_pattern(hf: Mapping, n_layers: int) -> tuple[bool, ...]:
    """Which layers of a mixture of experts hold experts, by the keys ``transformers``' families place them with:
    DeepSeek's ``first_k_dense_replace`` and ``moe_layer_freq``, Qwen-MoE's ``decoder_sparse_step`` and
    ``mlp_only_layers``."""
    first, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    return tuple(i >= first and i % freq == 0 and (i + 1) % step == 0 and i not in dense for i in range(n_layers))


def layer_extras(hf: Mapping, counted_whole: int, counted_split: int, index: int) -> LayerExtras:
    """What layer ``index`` of the config (a dense one) holds beyond ``counted_whole`` vectors and ``counted_split``
    matrix elements (the planner's counts of a dense layer on one rank of one). None beyond them for a config
    transformers cannot build (an unknown ``model_type``): the planner's Llama count stands."""
    sizes = layer_sizes(hf, index)
    if sizes is None:
        return LayerExtras()
    return LayerExtras(sizes.whole - counted_whole, sizes.split - counted_split, sizes.whole_vectors - counted_whole,
                       sizes.split_vectors, attention=sizes.attention)


def layer_sizes(hf: Mapping, index: int) -> Optional[LayerExtras]:
    """Every parameter of layer ``index`` of the config (a mixture of experts' first expert layer, whose experts stay
    whole on every tensor-parallel rank), or None when transformers cannot build it."""
    return _layer_sizes(json.dumps(dict(hf), sort_keys=True), index)


@functools.lru_cache(maxsize=64)
def _layer_sizes(config_json: str, index: int) -> Optional[LayerExtras]:
    import torch
    import transformers

    hf = json.loads(config_json)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", *PER_LAYER_KEYS)}
    try:
        config = transformers.AutoConfig.for_model(hf.get("model_type", "llama"),
                                                   **{**kwargs, "num_hidden_layers": index + 1})
        with torch.device("meta"):
            layer = transformers.AutoModelForCausalLM.from_config(config).base_model.layers[index]
    except (ValueError, KeyError, TypeError, AttributeError, ImportError, RuntimeError):  # a family it lacks, one
        return None  # without `layers`, or one needing another package
    plan = {plan_pattern(key): style for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items()}
    routed = [plan_pattern(key) for key, style in (getattr(config, "base_model_ep_plan", None) or {}).items()
              if style == "grouped_gemm"]
    counts = dict(whole=0, split=0, whole_vectors=0, split_vectors=0, routed=0, attention=0)
    for name, parameter in layer.named_parameters():
        module, _, kind = f"layers.{index}.{name}".rpartition(".")
        style = next((style for pattern, style in plan.items() if pattern.fullmatch(module)), None)
        part = "split" if style in SPLIT_WITH_BIAS or (style in SPLIT_WEIGHT_ONLY and kind != "bias") else "whole"
        counts[part] += parameter.numel()
        counts[f"{part}_vectors"] += parameter.numel() if parameter.dim() == 1 else 0
        counts["routed"] += parameter.numel() if any(p.fullmatch(f"layers.{index}.{name}") for p in routed) else 0
        counts["attention"] += parameter.numel() if name.startswith("self_attn.") and parameter.dim() == 2 else 0
    return LayerExtras(**counts)


def transformers_parameters(shape: Any, active: bool = False) -> int:
    """The whole parameter count of a ``TransformersShape``: its dense layers as the planner counts a Llama layer plus
    the family's extras, its expert layers as built (``active``: only the routed experts a token goes through)."""
    hd, extras, built = shape.head_dim, shape.layer_extras, shape.moe_layer
    attention = shape.dim * hd * (2 * shape.n_heads + 2 * shape.n_kv_heads) + (2 * hd if shape.qk_norm else 0)
    dense_layer = attention + 3 * shape.dim * shape.ffn_hidden + 2 * shape.dim + extras.whole + extras.split
    moe = sum(shape.is_moe_layer(i) for i in range(shape.n_layers)) if built is not None else 0
    idle = (idle_experts(shape, built) if active else 0) if built is not None else 0
    moe_layer = built.whole + built.split - idle if built is not None else 0
    embeddings = shape.vocab_size * shape.dim * (1 if shape.tie_embeddings else 2)
    return (shape.n_layers - moe) * dense_layer + moe * moe_layer + embeddings + shape.dim


def idle_experts(shape: Any, built: LayerExtras) -> int:
    """The routed experts' parameters of one expert layer that a token does not run through: the ``E - k`` experts'
    share of the layer's routed weights as built (gpt-oss's expert biases with them), or ``3 x dim x hidden`` each for
    a family whose config names no routed weights (no ``base_model_ep_plan``)."""
    idle = shape.num_experts - shape.experts_per_token
    if built.routed:
        return built.routed * idle // shape.num_experts
    return idle * 3 * shape.dim * shape.expert_ffn_hidden
