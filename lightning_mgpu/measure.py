"""Measure what one block of a model keeps for backward, under each activation-checkpointing mode: a custom model's
own per-block numbers for the planner (``LlamaConfig`` subclass with ``block_activation_bytes``, see
:func:`lightning_mgpu.planner.memory.block_bytes_for`), where the planner's derived formula describes this Llama only.

The bytes are those a forward leaves allocated, less its output (torch's profiler, CPU allocator events), which counts
what autograd saves and what selective checkpointing stores itself (saved-tensor hooks do not see the latter).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.planner.memory import BlockBytes

MODES = ("none", "selective", "full")


def kept_forward_bytes(run: Callable[[], torch.Tensor]) -> int:
    """Bytes ``run()`` (a forward) leaves allocated, less its output's: what it keeps for backward, whatever keeps it.
    In a process group it also counts buffers a collective allocates and keeps, so warm the collectives up first."""
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function

    gc.disable()  # earlier cyclic garbage (a previous model and its graph) must not be freed inside the measured region
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("kept_forward"):
                out = run()
    finally:
        gc.enable()
    event = next(e for e in prof.events() if e.name == "kept_forward")
    return event.cpu_memory_usage - out.untyped_storage().nbytes()


def block_bytes_per_token(make_block: Callable[[], nn.Module], make_inputs: Callable[[int], tuple],
                          tokens: Sequence[int] = (64, 128),
                          modes: Sequence[str] = MODES) -> dict[str, tuple[float, float]]:
    """``{mode: (bytes per token, bytes per block)}`` a fresh ``make_block()`` (in training mode) keeps for backward
    when called on ``make_inputs(n)`` (its inputs for ``n`` tokens, the first one requiring grad), measured at two token
    counts and fitted as a line: the slope is what grows with the tokens, the intercept what a block keeps once (a
    checkpointed block's random-generator state). The first input's bytes are counted as kept: inside a model it is the
    previous block's output, which this block keeps for its backward (its first operation, or its checkpoint, saves
    it), as the planner's formulas count it."""
    out = {}
    for mode in modes:
        points = []
        for n in tokens[:2]:
            block = make_block().train()
            checkpoint_blocks([block], mode)
            inputs = make_inputs(n)
            block(*inputs).sum().backward()  # a first pass allocates what later ones reuse (kernels' caches)
            points.append((n, kept_forward_bytes(lambda: block(*inputs)) + inputs[0].untyped_storage().nbytes()))
        (n0, b0), (n1, b1) = points
        slope = (b1 - b0) / (n1 - n0)
        out[mode] = (slope, b0 - slope * n0)
    return out


def measured_block_bytes(table: dict[str, tuple[float, float]], element_bytes: int) -> BlockBytes:
    """A ``block_activation_bytes`` for the planner from a :func:`block_bytes_per_token` table measured with
    activations of ``element_bytes``: exact at what was measured (one rank, that element size); other element sizes
    scale the per-token bytes in proportion, and tensor parallelism divides them by ``tp`` (what a plan that splits
    every activation does; sequence parallelism is not modelled)."""

    def block_activation_bytes(tokens: float, tp: int, sequence_parallel: bool, mode: str, w: int) -> float:
        per_token, once = table[mode]
        return tokens * per_token * w / element_bytes / tp + once

    return block_activation_bytes
