"""One training step of this rank's share of a global batch, behind one interface for both kinds of layout.

:class:`DataParallelStep` runs each micro-batch's forward (the module's own ``training_step``, through Lightning's
forward redirection so the engine's hooks run) and backward through the engine; :class:`PipelineStep` hands the batch
to the pipeline schedule, which runs forward and backward of every micro-batch itself. Both return the loss of the
whole global batch, detached: the mean over micro-batches, data-parallel replicas and context ranks. The optimizer
step (``engine.step()``) is Lightning's, at the end of each group of ``accumulate_grad_batches`` batches.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol

import torch
import torch.distributed as dist

from lightning_mgpu import engine as engines
from lightning_mgpu.contract import hook
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.models.moe import set_loss_scale
from lightning_mgpu.parallel.microbatch import split_microbatches
from lightning_mgpu.parallel.pipeline import Pipeline
from lightning_mgpu.parallel.timeline import PipelineTimeline


class TrainStep(Protocol):
    #: this rank's own mean loss of each batch since the last optimizer step, before the mean over replicas (the step
    #: guard tells from it which rank's loss was not finite); the strategy empties it at every optimizer step
    local_losses: list[torch.Tensor]

    def __call__(self, batch: Any, *rest: Any, **kwargs: Any) -> Any:
        """Forward and backward of every micro-batch of ``batch``; the global batch's mean loss (detached)."""


def mean_over_replicas(mean: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """The loss of the global batch: the mean over replicas and over the equal sequence parts of context ranks."""
    if layout.size("dp_cp") > 1:
        dist.all_reduce(mean, group=layout.group("dp_cp"))
        mean /= layout.size("dp_cp")
    return mean


class DataParallelStep:
    """Micro-batches through the engine, one after the other (no pipeline)."""

    def __init__(self, engine: Any, module: Any, layout: ParallelLayout, num_microbatches: int,
                 step_context: Callable[[], Any], forward: Callable[..., Any]) -> None:
        self.engine, self.module, self.layout = engine, module, layout
        self.num_microbatches, self.step_context, self.forward = num_microbatches, step_context, forward
        self.local_losses: list[torch.Tensor] = []

    def __call__(self, batch: Any, *rest: Any, **kwargs: Any) -> Any:
        if not self.module.automatic_optimization:  # the module calls manual_backward and opt.step() itself
            with self.step_context():
                return self.forward(self.engine, self.module, "training_step", batch, *rest, **kwargs)
        losses, out = [], None
        set_loss_scale(self.module, engines.loss_scale(self.engine) / engines.accumulation_steps(self.engine))
        for micro_batch in split_microbatches(batch, self.num_microbatches):
            with self.step_context():
                out = self.forward(self.engine, self.module, "training_step", micro_batch, *rest, **kwargs)
            loss = out["loss"] if isinstance(out, Mapping) else out
            engines.backward(self.engine, loss)  # scaled by 1 / (micro-batches x accumulate_grad_batches) in the engine
            losses.append(loss.detach().float())
        own = torch.stack(losses).mean()
        self.local_losses.append(own.clone())
        mean = mean_over_replicas(own, self.layout)
        # The module's other outputs (of the last micro-batch) reach on_train_batch_end as under DDP.
        return {**out, "loss": mean} if isinstance(out, Mapping) else mean


class PipelineStep:
    """The batch through the pipeline schedule (``pipeline_batch`` gives the first stage's input and the target)."""

    def __init__(self, pipeline: Pipeline, module: Any, layout: ParallelLayout) -> None:
        self.pipeline, self.module, self.layout = pipeline, module, layout
        self.local_losses: list[torch.Tensor] = []

    def __call__(self, batch: Any, *rest: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule divides each micro-batch's loss by their number and scales no gradient after.
        engine = self.pipeline.engine
        set_loss_scale(engine.module, engines.loss_scale(engine) / self.pipeline.n_microbatches)
        own = self.pipeline.train_step(*hook(self.module, "pipeline_batch")(batch))
        self.local_losses.append(own.detach().float().clone())
        return mean_over_replicas(own, self.layout)


def layout_step(engine: Any, module: Any, layout: ParallelLayout, device: Any, micro_batches: int,
                timeline: Optional[PipelineTimeline], step_context: Callable[[], Any],
                forward: Callable[..., Any]) -> tuple[TrainStep, Optional[Pipeline]]:
    """The step of the layout (the pipeline's, or micro-batches through the engine) and the pipeline, if any."""
    if layout.size("pp") > 1:
        pipeline = Pipeline(engine, layout, device, hook(module, "pipeline_loss"), micro_batches, timeline)
        return PipelineStep(pipeline, module, layout), pipeline
    return DataParallelStep(engine, module, layout, micro_batches, step_context, forward), None
