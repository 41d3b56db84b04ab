"""How one parameter's tensor is saved in a universal checkpoint and read back, whatever the layout: names without
the pipeline container's stage key, tensor-parallel shards as ``DTensor`` shards of the true (unpadded) shape."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_mgpu.layout import ParallelLayout


def canonical_name(name: str, layout: ParallelLayout, prefix: str = "model.") -> str:
    """A parameter's name independent of layout: the pipeline container's stage key becomes ``prefix``."""
    return prefix + name.split(".", 1)[1] if layout.size("pp") > 1 else name


def _unpadded(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout) -> torch.Tensor:
    dim, per_rank = param.partition_dim, local.shape[param.partition_dim]
    real = max(0, min(per_rank, param.full_size - layout.rank("tp") * per_rank))
    return local.narrow(dim, 0, real)


def as_saved(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout, mesh: DeviceMesh):
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
