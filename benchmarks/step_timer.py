"""The time between the ends of consecutive training steps, as the step-time benchmarks read it (a module of helpers,
not a benchmark: ``tests/benchmarks`` lists it among those run by no smoke test)."""

from __future__ import annotations

import time

import lightning as L

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
