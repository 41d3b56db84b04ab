"""What a rank runs, read from the objects ``setup`` built (not from the arguments asked for): printed at the start
of every run, so a layout that silently fell back would show."""

from __future__ import annotations

from typing import Any, Optional

from lightning_mgpu import engine as engines
from lightning_mgpu.layout import ParallelLayout


def applied_layout(engine: Any, layout: ParallelLayout, pipeline: Optional[Any], global_rank: int,
                   replica_sync: Optional[Any] = None) -> str:
    """One line: what the run splits (tensor-parallel parameters, context ranks, the pipeline's schedule and stages;
    a size of 1 is left out), the ZeRO stage and replicas, and with
    ``replica_update="local"`` the replicas' outer step (a ``lightning_mgpu.parallel.replicas.ReplicaSync``)."""
    split = [p for p in engine.module.parameters() if getattr(p, "tensor_model_parallel", False)]
    sequence = any(getattr(m, "sequence_parallel", False) for m in engine.module.modules())
    parts = []
    if layout.size("tp") > 1:
        parts.append(f"tensor parallel over {layout.size('tp')} ranks "
                     f"({len(split)} split parameters{', sequence parallel' if sequence else ''})")
    if layout.size("cp") > 1:
        parts.append(f"context parallel over {layout.size('cp')} ranks")
    if pipeline is not None:
        stages = [stage.stage_index for stage in pipeline.stages]
        parts.append(f"pipeline {type(pipeline.schedule).__name__} over {layout.size('pp')} ranks "
                     f"(stages {stages} of {layout.num_stages})")
    parts.append(f"ZeRO-{engines.zero_stage(engine)} over {engines.data_parallel_size(engine)} data-parallel replicas")
    if replica_sync is not None:
        parts.append(replica_sync.describe())
    return f"applied layout: rank {global_rank}: " + "; ".join(parts)
