"""Candidate layouts for a model on a cluster, each with its memory and step time, best first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from lightning_mgpu.layout import ModelShape, divisors, layout_problems
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.experts import expert_parallel_sizes
from lightning_mgpu.planner.hardware import ClusterSpec
from lightning_mgpu.planner.memory import MemoryEstimate, estimate_memory
from lightning_mgpu.planner.time import StepTimeEstimate, estimate_step_time
from lightning_mgpu.precision import pipeline_precision_problems
from lightning_mgpu.split_rules import sequence_problems

#: Share of GPU memory a plan may fill (the rest: allocator fragmentation, NCCL and CUDA context).
USABLE_MEMORY = 0.9


@dataclass(frozen=True)
class Candidate:
    """One layout: the ``parallel.*``, ``data.micro_batch_size`` and ``model.activation_checkpointing`` choices."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch: int
    virtual: int = 1
    recompute: bool = False
    #: The schedule and sequence parallelism of a configured layout; the search leaves them to its defaults.
    pipeline_schedule: Optional[str] = None
    sequence_parallel_on: Optional[bool] = None
    cp: int = 1  #: context-parallel ranks per replica (``dp`` counts replicas)
    selective: bool = False  #: selective recomputation (``recompute`` stays False): keeps the projections' outputs
    boundaries: Optional[tuple[int, ...]] = None  #: a configured layout's stage boundaries (default balanced)
    ep: int = 1  #: expert-parallel ranks, folded over the ``dp x cp`` ranks (a mixture-of-experts model)

    @property
    def schedule(self) -> str:
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved_1f1b" if self.virtual > 1 else "1f1b"

    @property
    def checkpointing(self) -> str:
        """The ``model.activation_checkpointing`` mode of this layout."""
        return "full" if self.recompute else "selective" if self.selective else "none"

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sequence_parallel_on is None else self.sequence_parallel_on

    def overrides(self) -> list[str]:
        """The ``mgpu-train`` overrides that select this layout: every setting of it, so that none of the config it
        is added to (a recipe's context parallelism, schedule or stage boundaries) is left to disagree with it."""
        out = [f"parallel.tensor_parallel_size={self.tp}", f"parallel.pipeline_parallel_size={self.pp}",
               f"parallel.context_parallel_size={self.cp}", f"parallel.zero_stage={self.zero_stage}",
               f"data.micro_batch_size={self.micro_batch}", f"model.activation_checkpointing={self.checkpointing}",
               f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
               f"parallel.pipeline_schedule={self.schedule}", f"parallel.virtual_pipeline_size={self.virtual}",
               f"parallel.expert_parallel_size={self.ep}"]
        if self.boundaries is None:
            out.append("parallel.pipeline_boundaries=null")
        return out


@dataclass(frozen=True)
class PlanRow:
    candidate: Candidate
    memory: MemoryEstimate
    time: StepTimeEstimate
    fits: bool


def candidates(cfg: LlamaConfig, cluster: ClusterSpec, global_batch: int, seq_len: Optional[int] = None,
               precision: str = "bf16-mixed") -> Iterator[Candidate]:
    """Every layout the launcher's rules allow (the layout's, with the model's shape, the sequence's and the
    precision's, asked here as ``mgpu-train`` asks them): tp within a node, context parallelism within the rest of the
    node where ``seq_len`` splits (only with ``seq_len`` given), pp dividing the remaining world, interleaving, ZeRO
    0-3, micro-batches dividing each replica's share, and for a mixture of experts every expert-parallel size that
    divides both the experts and the data x context ranks."""
    world, shape = cluster.world_size, ModelShape.of(cfg)
    for tp, cp in ((t, c) for t in divisors(cluster.gpus_per_node)
                   for c in (divisors(cluster.gpus_per_node // t) if seq_len else [1])):
        if seq_len and sequence_problems(seq_len, cp, tp, tp > 1):
            continue
        for pp in (p for p in divisors(world // (tp * cp)) if not pipeline_precision_problems(precision, p)):
            dp = world // (tp * cp * pp)
            for virtual, micro, ep in ((v, m, e) for v in ((1, 2, 4) if pp > 1 else (1,)) for m in (1, 2, 4, 8)
                                       for e in expert_parallel_sizes(cfg, dp * cp)):
                if global_batch % (micro * dp):
                    continue
                m = global_batch // (micro * dp)
                schedule = "interleaved_1f1b" if virtual > 1 else "1f1b"
                for zero in (0, 1, 2, 3):
                    if layout_problems(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       zero_stage=zero, pipeline_schedule=schedule, virtual_pipeline_size=virtual,
                                       num_microbatches=m, sequence_parallel=tp > 1, model=shape,
                                       context_parallel_size=cp, expert_parallel_size=ep):
                        continue
                    for mode in ("none", "selective", "full"):
                        yield Candidate(tp, pp, dp, zero, micro, virtual, mode == "full", cp=cp,
                                        selective=mode == "selective", ep=ep)


def evaluate(cfg: LlamaConfig, cluster: ClusterSpec, seq_len: int, global_batch: int, c: Candidate,
             precision: str = "bf16-mixed", achievable: Optional[float] = None, optimizer: str = "adamw") -> PlanRow:
    memory = estimate_memory(cfg, seq_len, c.micro_batch, c.tp, c.pp, c.dp, c.zero_stage, c.virtual,
                             c.sequence_parallel, c.recompute, precision, overlap=True,  # a plan is for GPUs
                             context=c.cp, mode=c.checkpointing, schedule=c.schedule, boundaries=c.boundaries,
                             microbatches=max(1, global_batch // (c.micro_batch * c.dp)), ep=c.ep,
                             optimizer=optimizer)
    time = estimate_step_time(cfg, cluster, seq_len, global_batch, c.micro_batch, c.tp, c.pp, c.zero_stage,
                              c.virtual, c.schedule, c.recompute, achievable, context=c.cp, selective=c.selective,
                              ep=c.ep, sequence_parallel=c.sequence_parallel)
    return PlanRow(c, memory, time, memory.total <= USABLE_MEMORY * cluster.gpu.memory_bytes)


def plan_layouts(cfg: LlamaConfig, cluster: ClusterSpec, seq_len: int, global_batch: int,
                 precision: str = "bf16-mixed", achievable: Optional[float] = None,
                 optimizer: str = "adamw") -> list[PlanRow]:
    """Every candidate, those that fit first, each group fastest first (``optimizer``: adamw or muon, whose
    matrices keep one momentum where Adam keeps two moments)."""
    rows = [evaluate(cfg, cluster, seq_len, global_batch, c, precision, achievable, optimizer)
            for c in candidates(cfg, cluster, global_batch, seq_len, precision)]
    return sorted(rows, key=lambda r: (not r.fits, r.time.total, r.memory.total))
