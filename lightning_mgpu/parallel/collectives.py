"""Lightning's collectives of a strategy (``barrier``, ``broadcast``, ``reduce``) over torch.distributed's world
group: what Lightning's metrics, checkpoint callbacks and ``self.log(..., sync_dist=True)`` call on every rank."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available


def gather_objects(value: Any, group: Any = None) -> list:
    """``value`` of every rank of ``group`` (the world by default), in rank order; ``[value]`` before the process
    group exists (one process)."""
    if not _distributed_is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


class WorldCollectives:
    """The three collectives of Lightning's ``Strategy`` interface, each a no-op before the process group exists."""

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
