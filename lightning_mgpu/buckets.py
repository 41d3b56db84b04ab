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
