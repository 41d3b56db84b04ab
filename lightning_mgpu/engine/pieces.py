"""This rank's own piece of a parameter's fp32 value or Adam moment under ZeRO 1-2, copied without a collective, and
its assembly into the whole (tensor-parallel shard of the) parameter later, over the data-parallel group.

What a background checkpoint snapshots (``lightning_mgpu.checkpoint.background``): DeepSpeed's ``safe_get_full_*``
all-reduce every parameter's whole size over the data-parallel group while training waits, which was 45% of a
synchronous save of an 88M model on two CPU processes; copying this rank's pieces is a copy of 1/dp of the state, and
the all-reduce moves to the writing thread, on a group of its own. The arithmetic is DeepSpeed's own
(``get_full_hp_param``: the piece at its offset in a zero buffer, summed over the group), applied to a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_mgpu.engine.parameter_state import ParameterState


@dataclass
class Piece:
    """A parameter's value or moment as this rank holds it: its part of the flattened tensor (copied; None when this
    rank holds none of it), where that part starts, the whole tensor's shape and the ranks that hold the rest."""

    part: Optional[torch.Tensor]
    start: int
    shape: torch.Size
    ranks: tuple[int, ...]


def own_piece(access: ParameterState, param: torch.nn.Parameter, key: Optional[str]) -> Optional[Piece]:
    """This rank's piece of ``param``'s fp32 value (``key=None``) or moment ``key``, copied to host memory; None
    where pieces do not apply (ZeRO 0 and 3, or moments before the first step: read those with ``access.get``)."""
    if access.stage not in (1, 2) or (key is not None and access.step() == 0):
        return None
    mapping = getattr(param, "_hp_mapping", None)
    part = None if mapping is None else mapping.get_hp_fragment(key).detach().to("cpu", copy=True)
    start = 0 if mapping is None else mapping.lp_fragment_address.start
    return Piece(part, start, access.shape(param), tuple(dist.get_process_group_ranks(param._dp_group)))


def assemble(piece: Piece, group: Any) -> torch.Tensor:
    """The whole tensor from every rank's piece (collective over ``group``, the ranks of ``piece.ranks``)."""
    buffer = torch.zeros(math.prod(piece.shape), dtype=torch.float32)
    if piece.part is not None:
        buffer.narrow(0, piece.start, piece.part.numel()).copy_(piece.part.flatten())
    dist.all_reduce(buffer, group=group)
    return buffer.reshape(piece.shape)
