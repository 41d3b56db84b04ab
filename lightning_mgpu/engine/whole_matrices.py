"""Where each tensor a DeepSpeed engine's optimizer steps comes from, for an optimizer that needs whole matrices.

DeepSpeed hands its client optimizer flat fp32 partitions (ZeRO 1-2 and its bf16 optimizer: the parameters of one
group flattened one after another and split in equal partitions over the group's data-parallel ranks; ZeRO-3: each
parameter split over them, this rank's partitions concatenated), or the parameters themselves (fp32 at ZeRO-0). Its
own Muon support (``MuonWithAuxAdam``) assembles ZeRO partitions but knows nothing of tensor parallelism and runs
its own Newton-Schulz variant; here the layouts are read from the engine's optimizer once, after
``deepspeed.initialize``, and handed to :func:`lightning_mgpu.optim.bind_whole_matrices`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.optim import bind_whole_matrices, is_matrix_optimizer
from lightning_mgpu.optim.whole_matrices import (FlatPartition, Matrices, PartitionedEach, SharedWork,
                                                 TensorParallelShard, Unsplit)


def parameter_matrices(param: nn.Parameter, layout: ParallelLayout) -> Matrices:
    """The whole matrices of one parameter as this rank holds it (before ZeRO): a tensor-parallel shard or whole."""
    shape = getattr(param, "ds_shape", param.shape)
    if getattr(param, "tensor_model_parallel", False) and layout.size("tp") > 1:
        return TensorParallelShard(shape, param.partition_dim, param.full_size, layout.group("tp"),
                                   layout.rank("tp"), layout.size("tp"))
    return Unsplit(shape)


def _flat_partitions(params_of_groups: list[list[nn.Parameter]], offsets_of_groups: Optional[list[list[int]]],
                     partitions: list[torch.Tensor], groups: list[Any], layout: ParallelLayout) -> dict[int, Matrices]:
    out = {}
    for i, (params, flat) in enumerate(zip(params_of_groups, partitions)):
        offsets = offsets_of_groups[i] if offsets_of_groups else _running_offsets(params)
        pieces = [(offset, parameter_matrices(p, layout), p.numel()) for offset, p in zip(offsets, params)]
        size = dist.get_world_size(groups[i])
        out[id(flat)] = FlatPartition(pieces, flat.numel(), groups[i], dist.get_rank(groups[i]), size)
    return out


def _running_offsets(params: list[nn.Parameter]) -> list[int]:
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    return offsets


def _zero3_partitions(ds_optimizer: Any, layout: ParallelLayout) -> dict[int, Matrices]:
    out = {}
    for i, params in enumerate(ds_optimizer.fp16_groups):
        group = ds_optimizer.sub_group_process_groups[i]
        pieces = [(p.partition_numel(), p.ds_numel, parameter_matrices(p, layout)) for p in params]
        out[id(ds_optimizer.fp32_partitioned_groups_flat[i])] = PartitionedEach(
            pieces, group, dist.get_rank(group), dist.get_world_size(group))
    return out


def stepped_tensors(ds_optimizer: Any, layout: ParallelLayout, stage: int) -> dict[int, Matrices]:
    """id of each tensor the client optimizer steps -> how it assembles into whole matrices."""
    if stage == 3:
        return _zero3_partitions(ds_optimizer, layout)
    if stage in (1, 2):
        return _flat_partitions(ds_optimizer.round_robin_bit16_groups,
                                getattr(ds_optimizer, "round_robin_bit16_offsets", None),
                                ds_optimizer.single_partition_of_fp32_groups, ds_optimizer.real_dp_process_group,
                                layout)
    if hasattr(ds_optimizer, "fp32_groups_flat_partition"):  # DeepSpeed's BF16_Optimizer (bf16 with a pipeline)
        return _flat_partitions(ds_optimizer.bf16_groups, None, ds_optimizer.fp32_groups_flat_partition,
                                ds_optimizer.real_dp_process_group, layout)
    if hasattr(ds_optimizer, "fp32_groups") and hasattr(ds_optimizer, "fp16_groups"):
        # bf16/fp16 at ZeRO-0 (FP16_UnfusedOptimizer): an fp32 clone of each parameter, whole or a tp shard
        return {id(clone): parameter_matrices(param, layout)
                for clones, params in zip(ds_optimizer.fp32_groups, ds_optimizer.fp16_groups)
                for clone, param in zip(clones, params)}
    return {}


def bind_engine_optimizer(optimizer: Optional[torch.optim.Optimizer], ds_optimizer: Any, module: nn.Module,
                          layout: ParallelLayout, stage: int) -> None:
    """Bind a matrix optimizer (Muon) to the tensors the engine hands it; nothing for any other optimizer."""
    if optimizer is None or not is_matrix_optimizer(optimizer):
        return
    tensors = stepped_tensors(ds_optimizer, layout, stage)
    if not tensors:  # fp32 ZeRO-0: the parameters themselves
        tensors = {id(p): parameter_matrices(p, layout) for p in module.parameters()}
    stepped = [t for g in optimizer.param_groups for t in g["params"]]
    unknown = [tuple(t.shape) for t in stepped if id(t) not in tensors]
    if unknown:  # a tensor assembled as if whole would be a shard orthogonalised on its own: never silently
        raise RuntimeError(f"Muon cannot tell how {len(unknown)} tensor(s) the {type(ds_optimizer).__name__} engine "
                           f"optimizer steps assemble into whole matrices (shapes {unknown[:3]}); this DeepSpeed "
                           "optimizer wrapper is not supported with Muon: use another zero_stage or precision")
    # the ranks of a tensor-parallel group assemble the same whole matrices (one data-parallel coordinate, one stage)
    share = SharedWork(layout.group("tp"), layout.rank("tp"), layout.size("tp")) if layout.size("tp") > 1 else None
    bind_whole_matrices(optimizer, lambda tensor: tensors.get(id(tensor)), share)
