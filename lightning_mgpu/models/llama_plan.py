"""How :class:`~lightning_mgpu.models.llama.Llama` is split: its tensor-parallel plan.

Data only, beside the model; applied by :func:`lightning_mgpu.parallel.plan.apply_tensor_parallel`.
Attention heads are split by splitting ``wq`` (query heads) and ``wk``/``wv`` (key/value heads) by
output rows, so each rank keeps whole heads and its query heads' own key/value group.
"""

from __future__ import annotations

#: Module name pattern -> tensor-parallel style (see ``lightning_mgpu.parallel.plan``).
LLAMA_TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "norm",
    "output": "vocab_output",
}


def llama_tp_plan(prefix: str = "") -> dict[str, str]:
    """The Llama plan with every pattern under ``prefix`` (e.g. ``"model."`` inside a LightningModule)."""
    return {prefix + key: style for key, style in LLAMA_TP_PLAN.items()}
