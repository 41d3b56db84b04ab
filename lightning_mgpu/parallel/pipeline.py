"""Pipeline parallelism: ``torch.distributed.pipelining`` schedules over stage chunks owned by a DeepSpeed engine.

The recipe that worked when measured (torch 2.13, DeepSpeed 0.19.8): this rank's stage chunks sit in one
``ModuleDict`` that is the engine's module (even for one chunk: with ZeRO-3 and a stage as the engine's root, ranks
deadlock); each ``PipelineStage`` wraps ``engine.module[str(stage_id)]``; the schedule runs inside
``lightning_mgpu.engine.deferred_grad_reduction`` (ZeRO 1-3: the per-parameter hooks do nothing, one
data-parallel reduction on exit), the loss is divided by the number of micro-batches and the schedule does not scale
gradients; then ``engine.step()`` clips by the global norm and updates.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.autograd.profiler as autograd_profiler
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
    _get_profiler_function_name,
    _PipelineScheduleRuntime,
)

from lightning_mgpu.engine import deferred_grad_reduction
from lightning_mgpu.models.moe import moe_layers, shapes_only
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.pipeline_overlap import OverlappedForwardBackward, overlap_for
from lightning_mgpu.parallel.timeline import ACTION_METHODS, PipelineTimeline

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
#: What the first stage takes: one tensor, or a tuple of its arguments (token ids and positions, say).
StageInput = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def forward_only_order(layout: ParallelLayout, n_microbatches: int) -> dict[int, list[_Action]]:
    """Per pipeline rank, the forward actions of an evaluation pass in a deadlock-free order.

    Stage ``s`` runs micro-batch ``m`` at time ``s + m`` (GPipe's diagonal); each rank runs its stages' actions sorted by
    that time, so every activation is sent before the rank that needs it waits for it, whatever the stage placement.
    """
    order: dict[int, list[_Action]] = {}
    for rank in range(layout.pipeline_parallel_size):
        actions = [(stage + mb, stage, mb) for stage in layout.stage_ids(rank) for mb in range(n_microbatches)]
        order[rank] = [_Action(stage, _ComputationType.FORWARD, mb) for _, stage, mb in sorted(actions)]
    return order


class ForwardOnlySchedule(_PipelineScheduleRuntime):
    """Evaluation over the training schedule's stages: forward actions only, for any stage placement.

    Written here because torch's ``eval()`` of a multi-stage schedule replays the *training* order with backward
    switched off; for ZBV and DualPipeV that order hands gradients between a rank's two stages and raises
    ``can't steal_bwd_input if this stage doesn't have backward`` (torch 2.13). The actions are torch's own
    (``_Action``, lowered to sends and receives by torch's ``_add_send_recv``); only their order is ours.
    """

    def __init__(self, stages: list[PipelineStage], layout: ParallelLayout, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        placement = {stage: rank for rank in range(layout.pipeline_parallel_size) for stage in layout.stage_ids(rank)}
        self.stage_index_to_group_rank = placement
        for stage in self._stages:
            stage.stage_index_to_group_rank = placement
        self.pipeline_order = forward_only_order(layout, n_microbatches)
        # torch's _prepare_schedule_with_comms would first validate that every forward has a backward; lower directly.
        self.pipeline_order_with_comms = _add_send_recv(self.pipeline_order, stage_to_rank=placement.__getitem__,
                                                        num_stages=self._num_stages)


class Pipeline:
    """Runs one global batch (this replica's share) through the schedule, for training or evaluation.

    ``loss_fn(output, target)`` is the mean loss of one micro-batch; every rank of the replica gets the
    mean over all micro-batches back (broadcast from the rank that holds the last stage).
    """

    def __init__(self, engine: Any, layout: ParallelLayout, device: torch.device,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_microbatches: int,
                 timeline: Optional[PipelineTimeline] = None) -> None:
        self.engine, self.layout, self.n_microbatches = engine, layout, n_microbatches
        self.loss_fn = loss_fn
        self.group = layout.group("pp")
        total = layout.num_stages
        ids = layout.stage_ids(layout.rank("pp"))
        self.stages = [PipelineStage(engine.module[str(i)], i, total, device, group=self.group) for i in ids]
        for stage in self.stages:
            _without_routing_while_inferring_shapes(stage)
        name = layout.pipeline_schedule
        if name in SINGLE_STAGE_SCHEDULES:
            for stage in self.stages:
                name_actions(stage)
        self.timeline = timeline
        if timeline is not None:
            for stage in self.stages:
                timeline.instrument(stage)
        stages: Any = self.stages[0] if name in SINGLE_STAGE_SCHEDULES else self.stages
        self.schedule = SCHEDULE_CLASSES[name](stages, n_microbatches, loss_fn=self._microbatch_loss,
                                               scale_grads=False)
        #: DualPipeV's forward / backward pairs on two threads where it applies (``pipeline_overlap``; on by default on
        #: an accelerator, ``enable()`` on CPU), else None.
        self.overlap: Optional[OverlappedForwardBackward] = overlap_for(
            self.schedule, layout, [engine.module[str(i)] for i in ids], device)
        self.eval_schedule = self.schedule if name in SINGLE_STAGE_SCHEDULES else \
            ForwardOnlySchedule(self.stages, layout, n_microbatches, self._microbatch_loss)
        self.has_first, self.has_last = 0 in ids, total - 1 in ids
        self.last_rank = layout.global_rank_of(layout.rank("tp"), layout.stage_owner(total - 1), layout.rank("dp"),
                                               layout.rank("cp"), layout.rank("rep"))

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.n_microbatches

    def _run(self, run: Callable, inputs: StageInput, targets: torch.Tensor) -> torch.Tensor:
        """``inputs``: the first stage's argument, or a tuple of its arguments (token ids and positions, say)."""
        losses: list[torch.Tensor] = []
        args = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.has_first else ()
        run(*args, target=targets if self.has_last else None, losses=losses)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if self.has_last else \
            torch.zeros((), device=targets.device)
        if self.layout.size("pp") > 1:
            dist.broadcast(total, src=self.last_rank, group=self.group)
        return total

    def train_step(self, inputs: StageInput, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients stay in the engine for ``engine.step()``."""
        if self.timeline is not None:
            self.timeline.next_step()
        with deferred_grad_reduction(self.engine):
            loss = self._run(self.schedule.step, inputs, targets)
            if self.overlap is not None:
                self.overlap.finish()  # the sends it issued itself
            return loss

    @torch.no_grad()
    def evaluate(self, inputs: StageInput, targets: torch.Tensor) -> torch.Tensor:
        """Forward only; the mean loss over the micro-batches on every rank."""
        if self.timeline is not None:
            self.timeline.pause()
        return self._run(self.eval_schedule.eval, inputs, targets)


def name_actions(stage: PipelineStage) -> None:
    """Label ``stage``'s forward, backward and weight-gradient calls in a profiler's trace as torch's schedules that run
    a list of actions (``_PipelineScheduleRuntime``: interleaved 1F1B, looped BFS, the zero-bubble ones, DualPipeV)
    label theirs, ``PP:<stage><F|B|W><micro-batch>`` (``PP:0F1``), by torch's own function; GPipe and 1F1B label
    none (GPipe only ``Forward i``). While no profiler runs, a call costs one flag read more (no ``record_function``)."""
    for method, kind in ACTION_METHODS:
        original = getattr(stage, method)

        def named(chunk_id: int, *args: Any, _original=original, _kind=_ComputationType.from_str(kind),
                  **kwargs: Any) -> Any:
            if not autograd_profiler._is_profiler_enabled:
                return _original(chunk_id, *args, **kwargs)
            with record_function(_get_profiler_function_name(_Action(stage.stage_index, _kind, chunk_id))):
                return _original(chunk_id, *args, **kwargs)

        setattr(stage, method, named)


def stage_container(stages: dict[int, nn.Module]) -> nn.ModuleDict:
    """This rank's stage chunks in the one container the DeepSpeed engine wraps (keys: stage ids)."""
    return nn.ModuleDict({str(i): m for i, m in sorted(stages.items())})


def _without_routing_while_inferring_shapes(stage: PipelineStage) -> None:
    """The schedule's first step runs each stage once on made-up tensors to learn its output shapes: mixture-of-experts
    layers then pass their input through (same shape, no routing, no token exchange, no counts for the bias)."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    layers = moe_layers(stage.submod)
    if infer is None or not layers:
        return

    def inferring(*args: Any, **kwargs: Any) -> Any:
        with shapes_only(layers):
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = inferring
