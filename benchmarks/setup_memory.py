"""Peak resident memory of every rank during setup and the first step, for a ~470M-parameter Llama on 8 CPU processes
(tp2 x pp2 x dp2, ZeRO-3, fp32), next to the bytes of that rank's shard, its steady-state model states (the planner's
measured model) and the whole model.

Usage: python benchmarks/setup_memory.py [--layers 24] [--processes 8]

Each rank reads its resident set size (VmRSS) when it starts, its peak (ru_maxrss) when training starts (setup done:
model built, split, materialised, engine created) and after the first optimizer step. The process's import baseline
is its RSS at start; the bound the issue sets is peak < 1.3 x steady-state + the largest single tensor + baseline.
"""

from __future__ import annotations

import argparse
import resource
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
from lightning_mgpu.planner.memory import model_state_bytes
from lightning_mgpu.planner.model_stats import rank_parameters
from lightning_mgpu.testing import run_distributed

GB = 1e9


def rss_now() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1e3
    return float("nan")


def rss_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1e3


class Peaks(L.Callback):
    def __init__(self) -> None:
        self.setup = self.step = 0.0
        self.t_setup = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self.setup, self.t_setup = rss_peak(), time.perf_counter() - self.t_setup

    def on_train_batch_end(self, *args) -> None:
        self.step = rss_peak()


def run(rank: int, config: LlamaConfig, token_file: str, devices: int, layout: dict) -> dict:
    baseline = rss_now()
    peaks = Peaks()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**layout), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[peaks])
    module = LLMModule(config, lr=1e-4, warmup_steps=0, max_steps=1)
    data = TokenFileDataModule(token_file, seq_len=32, global_batch_size=4, micro_batch_size=1, seed=0)
    trainer.fit(module, data)
    s = trainer.strategy
    return {"rank": rank, "tp": s.layout.rank("tp"), "pp": s.layout.rank("pp"), "dp": s.layout.rank("dp"),
            "baseline": baseline, "setup": peaks.setup, "step": peaks.step, "setup_s": peaks.t_setup,
            "materialized": getattr(s, "materialized_elements", None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--processes", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LlamaConfig(dim=1024, n_layers=args.layers, n_heads=16, n_kv_heads=16, ffn_hidden=4096,
                         vocab_size=32000, max_seq_len=64)
    layout = dict(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=3)
    dp = args.processes // 4
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.u16"
        np.random.default_rng(0).integers(0, config.vocab_size, 200_000).astype(np.uint16).tofile(tokens)
        results = run_distributed(run, args.processes, config, str(tokens), args.processes, layout, timeout=1800)
    whole = config.num_parameters()
    largest = config.vocab_size * config.dim * 4
    print(f"model: {whole:,} parameters ({whole * 4 / GB:.2f} GB fp32), largest tensor {largest / GB:.3f} GB; "
          f"layout tp2 x pp2 x dp{dp}, ZeRO-3, fp32")
    print("| rank | tp,pp,dp | shard params | shard GB | steady GB (planner) | baseline GB | setup peak GB | "
          "step peak GB | bound GB | setup s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        shard = rank_parameters(config, 2, 2, 1, r["pp"])
        steady = sum(model_state_bytes(shard, 3, dp, "32-true", True).values())
        bound = 1.3 * steady + largest + r["baseline"]
        print(f"| {r['rank']} | {r['tp']},{r['pp']},{r['dp']} | {shard:,} | {shard * 4 / GB:.2f} | {steady / GB:.2f} | "
              f"{r['baseline'] / GB:.2f} | {r['setup'] / GB:.2f} | {r['step'] / GB:.2f} | {bound / GB:.2f} | "
              f"{r['setup_s']:.1f} |")
    worst = max(r["step"] - r["baseline"] for r in results)
    print(f"largest growth over the baseline: {worst / GB:.2f} GB; whole model fp32: {whole * 4 / GB:.2f} GB")


if __name__ == "__main__":
    sys.exit(main())
