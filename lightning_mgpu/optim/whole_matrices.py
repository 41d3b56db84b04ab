"""Whole weight matrices out of the pieces a layout leaves on one rank, and that rank's piece of a whole result back.

Muon's Newton-Schulz iteration needs each weight matrix whole; a rank may hold a tensor-parallel shard of it, a ZeRO
partition of a flat buffer of several parameters, or a partition of a shard. Each class below is told, once, how the
tensor an optimizer steps is laid out, and then turns this rank's local tensor (a momentum, in that layout) into the
whole matrices it touches (:meth:`whole`), and a list of whole results back into the local layout (:meth:`local`).
``torch.distributed.tensor`` does this for DTensors (``full_tensor`` / ``redistribute``); the package's shards and
DeepSpeed's flat partitions are plain tensors with their layout kept beside them, hence by hand.

A stack of expert matrices (``[experts, in, out]``, as the grouped experts hold them) is as many matrices as experts:
Muon orthogonalises each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SharedWork:
    """Ranks that assemble the same whole matrices (a tensor-parallel group, a ZeRO-3 data-parallel group), and so
    can split the work on them."""

    group: Any
    rank: int
    size: int


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
        return whole_of_many([(self, local)])

    def assemble(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The whole matrices from every rank's shard (flat or shaped), in rank order."""
        full = torch.cat([s.reshape(self.shard_shape) for s in shards], dim=self.dim)
        return self.inner.whole(full.narrow(self.dim, 0, self.full_size))

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        full = self.inner.local(wholes)
        padded = self.shard_shape[self.dim] * self.size
        if padded > self.full_size:
            pad = list(full.shape)
            pad[self.dim] = padded - self.full_size
            full = torch.cat([full, full.new_zeros(pad)], dim=self.dim)
        return full.chunk(self.size, dim=self.dim)[self.rank]


def whole_of_many(items: Sequence[tuple[Matrices, torch.Tensor]]) -> list[torch.Tensor]:
    """The whole matrices of several local tensors, in order: the tensor-parallel shards of one group gathered in one
    collective (one per parameter costs a round trip each: 28 for a 4-layer Llama), the rest each as it assembles.
    Every rank of a group passes the same kinds of items in the same order."""
    results: list[Optional[list[torch.Tensor]]] = [None] * len(items)
    by_group: dict[int, list[int]] = {}
    for i, (matrices, _) in enumerate(items):
        if isinstance(matrices, TensorParallelShard):
            by_group.setdefault(id(matrices.group), []).append(i)
    for indices in by_group.values():
        first = items[indices[0]][0]
        flat = torch.cat([items[i][1].reshape(-1) for i in indices])
        gathered = _gather_flat(flat, first.group, first.size)
        offset = 0
        for i in indices:
            numel = items[i][1].numel()
            results[i] = items[i][0].assemble([g[offset:offset + numel] for g in gathered])
            offset += numel
    return [w for i, (matrices, local) in enumerate(items)
            for w in (results[i] if results[i] is not None else matrices.whole(local))]


def _gather_flat(local: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return pieces


class FlatPartition:
    """Partition ``rank`` of ``size`` equal partitions of a flat buffer that holds parameters one after another, each
    at its offset (ZeRO 1-2 and DeepSpeed's bf16 optimizer: ``pieces`` are (offset, matrices of that parameter,
    numel)). Only the parameters that overlap this partition are assembled (about 1 / size of them): a rank needs the
    whole result of no other, so the matrix work is split over the data-parallel ranks."""

    def __init__(self, pieces: Sequence[tuple[int, Matrices, int]], partition_size: int, group: Any, rank: int,
                 size: int) -> None:
        self.partition_size, self.group, self.rank, self.size = partition_size, group, rank, size
        self.start, self.end = rank * partition_size, (rank + 1) * partition_size
        self.mine = [(o, m, n) for o, m, n in pieces if o < self.end and o + n > self.start]
        self.count = sum(m.count for _, m, _ in self.mine)

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        self._device = local.device  # for a partition that overlaps no matrix (the tensor itself is not kept)
        flat = torch.cat(_gather_flat(local, self.group, self.size))
        return whole_of_many([(m, flat[offset:offset + numel]) for offset, m, numel in self.mine])

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(self.partition_size, dtype=torch.float32, device=self._device)
        used = 0
        for offset, m, numel in self.mine:
            piece = m.local(wholes[used:used + m.count]).reshape(-1)
            used += m.count
            a, b = max(offset, self.start), min(offset + numel, self.end)
            out[a - self.start:b - self.start] = piece[a - offset:b - offset]
        return out


class PartitionedEach:
    """This rank's partitions of several parameters, one after another: each parameter was flattened, zero-padded
    to ``size`` equal partitions of ``partition_numel`` and split (ZeRO-3: ``pieces`` are (partition numel, numel,
    matrices of that parameter))."""

    def __init__(self, pieces: Sequence[tuple[int, int, Matrices]], group: Any, rank: int, size: int) -> None:
        self.pieces, self.group, self.rank, self.size = list(pieces), group, rank, size
        self.count = sum(m.count for _, _, m in self.pieces)
        self.share = SharedWork(group, rank, size)  #: every rank of the group assembles the same matrices

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        ranks = torch.stack(_gather_flat(local, self.group, self.size))  # [size, local numel]
        items, offset = [], 0
        for partition_numel, numel, m in self.pieces:
            items.append((m, ranks[:, offset:offset + partition_numel].reshape(-1)[:numel]))
            offset += partition_numel
        return whole_of_many(items)

    def local(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        parts, used = [], 0
        for partition_numel, numel, m in self.pieces:
            flat = m.local(wholes[used:used + m.count]).reshape(-1)
            used += m.count
            flat = torch.cat([flat, flat.new_zeros(partition_numel * self.size - numel)])
            parts.append(flat[self.rank * partition_numel:(self.rank + 1) * partition_numel])
        return torch.cat(parts)
