"""Each rank's ``torch.profiler`` trace and memory snapshot of chosen training steps (``mgpu-train profile.steps=[5]``).

For every chosen step ``N`` (a global step: optimizer steps done before it, counted from 0, as ``metrics.csv`` and the
pipeline timeline count them) every rank writes into ``<dir>/step{N}/``:

* ``rank{R}.trace.json``: the profiler's trace in Chrome's trace format, which https://ui.perfetto.dev and
  ``chrome://tracing`` open. It spans the whole optimizer step (every batch of it when ``accumulate_grad_batches`` > 1,
  under one ``ProfilerStep#N`` range, torch's own name for a step), with the operators' input shapes and the memory
  they allocate and free. Collectives carry the names torch gives them (``gloo:all_reduce``, ``nccl:all_reduce``,
  ``c10d::allreduce_``, ``gloo:send``...); pipeline actions are ``PP:<stage><F|B|W><micro-batch>`` (``PP:1B3``: stage
  1's backward of micro-batch 3), torch's own labels for the schedules that run actions from a list, and the same
  labels set by :func:`lightning_mgpu.parallel.pipeline.name_actions` for GPipe and 1F1B, which torch leaves unnamed.
* ``rank{R}.memory.json``: the memory of the step, written by this module on every device: the peak resident memory of
  the process during the step (Linux ``VmHWM``, reset when the step starts; the process's peak so far beside it), the
  live tensors' count and bytes when the step ends and the largest of them (named where the tensor is a parameter, a
  gradient or an optimizer's tensor; shape, dtype, device, bytes), and on CUDA the allocator's peaks since the
  process started. It is hand-written because torch has no snapshot of host memory: ``torch.cuda.memory`` records
  CUDA allocations only, and the profiler's CPU memory events are in the trace, one event per allocation, with no
  summary of what is alive.
* ``rank{R}.memory.pickle`` (CUDA only): the CUDA caching allocator's snapshot
  (``torch.cuda.memory._record_memory_history`` started at the step's start, ``_dump_snapshot`` at its end), which
  https://pytorch.org/memory_viz draws as the step's memory over time, each allocation with the stack that made it.

Why not Lightning's ``PyTorchProfiler`` (``Trainer(profiler=...)``): it chooses steps with a ``torch.profiler.schedule``
counted in ``training_step`` calls (batches, not optimizer steps, under gradient accumulation; by default it records
the third to fifth calls of every stage, validation's too), names its files by stage, action and *local* rank (the
ranks of two nodes writing into one run directory collide), registers a forward hook on every module to name them,
and records no allocator snapshot. Here the profiler exists only from the first batch of a chosen optimizer step to its
last one, the files are named by global step and global rank, and a run without ``profile.steps`` adds no callback.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile, record_function


class ProfileSteps(L.Callback):
    """Profile the training steps ``steps`` (global step numbers) on every rank, writing into ``directory``.

    Args:
        steps: global steps to profile (0 is the first step of a run that starts from scratch).
        directory: where ``step{N}/rank{R}.*`` go (``mgpu-train``: ``<run dir>/profile``).
        record_shapes: record each operator's input shapes.
        with_stack: record the Python stack of each operator (larger traces, slower steps).
        largest_tensors: how many of the largest live tensors the memory file lists.
    """

    def __init__(self, steps: Iterable[int], directory: str | Path, record_shapes: bool = True,
                 with_stack: bool = False, largest_tensors: int = 20) -> None:
        self.steps = sorted({int(s) for s in steps})
        self.directory = Path(directory)
        self.record_shapes, self.with_stack, self.largest_tensors = record_shapes, with_stack, largest_tensors
        self._profiler: Optional[profile] = None
        self._range: Optional[record_function] = None
        self._step = -1
        self._cuda = False
        self._step_peak = False
        self._process_peak = 0

    # -------------------------------------------------------------------------------------------- Lightning's hooks
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._profiler is None and trainer.global_step in self.steps:
            self._start(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._profiler is not None and trainer.global_step > self._step:  # the optimizer step has run
            self._finish(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()  # a run stopped inside a chosen step (max_time, a signal): nothing is written

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    # -------------------------------------------------------------------------------------------- the profiler
    def _start(self, trainer: L.Trainer) -> None:
        self._step = trainer.global_step
        self._cuda = trainer.strategy.root_device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        if self._cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        before = resident_bytes("VmHWM")  # the process's peak so far, which the reset below forgets
        self._process_peak = max(self._process_peak, before or 0)
        self._step_peak = reset_peak_resident()
        self._profiler = profile(activities=activities, record_shapes=self.record_shapes, profile_memory=True,
                                 with_stack=self.with_stack)
        self._profiler.start()
        self._range = record_function(f"ProfilerStep#{self._step}")
        self._range.__enter__()

    def _stop(self) -> None:
        if self._profiler is None:
            return
        self._range.__exit__(None, None, None)
        self._profiler.stop()
        if self._cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        self._profiler = self._range = None

    def _finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        profiler, step, rank = self._profiler, self._step, trainer.global_rank
        out = self.directory / f"step{step}"
        out.mkdir(parents=True, exist_ok=True)
        if self._cuda:
            torch.cuda.synchronize()  # the step's kernels end inside its range
        self._range.__exit__(None, None, None)
        # before the profiler's own post-processing and the scan below
        resident = {field: resident_bytes(field) for field in ("VmHWM", "VmRSS")}
        profiler.stop()
        if self._cuda:
            torch.cuda.memory._dump_snapshot(str(out / f"rank{rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._process_peak = max(self._process_peak, resident["VmHWM"] or 0)
        memory = step_memory(step, rank, resident, self._step_peak, self._process_peak,
                             tensor_names(pl_module, trainer.optimizers), self.largest_tensors)
        if self._cuda:  # since the process started: the snapshot shows the step's own
            memory["cuda"] = {"snapshot": f"rank{rank}.memory.pickle",
                              "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                              "max_reserved_bytes": torch.cuda.max_memory_reserved()}
        profiler.export_chrome_trace(str(out / f"rank{rank}.trace.json"))
        (out / f"rank{rank}.memory.json").write_text(json.dumps(memory, indent=1) + "\n")
        self._profiler = self._range = None
        if trainer.is_global_zero:
            print(f"profile of step {step}: {out}/rank*.trace.json (open in https://ui.perfetto.dev), "
                  f"rank*.memory.json{', rank*.memory.pickle (https://pytorch.org/memory_viz)' if self._cuda else ''}")


# ------------------------------------------------------------------------------------------------ memory
def reset_peak_resident() -> bool:
    """Start a new peak of this process's resident memory (Linux ``clear_refs``: ``VmHWM`` becomes ``VmRSS``); False
    where that is not possible, and ``VmHWM`` stays the process's lifetime peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def resident_bytes(field: str) -> Optional[int]:
    """``VmRSS`` or ``VmHWM`` of this process from ``/proc/self/status``, in bytes; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tensor_names(module: torch.nn.Module, optimizers: Iterable[Any] = ()) -> dict[int, str]:
    """``{id(tensor): name}`` of what a memory file can name: the module's parameters and their gradients, and each
    optimizer's parameters and states (``layers.0.attention.wq.weight.exp_avg``; a tensor the optimizer steps that is no
    parameter of the module, such as DeepSpeed ZeRO's flat fp32 partition, as ``optimizer 0 group 0 tensor 0``)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        if p.grad is not None:
            names[id(p.grad)] = f"{name}.grad"
    for o, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", None)  # Lightning's and DeepSpeed's wrappers hold torch's optimizer
        optimizer = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        for g, group in enumerate(getattr(optimizer, "param_groups", ())):
            for i, p in enumerate(group.get("params", ())):
                names.setdefault(id(p), f"optimizer {o} group {g} tensor {i}")
        state = getattr(optimizer, "state", None)
        for key, values in (state.items() if isinstance(state, dict) else ()):
            owner = names.get(id(key))
            for what, value in (values.items() if owner is not None and isinstance(values, dict) else ()):
                if isinstance(value, torch.Tensor):
                    names.setdefault(id(value), f"{owner}.{what}")
    return names


