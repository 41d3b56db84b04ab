"""Whole weight matrices out of the pieces a layout leaves on one rank, and that rank's piece of a whole result back.

Muon's Newton-Schulz iteration needs each weight matrix whole; a rank may hold a tensor-parallel shard of it, a ZeRO
partition of a flat buffer of several parameters, or a partition of a shard. Each class below is told, once, how the
tensor an optimizer steps is laid out, and then turns this rank's local tensor (a momentum, in that layout) into the
whole matrices it touches (:meth:`whole`), and a list of whole results back into the local layout (:meth:`local`).
``torch.distributed.tensor`` does this for DTensors (``full_tensor`` / ``redistribute``); the package's shards and
DeepSpeed's flat partitions are plain tensors with their layout kept beside them, hence by hand.

A stack of expert matrices (``[experts, out, in]``) is as many matrices as experts: Muon orthogonalises each.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist


class Matrices(Protocol):
    """The whole matrices behind one local tensor."""

    count: int  #: how many whole matrices the local tensor touches

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The whole matrices (collectives over the layout's groups where the tensor is split)."""

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's piece of ``wholes`` (results of the same shapes as :meth:`whole` gave), in the local layout."""


class Unsplit:
    """A parameter this rank holds whole: one matrix, or a stack of expert matrices."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = torch.Size(shape)
        self.count = 1 if len(self.shape) <= 2 else self.shape[:-2].numel()

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        tensor = local.reshape(self.shape)
        return [tensor] if tensor.dim() <= 2 else list(tensor.reshape(-1, *self.shape[-2:]).unbind(0))

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        return (wholes[0] if len(self.shape) <= 2 else torch.stack(list(wholes))).reshape(self.shape)


class TensorParallelShard:
    """A tensor-parallel shard: chunk ``rank`` of ``size`` along ``dim`` of the whole tensor, which was zero-padded to a
    multiple of ``size`` rows first (``full_size`` rows are real)."""

    def __init__(self, shard_shape: Sequence[int], dim: int, full_size: int, group: Any, rank: int, size: int) -> None:
        self.shard_shape, self.dim, self.full_size = torch.Size(shard_shape), dim, full_size
        self.group, self.rank, self.size = group, rank, size
        full = list(self.shard_shape)
        full[dim] = full_size
        self.inner = Unsplit(full)
        self.count = self.inner.count

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        shard = local.reshape(self.shard_shape).contiguous()
        pieces = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(pieces, shard, group=self.group)
        return self.inner.whole(torch.cat(pieces, dim=self.dim).narrow(self.dim, 0, self.full_size))

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        full = self.inner.local(wholes)
        padded = self.shard_shape[self.dim] * self.size
        if padded > self.full_size:
            pad = list(full.shape)
            pad[self.dim] = padded - self.full_size
            full = torch.cat([full, full.new_zeros(pad)], dim=self.dim)
        return full.chunk(self.size, dim=self.dim)[self.rank]


def _gather_flat(local: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return pieces


class FlatPartition:
    """Partition ``rank`` of ``size`` equal partitions of a flat buffer that holds parameters one after another, each
    at its offset (ZeRO 1-2 and DeepSpeed's bf16 optimizer: ``pieces`` are (offset, matrices of that parameter))."""

    def __init__(self, pieces: Sequence[tuple[int, Matrices, int]], partition_size: int, group: Any, rank: int,
                 size: int) -> None:
        self.pieces, self.partition_size = list(pieces), partition_size
        self.group, self.rank, self.size = group, rank, size
        self.count = sum(m.count for _, m, _ in self.pieces)

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        flat = torch.cat(_gather_flat(local, self.group, self.size))
        return [w for offset, m, numel in self.pieces for w in m.whole(flat[offset:offset + numel])]

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.partition_size * self.size, dtype=wholes[0].dtype if wholes else torch.float32,
                           device=wholes[0].device if wholes else None)
        used = 0
        for offset, m, numel in self.pieces:
            flat[offset:offset + numel] = m.local(wholes[used:used + m.count]).reshape(-1)
            used += m.count
        return flat[self.rank * self.partition_size:(self.rank + 1) * self.partition_size]


class PartitionedEach:
    """This rank's partitions of several parameters, one after another: each parameter was flattened, zero-padded
    to ``size`` equal partitions of ``partition_numel`` and split (ZeRO-3: ``pieces`` are (partition numel, numel,
    matrices of that parameter))."""

    def __init__(self, pieces: Sequence[tuple[int, int, Matrices]], group: Any, rank: int, size: int) -> None:
        self.pieces, self.group, self.rank, self.size = list(pieces), group, rank, size
        self.count = sum(m.count for _, _, m in self.pieces)

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        ranks = torch.stack(_gather_flat(local, self.group, self.size))  # [size, local numel]
        out, offset = [], 0
        for partition_numel, numel, m in self.pieces:
            out += m.whole(ranks[:, offset:offset + partition_numel].reshape(-1)[:numel])
            offset += partition_numel
        return out

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        parts, used = [], 0
        for partition_numel, numel, m in self.pieces:
            flat = m.local(wholes[used:used + m.count]).reshape(-1)
            used += m.count
            flat = torch.cat([flat, flat.new_zeros(partition_numel * self.size - numel)])
            parts.append(flat[self.rank * partition_numel:(self.rank + 1) * partition_numel])
        return torch.cat(parts)
