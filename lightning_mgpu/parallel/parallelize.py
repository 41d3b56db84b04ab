"""One function over the layout that turns a LightningModule into what this rank trains, in a fixed order:

tensor-parallel plan -> context-parallel attention -> pipeline stage split -> activation checkpointing of this rank's
blocks -> torch.compile of those blocks -> materialise this rank's share.

The engine (DeepSpeed, :mod:`lightning_mgpu.engine`) wraps the result; the strategy calls this between the two. Tests call
it without a Trainer. A module built on the meta device (``MGPUStrategy`` builds ``configure_model`` there when the
module defines ``initial_value``) holds no memory until the last step, which gives each rank only its own shard; with
``partitioner`` (the engine's ZeRO-3 partitioning) each module's parameters are partitioned as soon as they are filled,
so a rank never holds its whole shard either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from lightning_mgpu.checkpoint.universal import canonical_name
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.parallel.compile import compile_blocks, compile_layout_problems
from lightning_mgpu.parallel.context import apply_context_parallel
from lightning_mgpu.parallel.materialize import Place, materialize, meta_parameters
from lightning_mgpu.parallel.plan import TensorParallelPlan, apply_tensor_parallel


@dataclass
class Parallelized:
    """What :func:`parallelize` made: the module the engine wraps (the LightningModule, or with pipeline parallelism
    the container of this rank's stages), notes worth reporting, and the elements this rank materialised."""

    module: nn.Module
    notes: list[str] = field(default_factory=list)
    materialized: int = 0


def parallelize(module: nn.Module, layout: ParallelLayout, device: torch.device,
                plan: Optional[TensorParallelPlan] = None, boundaries: Optional[list[int]] = None,
                partitioner: Optional[Callable[[nn.Module], Place]] = None) -> Parallelized:
    """Split ``module`` (a LightningModule following :class:`lightning_mgpu.contract.ParallelModule`) for this rank.

    ``plan`` defaults to the module's ``tensor_parallel_plan()``; ``boundaries`` are the pipeline stage boundaries
    (default: balanced). ``partitioner(kept)``, given the module this rank keeps while it is still on the meta device,
    returns what takes each module's parameters as soon as they are materialised (see :func:`materialize`). Raises one
    ``ValueError`` naming what the module lacks for the layout.
    """
    notes: list[str] = []
    if layout.size("tp") > 1:
        if plan is None and callable(getattr(module, "tensor_parallel_plan", None)):
            plan = module.tensor_parallel_plan()
        if plan is None:
            raise ValueError(f"tensor_parallel_size={layout.size('tp')} needs a tensor-parallel plan: define "
                             f"tensor_parallel_plan() on {type(module).__name__} returning {{module name pattern: "
                             "style}, or pass MGPUStrategy(tensor_parallel_plan=...)")
        notes += apply_tensor_parallel(module, plan, layout.group("tp"), layout.sequence_parallel)
    if layout.size("cp") > 1:
        C = layout.size("cp")
        eod = getattr(getattr(module, "config", None), "eod_token_id", None)
        if eod is not None:
            raise ValueError(f"context_parallel_size={C} does not support document masking yet (the model's "
                             f"eod_token_id={eod}): each rank would need the document boundaries of the chunks it "
                             "does not hold; use eod_token_id=None or context_parallel_size=1")
        changed = apply_context_parallel(module, layout.group("cp"), layout.rank("cp"), C)
        if not changed or not callable(getattr(module, "context_parallel_batch", None)):
            raise ValueError(f"context_parallel_size={C} needs a module whose attention exposes a replaceable "
                             f"`kernel` and that defines context_parallel_batch() to give each rank its chunks of a "
                             f"sequence (LLMModule does); {type(module).__name__} has {changed} such attention "
                             "layers. Use context_parallel_size=1 for this module")
        notes.append(f"context parallelism: {changed} attention layers exchange keys/values over {C} ranks")
    kept = module
    if layout.size("pp") > 1:
        ids = layout.stage_ids(layout.rank("pp"))
        kept = module.pipeline_stages(ids, layout.num_stages, boundaries)
    if callable(getattr(module, "checkpointed_blocks", None)):
        mode, blocks = module.checkpointed_blocks()
        if checkpoint_blocks(blocks, mode):
            notes.append(f"activation checkpointing: {mode} on {len(blocks)} blocks of this rank")
    if callable(getattr(module, "compiled_blocks", None)):
        backend, blocks = module.compiled_blocks()
        problems = compile_layout_problems(layout.zero_stage) if backend is not None else []
        if problems:
            raise ValueError(problems[0])
        if backend is not None and compile_blocks(blocks, backend):
            notes.append(f"torch.compile ({backend}) of {len(blocks)} blocks of this rank")
    buffers = [name for name, b in kept.named_buffers() if b.is_meta]
    if buffers:
        raise ValueError(f"{type(module).__name__} built buffers on the meta device ({', '.join(buffers[:3])}), which "
                         "have no initial value to take: create buffers with an explicit device (device='cpu'), or "
                         "build the model on a real device (define no initial_value)")
    missing = meta_parameters(kept)
    if not missing:
        return Parallelized(kept, notes)
    value = getattr(module, "initial_value", None)
    if not callable(value):
        raise ValueError(f"{type(module).__name__} built {len(missing)} parameters on the meta device (e.g. "
                         f"{missing[0]!r}) but defines no initial_value(name, shape, index) to fill them; define it, "
                         "or build the model on a real device")
    place = partitioner(kept) if partitioner is not None else None
    count = materialize(kept, device, value, lambda name: canonical_name(name, layout), place)
    return Parallelized(kept, notes, count)
