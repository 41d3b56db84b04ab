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
from lightning_mgpu.models.llama import document_positions

IGNORE_INDEX = -100


def document_numbers(positions: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]``: each token's document, counted from 1 in each row; a document starts wherever a position is
    not one more than the one before (``transformers``' ``find_packed_sequence_indices`` rule)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    return starts.cumsum(dim=1)


def position_arguments(positions: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``position_ids`` and the block-diagonal causal ``attention_mask`` of packed documents given by their positions
    (``[batch, seq]``): a document starts wherever a position is not one more than the one before, the rule by which
    ``transformers`` reads packed ``position_ids`` given without a mask (``find_packed_sequence_indices``), so query
    ``i`` sees key ``j <= i`` of its own document. Positions are what pipeline stages hand on and what a collator's
    ``position_ids`` say; every row allows its diagonal, so none is all masked."""
    docs = document_numbers(positions)
    index = torch.arange(positions.shape[1], device=positions.device)
    allowed = (docs[:, :, None] == docs[:, None, :]) & (index[None, :] <= index[:, None])[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return {"position_ids": positions, "attention_mask": mask[:, None]}


def document_arguments(tokens: torch.Tensor, eod: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``position_ids`` restarting at each document of ``tokens`` and the block-diagonal causal ``attention_mask``."""
    return position_arguments(document_positions(tokens, eod), dtype)


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
    pipeline = context.pipeline if context is not None else None
    if pipeline is not None:  # which splits an evaluation batch into micro-batches too
        micro = pipeline.n_microbatches
    else:
        micro = context.num_microbatches if context is not None and training else 1
    return counted.clamp(min=1) / (micro * replicas)


__all__ = ["document_arguments", "document_numbers", "document_positions", "items_per_part", "position_arguments"]
