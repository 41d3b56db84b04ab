"""GPU check (``make gpu-check`` runs it; never part of the test suite's timings): fp8 matmuls against bf16 on one GPU,
side by side in one run. The same model, data and steps through Trainer(strategy=MGPUStrategy()) in bf16-mixed, then
in bf16-mixed with ``MGPUPrecision(fp8="rowwise")`` (torchao's fp8 kernels), then ``fp8="tensorwise"``; prints each
one's median step time and tokens/s, and fp8's speed-up over bf16 beside what to expect: +10-25 % at 1B-8B (torchao's
Llama-3 8B table: +11.5 % rowwise, +21 % tensorwise, with torch.compile; smaller models gain less, their matmuls are a
smaller share of the step).

    python benchmarks/gpu_fp8.py [--model llama3_1b] [--seq 2048] [--micro 4] [--steps 20] [--compile]

``--smoke``: a tiny model for two steps on the CPU in fp32 with fp8 emulated, bf16's place taken by fp32 and
tensorwise left out (the figure then measures nothing); without ``--smoke`` it needs CUDA and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import torch

from gpu_llama_mfu import ON_GPU, StepTimer
from lightning_mgpu import LLMModule, MGPUPrecision, MGPUStrategy
from lightning_mgpu.data import TokenFileDataModule
from lightning_mgpu.models import LlamaConfig
from smoke import SMOKE

EXPECTED = "+10-25 % tokens/s at 1B-8B (torchao, Llama-3 8B on H100: rowwise +11.5 %, tensorwise +21 %)"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (as torchao measures)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps (CPU without a GPU)")
    args = parser.parse_args()
    if SMOKE:
        args.seq, args.micro, args.steps = 32, 2, 2
    return args


def step_time(cfg: LlamaConfig, path: Path, args: argparse.Namespace, fp8: str | None) -> float:
    """The median step time (after 3 warm-up steps) of one training run."""
    timer = StepTimer()
    base = "bf16-mixed" if ON_GPU else "32-true"
    trainer = L.Trainer(accelerator="gpu" if ON_GPU else "cpu", devices=1, max_steps=args.steps,
                        strategy=MGPUStrategy(zero_stage=1, precision_plugin=MGPUPrecision(base, fp8=fp8)),
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    dm = TokenFileDataModule(path, dtype="uint32", seq_len=args.seq, global_batch_size=args.micro,
                             micro_batch_size=args.micro)
    trainer.fit(LLMModule(cfg, lr=3e-4, warmup_steps=2, max_steps=args.steps), dm)
    if torch.distributed.is_initialized():  # the next run starts its own one-process group
        torch.distributed.destroy_process_group()
    return statistics.median(timer.times[min(3, len(timer.times) - 1):])


def main() -> int:
    args = arguments()
    if not (ON_GPU or SMOKE):
        print("gpu_fp8.py needs CUDA (torch.cuda.is_available() is False); run it on a GPU, or with --smoke")
        return 2
    cfg = (LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64)
           if SMOKE else LlamaConfig.from_name(args.model))
    cfg = dataclasses.replace(cfg, compile=args.compile)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=200_000 if SMOKE else 5_000_000)
    path = Path(tempfile.mkdtemp()) / "tokens.u32"
    tokens.astype(np.uint32).tofile(path)
    tokens_per_step = args.micro * args.seq
    print(f"{'smoke' if SMOKE else args.model}: {cfg.num_parameters() / 1e9:.3f} B params, seq {args.seq}, "
          f"{tokens_per_step} tokens/step, {'cuda' if ON_GPU else 'cpu (fp8 emulated)'}"
          f"{', compiled blocks' if args.compile else ''}")
    runs = (("bf16", None), ("fp8 rowwise", "rowwise")) + (() if SMOKE else (("fp8 tensorwise", "tensorwise"),))
    times = {name: step_time(cfg, path, args, fp8) for name, fp8 in runs}
    print("| precision | median step ms | tokens/s | tokens/s over bf16 |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.1f} | {tokens_per_step / t:,.0f} | {times['bf16'] / t - 1:+.1%} |")
    tensorwise = f" (tensorwise {times['bf16'] / times['fp8 tensorwise'] - 1:+.1%})" if "fp8 tensorwise" in times else ""
    print(f"fp8 rowwise speed-up over bf16: {times['bf16'] / times['fp8 rowwise'] - 1:+.1%}{tensorwise}; "
          f"expected {EXPECTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
