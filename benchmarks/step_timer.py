"""The time between the ends of consecutive training steps, and where one step's time went, as the step-time
benchmarks read them (a module of helpers, not a benchmark: ``tests/benchmarks`` lists it among those run by no
smoke test)."""

from __future__ import annotations

import statistics
import time
from typing import Optional

import lightning as L
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mgpu import LLMModule


class QuietLLMModule(LLMModule):
    """The package's module without its per-step logging, as the benchmarks' transformers modules log nothing: the
    side by side times the same work."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass


class Timer(L.Callback):
    """Seconds from the end of one training batch to the end of the next (``times``; the first batch has none)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


class OpTimes(TorchDispatchMode):
    """Seconds spent in each kind of operator while active: ``matmuls`` (mm, addmm, bmm), ``attention`` (the fused
    scaled-dot-product kernels, forward and backward) and ``other`` (every other operator but the collectives'). A
    step's wall time minus their sum is what ran outside computing operators: the collectives and their waits, Python,
    the autograd engine, Lightning. A tensor subclass (DTensor) is timed as one operator with its dispatch, and with
    any collective its dispatch runs inside. Written as a dispatch mode rather than read from torch's profiler, whose
    tables are per operator: this sums them into the three buckets the benchmarks print, with no trace kept."""

    MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")
    COLLECTIVES = ("c10d.", "_c10d_functional.")

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {"matmuls": 0.0, "attention": 0.0, "other": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not name.startswith(self.COLLECTIVES):
            kind = ("matmuls" if name.startswith(self.MATMULS) else
                    "attention" if "scaled_dot_product" in name else "other")
            self.seconds[kind] += time.perf_counter() - start
        return out


class StepBreakdown(L.Callback):
    """:class:`OpTimes` over each training batch from ``first`` on, with that step's wall time (from the batch's start
    to its end): ``steps`` holds one ``(seconds by bucket, wall)`` a step, what :func:`breakdown_line` summarises."""

    def __init__(self, first: int) -> None:
        self.first, self.steps, self._start = first, [], 0.0
        self._ops: Optional[OpTimes] = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx >= self.first:
            self._ops, self._start = OpTimes(), time.perf_counter()
            self._ops.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.first:
            self._ops.__exit__(None, None, None)
            self.steps.append((self._ops.seconds, time.perf_counter() - self._start))


def breakdown_line(steps: list[tuple[dict, float]]) -> str:
    """The median over ``steps`` (each ``(OpTimes.seconds, wall)``) of each bucket, of what ran outside operators and
    of the step: ``matmuls X s, attention Y s, other operators Z s, outside operators W s (step S s)``."""
    medians = {name: statistics.median(seconds[name] for seconds, _ in steps) for name in steps[0][0]}
    outside = statistics.median(wall - sum(seconds.values()) for seconds, wall in steps)
    step = statistics.median(wall for _, wall in steps)
    parts = [f"{name if name != 'other' else 'other operators'} {s:.3f} s" for name, s in medians.items()]
    return ", ".join(parts + [f"outside operators {outside:.3f} s (step {step:.3f} s)"])
