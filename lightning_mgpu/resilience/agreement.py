"""Small agreements between every rank at a step boundary: a few integers all-reduced in one collective.

The tensor lives on the strategy's device, so that the same call works on gloo (CPU) and NCCL (which has no CPU
tensors unless the group was created with a CPU backend too).
"""

from __future__ import annotations

from typing import Sequence

import lightning as L
import torch
import torch.distributed as dist

from lightning_mgpu.resilience.liveness import name_lost_ranks


def agree(trainer: L.Trainer, values: Sequence[int], op: str = "max") -> list[int]:
    """``values`` reduced over every rank (``op``: ``max`` or ``sum``); the values themselves in one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [int(v) for v in values]
    device = getattr(trainer.strategy, "root_device", torch.device("cpu"))
    flag = torch.tensor(list(values), dtype=torch.int64, device=device)
    with name_lost_ranks(getattr(trainer.strategy, "_heartbeat", None)):  # a rank lost here is named too
        dist.all_reduce(flag, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [int(v) for v in flag.tolist()]


def at_boundary(trainer: L.Trainer) -> bool:
    """Whether every rank can meet here: always, unless replicas step apart and this step did not end a round."""
    sync = getattr(trainer.strategy, "_replica_sync", None)
    return sync is None or sync.synced_at == sync.inner_steps
