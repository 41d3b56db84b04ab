"""The optimizer a built-in module trains with (``optim.name``): AdamW, or Muon for the blocks' weight matrices with
AdamW for the rest. One rule for ``LLMModule`` and a Hugging Face model as it is."""

from __future__ import annotations

from typing import Iterable

import torch

from lightning_mgpu.optim.muon import MuonWithAdamW

#: ``optim.name`` values.
OPTIMIZERS = ("adamw", "muon")
#: ``optim.muon_ns_dtype`` values: the dtype of Newton-Schulz (``auto``: bf16, torch.optim.Muon's, on CUDA; fp32 on a
#: CPU, see :func:`lightning_mgpu.optim.muon.orthogonalize`).
NS_DTYPES = ("auto", "bfloat16", "float32")


def muon_steps(name: str, shape: torch.Size) -> bool:
    """The parameters Muon steps: the repeated blocks' weight matrices and expert stacks (2-D or more, under a
    numbered block: ``layers.3.``, ``model.layers.3.``, GPT-2's ``transformer.h.3.``); embeddings, norms, the output
    head and routers (``router``, or a Hugging Face MoE's ``gate``) stay on AdamW, as Muon's authors prescribe. Under
    pipeline parallelism the stage's index comes first (``0.layers.3.``, ``0.tok_embeddings``): it is not a block's."""
    parts = name.split(".")
    in_block = any(part.isdigit() for part in parts[1:])
    return in_block and "router" not in parts and "gate" not in parts and len(shape) >= 2


def build_optimizer(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], shape_of, name: str, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float, muon_momentum: float = 0.95,
                    muon_ns_dtype: str = "auto", fused: bool = False) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only), or with ``name="muon"`` :class:`MuonWithAdamW` under Moonshot's LR rule
    (``match_rms_adamw``: Muon's update scaled to AdamW's RMS, so both kinds share one LR and schedule).
    ``shape_of(param)``: its shape as built (a ZeRO-3 partition is flat by then)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is unknown; choose {' or '.join(OPTIMIZERS)}")
    named = list(named_parameters)
    matrices = [p for n, p in named if muon_steps(n, shape_of(p))] if name == "muon" else []
    chosen = {id(p) for p in matrices}
    decay = [p for _, p in named if len(shape_of(p)) >= 2 and id(p) not in chosen]
    no_decay = [p for _, p in named if len(shape_of(p)) < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = {"betas": tuple(betas), "eps": eps, **({"fused": True} if fused else {})}
    if name != "muon":  # a group with nothing to train (no 1-D parameter of a LoRA run) is left out: DeepSpeed drops it
        return torch.optim.AdamW([group for group in groups if group["params"]], lr=lr, **adamw)
    return MuonWithAdamW([{"params": matrices, "muon": True}, *groups], lr=lr, weight_decay=weight_decay, adamw=adamw,
                         muon={"momentum": muon_momentum, "adjust_lr_fn": "match_rms_adamw",
                               "ns_dtype": None if muon_ns_dtype == "auto" else getattr(torch, muon_ns_dtype)})
