"""What a rank runs, read from the objects ``setup`` built (not from the arguments asked for): printed at the start
of every run, so a layout that silently fell back would show; and the parameters of the whole model, which no rank
holds alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_mgpu import engine as engines
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.frozen import is_placeholder


def applied_layout(engine: Any, layout: ParallelLayout, pipeline: Optional[Any], global_rank: int,
                   replica_sync: Optional[Any] = None) -> str:
    """One line: what the run splits (tensor-parallel parameters, context ranks, experts, the pipeline's schedule and
    stages; a size of 1 is left out), the ZeRO stage and replicas, and with
    ``replica_update="local"`` the replicas' outer step (a ``lightning_mgpu.parallel.replicas.ReplicaSync``)."""
    split = [p for p in engine.module.parameters() if getattr(p, "tensor_model_parallel", False)]
    sequence = any(getattr(m, "sequence_parallel", False) for m in engine.module.modules())
    parts = []
    if layout.size("tp") > 1:
        parts.append(f"tensor parallel over {layout.size('tp')} ranks "
                     f"({len(split)} split parameters{', sequence parallel' if sequence else ''})")
    if layout.size("cp") > 1:
        parts.append(f"context parallel over {layout.size('cp')} ranks")
    if layout.size("ep") > 1:
        experts = [p for n, p in engine.module.named_parameters()
                   if getattr(p, "expert_partition", None) is not None and not is_placeholder(n)]
        parts.append(f"expert parallel over {layout.size('ep')} ranks ({len(experts)} expert weights split by expert)")
    if pipeline is not None:
        stages = [stage.stage_index for stage in pipeline.stages]
        parts.append(f"pipeline {type(pipeline.schedule).__name__} over {layout.size('pp')} ranks "
                     f"(stages {stages} of {layout.num_stages})")
    parts.append(f"ZeRO-{engines.zero_stage(engine)} over {engines.data_parallel_size(engine)} data-parallel replicas")
    if replica_sync is not None:
        parts.append(replica_sync.describe())
    return f"applied layout: rank {global_rank}: " + "; ".join(parts)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the whole model (each tensor-parallel shard, pipeline stage and expert once) and of this rank."""

    total: int
    trainable: int
    on_rank: int  #: what this rank's modules hold (its shards and stages, before ZeRO partitions them)


def parameter_counts(module: torch.nn.Module, layout: ParallelLayout, device: torch.device) -> ParameterCounts:
    """Count ``module``'s parameters on every rank and sum the distinct ones over the tensor x pipeline ranks (one
    small all-reduce): the first tensor-parallel rank counts a split parameter by its whole size (without the padding
    of an uneven split) and the others count it not; experts kept by expert parallelism count once per
    expert-parallel rank; ZeRO-3's partitioned parameters count by their size before partitioning; placeholders
    (:mod:`lightning_mgpu.parallel.frozen`) are no parameters of the model and count nowhere."""
    first_tp_rank, experts_ranks = layout.rank("tp") == 0, layout.size("ep")
    whole, trainable, on_rank = 0, 0, 0
    for p in (p for name, p in module.named_parameters() if not is_placeholder(name)):
        numel, shape = int(getattr(p, "ds_numel", p.numel())), tuple(getattr(p, "ds_shape", p.shape))
        on_rank += numel
        if not first_tp_rank:
            continue
        if getattr(p, "tensor_model_parallel", False):
            numel = numel // shape[p.partition_dim] * p.full_size
        distinct = numel * (experts_ranks if getattr(p, "expert_partition", None) else 1)
        whole += distinct
        trainable += distinct if p.requires_grad else 0
    counts = torch.tensor([whole, trainable], dtype=torch.int64, device=device)
    if layout.size("mp") > 1:
        torch.distributed.all_reduce(counts, group=layout.group("mp"))
    return ParameterCounts(int(counts[0]), int(counts[1]), on_rank)
