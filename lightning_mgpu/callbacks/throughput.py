"""Throughput that counts each token once: tokens/s per data-parallel replica set, TFLOP/s per GPU, MFU.

Lightning's own throughput utilities multiply per-device figures by the world size, which is right for
pure data parallelism only: with tensor or pipeline parallelism several ranks share one micro-batch, and
naive scaling overcounts tokens by ``tp x pp``. Here tokens per step are this rank's batch times the
number of data-parallel replicas (from ``strategy.layout``), FLOPs per token come from the module
(``flops_per_token(seq_len)``) and the peak from the GPU (``lightning_mgpu.planner.hardware``) or the argument.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import lightning as L
import torch

from lightning_mgpu.contract import parallel_context
from lightning_mgpu.planner.hardware import gpu_by_device_name


@dataclass(frozen=True)
class Throughput:
    tokens_per_second: float
    tflops_per_gpu: float
    mfu: Optional[float]


def throughput(tokens_per_rank_batch: int, data_parallel_size: int, world_size: int, seconds: float,
               flops_per_token: float, peak_flops: Optional[float]) -> Throughput:
    """Figures of one optimizer step: ``tokens_per_rank_batch`` tokens went through each replica's ranks."""
    tokens = tokens_per_rank_batch * data_parallel_size
    flops_per_gpu = tokens * flops_per_token / world_size / seconds
    return Throughput(tokens / seconds, flops_per_gpu / 1e12, flops_per_gpu / peak_flops if peak_flops else None)


class ThroughputCallback(L.Callback):
    """Logs ``perf/tokens_per_s``, ``perf/tflops_per_gpu``, ``perf/mfu`` (when the peak is known) and, on CUDA,
    ``perf/peak_memory_gb`` of this rank, every step; tokens/s and MFU also in the progress bar.

    Args:
        peak_flops: bf16 peak FLOP/s of one device; default: looked up from the CUDA device name.
    """

    def __init__(self, peak_flops: Optional[float] = None) -> None:
        self.peak_flops = peak_flops
        self._start: Optional[float] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.peak_flops is None and torch.cuda.is_available():
            spec = gpu_by_device_name(torch.cuda.get_device_name())
            self.peak_flops = spec.bf16_peak_flops if spec else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._start is None or not isinstance(batch, torch.Tensor):
            return
        seconds = time.perf_counter() - self._start
        context = parallel_context(pl_module)
        replicas = context.data_ranks if context is not None else trainer.world_size
        seq = max(1, batch.shape[-1] - 1)  # token windows carry one extra token for the targets
        tokens = batch.shape[0] * seq
        flops_fn = getattr(pl_module, "flops_per_token", None)
        flops = float(flops_fn(seq)) if callable(flops_fn) else 0.0
        t = throughput(tokens, replicas, trainer.world_size, seconds, flops, self.peak_flops)
        pl_module.log("perf/tokens_per_s", t.tokens_per_second, prog_bar=True, on_step=True)
        if flops:
            pl_module.log("perf/tflops_per_gpu", t.tflops_per_gpu, on_step=True)
        if t.mfu is not None and flops:
            pl_module.log("perf/mfu", t.mfu, prog_bar=True, on_step=True)
        if torch.cuda.is_available():
            pl_module.log("perf/peak_memory_gb", torch.cuda.max_memory_allocated() / 1e9, on_step=True)
