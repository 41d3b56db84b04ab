"""One function over the layout that turns a LightningModule into what this rank trains, in a fixed order:

tensor-parallel plan -> context-parallel attention -> experts (expert and tensor parallel) -> pipeline stage split -> activation checkpointing of this rank's
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

from lightning_mgpu.contract import hook
from lightning_mgpu.layout import ParallelLayout, canonical_name, container_prefix
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.parallel.compile import compile_blocks, compile_layout_problems
from lightning_mgpu.parallel.context import apply_context_parallel
from lightning_mgpu.parallel.experts import apply_expert_parallel
from lightning_mgpu.parallel.materialize import Place, materialize, meta_parameters
from lightning_mgpu.parallel.plan import TensorParallelPlan, apply_tensor_parallel
from lightning_mgpu.problems import raise_problems


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
    returns what takes each module's parameters as soon as they are materialised (see :func:`materialize`). On the
    ``meta`` device nothing is materialised (the dry run, with :meth:`ParallelLayout.planned_at`). Raises one
    ``ValueError`` naming what the module lacks for the layout.
    """
    notes = _tensor_parallel(module, layout, plan) + _context_parallel(module, layout)
    notes += apply_expert_parallel(module, layout)
    if (split_experts := hook(module, "expert_parallel")) is not None:
        notes += split_experts(layout)
    kept = module
    if layout.size("pp") > 1:
        kept = hook(module, "pipeline_stages")(layout.stage_ids(layout.rank("pp")), layout.num_stages, boundaries)
    notes += _per_block(module, layout)
    if device.type == "meta":
        return Parallelized(kept, notes)
    return Parallelized(kept, notes, _materialize(module, kept, layout, device, partitioner))


def _tensor_parallel(module: nn.Module, layout: ParallelLayout, plan: Optional[TensorParallelPlan]) -> list[str]:
    if layout.size("tp") == 1:
        return []
    if plan is None and (planner := hook(module, "tensor_parallel_plan")) is not None:
        plan = planner()
    if plan is None:
        raise ValueError(f"tensor_parallel_size={layout.size('tp')} needs a tensor-parallel plan: define "
                         f"tensor_parallel_plan() on {type(module).__name__} returning {{module name pattern: "
                         "style}, or pass MGPUStrategy(tensor_parallel_plan=...)")
    return apply_tensor_parallel(module, plan, layout.group("tp"), layout.sequence_parallel)


def _context_parallel(module: nn.Module, layout: ParallelLayout) -> list[str]:
    C = layout.size("cp")
    if C == 1:
        return []
    wire = hook(module, "context_parallel_attention")
    if wire is not None:
        changed = wire(layout.group("cp"), layout.rank("cp"), C)
    else:
        changed = apply_context_parallel(module, layout.group("cp"), layout.rank("cp"), C)
    if not changed or (wire is None and hook(module, "context_parallel_batch") is None):
        raise ValueError(f"context_parallel_size={C} needs a module whose attention exposes a replaceable "
                         f"`kernel` and that defines context_parallel_batch() to give each rank its chunks of a "
                         f"sequence (LLMModule does); {type(module).__name__} has {changed} such attention "
                         "layers. Use context_parallel_size=1 for this module")
    return [f"context parallelism: {changed} attention layers exchange keys/values over {C} ranks"]


def _per_block(module: nn.Module, layout: ParallelLayout) -> list[str]:
    """Activation checkpointing, then torch.compile, of this rank's blocks (after the stage split)."""
    notes = []
    if (checkpointed := hook(module, "checkpointed_blocks")) is not None:
        mode, blocks = checkpointed()
        if checkpoint_blocks(blocks, mode):
            notes.append(f"activation checkpointing: {mode} on {len(blocks)} blocks of this rank")
    if (compiled := hook(module, "compiled_blocks")) is not None:
        backend, blocks = compiled()
        if backend is not None:
            raise_problems("Invalid compile", compile_layout_problems(layout.zero_stage))
        if backend is not None and compile_blocks(blocks, backend):
            notes.append(f"torch.compile ({backend}) of {len(blocks)} blocks of this rank")
    return notes


def _materialize(module: nn.Module, kept: nn.Module, layout: ParallelLayout, device: torch.device,
                 partitioner: Optional[Callable[[nn.Module], Place]]) -> int:
    """Give this rank's meta parameters their storage and initial values; the number of elements filled."""
    buffers = [name for name, b in kept.named_buffers() if b.is_meta]
    if buffers:
        raise ValueError(f"{type(module).__name__} built buffers on the meta device ({', '.join(buffers[:3])}), which "
                         "have no initial value to take: create buffers with an explicit device (device='cpu'), or "
                         "build the model on a real device (define no initial_value)")
    missing = meta_parameters(kept)
    if not missing:
        return 0
    value = hook(module, "initial_value")
    if value is None:
        raise ValueError(f"{type(module).__name__} built {len(missing)} parameters on the meta device (e.g. "
                         f"{missing[0]!r}) but defines no initial_value(name, shape, index) to fill them; define it, "
                         "or build the model on a real device")
    place = partitioner(kept) if partitioner is not None else None
    stages = container_prefix(kept)
    return materialize(kept, device, value, lambda name: canonical_name(name, layout, stages), place)
