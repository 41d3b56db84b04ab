"""Give a module built on the meta device real storage for exactly the parameters this rank keeps.

A model built under ``torch.device("meta")`` takes no memory; the tensor-parallel plan and the pipeline stage split
then run on shapes alone, so a rank ends up holding meta parameters only for its own shard of its own stages. This
module fills those, and only those, with their initial values: each parameter asks ``value(name, shape, index)`` for
the part ``index`` of the whole tensor ``name`` of shape ``shape``, so a shard gets exactly the slice of the value one
process would have built whole. Written by hand because the shards are plain local tensors tagged the Megatron way
(see :mod:`lightning_mgpu.parallel.tensor`), not DTensors, so torch's ``to_empty`` + ``reset_parameters`` cannot know
which slice a shard is.

With ZeRO-3 the engine partitions every parameter over the data-parallel ranks anyway; ``place`` lets it do so as soon
as one module's parameters are filled, so a rank never holds more than its partitions plus one module's parameters
whole (instead of its whole tensor/pipeline shard first).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

#: ``value(name, shape, index)``: the part ``index`` (one slice per dimension) of parameter ``name``'s initial value,
#: whose whole tensor has shape ``shape``.
InitialValue = Callable[[str, torch.Size, tuple[slice, ...]], torch.Tensor]
#: ``place(params)``: takes over parameters just filled (ZeRO-3: partitions them in place, keeping their identity).
Place = Callable[[list[nn.Parameter]], None]


def meta_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters of ``module`` that have no storage yet."""
    return [name for name, p in module.named_parameters() if p.is_meta]


def materialize(module: nn.Module, device: torch.device, value: InitialValue,
                name_of: Callable[[str], str] = lambda name: name, place: Optional[Place] = None) -> int:
    """Replace every meta parameter of ``module`` (in place, ties kept) by one on ``device`` holding this rank's part
    of its initial value; ``name_of`` maps a name inside ``module`` to the name ``value`` knows. Each module's new
    parameters go to ``place`` before the next module's are filled. Returns the number of elements materialised."""
    done: dict[int, nn.Parameter] = {}
    count = 0
    for prefix, owner in module.named_modules(remove_duplicate=False):
        fresh = []
        for key, param in list(owner._parameters.items()):
            if param is None:
                continue
            if not param.is_meta:  # built on a real device: nothing to fill, but ``place`` takes it over as well
                if place is not None and id(param) not in done:
                    done[id(param)] = param
                    fresh.append(param)
                continue
            if id(param) not in done:
                done[id(param)] = _filled(param, name_of(f"{prefix}.{key}" if prefix else key), device, value)
                fresh.append(done[id(param)])
                count += param.numel()
            owner._parameters[key] = done[id(param)]
        if fresh and place is not None:
            place(fresh)
    return count


def _filled(param: nn.Parameter, name: str, device: torch.device, value: InitialValue) -> nn.Parameter:
    shape, index = list(param.shape), [slice(None)] * param.dim()
    data = torch.zeros(param.shape, dtype=param.dtype, device=device)
    target = data
    if getattr(param, "tensor_model_parallel", False):  # a shard: chunk ``partition_rank`` along ``partition_dim``
        dim, per_rank, full = param.partition_dim, param.shape[param.partition_dim], param.full_size
        start = min(param.partition_rank * per_rank, full)
        shape[dim], index[dim] = full, slice(start, min(start + per_rank, full))
        target = data.narrow(dim, 0, index[dim].stop - start)  # rows past the whole tensor are padding: zeros
    if getattr(param, "expert_partition", None) is not None:  # experts [rank * local, (rank + 1) * local)
        rank, size = param.expert_partition
        local = param.shape[0]
        shape[0], index[0] = local * size, slice(rank * local, (rank + 1) * local)
    target.copy_(value(name, torch.Size(shape), tuple(index)))
    filled = nn.Parameter(data, requires_grad=param.requires_grad)
    filled.__dict__.update(param.__dict__)  # tensor_model_parallel, partition_dim, full_size, ...
    return filled
