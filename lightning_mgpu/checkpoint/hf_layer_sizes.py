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
import re
from typing import Mapping

#: transformers' styles that split a module's weight and bias by output features.
SPLIT_WITH_BIAS = ("colwise", "colwise_gather_output", "packed_colwise")
#: Styles that split a module's weight by input features and keep its bias whole.
SPLIT_WEIGHT_ONLY = ("rowwise", "rowwise_split_input", "packed_rowwise")
#: The children of a mixture-of-experts layer the planner counts by its own rules (router, experts, shared experts).
MOE_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")
#: Keys of ``config.json`` that depend on the number of layers, dropped to build one.
PER_LAYER_KEYS = ("layer_types", "mlp_only_layers", "no_rope_layers", "sliding_window_pattern")


def layer_extras(hf: Mapping, counted_whole: int, counted_split: int, moe: bool) -> tuple[int, int, int]:
    """(whole, split, split vectors) parameters of layer 0 beyond ``counted_whole`` and ``counted_split`` (the
    planner's counts on one rank of one, which split no vector), leaving out a mixture of experts' block when ``moe``;
    split vectors (biases) are among the split ones. Zeros for a config transformers cannot build (an unknown
    ``model_type``): the planner's Llama count stands."""
    whole, split, split_vectors = _layer_sizes(json.dumps(dict(hf), sort_keys=True), moe)
    if whole < 0:
        return 0, 0, 0
    return whole - counted_whole, split - counted_split, split_vectors


@functools.lru_cache(maxsize=64)
def _layer_sizes(config_json: str, moe: bool) -> tuple[int, int, int]:
    """(whole, split, split vectors) parameters of layer 0 of the config, or -1s when transformers does not know
    it."""
    import torch
    import transformers

    hf = json.loads(config_json)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", *PER_LAYER_KEYS)}
    try:
        config = transformers.AutoConfig.for_model(hf.get("model_type", "llama"), **{**kwargs, "num_hidden_layers": 1})
        with torch.device("meta"):
            layer = transformers.AutoModelForCausalLM.from_config(config).base_model.layers[0]
    except (ValueError, KeyError, TypeError, AttributeError):  # a family transformers lacks, or without `layers`
        return -1, -1, -1
    plan = {re.compile(key.replace(".", r"\.").replace("*", r"\d+")): style
            for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items()}
    whole = split = split_vectors = 0
    for name, parameter in layer.named_parameters():
        if moe and name.split(".")[0] in MOE_BLOCKS:
            continue
        module, _, kind = f"layers.0.{name}".rpartition(".")
        style = next((style for pattern, style in plan.items() if pattern.fullmatch(module)), None)
        if style in SPLIT_WITH_BIAS or (style in SPLIT_WEIGHT_ONLY and kind != "bias"):
            split += parameter.numel()
            split_vectors += parameter.numel() if parameter.dim() == 1 else 0
        else:
            whole += parameter.numel()
    return whole, split, split_vectors
