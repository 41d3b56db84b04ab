"""``comm/*`` metrics: the bytes and calls of every collective a training step issues, by axis and operation.

The step is what runs between Lightning's ``on_train_batch_start`` and ``on_train_batch_end``: the forward and
backward passes (a pipeline schedule's included) and the optimizer step with its ZeRO collectives. Counting is
:class:`~lightning_mgpu.parallel.comm_count.CommCounter`; it runs only where this callback is given (the switch), and
costs nothing where it is not.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L

from lightning_mgpu.parallel.comm_count import CommCount, CommCounter


class CommunicationCounter(L.Callback):
    """Logs ``comm/<axis>/<op>_bytes`` and ``comm/<axis>/<op>_calls`` of this rank every step, and ``comm/bytes``
    in all; ``last`` holds the latest step's :class:`~lightning_mgpu.parallel.comm_count.CommCount` and ``steps``
    every step's table (``keep_steps=True``). Axes are the layout's groups (``tp``, ``cp``, ``pp``, ``dp_cp``,
    ``ep``, ``edp``, ``mp``, ``rep``, ``replica``) and ``world``."""

    def __init__(self, log: bool = True, keep_steps: bool = False) -> None:
        self.log, self.keep_steps = log, keep_steps
        self.last: Optional[CommCount] = None
        self.steps: list[dict] = []
        self._mode: Optional[CommCounter] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._mode = CommCounter()
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._mode is None:
            return
        self._stop()
        if self.keep_steps:
            self.steps.append(self.last.table())
        if self.log:
            metrics = {f"comm/{name}_{kind}": float(entry[kind]) for name, entry in self.last.table().items()
                       for kind in ("bytes", "calls")}
            pl_module.log_dict({**metrics, "comm/bytes": float(self.last.bytes())}, on_step=True, on_epoch=False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._mode is not None:
            self._stop()

    def _stop(self) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.last = mode.count
