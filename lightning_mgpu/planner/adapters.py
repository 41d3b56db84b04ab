"""LoRA adapters' parameters on one rank, from the model's shape and the ``adapters.*`` settings alone.

With ``adapters=lora`` the base is frozen (no gradient, no fp32 master, no optimizer state: the engine hands only what
trains to the optimizer), and what trains is the adapters: for a targeted linear of ``in`` inputs and ``out`` outputs,
``A`` of ``r x in`` and ``B`` of ``out x r``. Each adapter follows its base layer's tensor-parallel split (the same rule
as :mod:`lightning_mgpu.hf.adapters`): a column-parallel base keeps ``A`` whole and splits ``B`` by its output, a
row-parallel base splits ``A`` by its input and keeps ``B`` whole. ``modules_to_save`` adds a trained copy of each
named module (PEFT keeps the frozen original beside it).

The planner has no module to look at, so the targets are the Llama family's decoder linears by name (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, or the package's own model's ``wq`` ...
``w2`` for them); ``all-linear`` is all of them and never the head (PEFT's rule). A mixture-of-experts layer's routed experts are not counted as targets (their dense
parts, attention, are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

#: The decoder linears the planner counts as targets (``all-linear``: all of them).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
#: The package's own Llama's names of the same linears (``adapters=lora`` without ``model=hf`` targets them).
OWN_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w3": "up_proj",
             "w2": "down_proj", "output": "lm_head", "tok_embeddings": "embed_tokens"}


@dataclass(frozen=True)
class LoraShape:
    """What the planner needs of ``adapters=lora``: hashable, so shapes carrying it stay cacheable."""

    rank: int
    targets: tuple[str, ...] = ATTENTION + MLP
    modules_to_save: tuple[str, ...] = ()


def lora_shape(settings: Mapping[str, Any]) -> Optional[LoraShape]:
    """The :class:`LoraShape` of the ``adapters`` group (a plain mapping), ``None`` for ``adapters=none``."""
    if settings.get("kind", "none") == "none":
        return None
    targets = settings.get("targets") or ALL_LINEAR
    names = ATTENTION + MLP if targets == ALL_LINEAR else tuple(
        OWN_NAMES.get(str(t), str(t)) for t in ([targets] if isinstance(targets, str) else targets))
    saved = tuple(OWN_NAMES.get(str(m), str(m)) for m in settings.get("modules_to_save") or ())
    return LoraShape(int(settings["rank"]), names, saved)


def _linears(cfg: Any) -> dict[str, tuple[str, int, int]]:
    """(style, in, out) of each decoder linear of a Llama-family shape."""
    h, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    return {"q_proj": ("col", h, q), "k_proj": ("col", h, kv), "v_proj": ("col", h, kv), "o_proj": ("row", q, h),
            "gate_proj": ("col", h, f), "up_proj": ("col", h, f), "down_proj": ("row", f, h)}


def adapter_matrices(style: str, n_in: int, n_out: int, rank: int, tp: int) -> tuple[int, int]:
    """Elements of one adapter's ``A`` and ``B`` on one tensor-parallel rank: ``r in`` and ``out r`` with the base's
    split dimension over ``tp`` (column: ``B``'s output rows; row: ``A``'s input columns)."""
    if style == "col":
        return rank * n_in, n_out // tp * rank
    return rank * (n_in // tp), n_out * rank


def adapter_parameters(style: str, n_in: int, n_out: int, rank: int, tp: int) -> int:
    """One adapter's parameters on one tensor-parallel rank (:func:`adapter_matrices`, summed)."""
    return sum(adapter_matrices(style, n_in, n_out, rank, tp))


def layer_adapter_matrices(cfg: Any, lora: LoraShape, tp: int, moe: bool = False) -> list[int]:
    """Elements of every adapter matrix of one decoder layer on one tensor-parallel rank (a mixture-of-experts
    layer: attention only)."""
    linears = _linears(cfg)
    names = [n for n in lora.targets if n in linears and not (moe and n in MLP)]
    return [m for n in names for m in adapter_matrices(*linears[n], lora.rank, tp)]


def layer_adapter_parameters(cfg: Any, lora: LoraShape, tp: int, moe: bool = False) -> int:
    """The adapters of one decoder layer on one tensor-parallel rank."""
    return sum(layer_adapter_matrices(cfg, lora, tp, moe))


def largest_parameter(cfg: Any, tp: int, first: bool, last: bool) -> int:
    """The most elements one parameter of the rank has (the engine's ZeRO-3 persistence threshold is an eighth of
    it): the widest split linear, or the embedding's or head's vocabulary rows where the rank holds them."""
    rows = -(-cfg.vocab_size // tp) * cfg.dim if first or last else 0
    return max(rows, *(n_in * n_out // tp for _, n_in, n_out in _linears(cfg).values()))


def persistent_parameters(matrices: list[int], threshold: int) -> int:
    """Elements of the matrices ZeRO-3 keeps whole on every rank: those of at most ``threshold`` elements
    (DeepSpeed's ``stage3_param_persistence_threshold``, :func:`lightning_mgpu.buckets.persistence_threshold`)."""
    return sum(m for m in matrices if m <= threshold)


def saved_module_parameters(cfg: Any, lora: LoraShape, tp: int, first: bool, last: bool) -> int:
    """The trained copies ``modules_to_save`` adds on a rank: the head's and the embedding's (vocabulary rows split
    over ``tp``) where the rank holds them, the final norm's on the last stage."""
    rows = -(-cfg.vocab_size // tp)
    sizes = {"lm_head": rows * cfg.dim if last else 0, "embed_tokens": rows * cfg.dim if first else 0,
             "norm": cfg.dim if last else 0}
    return sum(sizes.get(name, 0) for name in lora.modules_to_save)


def trained_parameters(cfg: Any) -> Optional[int]:
    """What an adapter run trains in the whole model (the adapters at one tensor rank, any ``modules_to_save`` copy):
    what its checkpoints hold, the frozen base being left out of them. None without adapters."""
    lora = getattr(cfg, "adapters", None)
    if lora is None:
        return None
    layers = sum(layer_adapter_parameters(cfg, lora, 1, cfg.is_moe_layer(j)) for j in range(cfg.n_layers))
    return layers + saved_module_parameters(cfg, lora, 1, first=True, last=True)
