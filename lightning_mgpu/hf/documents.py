"""Packed documents for a ``transformers`` model as it is: each document attends only to itself and its positions
restart, given to the model as ``position_ids`` and a 4-D additive ``attention_mask`` (``[batch, 1, seq, seq]``: 0
where a token may attend, the dtype's lowest value elsewhere), which transformers' SDPA and eager attention take as
they are; and the loss's divisor, ``num_items_in_batch``, from the global batch's counted targets.

A document ends with its end-of-document token (the token belongs to the document it ends), as in the package's own
model (:func:`lightning_mgpu.models.llama.document_positions`).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mgpu.contract import parallel_context

IGNORE_INDEX = -100


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[batch, seq]``: the number of the document each token belongs to (0, 1, ... per sample)."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def document_arguments(tokens: torch.Tensor, eod: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``position_ids`` restarting at each document and the block-diagonal causal ``attention_mask`` of ``tokens``."""
    docs = document_ids(tokens, eod)
    seq = tokens.shape[1]
    index = torch.arange(seq, device=tokens.device)
    first = torch.zeros_like(docs)
    starts = torch.where(docs[:, 1:] != docs[:, :-1], index[1:].expand_as(docs[:, 1:]), 0)
    first[:, 1:] = torch.cummax(starts, dim=1).values
    allowed = (docs[:, :, None] == docs[:, None, :]) & (index[None, :] <= index[:, None])[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return {"position_ids": index[None] - first, "attention_mask": mask[:, None]}


def items_per_part(module: Any, targets: torch.Tensor, training: bool) -> torch.Tensor:
    """``num_items_in_batch`` for one micro-batch: the counted targets of the whole global batch (summed over the
    data-parallel replicas, once a step) over the parts the strategy averages with equal weights (micro-batches x
    replicas), so that each part's ``sum / this`` averaged equals ``sum / counted`` over the global batch."""
    counted = (targets != IGNORE_INDEX).sum().float()
    context = parallel_context(module)
    replicas = context.replicas if context is not None else module.trainer.world_size
    if replicas > 1:
        group = context.layout.group("dp") if context is not None else None
        counted = module.trainer.strategy.reduce(counted, group=group, reduce_op="sum")
    micro = context.num_microbatches if context is not None and training else 1
    return counted.clamp(min=1) / (micro * replicas)


__all__ = ["document_arguments", "document_ids", "items_per_part"]
