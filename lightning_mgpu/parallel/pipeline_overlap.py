"""DualPipeV's paired actions overlapped: one micro-batch's forward and another's backward run at once, on two threads.

torch's ``ScheduleDualPipeV`` pairs a forward on one of the rank's two stages with a full backward on the other
(``OVERLAP_F_B``) but runs the pair one after the other unless a function is registered for it
(``_PipelineScheduleRuntime.register_custom_function``). :class:`OverlappedForwardBackward` is that function: the
forward runs on the schedule's thread, the backward on a second one, and each thread's expert all-to-alls wait in gloo
while the other computes (on GPUs both threads queue kernels on one stream: what that overlaps is unmeasured); the forward's pipeline send leaves as soon as the forward ends, under the
backward's remaining work.

Deadlock-free and exact by construction. Two threads issuing collectives on one group could issue them in different
orders on different ranks (a hang, or tensors of equal shape swapped). Here no group is shared between the threads:

- every collective a backward pass issues (autograd running; a forward recomputed there under activation
  checkpointing included, by the same rule, untested) goes over a twin of its
  group (``ExpertWiring.backward_groups``, created once for the expert-parallel and data x context groups), every
  other one over the layout's own group. At most one backward and one forward run at a time, so each group's
  collectives come from one thread, in the schedule's order, which is the same on every rank of the group;
- the pipeline's sends are issued on the schedule's thread only, the forward's before the backward's: the order torch
  lowers them in and its receivers post their receives in (the backward's send waits for the forward's when it ends
  first).

torchtitan's overlap for DeepSeek V3 instead keeps one group and makes the two threads take turns at a two-party
barrier around each dispatch and combine, so that one computes while the other communicates; its order of collectives
rests on the threads meeting at every barrier, and it refuses activation checkpointing. Twin groups cost one more
communicator per group and need no turn-taking. Every parameter's gradient is summed in the same order as
sequentially (the two actions run on different stages), so the result is the sequential schedule's bit for bit.

Where it applies (:func:`overlap_problems`): ``dualpipev`` (torch's zero-bubble schedules emit no ``OVERLAP_F_B``
action; fusing their forwards and input-gradient steps would be a schedule of our own) with expert parallelism, whose
all-to-alls are what a backward can hide, and without tensor or context parallelism or ZeRO-3, whose collectives the
layers issue on groups this module does not twin. There it is on by default on an accelerator and off on CPU
(:func:`overlap_for`); ``Pipeline.overlap.enable(on)`` switches it between steps.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    _Action,
    _batch_p2p,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.experts import ExpertWiring

OVERLAP_F_B, SEND_F, SEND_B = _ComputationType.OVERLAP_F_B, _ComputationType.SEND_F, _ComputationType.SEND_B
#: The groups a mixture-of-experts layer communicates on that get a twin for backward passes.
TWINNED = ("ep", "dp_cp")


def overlap_problems(layout: ParallelLayout) -> list[str]:
    """Why the forward / backward overlap does not apply to ``layout`` (empty: it does)."""
    out = []
    if layout.pipeline_schedule != "dualpipev":
        out.append(f"pipeline_schedule={layout.pipeline_schedule!r} pairs no forward with a backward (dualpipev does)")
    if layout.size("ep") == 1:
        out.append("expert_parallel_size=1: no all-to-all for the other action to hide")
    for axis, name in (("tp", "tensor_parallel_size"), ("cp", "context_parallel_size")):
        if layout.size(axis) > 1:
            out.append(f"{name}={layout.size(axis)}: its layers' collectives share one group between the threads")
    if layout.zero_stage == 3:
        out.append("zero_stage=3 gathers parameters over one group from both threads")
    return out


def twin_groups(layout: ParallelLayout, timeout: Any = None) -> dict[str, Any]:
    """This rank's twin of each group in :data:`TWINNED` (a second communicator over the same ranks). Collective over
    the world: every rank calls it, in the same order."""
    twins: dict[str, Any] = {}
    me = dist.get_rank()
    for axis in TWINNED:
        for ranks in layout.group_ranks(axis):
            group = dist.new_group(ranks, timeout=timeout, group_desc=axis)  # counted on its axis
            if me in ranks:
                twins[axis] = group
    return twins


class OverlappedForwardBackward:
    """The function torch's runtime calls for each ``OVERLAP_F_B`` action of ``schedule`` (module docstring)."""

    def __init__(self, schedule: _PipelineScheduleRuntime, modules: list[torch.nn.Module],
                 twins: dict[str, Any]) -> None:
        self.schedule, self.twins = schedule, twins
        self.wirings = expert_wirings(modules)
        self.sequential_order = schedule.pipeline_order_with_comms
        self.sends: list[dist.Work] = []
        self.overlapped = 0  #: pairs run on two threads so far
        self.backward_threads: set[int] = set()  #: idents of the threads the paired backwards ran on
        self.enabled = False

    def enable(self, on: bool = True) -> None:
        """Register (or remove) the overlap; removed, the schedule is torch's own again (sequential pairs). Call it
        between steps, on every rank of the pipeline alike."""
        rank = self.schedule.rank
        functions = self.schedule._comp_type_to_function_map
        if on:
            order = dict(self.sequential_order)
            order[rank] = folded_sends(self.sequential_order[rank])
            self.schedule.pipeline_order_with_comms = order
            functions[OVERLAP_F_B] = self
        else:
            self.schedule.pipeline_order_with_comms = self.sequential_order
            functions.pop(OVERLAP_F_B, None)
        for wiring in self.wirings:
            wiring.backward_groups = dict(self.twins) if on else {}
        self.enabled = on

    def finish(self) -> None:
        """Wait for the sends this step issued (torch's runtime waits for its own at the end of a step)."""
        while self.sends:
            _wait_batch_p2p(self.sends.pop())

    def __call__(self, action: _Action, ctx: _PipelineContext) -> None:
        forward, backward = action.sub_actions
        stages = {stage.stage_index: stage for stage in self.schedule._stages}
        errors: list[BaseException] = []
        modes = _get_current_dispatch_mode_stack()  # thread-local: the communication counter, say
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None
        thread = threading.Thread(target=self._backward, args=(backward, stages, modes, stream, errors),
                                  name="mgpu-overlap-backward")
        thread.start()
        try:
            self._forward(forward, stages, ctx)
        finally:
            thread.join()
        if errors:
            raise errors[0]
        self._send(stages[backward.stage_index], backward)
        self.overlapped += 1

    def _forward(self, action: _Action, stages: dict, ctx: _PipelineContext) -> None:
        """torch's ``FORWARD`` branch, then this action's send at once."""
        schedule, stage, mb = self.schedule, stages[action.stage_index], action.microbatch_index
        if not stage.is_first and action.stage_index - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((action.stage_index, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if action.stage_index + 1 in stages:
            stages[action.stage_index + 1].set_local_fwd_input(output, mb)
        self._send(stage, action)

    def _backward(self, action: _Action, stages: dict, modes: list, stream: Any, errors: list) -> None:
        """torch's ``FULL_BACKWARD`` branch, on this thread; an error is handed to the schedule's thread. On a GPU it
        runs on the schedule thread's device and stream (both are per thread), so its kernels queue behind the
        forward's in issue order and read nothing early."""
        try:
            if stream is not None:
                torch.accelerator.set_device_index(stream.device.index)
                torch.accelerator.set_stream(stream)
            with contextlib.ExitStack() as entered:
                for mode in modes:
                    entered.enter_context(mode)
                self.backward_threads.add(threading.get_ident())
                self._full_backward(action, stages)
        except BaseException as error:  # raised again on the schedule's thread
            errors.append(error)

    def _full_backward(self, action: _Action, stages: dict) -> None:
        schedule, stage, mb = self.schedule, stages[action.stage_index], action.microbatch_index
        if not stage.is_last and action.stage_index + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((action.stage_index, mb)))
        schedule.backward_counter[action.stage_index] += 1
        last = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=schedule._maybe_get_loss(stage, mb), full_backward=True, last_backward=last)
        if action.stage_index - 1 in stages:
            stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def _send(self, stage: Any, action: _Action) -> None:
        """The send torch lowers right after the pair for ``action``: where the neighbour stage it feeds (the next
        one's input, the previous one's gradient) is on another rank."""
        forward = action.computation_type == _ComputationType.FORWARD
        if (stage.is_last if forward else stage.is_first) or self._local(stage.stage_index + (1 if forward else -1)):
            return
        mb = action.microbatch_index
        self.sends.append(_batch_p2p(stage.get_fwd_send_ops(mb) if forward else stage.get_bwd_send_ops(mb)))

    def _local(self, stage_index: int) -> bool:
        return any(stage.stage_index == stage_index for stage in self.schedule._stages)