def live_tensors(names: dict[int, str]) -> list[dict]:
    """Every storage held by a live tensor, once, as ``{name, shape, dtype, device, bytes}``: the shape and dtype of
    the tensor with the most elements that holds it, the storage's bytes, and the name :func:`tensor_names` gives that
    tensor, or where it has none but views of the same storage are named (DeepSpeed's flat buffer of parameters),
    ``views: <the first>, ... (N named)``. A garbage collector scan after a collection, since neither torch nor Python
    lists the tensors alive. Meta tensors and wrappers without a storage of their own (a DTensor: its local shard is counted) are left
    out."""
    found: dict[tuple[str, int], list] = {}  # storage -> [largest tensor, bytes, names of its named views]
    gc.collect()  # tensors held only by unreachable cycles are not alive, though the collector still lists them
    with warnings.catch_warnings():  # isinstance on every object touches deprecated ones (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key, size = (str(obj.device), storage.data_ptr()), storage.nbytes()
        except Exception:  # noqa: BLE001 - subclasses without a storage (DTensor) or an unusable one
            continue
        if size == 0:
            continue
        held = found.setdefault(key, [obj, size, []])
        if id(obj) in names:
            held[2].append(names[id(obj)])
        if obj.numel() > held[0].numel() or (obj.numel() == held[0].numel() and id(obj) in names):
            held[0] = obj
    out = []
    for tensor, size, named in found.values():
        name = names.get(id(tensor), "")
        if not name and named:
            name = f"views: {', '.join(sorted(named)[:3])}{', ...' if len(named) > 3 else ''} ({len(named)} named)"
        out.append({"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                    "device": str(tensor.device), "bytes": size})
    return out


def step_memory(step: int, rank: int, resident: dict[str, Optional[int]], step_peak: bool, process_peak: int,
                names: dict[int, str], largest: int) -> dict:
    """The memory file's contents (see the module docstring): ``resident`` holds ``VmHWM`` and ``VmRSS`` at the step's
    end, ``VmHWM`` since the step's start when ``step_peak``; ``process_peak`` the largest ``VmHWM`` seen before any
    reset and since. Without ``/proc`` (not Linux) both peaks are ``getrusage``'s, the process's. The tensors are those
    alive now."""
    tensors = sorted(live_tensors(names), key=lambda t: -t["bytes"])
    peak = resident["VmHWM"]
    if peak is None:
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = process_peak = usage if sys.platform == "darwin" else usage * 1024  # macOS counts bytes, Linux KiB
    return {
        "step": step, "rank": rank,
        "peak_resident_bytes": peak, "peak_resident_scope": "step" if step_peak and resident["VmHWM"] else "process",
        "process_peak_resident_bytes": process_peak,
        "resident_bytes": resident["VmRSS"],
        "live_tensors": len(tensors), "live_tensor_bytes": sum(t["bytes"] for t in tensors),
        "largest_tensors": tensors[:largest],
    }


# ------------------------------------------------------------------------------------------------ reading
def merge_traces(step_dir: str | Path) -> Path:
    """Every rank's trace of one profiled step in one file, ``all.trace.json`` beside them, to see the ranks one above
    the other in Perfetto (which opens one file at a time). Each rank's processes are renamed ``rank R ...`` and
    numbered ``1000 R + i`` (ranks of two machines may share a process id), flow arrows stay within their rank. Times
    are the profiler's own: one clock for the processes of one machine; across machines, as far apart as their clocks.
    It holds every trace in memory at once."""
    step_dir = Path(step_dir)
    traces = sorted(step_dir.glob("rank*.trace.json"), key=lambda p: int(p.name.split(".")[0].removeprefix("rank")))
    if not traces:
        raise FileNotFoundError(f"no rank*.trace.json in {step_dir}: give a profile/step<N> directory")
    events: list = []
    for path in traces:
        rank = int(path.name.split(".")[0].removeprefix("rank"))
        pids: dict = {}
        for e in json.loads(path.read_text())["traceEvents"]:
            if "pid" in e:
                e["pid"] = pids.setdefault(e["pid"], 1000 * rank + len(pids))
            if e.get("ph") in ("s", "t", "f") and "id" in e:
                e["id"] = f"{rank}:{e['id']}"
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"]["name"] = f"rank {rank} {e['args'].get('name', '')}".strip()
            elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"]["sort_index"] = e["pid"]
            events.append(e)
    out = step_dir / "all.trace.json"
    out.write_text(json.dumps({"displayTimeUnit": "ms", "traceEvents": events}))
    return out
