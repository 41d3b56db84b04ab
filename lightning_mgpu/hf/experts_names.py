"""Hugging Face Mixtral and Qwen3-MoE names, offline: their ``config.json`` keys and per-expert tensors (the one table
of where a family keeps its router and experts, read by the importer, the slice readers and both exporters).

Both families store each expert apart (``...experts.{e}.{gate,up,down}.weight``, as ``nn.Linear`` weights ``[out,
in]``), which is what ``transformers`` 5 writes (it fuses them only in memory) and loads. Our experts are stacked
(``experts.w1``, ``w3``: ``[E, dim, hidden]``, ``w2``: ``[E, hidden, dim]``), so expert ``e`` of ours is the
transpose of its Hugging Face tensor: stacked on import, unstacked on export, and one rank reads only its experts'
tensors (and only the part of each it holds). A Qwen3 model is ours with ``qk_norm`` (and usually ``head_dim``) set;
a mixture of experts without ``qk_norm`` is a Mixtral.

What a family's config can say that our model cannot do is refused, every such key at once, naming the key, its value
and the fix; so is a model of ours that a family cannot hold (shared experts, sigmoid scores, a router bias, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lightning_mgpu.models.llama import LlamaConfig


@dataclass(frozen=True)
class MoEFamily:
    """Where a Hugging Face mixture-of-experts family keeps a layer's router and experts, and its config's names."""

    model_type: str
    architecture: str
    block: str  #: the module of a layer holding ``gate`` (the router) and ``experts``
    expert_names: tuple[str, str, str]  #: the Linear names of our w1 (gate), w3 (up) and w2 (down)
    experts_key: str  #: the config key of the number of experts


MIXTRAL = MoEFamily("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts")
QWEN3_MOE = MoEFamily("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts")
FAMILIES = {f.model_type: f for f in (MIXTRAL, QWEN3_MOE)}

_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_ROUTER = re.compile(r"layers\.(\d+)\.feed_forward\.router\.gate\.weight")
_OURS = ("w1", "w3", "w2")


def family_of(cfg: LlamaConfig) -> Optional[MoEFamily]:
    """The family ``cfg`` is written as: None for a dense model; Qwen3-MoE with per-head q/k norms, else Mixtral."""
    if not cfg.num_experts:
        return None
    return QWEN3_MOE if cfg.qk_norm else MIXTRAL


def is_stacked(name: str) -> bool:
    """Whether our parameter ``name`` stacks one Hugging Face tensor per expert (so each is its transpose)."""
    return _EXPERTS.fullmatch(name) is not None


def moe_hf_names(name: str, family: MoEFamily, num_experts: int) -> Optional[list[str]]:
    """The Hugging Face tensors of our mixture-of-experts parameter ``name`` (one per expert, in expert order, for a
    stacked weight); None for a parameter a dense Llama has too (its name maps the Llama way)."""
    router = _ROUTER.fullmatch(name)
    if router:
        return [f"model.layers.{router.group(1)}.{family.block}.gate.weight"]
    experts = _EXPERTS.fullmatch(name)
    if not experts:
        return None
    theirs = family.expert_names[_OURS.index(experts.group(2))]
    return [f"model.layers.{experts.group(1)}.{family.block}.experts.{e}.{theirs}.weight" for e in range(num_experts)]


# ---------------------------------------------------------------------------------------------- config.json: import
def _need(hf: Mapping, key: str, problems: list[str]) -> Any:
    """``hf[key]``, or None and a problem naming the key: an expert count is never guessed from a default."""
    if hf.get(key) is None:
        problems.append(f"{key} is missing from config.json; a {hf.get('model_type')} config names it")
    return hf.get(key)


def qwen3_dense_layers(hf: Mapping, problems: list[str]) -> int:
    """``dense_layers`` of a Qwen3-MoE config: its ``mlp_only_layers`` and ``decoder_sparse_step`` may only mean
    "the first N layers are dense", the one arrangement our model has."""
    n, step, only = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        problems.append(f"decoder_sparse_step={step!r} must be a positive integer; use 1 (every layer sparse)")
        return 0
    dense = [i for i in range(n) if i in only or (i + 1) % step]
    if dense == list(range(len(dense))) and len(dense) < n:
        return len(dense)
    problems.append(f"mlp_only_layers={list(only)!r} with decoder_sparse_step={step} makes layers {dense} dense; "
                    "lightning_mgpu keeps only the first N layers dense (dense_layers=N) and at least one sparse: "
                    "give decoder_sparse_step=1 and mlp_only_layers=[0, ..., N-1] with N < num_hidden_layers")
    return 0


def _mixtral_problems(hf: Mapping) -> list[str]:
    problems = []
    if hf.get("router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r}: lightning_mgpu's router adds no noise; "
                        "set it to 0.0 (the weights do not depend on it)")
    window, positions = hf.get("sliding_window"), hf.get("max_position_embeddings", 2048)
    if window is not None and window < positions:
        problems.append(f"sliding_window={window!r} is shorter than max_position_embeddings={positions}: "
                        "lightning_mgpu attends over the whole sequence; set sliding_window to null")
    return problems


def _qwen3_problems(hf: Mapping) -> list[str]:
    if hf.get("use_sliding_window", False):
        return ["use_sliding_window=True: lightning_mgpu attends over the whole sequence; set it to false"]
    return []


def moe_fields(hf: Mapping, problems: list[str]) -> dict:
    """Our :class:`LlamaConfig` fields for the mixture of experts of a Mixtral or Qwen3-MoE ``config.json``
    (appending to ``problems`` what cannot be represented); the attention and shape fields are mapped by the caller."""
    qwen = hf["model_type"] == QWEN3_MOE.model_type
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is None:
        problems.append(f"num_local_experts (or num_experts) is missing from config.json; a {hf['model_type']} "
                        "config names it")
    fields = dict(num_experts=experts or 0, experts_per_token=_need(hf, "num_experts_per_tok", problems) or 1,
                  aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)))
    if qwen:
        problems += _qwen3_problems(hf)
        fields.update(qk_norm=True, expert_hidden=_need(hf, "moe_intermediate_size", problems) or 0,
                      router_renormalize=bool(hf.get("norm_topk_prob", False)),
                      dense_layers=qwen3_dense_layers(hf, problems))
    else:
        problems += _mixtral_problems(hf)
    return fields


# ---------------------------------------------------------------------------------------------- config.json: export
def moe_export_problems(cfg: LlamaConfig) -> list[str]:
    """Every reason ``cfg`` cannot be written as its family (:func:`family_of`), worded with our field and the fix."""
    family = family_of(cfg)
    if family is None:
        return []
    name = family.architecture
    wrong = [("shared_experts", 0), ("router_score", "softmax"), ("router_scale", 1.0), ("router_bias_rate", 0.0)]
    if family is MIXTRAL:
        wrong += [("dense_layers", 0), ("router_renormalize", True)]
    problems = [f"{key}={getattr(cfg, key)!r}: {name} has no such option; a model to export as {name} needs "
                f"{key}={ok!r}" for key, ok in wrong if getattr(cfg, key) != ok]
    return problems


def moe_hf_config(cfg: LlamaConfig) -> dict:
    """The family keys of ``config.json`` for ``cfg`` (beside the attention and shape keys every family has)."""
    family = family_of(cfg)
    out = {"architectures": [family.architecture], "model_type": family.model_type,
           family.experts_key: cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
           "router_aux_loss_coef": cfg.aux_loss_coeff, "output_router_logits": False, "sliding_window": None}
    if family is MIXTRAL:
        return {**out, "intermediate_size": cfg.expert_ffn_hidden, "router_jitter_noise": 0.0}
    return {**out, "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.expert_ffn_hidden,
            "norm_topk_prob": cfg.router_renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.dense_layers)), "use_sliding_window": False,
            "max_window_layers": cfg.n_layers}
