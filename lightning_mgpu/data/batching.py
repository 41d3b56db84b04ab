"""Global-batch arithmetic: how a global batch splits into data-parallel slices and micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_mgpu.problems import format_problems


@dataclass(frozen=True)
class BatchPlan:
    """``global_batch_size`` samples per optimizer step = ``micro_batch_size`` x ``num_microbatches`` x
    ``data_parallel_size``. Every data-parallel rank receives ``per_rank`` samples per step and the
    strategy runs them as ``num_microbatches`` micro-batches before one optimizer step."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    seq_len: Optional[int] = None  #: tokens per sample, for the tokens-per-step figure

    def __post_init__(self) -> None:
        problems = batch_problems(self.global_batch_size, self.micro_batch_size, self.data_parallel_size)
        if problems:
            raise ValueError(format_problems("Invalid batch sizes", problems))

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.per_rank // self.micro_batch_size

    def describe(self, pipeline_parallel_size: int = 1) -> str:
        """One line saying how the global batch is made, printed at the start of training."""
        line = (f"global batch {self.global_batch_size} = {self.micro_batch_size} per micro-batch x "
                f"{self.num_microbatches} micro-batches x {self.data_parallel_size} data-parallel replicas")
        if self.seq_len:
            line += f" = {self.global_batch_size * self.seq_len:,} tokens per step"
        if pipeline_parallel_size > 1:
            return line + (f"; the {self.num_microbatches} micro-batches flow through {pipeline_parallel_size} "
                           "pipeline ranks, one optimizer step per schedule")
        return line + f"; {self.num_microbatches} gradient-accumulation steps per optimizer step"


def batch_problems(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> list[str]:
    """Every rule the batch sizes break, each with the nearest valid values."""
    out: list[str] = []
    for name, v in (("data.global_batch_size", global_batch_size), ("data.micro_batch_size", micro_batch_size),
                    ("data-parallel size", data_parallel_size)):
        if not isinstance(v, int) or v < 1:
            out.append(f"{name}={v!r} must be a positive integer")
    if out:
        return out
    unit = micro_batch_size * data_parallel_size
    if global_batch_size % unit:
        below = (global_batch_size // unit) * unit
        fix = f"use data.global_batch_size={_one_of([v for v in (below, below + unit) if v > 0])}"
        if global_batch_size % data_parallel_size == 0:  # then a smaller micro-batch can split each rank's share
            per_rank = global_batch_size // data_parallel_size
            smaller = [m for m in range(1, micro_batch_size) if per_rank % m == 0][-4:]
            fix += f", or data.micro_batch_size={_one_of(smaller)} (it must divide the {per_rank} samples per rank)"
        out.append(
            f"data.global_batch_size={global_batch_size} is not divisible by data.micro_batch_size x data-parallel "
            f"size = {micro_batch_size} x {data_parallel_size} = {unit}; {fix}"
        )
    return out


def _one_of(values: list[int]) -> str:
    """``1``, ``1 or 2``, ``1, 2 or 4``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