def expert_wirings(modules: list[torch.nn.Module]) -> list[ExpertWiring]:
    """Every expert exchange in ``modules``: the package's mixture-of-experts layers' and those set on a transformers
    experts module (``mgpu_exchange``), so that none keeps sharing its groups between the threads."""
    found = []
    for module in modules:
        for sub in module.modules():
            for wiring in (getattr(sub, "wiring", None), getattr(getattr(sub, "mgpu_exchange", None), "wiring", None)):
                if isinstance(wiring, ExpertWiring) and wiring not in found:
                    found.append(wiring)
    return found


def folded_sends(actions: list[_Action]) -> list[_Action]:
    """``actions`` without the sends that follow each ``OVERLAP_F_B`` action for its own sub-actions (torch lowers
    them right after it; :class:`OverlappedForwardBackward` issues them itself, in the same order)."""
    out: list[_Action] = []
    owned: set[tuple[int, Any, Optional[int]]] = set()
    for action in actions:
        if action.computation_type == OVERLAP_F_B:
            owned = {(a.stage_index, SEND_F if a.computation_type == _ComputationType.FORWARD else SEND_B,
                      a.microbatch_index) for a in action.sub_actions}
            out.append(action)
            continue
        key = (action.stage_index, action.computation_type, action.microbatch_index)
        if key in owned:
            owned.discard(key)
            continue
        owned = set()
        out.append(action)
    return out


def overlap_for(schedule: Any, layout: ParallelLayout, modules: list[torch.nn.Module],
                device: torch.device) -> Optional[OverlappedForwardBackward]:
    """The overlap of ``schedule``'s paired actions where it applies to ``layout`` (else None), switched on where it
    helps: on an accelerator. On CPU it is built but off: the two threads compete for the cores the other ranks compute
    on (measured 1.2x slower a step, ``benchmarks/pipeline_overlap.py``); ``enable()`` turns it on. Every rank calls
    this, in the same order (it creates process groups)."""
    if overlap_problems(layout):
        return None
    backend = layout.group("ep")._get_backend(torch.device(device.type))
    overlap = OverlappedForwardBackward(schedule, modules, twin_groups(layout, backend.options._timeout))
    overlap.enable(device.type != "cpu")
    return overlap
