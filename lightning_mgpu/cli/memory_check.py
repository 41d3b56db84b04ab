"""The memory check of a launch: a layout whose estimated peak memory does not fit the GPU (or, on CPU, this
machine for its ``trainer.devices`` processes) is refused before any process starts, with the estimate, the limit and
the cheapest changes that fit, each a set of config overrides checked against the launcher's own rules."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from omegaconf import DictConfig

from lightning_mgpu.cli.machine import _inside_slurm_job, _wants_gpu
from lightning_mgpu.cli.spec import RunSpec
from lightning_mgpu.layout import chunks_per_rank, divisors
from lightning_mgpu.planner.hardware import GPUS
from lightning_mgpu.planner.model_stats import RankParameters, max_rank_split
from lightning_mgpu.planner.process import ProcessMemory, host_memory, process_memory
from lightning_mgpu.planner.replicas import master_share, outer_copy_bytes
from lightning_mgpu.planner.search import USABLE_MEMORY
from lightning_mgpu.split_rules import steps_apart


GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The memory a run's processes share: one GPU's, or on CPU one machine's for its ``trainer.devices`` processes."""

    total: float  #: bytes
    usable: float  #: the share an estimate may fill (the planner's USABLE_MEMORY: the rest is the OS, fragmentation)
    processes: int  #: processes that share it
    on_gpu: bool
    name: str  #: where the figure comes from, for messages


def memory_budget(cfg: DictConfig) -> Optional[MemoryBudget]:
    """On GPUs, the memory of the GPU this process will use (or of ``plan.gpu``'s preset where no GPU is visible, as
    at SLURM submission); on CPU, this machine's memory, shared by the ``trainer.devices`` processes it runs. None
    where it cannot be known here: a CPU job submitted to SLURM (it checks again inside the job)."""
    import torch

    visible = torch.cuda.device_count()
    if _wants_gpu(cfg.trainer.accelerator, visible):
        if visible:
            index = int(os.environ.get("LOCAL_RANK", "0")) % visible  # this process's own GPU: no context elsewhere
            props = torch.cuda.get_device_properties(index)
            total, name = float(props.total_memory), f"the {props.name} (cuda:{index})"
        elif cfg.plan.gpu in GPUS:
            gpu = GPUS[cfg.plan.gpu]
            total, name = gpu.memory_bytes, f"a {gpu.name} (plan.gpu={cfg.plan.gpu}; no GPU is visible here)"
        else:
            return None
        return MemoryBudget(total, USABLE_MEMORY * total, 1, True, name)
    if cfg.cluster.launcher == "slurm" and not _inside_slurm_job():
        return None
    total, name = host_memory()
    return MemoryBudget(total, USABLE_MEMORY * total, cfg.trainer.devices, False, name)


def builds_whole_model() -> bool:
    """Whether every rank of ``mgpu-train`` builds the whole model before keeping its shard (see
    :func:`lightning_mgpu.contract.builds_on_meta`)."""
    from lightning_mgpu.contract import builds_on_meta
    from lightning_mgpu.module import LLMModule

    return not builds_on_meta(LLMModule)


