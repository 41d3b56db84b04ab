"""What MGPUStrategy refuses of a Trainer and a LightningModule at ``setup``, all at once and by name, with what to do
instead: the layout against the module's shape and the data's micro-batches, the hooks a pipeline needs, Lightning
features the engine cannot run, and optimizer groups that ZeRO-3's early partitioning would leave empty."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_mgpu.contract import builds_on_meta, hook, model_shape_of
from lightning_mgpu.layout import LayoutRequest, ParallelLayout
from lightning_mgpu.optim.muon import is_matrix_optimizer, muon_offload_problem
from lightning_mgpu.precision import pipeline_precision_problems, replica_precision_problems
from lightning_mgpu.problems import raise_problems
from lightning_mgpu.resilience.stragglers import slow_rank_problems
from lightning_mgpu.split_rules import timer_problems

#: The hooks a module needs for pipeline parallelism.
PIPELINE_HOOKS = ("pipeline_stages", "pipeline_batch", "pipeline_loss")


def check_module(module: Any, request: LayoutRequest, world_size: int, num_microbatches: int, precision: str) -> None:
    """The layout against the module's shape (when it declares ``model_shape``) and the micro-batch count the data
    gives; with pipeline stages, the precision and the hooks the pipeline calls."""
    shape = model_shape_of(module)
    problems = request.problems_with(world_size, shape, num_microbatches=num_microbatches)
    problems += replica_precision_problems(precision, request.zero_stage, request.replica_update)
    raise_problems("Invalid parallel layout", problems)
    stages = request.pipeline_parallel_size
    if stages == 1:
        return
    problems: list = pipeline_precision_problems(precision, stages)
    missing = [name for name in PIPELINE_HOOKS if hook(module, name) is None]
    if missing:
        problems.append(f"pipeline_parallel_size={stages} needs {type(module).__name__} to define "
                        f"{', '.join(missing)} (see LLMModule)")
    raise_problems("Invalid pipeline setup", problems)


def training_loop_problems(pipeline_parallel_size: int, accumulate_grad_batches: int = 1,
                           manual_optimization: bool = False, num_microbatches: int = 1) -> list[str]:
    """What Lightning's training loop may ask for that this layout cannot run (empty when all is well)."""
    out = []
    if pipeline_parallel_size > 1 and accumulate_grad_batches > 1:
        out.append(f"accumulate_grad_batches={accumulate_grad_batches} is not supported with pipeline parallelism "
                   f"(pipeline_parallel_size={pipeline_parallel_size}): the schedule already accumulates over its "
                   "micro-batches; raise the number of micro-batches instead (a larger global batch, or "
                   "num_microbatches)")
    if manual_optimization and pipeline_parallel_size > 1:
        out.append("manual optimization (automatic_optimization=False) is not supported with pipeline parallelism: "
                   "the schedule runs forward and backward itself; use automatic optimization")
    if manual_optimization and num_microbatches > 1:
        out.append(f"manual optimization runs one training_step per batch, but {num_microbatches} micro-batches were "
                   "asked for; use num_microbatches=1 (micro-batch = the whole batch) or automatic optimization")
    return out


def check_trainer(trainer: Any, module: Any, layout: ParallelLayout, num_microbatches: int) -> None:
    """The Lightning features this strategy cannot run."""
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging, Timer

    from lightning_mgpu.callbacks.checkpoint import PeriodicCheckpoint
    from lightning_mgpu.checkpoint.formats import replica_checkpoint_problems

    if trainer.gradient_clip_algorithm not in (None, "norm") and trainer.gradient_clip_val:
        raise ValueError(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} is not supported: "
                         "MGPUStrategy clips by the global norm; use gradient_clip_algorithm='norm'")
    problems = training_loop_problems(layout.size("pp"), trainer.accumulate_grad_batches,
                                      not module.automatic_optimization, num_microbatches)
    problems += [str(p) for p in slow_rank_problems(getattr(trainer.strategy, "slow_ranks", None), layout.world_size)]
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer) and cb._duration is not None]
    problems += [str(p) for p in timer_problems(layout.replica_update, "set" if timers else None)]
    savers = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, (ModelCheckpoint, PeriodicCheckpoint))]
    if savers and layout.replica_update == "async":
        problems += [f"{line} ({', '.join(savers)} in the callbacks; Trainer(enable_checkpointing=False) leaves "
                     "Lightning's own out)" for line in replica_checkpoint_problems("async", "universal")]
    if any(isinstance(cb, StochasticWeightAveraging) for cb in trainer.callbacks):
        problems.append("StochasticWeightAveraging is not supported by MGPUStrategy: it averages full copies of the "
                        "parameters, which ZeRO partitions and tensor/pipeline parallelism split; average "
                        "checkpoints offline instead (mgpu-export writes whole weights)")
    raise_problems("Unsupported with MGPUStrategy", problems)


def check_optimizers(optimizers: list, module: Any, layout: ParallelLayout) -> Optional[torch.optim.Optimizer]:
    """The one optimizer the engine drives. A module built on the meta device has its parameters partitioned as they
    are filled under ZeRO-3 (``partitioned_early``), before ``configure_optimizers`` runs: grouping them by
    ``p.dim()`` or ``p.shape`` then sees empty 1-d tensors and leaves a group empty (DeepSpeed drops it; an LR
    scheduler of the groups then fails, or weight decay silently goes): refused by name."""
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers; MGPUStrategy drives one "
                         "DeepSpeed engine and needs exactly one")
    optimizer, partitioned_early = optimizers[0], layout.zero_stage == 3 and builds_on_meta(module)
    empty = [i for i, group in enumerate(optimizer.param_groups) if not group["params"]]
    if partitioned_early and empty:
        raise ValueError(f"configure_optimizers of {type(module).__name__} returned parameter group(s) {empty} of "
                         f"{len(optimizer.param_groups)} with no parameters. Under ZeRO-3 each parameter is already "
                         "partitioned when configure_optimizers runs (p.shape is an empty 1-d tensor's): group "
                         "parameters by lightning_mgpu.parameter_shape(p), or leave empty groups out")
    if layout.offload_optimizer is not None and is_matrix_optimizer(optimizer):
        raise ValueError(muon_offload_problem(layout.offload_optimizer, "MGPUStrategy(offload_optimizer=...)"))
    return optimizer
