"""Planner against measurement on one GPU (``make gpu-check`` runs it): predicted vs measured peak memory and step time
of a Llama sized to fill most of the GPU, one process, bf16-mixed, ZeRO-0, with no, selective and full activation
recomputation. Prints one line per mode with both ratios (predicted / measured).

    python benchmarks/gpu_planner_check.py [--steps 8] [--modes none,selective,full]

``--smoke``: a tiny model for a few steps, on the CPU in fp32 when there is no GPU (its memory figure is then this
process's resident growth, which the GPU estimate does not model); without ``--smoke`` it needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.planner import ClusterSpec, estimate_memory, estimate_step_time
from lightning_mgpu.planner.hardware import GPUS, gpu_by_device_name
from lightning_mgpu.testing import resident_bytes
from smoke import SMOKE, sized

ON_GPU = torch.cuda.is_available()
# ~1.5B parameters; at micro-batch 2 x 4096 it fits an 80 GB GPU without recomputation and a 141 GB H200 with room.
MODEL = sized(LlamaConfig(dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=8192, vocab_size=32000,
                          max_seq_len=4096),
              LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64))
SEQ, MICRO = sized((4096, 2), (32, 2))


class Random(Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, MODEL.vocab_size, (SEQ + 1,))


class Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        if ON_GPU:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        if ON_GPU:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def measure(model: LlamaConfig, steps: int) -> tuple[float, float]:
    """(peak bytes: allocated on the GPU, or resident growth on CPU; median step seconds after two)."""
    if ON_GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before, timer = resident_bytes(), Timer()
    trainer = L.Trainer(accelerator="gpu" if ON_GPU else "cpu", devices=1, strategy=MGPUStrategy(zero_stage=0),
                        precision="bf16-mixed" if ON_GPU else "32-true", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0, callbacks=[timer])
    trainer.fit(LLMModule(model), DataLoader(Random(), batch_size=MICRO))
    peak = torch.cuda.max_memory_allocated() if ON_GPU else resident_bytes("VmHWM") - before
    return float(peak), statistics.median(timer.times[min(2, len(timer.times) - 1):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", default="none,selective,full")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps (CPU without a GPU)")
    args = parser.parse_args()
    if not (ON_GPU or SMOKE):
        print("gpu_planner_check.py needs CUDA (torch.cuda.is_available() is False); run it on a GPU, or with --smoke")
        return 2
    gpu = gpu_by_device_name(torch.cuda.get_device_name()) if ON_GPU else GPUS["h100_80gb"]
    name = torch.cuda.get_device_name() if ON_GPU else "CPU (smoke: the GPU estimates beside CPU figures)"
    print(f"{name}: {MODEL.num_parameters() / 1e9:.2f}B params, micro-batch {MICRO}x{SEQ}, bf16-mixed, ZeRO-0")
    print("| recomputation | memory predicted GB | measured GB | ratio | step predicted s | measured s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        measured_mem, measured_time = measure(replace(MODEL, activation_checkpointing=mode), 3 if SMOKE else args.steps)
        mem = estimate_memory(MODEL, SEQ, MICRO, tp=1, pp=1, dp=1, zero_stage=0, recompute=mode == "full", mode=mode,
                              overlap=True)
        step = estimate_step_time(MODEL, ClusterSpec(1, 1, gpu), SEQ, MICRO, MICRO, tp=1, pp=1, zero_stage=0,
                                  recompute=mode == "full", selective=mode == "selective")
        print(f"| {mode} | {mem.total / 1e9:.1f} | {measured_mem / 1e9:.1f} | {mem.total / measured_mem:.2f} | "
              f"{step.total:.3f} | {measured_time:.3f} | {step.total / measured_time:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
