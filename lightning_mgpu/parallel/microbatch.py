"""Splitting one rank's batch into micro-batches."""

from __future__ import annotations

from typing import Any

import torch


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple / list / dict of tensors) cut into ``num_microbatches`` equal parts along dim 0."""
    if num_microbatches == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % num_microbatches:
            raise ValueError(f"a batch of {batch.shape[0]} samples does not split into {num_microbatches} "
                             "equal micro-batches; make the per-rank batch a multiple of the micro-batch count")
        return list(batch.chunk(num_microbatches))
    if isinstance(batch, (list, tuple)):
        parts = [split_microbatches(b, num_microbatches) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(num_microbatches)]
    if isinstance(batch, dict):
        parts = {k: split_microbatches(v, num_microbatches) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(num_microbatches)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches; yield tensors, or "
                    "tuples / lists / dicts of tensors, from the dataloader")
