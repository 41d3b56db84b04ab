"""How one parameter's tensor is saved in a universal checkpoint and read back, whatever the layout: names without
the pipeline container's stage key, tensor-parallel shards as ``DTensor`` shards of the true (unpadded) shape."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_mgpu.layout import ParallelLayout


def _unpadded(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout) -> torch.Tensor:
    dim, per_rank = param.partition_dim, local.shape[param.partition_dim]
    real = max(0, min(per_rank, param.full_size - layout.rank("tp") * per_rank))
    return local.narrow(dim, 0, real)


def expert_mesh(layout: ParallelLayout) -> DeviceMesh:
    """The (expert-parallel x tensor-parallel) ranks that together hold one replica of a layer's experts."""
    T = layout.size("tp")
    ep = next(g for g in layout.group_ranks("ep") if dist.get_rank() in g)
    ranks = torch.tensor([[r // T * T + t for t in range(T)] for r in ep])
    return DeviceMesh.from_group([layout.group("ep"), layout.group("tp")], "cpu", mesh=ranks,
                                 mesh_dim_names=("ep", "tp"))


def _expert_saved(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout, mesh: DeviceMesh):
    """An expert-parallel shard (experts along dimension 0, maybe a hidden slice) as a DTensor of the whole tensor."""
    shape = list(local.shape)
    shape[0] *= layout.size("ep")
    tp = getattr(param, "tensor_model_parallel", False) and layout.size("tp") > 1
    if tp:
        shape[param.partition_dim] = param.full_size
    placements = [Shard(0), Shard(param.partition_dim) if tp else Replicate()]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def as_saved(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout, mesh: DeviceMesh,
             experts: Optional[DeviceMesh] = None):
    """``local`` as the checkpoint holds it: a tensor or expert shard as a ``DTensor`` of the whole tensor
    (``experts``: :func:`expert_mesh`, for a layout with expert parallelism)."""
    if getattr(param, "expert_partition", None) is not None and experts is not None:
        return _expert_saved(local, param, layout, experts)
    if not getattr(param, "tensor_model_parallel", False) or layout.size("tp") == 1:
        return local
    dim = param.partition_dim
    shape = list(local.shape)
    shape[dim] = param.full_size
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(_unpadded(local, param, layout).contiguous(), mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def from_saved(value, param: torch.nn.Parameter, layout: ParallelLayout, like: torch.Tensor) -> torch.Tensor:
    """The full local (tensor-parallel shard, padded) tensor for ``param`` from a loaded value."""
    local = value.to_local() if isinstance(value, DTensor) else value
    if local.shape == like.shape:
        return local
    out = torch.zeros_like(like)
    out.narrow(param.partition_dim, 0, local.shape[param.partition_dim]).copy_(local)
    return out