def run_memory(spec: RunSpec, on_gpu: bool) -> ProcessMemory:
    """Peak memory of one process of the run (its fullest rank), as
    :func:`lightning_mgpu.planner.process.process_memory` estimates it: on its GPU, or in host memory on CPU."""
    p, t, d, model = spec.layout, spec.config.trainer, spec.config.data, spec.model
    tp, pp, cp = p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size
    dp = t.devices * t.num_nodes // (tp * pp * cp * p.replicas)  # ZeRO partitions inside a replica
    need = process_memory(model, d.seq_len, d.micro_batch_size, tp, pp, dp,
                          p.zero_stage, chunks_per_rank(p.pipeline_schedule, p.virtual_pipeline_size),
                          p.sequence_parallel, model.activation_checkpointing == "full", str(t.precision),
                          host=not on_gpu, builds_whole_model=builds_whole_model(),
                          offload_optimizer=p.offload_optimizer is not None,
                          offload_params=p.offload_params is not None, context=cp,
                          mode=model.activation_checkpointing, schedule=p.pipeline_schedule,
                          boundaries=spec.config.parallel.pipeline_boundaries,
                          return_freed_memory=spec.config.parallel.return_freed_memory,
                          microbatches=max(1, d.global_batch_size // (d.micro_batch_size * max(1, dp * p.replicas))),
                          ep=p.expert_parallel_size)
    if not steps_apart(p.replica_update):
        return need
    share = master_share(model, tp, pp, chunks_per_rank(p.pipeline_schedule, p.virtual_pipeline_size), dp * cp,
                         p.zero_stage)
    extra = outer_copy_bytes(share, spec.config.parallel.outer_optimizer.momentum, p.replica_update, p.replicas,
                             p.max_staleness)
    return dataclasses.replace(need, model_states=need.model_states + extra)


def memory_problems(spec: RunSpec) -> list[str]:
    """A layout whose estimated peak memory does not fit, refused before any process starts, with the estimate, the
    limit and the cheapest changes that fit. ``cluster.check_memory=false`` turns the check off."""
    if not spec.config.cluster.check_memory:
        return []
    budget = memory_budget(spec.config)
    if budget is None:
        return []
    need = run_memory(spec, budget.on_gpu)
    if budget.processes * need.total <= budget.usable:
        return []
    return [_memory_refusal(spec, need, budget)]


def _held_note(held: RankParameters, dp: int, ep: int) -> str:
    """What the fullest rank's count holds apart: routed experts (partitioned over fewer ranks) and, in an adapter
    run, the frozen base, which costs its storage alone; so a reader sees why the states are what they are."""
    note = (f"; of them {held.experts / 1e6:,.0f}M of routed experts, ZeRO over the {dp // ep} holding the same "
            "experts" if held.experts else "")
    if held.frozen:
        note += (f"; {(held.total - held.frozen - (held.experts if held.experts_frozen else 0)) / 1e6:,.1f}M train "
                 "(adapters), the rest is the frozen base: its weights only, no gradient, master or optimizer state")
    return note


def _memory_refusal(spec: RunSpec, need: ProcessMemory, budget: MemoryBudget) -> str:
    p, t, d, model = spec.layout, spec.config.trainer, spec.config.data, spec.model
    n = budget.processes
    limit = f"the {budget.usable / GB:.1f} GB usable of the {budget.total / GB:.1f} GB of {budget.name}"
    if budget.on_gpu:
        lines = [f"memory: an estimated peak of {need.total / GB:.1f} GB per GPU is more than {limit}"]
    else:
        lines = [f"memory: trainer.devices={n} process{'es' if n > 1 else ''} on this machine x an estimated peak "
                 f"of {need.total / GB:.1f} GB each = {n * need.total / GB:.1f} GB is more than {limit}"]
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    dp = t.devices * t.num_nodes // (tp * pp * p.replicas)  # the ranks ZeRO partitions over: data x context
    stages = chunks_per_rank(p.pipeline_schedule, p.virtual_pipeline_size)
    held = max_rank_split(model, tp, pp, stages, p.expert_parallel_size)
    parts = [f"{need.baseline / GB:.1f} GB libraries"] if need.baseline else []
    states = "model states" if budget.on_gpu else "model states at the first optimizer step's peak"
    parts += [f"{need.model_states / GB:.1f} GB {states} ({held.total / 1e6:,.0f}M parameters on the fullest rank, "
              f"{t.precision}, ZeRO-{p.zero_stage} over {dp} data-parallel rank{'s' if dp > 1 else ''}"
              f"{_held_note(held, dp, p.expert_parallel_size)})",
              f"{need.activations / GB:.1f} GB activations (micro-batch {d.micro_batch_size} x {d.seq_len} tokens)"]
    breakdown = f"per {'GPU' if budget.on_gpu else 'process'}: " + " + ".join(parts)
    if need.whole_model:
        held = ("the whole model" if builds_whole_model() else "its largest tensor whole (ZeRO-3 partitions each as it is "
                "filled)" if p.zero_stage == 3 else "its tensor/pipeline shard whole")
        breakdown += f"; before that, every rank builds {held}: {need.whole_model / GB:.1f} GB"
    lines.append(breakdown)
    fits, together = _memory_fixes(spec, budget)
    unit = "per GPU" if budget.on_gpu else "per machine"
    if fits:
        lines.append("fixes, cheapest first: "
                     + "; ".join(f"{_overrides(change)} ({after / GB:.1f} GB {unit})" for change, after in fits))
    elif together is not None:
        lines.append(f"no single change fits; together: {_overrides(together[0])} ({together[1] / GB:.1f} GB {unit})")
    else:
        alone = need.baseline + need.whole_model
        copy = "whole-model copy" if builds_whole_model() else "unpartitioned shard" if p.zero_stage != 3 else "largest tensor"
        why = (f"the {copy} alone needs {alone / GB:.1f} GB {'per GPU' if budget.on_gpu else 'per process'}"
               if budget.processes * alone > budget.usable else "")
        lines.append("no change of ZeRO stage, activation checkpointing, micro-batch, tensor/pipeline parallelism or "
                     f"processes per machine fits{': ' + why if why else ''}; use "
                     + ("GPUs with more memory, more GPUs" if budget.on_gpu else "a machine with more memory, more "
                        "machines") + " (trainer.num_nodes) or a smaller model")
    lines.append("cluster.check_memory=false launches it anyway")
    return "\n    ".join(lines)


def _overrides(overrides: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in overrides.items())


Fix = tuple[dict, float]  # (overrides, estimated bytes per GPU, or per machine on CPU)


def _memory_fixes(spec: RunSpec, budget: MemoryBudget) -> tuple[list[Fix], Optional[Fix]]:
    """(single changes that fit: each kind's mildest setting that does, cheapest kind first; when none does, changes
    of several kinds that fit together, or None).

    Together: kind by kind, the mildest setting that makes the run fit, else the one that saves most; then every
    kind whose change is not needed for the run to fit is left out again.
    """
    kinds = _fix_kinds(spec.config, budget, spec.model.num_experts > 0)
    fits = []
    for kind in kinds:
        for overrides in kind:
            need = _need_with(spec, overrides, budget)
            if need is not None and need <= budget.usable:
                fits.append((overrides, need))
                break
    if fits:
        return fits, None
    chosen: list[dict] = []
    best = _need_with(spec, {}, budget)
    for kind in kinds:
        tried = [(need, overrides) for overrides in kind
                 if (need := _need_with(spec, _merged(*chosen, overrides), budget)) is not None]
        fitting = [(need, overrides) for need, overrides in tried if need <= budget.usable]
        need, overrides = fitting[0] if fitting else min(tried, key=lambda pair: pair[0], default=(best, {}))
        if overrides and need < best:
            chosen.append(overrides)
            best = need
        if best <= budget.usable:
            for change in list(chosen[:-1]):  # drop what the fit does not need
                rest = [c for c in chosen if c is not change]
                need = _need_with(spec, _merged(*rest), budget)
                if need is not None and need <= budget.usable:
                    chosen, best = rest, need
            return [], (_merged(*chosen), best)
    return [], None


def _merged(*overrides: dict) -> dict:
    return {key: value for change in overrides for key, value in change.items()}


def _fix_kinds(cfg: DictConfig, budget: MemoryBudget, moe: bool = False) -> list[list[dict]]:
    """The changes that lower memory, by kind (cheapest kind first), each kind's settings mildest first (``moe``: a
    mixture of experts, whose experts can spread over more expert-parallel ranks)."""
    p, t, d = cfg.parallel, cfg.trainer, cfg.data
    world = t.devices * t.num_nodes
    kinds = [[{"parallel.zero_stage": z} for z in range(p.zero_stage + 1, 4)],
             [{"model.activation_checkpointing": "full"}] if cfg.model.activation_checkpointing != "full" else [],
             [{"data.micro_batch_size": m} for m in reversed(divisors(d.micro_batch_size)) if m < d.micro_batch_size],
             [{"parallel.tensor_parallel_size": n} for n in divisors(t.devices) if n > p.tensor_parallel_size],
             [{"parallel.pipeline_parallel_size": n} for n in divisors(world // p.tensor_parallel_size)
              if n > p.pipeline_parallel_size],
             [{"parallel.context_parallel_size": n} for n in divisors(t.devices // p.tensor_parallel_size)
              if n > p.context_parallel_size],  # a split the sequence does not allow is dropped by _need_with
             [{"parallel.expert_parallel_size": n} for n in divisors(world // p.tensor_parallel_size)
              if n > p.expert_parallel_size] if moe else []]  # experts over more ranks
    fewer = [n for n in reversed(divisors(t.devices)) if n < t.devices]
    if budget.on_gpu:
        if p.offload_optimizer is None and not steps_apart(p.replica_update):  # the outer step needs them in memory
            kinds.append([{"parallel.zero_stage": max(1, p.zero_stage), "parallel.offload_optimizer": "cpu"}])
    else:  # memory handed back; fewer processes per machine: the same layout over more machines, or fewer in all
        if not p.return_freed_memory:
            kinds.insert(0, [{"parallel.return_freed_memory": True}])
        kinds.append([{"trainer.devices": n, "trainer.num_nodes": t.num_nodes * t.devices // n} for n in fewer])
        kinds.append([{"trainer.devices": n} for n in fewer])
    return [kind for kind in kinds if kind]


def _need_with(spec: RunSpec, overrides: dict, budget: MemoryBudget) -> Optional[float]:
    """Estimated bytes per GPU (CPU: per machine) of the run changed by ``overrides``; None if that breaks a rule."""
    changed = spec.replaced(overrides)
    if changed is None:
        return None
    return (1 if budget.on_gpu else changed.config.trainer.devices) * run_memory(changed, budget.on_gpu).total
