"""The ``parallel`` group against the devices, the model, the batch and the precision: the layout's own rules
(``lightning_mgpu.layout``) and those stated beside it (sequence splits, compile, precision, stage boundaries), each
asked where it is stated and named by its config key through :data:`~lightning_mgpu.cli.rule_base.CONFIG_KEYS`."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.cli.rule_base import _positive, keyed
from lightning_mgpu.data.batching import batch_problems
from lightning_mgpu.layout import ModelShape, chunks_per_rank, layout_problems
from lightning_mgpu.split_rules import sequence_problems, timer_problems
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.models.llama_plan import boundary_problems
from lightning_mgpu.resilience.stragglers import slow_rank_problems
from lightning_mgpu.precision import fp8_layout_problems, pipeline_precision_problems, replica_precision_problems
from lightning_mgpu.refusals import training_loop_problems


def _outer_problems(outer: DictConfig) -> list:
    from lightning_mgpu.parallel.replicas import OuterOptimizer

    return OuterOptimizer.of(OmegaConf.to_container(outer, resolve=True)).problems()


def _source_layout_problems(cfg: DictConfig, world: int, shape: Optional[ModelShape], micro: Optional[int]) -> list:
    """What the model source forbids of a layout its rules accepted (the layout built as a launch builds it)."""
    from lightning_mgpu.layout import LayoutRequest

    request = LayoutRequest(**{name: cfg.parallel[name] for name in LayoutRequest.__dataclass_fields__})
    try:
        layout = request.build(world, model=shape, num_microbatches=micro)
    except ValueError:  # a rule stated elsewhere (the batch, the micro-batches) names it
        return []
    return model_source(cfg).layout_problems(layout)


def parallel_problems(cfg: DictConfig, model: Optional[LlamaConfig]) -> list[str]:
    """The layout against the devices, the model and the batch, as ``parallel.*`` keys."""
    p, t, d = cfg.parallel, cfg.trainer, cfg.data
    sizes_ok = not (_positive("trainer.devices", t.devices) or _positive("trainer.num_nodes", t.num_nodes))
    world = t.devices * t.num_nodes if sizes_ok else 1
    shape = None if model is None else ModelShape.of(model)
    T, P, C = p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size
    sizes = (T, P, C)
    dp = world // (T * P * C) if all(isinstance(n, int) and n > 0 for n in sizes) and world % (T * P * C) == 0 \
        else None
    micro = p.num_microbatches
    batch = []
    if dp is not None:
        batch = batch_problems(d.global_batch_size, d.micro_batch_size, dp)
        if not batch and micro is None:
            micro = d.global_batch_size // (d.micro_batch_size * dp)
    raw = layout_problems(world_size=world, tensor_parallel_size=T, pipeline_parallel_size=P, zero_stage=p.zero_stage,
                          pipeline_schedule=p.pipeline_schedule, virtual_pipeline_size=p.virtual_pipeline_size,
                          num_microbatches=micro, sequence_parallel=p.sequence_parallel, context_parallel_size=C,
                          offload_optimizer=p.offload_optimizer, offload_params=p.offload_params, model=shape,
                          replicas=p.replicas, replica_update=p.replica_update, sync_every=p.sync_every,
                          max_staleness=p.max_staleness, expert_parallel_size=p.expert_parallel_size)
    if not raw and model is not None:
        raw = _source_layout_problems(cfg, world, shape, micro)
    raw = [model_source(cfg).restated(problem) for problem in raw]
    out = keyed(raw, t) + batch + keyed(_outer_problems(p.outer_optimizer), t)
    if isinstance(T, int) and isinstance(C, int) and T > 0 and C > 0 and isinstance(d.seq_len, int):
        out += sequence_problems(d.seq_len, C, T, bool(p.sequence_parallel), key="data.seq_len")
    if cfg.model.compile and isinstance(p.zero_stage, int):
        from lightning_mgpu.parallel.compile import compile_layout_problems

        out += compile_layout_problems(p.zero_stage, key="model.compile")
    if isinstance(P, int) and isinstance(t.accumulate_grad_batches, int):
        out += [f"trainer.{line}" for line in training_loop_problems(P, t.accumulate_grad_batches)]
    out += keyed(replica_precision_problems(str(t.precision), p.zero_stage, p.replica_update), t)
    if isinstance(C, int) and isinstance(p.expert_parallel_size, int):
        out += keyed(fp8_layout_problems(t.fp8, C, p.expert_parallel_size), t)
    out += [f"trainer.{problem}" for problem in timer_problems(p.replica_update, t.max_time)]
    slow = OmegaConf.to_container(p.slow_ranks) if isinstance(p.slow_ranks, DictConfig) else p.slow_ranks
    out += keyed(slow_rank_problems(slow, world if sizes_ok else None), t)
    if isinstance(P, int) and P > 1:
        out += keyed(pipeline_precision_problems(str(t.precision), P), t)
        if p.pipeline_boundaries is not None and model is not None and isinstance(p.virtual_pipeline_size, int):
            stages = P * chunks_per_rank(p.pipeline_schedule, p.virtual_pipeline_size)
            out += [f"parallel.{line}" for line in boundary_problems(p.pipeline_boundaries, model.n_layers, stages)]
    return out
