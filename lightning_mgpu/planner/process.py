"""Peak memory of one training process of this engine, and the memory a machine has: what ``mgpu-train`` checks before
it launches anything.

The planner's :func:`~lightning_mgpu.planner.memory.estimate_memory` gives a rank's steady-state model states and
activations on a GPU. A process's peak has more, which this module adds:

* **Setup.** A module that cannot give each rank its share of the initial values is built WHOLE by every rank (fp32,
  or bf16 under ``bf16-true``) on the rank's device, which then keeps only its shard. The copy is freed before the
  engine starts, so it is a peak of its own: the process needs ``max(whole model, training)``. Built on the meta
  device, a rank holds its own tensor/pipeline shard whole before the engine starts, except under ZeRO-3, which
  partitions each module's parameters as soon as they are filled: then one tensor at a time is whole.
* **Host memory on CPU.** Every process of a machine shares its memory. Each holds the libraries
  (:data:`PROCESS_BASELINE_BYTES`), and its first optimizer step holds more than the planner's steady state:
  unpartitioned gradients and the flat gradient copies DeepSpeed makes for the step, Adam's temporaries, and the
  heap glibc keeps after activations are freed (:data:`CPU_STATE_FACTOR`); activations get a small margin
  (:data:`CPU_ACTIVATION_FACTOR`).

The factors are measured peak resident memory (``VmHWM``) over planner figures, for a 104M-parameter Llama
(dim 768, 12 layers, vocabulary 256) trained in fp32 by ``mgpu-train`` on 2 CPU processes (torch 2.13 CPU,
Lightning 2.6.6, DeepSpeed 0.19.8), sequence 128, micro-batch 4.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from lightning_mgpu.allocator import returns_freed_memory
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.model_stats import max_rank_parameters
from lightning_mgpu.planner.memory import estimate_memory

#: Resident memory of a training process before its model: Python, torch, Lightning, DeepSpeed, this package, gloo and
#: the data module. Measured: 0.46 GB after the imports, 0.56 GB peak over a 3-step run of the tiny model.
PROCESS_BASELINE_BYTES = 0.6e9
#: Peak host bytes of a CPU process's model states over the planner's steady-state figure, through setup and the first
#: optimizer step. Measured (peak RSS less the import baseline, sequence 16, 2 processes of a 104M-parameter Llama,
#: fp32, CPU processes returning freed memory to the OS: :mod:`lightning_mgpu.allocator`, AdamW fused): ZeRO-0 dp2 1.03,
#: ZeRO-1 dp2 0.97, ZeRO-2 dp2 1.21, ZeRO-3 dp2 1.25, ZeRO-1 and ZeRO-2 tp2 1.20-1.25, ZeRO-1 pp2 1.25; 8 processes of a
#: 401M-parameter Llama at tp2 x pp2 x dp2 with ZeRO-3 1.36 (``benchmarks/setup_memory.py``); with margin above the
#: largest.
CPU_STATE_FACTOR = 1.5
#: The same where glibc keeps freed memory (the default, ``return_freed_memory=False``; or the user set
#: ``MALLOC_MMAP_THRESHOLD_``, or another C library): measured before that setting and the fused optimizer, 1.33
#: (ZeRO-1 dp2) to 2.22 (ZeRO-1 tp2), with margin.
CPU_STATE_FACTOR_KEPT_HEAP = 2.4
#: Host memory for activations over the planner's figure. The planner's activation bytes are what this Llama keeps for
#: backward, derived per tensor for the run's precision and checked to 10% (measured 0.99-1.00 at tp 1 and 2, with and
#: without sequence parallelism, every checkpointing mode: tests/unit/test_activation_formulas.py and
#: tests/distributed/test_activation_memory.py); the 10% above it is for the CPU allocator's rounding and what it keeps
#: cached between the step's phases. For SwiGLU at 4 x dim in fp32 this gives what the former factor (3.5 over a
#: bf16 formula of 34 bytes per token and dim) gave: 1.1 x 108 against 3.5 x 34 bytes per token and dim.
CPU_ACTIVATION_FACTOR = 1.1


@dataclass(frozen=True)
class ProcessMemory:
    """Peak bytes of one training process, by what holds them."""

    baseline: float  #: the libraries (counted in host memory only)
    whole_model: float  #: what a rank holds whole before the engine starts: the whole model, or (built on the meta
    #: device) its own tensor/pipeline shard, or under ZeRO-3 (partitioned as it is filled) its largest tensor
    model_states: float  #: this rank's parameters, gradients, optimizer state and buffers, at their peak
    activations: float

    @property
    def training(self) -> float:
        return self.model_states + self.activations

    @property
    def total(self) -> float:
        """The whole-model copy is freed before training starts: the peak is the larger of the two phases."""
        return self.baseline + max(self.whole_model, self.training)


def process_memory(cfg: LlamaConfig, seq_len: int, micro_batch: int, tp: int, pp: int, dp: int, zero_stage: int,
                   stages_per_rank: int = 1, sequence_parallel: bool = False, recompute: bool = False,
                   precision: str = "32-true", host: bool = True, builds_whole_model: bool = True,
                   offload_optimizer: bool = False, offload_params: bool = False, context: int = 1,
                   mode: str | None = None, schedule: str = "1f1b",
                   boundaries: Optional[Sequence[int]] = None, microbatches: Optional[int] = None,
                   return_freed_memory: bool = False, ep: int = 1) -> ProcessMemory:
    """Peak memory of the fullest rank: in host memory (``host=True``, a CPU process) or on its GPU.

    ``builds_whole_model``: every rank first builds the whole model on its device (fp32; bf16 under ``bf16-true``)
    and then keeps its shard, as a module built off the meta device does; otherwise it holds its whole tensor/pipeline
    shard before the engine starts, or under ZeRO-3 (partitioned as it is filled) its largest tensor. On a GPU, ZeRO offload moves the
    optimizer state (``offload_optimizer``) and ZeRO-3's parameter partitions (``offload_params``) to host memory.
    ``return_freed_memory``: the CPU process hands freed memory back (``lightning_mgpu.allocator``). ``ep``:
    expert-parallel ranks (a mixture of experts: each holds ``num_experts / ep`` of every layer's experts).
    """
    planned = estimate_memory(cfg, seq_len, micro_batch, tp, pp, dp, zero_stage, stages_per_rank, sequence_parallel,
                              recompute, precision, overlap=not host,  # the engine overlaps on GPUs only
                              context=context, mode=mode, schedule=schedule, boundaries=boundaries,
                              microbatches=microbatches, ep=ep)
    w = 2 if precision == "bf16-true" else 4
    if builds_whole_model:
        whole = cfg.num_parameters() * w
    elif zero_stage == 3:  # partitioned as it is filled: the largest tensor (embedding, MLP or stacked experts) once
        whole = max(cfg.vocab_size, cfg.ffn_hidden, cfg.num_experts // ep * cfg.expert_ffn_hidden) * cfg.dim / tp * w
    else:
        whole = max_rank_parameters(cfg, tp, pp, stages_per_rank, ep) * w
    if host:
        factor = CPU_STATE_FACTOR if returns_freed_memory(return_freed_memory) else CPU_STATE_FACTOR_KEPT_HEAP
        return ProcessMemory(PROCESS_BASELINE_BYTES, whole, factor * planned.model_states,
                             CPU_ACTIVATION_FACTOR * planned.activations)
    states = planned.model_states
    states -= planned.optimizer if offload_optimizer else 0.0
    states -= planned.parameters if offload_params else 0.0
    return ProcessMemory(0.0, whole, states, planned.activations)


def host_memory() -> tuple[float, str]:
    """(bytes of memory this machine gives its processes, where that figure comes from): the physical memory
    (``MemTotal``), or the control group's limit when a container sets a lower one."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        return limit, "the memory limit of this container's cgroup"
    return total, "this machine's physical memory"


def _cgroup_limit() -> Optional[float]:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return float(text)
    return None
