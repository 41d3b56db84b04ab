"""GPU check (``make gpu-check`` runs it; never part of the test suite's timings): train llama3_1b (or another named
shape) in bf16-mixed on one GPU through Trainer(strategy=MGPUStrategy()) and print tokens/s and MFU against the bf16
matmul peak measured on the same device in the same run.

    python benchmarks/gpu_llama_mfu.py [--model llama3_1b] [--seq 2048] [--micro 4] [--steps 20]

``--smoke``: a tiny model for a few steps, on the CPU in fp32 when there is no GPU (the figure then measures
nothing); without ``--smoke`` it needs CUDA and says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.data import TokenFileDataModule
from lightning_mgpu.models import LlamaConfig
from smoke import SMOKE

ON_GPU = torch.cuda.is_available()
DEVICE, DTYPE = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float32)


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def measured_peak(n: int = 8192, iters: int = 20) -> float:
    """FLOP/s of a large matmul on this device in the run's dtype (the practical peak MFU is measured against)."""
    a = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    for _ in range(3):
        a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """6 N (weights, forward + backward) + 12 L d s (attention scores and values)."""
    return 6 * cfg.num_parameters() + 12 * cfg.n_layers * cfg.dim * seq


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps (CPU without a GPU)")
    args = parser.parse_args()
    if SMOKE:
        args.seq, args.micro, args.accum, args.steps = 32, 2, 1, 5
    return args


def main() -> int:
    args = arguments()
    if not (ON_GPU or SMOKE):
        print("gpu_llama_mfu.py needs CUDA (torch.cuda.is_available() is False); run it on a GPU, or with --smoke")
        return 2
    cfg = (LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64)
           if SMOKE else LlamaConfig.from_name(args.model, activation_checkpointing="full"
                                               if args.model != "llama3_1b" else "none"))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=200_000 if SMOKE else 5_000_000)
    path = Path(tempfile.mkdtemp()) / "tokens.u32"
    tokens.astype(np.uint32).tofile(path)
    dm = TokenFileDataModule(path, dtype="uint32", seq_len=args.seq, global_batch_size=args.micro * args.accum,
                             micro_batch_size=args.micro)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="gpu" if ON_GPU else "cpu", devices=1, strategy=MGPUStrategy(zero_stage=1),
                        precision="bf16-mixed" if ON_GPU else "32-true", max_steps=args.steps, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                        callbacks=[timer])
    trainer.fit(LLMModule(cfg, lr=3e-4, warmup_steps=2, max_steps=args.steps), dm)
    step = statistics.median(timer.times[min(3, len(timer.times) - 1):])
    tokens_per_step = args.micro * args.accum * args.seq
    tps = tokens_per_step / step
    peak = measured_peak(n=256 if SMOKE else 8192)
    mfu = tps * flops_per_token(cfg, args.seq) / peak
    memory = torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else float("nan")
    print(f"{'smoke' if SMOKE else args.model}: {cfg.num_parameters() / 1e9:.3f} B params, seq {args.seq}, "
          f"{tokens_per_step} tokens/step, {DEVICE}")
    print(f"median step {step * 1e3:.0f} ms, {tps:,.0f} tokens/s, measured peak {peak / 1e12:.1f} TFLOP/s, "
          f"MFU {mfu:.1%}, peak memory {memory:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
