"""GPU check (run on a lent accelerator, never in the test suite): train llama3_1b (or the largest named
shape that fits) in bf16-mixed on one GPU through Trainer(strategy=MGPUStrategy()) and print tokens/s and
MFU against the bf16 matmul peak measured on the same device in the same run.

    python benchmarks/gpu_llama_mfu.py [--model llama3_1b] [--seq 2048] [--micro 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.data import TokenFileDataModule
from lightning_mgpu.models import LlamaConfig


def measured_bf16_peak(n: int = 8192, iters: int = 20) -> float:
    """FLOP/s of a large bf16 matmul on this device (the practical peak MFU is measured against)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """6 N (weights, forward + backward) + 12 L d s (attention scores and values)."""
    return 6 * cfg.num_parameters() + 12 * cfg.n_layers * cfg.dim * seq


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cfg = LlamaConfig.from_name(args.model, activation_checkpointing="full" if args.model != "llama3_1b" else "none")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=5_000_000).astype(np.uint32)
    path = Path(tempfile.mkdtemp()) / "tokens.u32"
    tokens.tofile(path)
    dm = TokenFileDataModule(path, dtype="uint32", seq_len=args.seq, global_batch_size=args.micro * args.accum,
                             micro_batch_size=args.micro)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MGPUStrategy(zero_stage=1), precision="bf16-mixed",
                        max_steps=args.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, callbacks=[timer])
    trainer.fit(LLMModule(cfg, lr=3e-4, warmup_steps=2, max_steps=args.steps), dm)
    step = statistics.median(timer.times[3:])
    tokens_per_step = args.micro * args.accum * args.seq
    tps = tokens_per_step / step
    peak = measured_bf16_peak()
    mfu = tps * flops_per_token(cfg, args.seq) / peak
    print(f"{args.model}: {cfg.num_parameters() / 1e9:.2f} B params, seq {args.seq}, {tokens_per_step} tokens/step")
    print(f"median step {step * 1e3:.0f} ms, {tps:,.0f} tokens/s, measured bf16 peak {peak / 1e12:.0f} TFLOP/s, "
          f"MFU {mfu:.1%}, peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
