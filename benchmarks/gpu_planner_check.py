"""Planner against measurement on one GPU (needs CUDA; run on the lent H200): predicted vs measured peak memory and
step time for a Llama sized to fill the GPU, single process, bf16-mixed, ZeRO-0. Prints both ratios.

    python benchmarks/gpu_planner_check.py [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner import ClusterSpec, estimate_memory, estimate_step_time
from lightning_mgpu.planner.hardware import gpu_by_device_name

# ~1.5B parameters; at micro-batch 4 x 4096 with full recompute it fills most of a 141 GB H200.
MODEL = LlamaConfig(dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=8192, vocab_size=32000,
                    max_seq_len=4096, activation_checkpointing="full")
SEQ, MICRO = 4096, 4


class Random(Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, MODEL.vocab_size, (SEQ + 1,))


class Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    steps = parser.parse_args().steps
    gpu = gpu_by_device_name(torch.cuda.get_device_name())
    timer = Timer()
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MGPUStrategy(zero_stage=0), precision="bf16-mixed",
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0, callbacks=[timer])
    trainer.fit(LLMModule(MODEL), DataLoader(Random(), batch_size=MICRO))
    measured_mem, measured_time = torch.cuda.max_memory_allocated(), statistics.median(timer.times[2:])
    mem = estimate_memory(MODEL, SEQ, MICRO, tp=1, pp=1, dp=1, zero_stage=0, recompute=True)
    step = estimate_step_time(MODEL, ClusterSpec(1, 1, gpu), SEQ, MICRO, MICRO, tp=1, pp=1, zero_stage=0,
                              recompute=True)
    print(f"{torch.cuda.get_device_name()}: {MODEL.num_parameters() / 1e9:.2f}B params, micro-batch {MICRO}x{SEQ}")
    print(f"peak memory: predicted {mem.total / 1e9:.1f} GB, measured {measured_mem / 1e9:.1f} GB, "
          f"ratio {mem.total / measured_mem:.2f}")
    print(f"step time: predicted {step.total:.3f} s (at 50% of peak), measured {measured_time:.3f} s, "
          f"ratio {step.total / measured_time:.2f}")


if __name__ == "__main__":
    main()
