"""The size of DeepSpeed's communication buckets for a model: one rule, read by the engine's config and by the planner's
memory model (which must not import the engine: it runs where no job does)."""

from __future__ import annotations

#: DeepSpeed's default bucket size; buckets are never larger than this.
MAX_BUCKET_ELEMENTS = 500_000_000
MIN_BUCKET_ELEMENTS = 1 << 17


def bucket_elements_for(total_parameters: int) -> int:
    """Communication bucket size sized from the model: a quarter of it (at least 2**17 elements), at most DeepSpeed's
    default. DeepSpeed's fixed 5e8-element buckets cost GBs and tens of seconds on a tiny CPU model."""
    return int(min(MAX_BUCKET_ELEMENTS, max(MIN_BUCKET_ELEMENTS, total_parameters // 4)))


#: DeepSpeed's default ZeRO-3 persistence threshold (elements), which the engine lowers for a small model.
MAX_PERSISTENCE_ELEMENTS = 100_000


def persistence_threshold(largest_parameter: int) -> int:
    """ZeRO-3 keeps a parameter of fewer elements than this whole on every rank (beside its partition): an eighth of
    the largest parameter, at most DeepSpeed's 1e5, which would keep a small model unsharded. LoRA's adapters are
    mostly below it, so the planner counts them whole at ZeRO-3 (measured: tests/distributed/test_adapter_memory.py)."""
    return int(min(MAX_PERSISTENCE_ELEMENTS, max(1, largest_parameter // 8)))
