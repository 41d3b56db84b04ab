"""Peak resident memory of every rank during setup and the first step, for a 401M-parameter Llama on 8 CPU processes
(tp2 x pp2 x dp2, ZeRO-3, fp32), next to the bytes of that rank's shard, its steady-state model states (the planner's
measured figure), the model's largest tensor and the whole model.

Usage: python benchmarks/setup_memory.py [--layers 20] [--processes 8]

Each rank reads its resident set size (VmRSS) once torch, Lightning and DeepSpeed are loaded (its import baseline),
its peak (VmHWM) over setup (model built, split, materialised; engine created) and its peak over the first optimizer
step. The bound is the one ``tests/distributed/test_setup_memory.py`` asserts: peak < 1.3 x steady-state + the
largest single tensor + baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.testing import rank_memory_bound, run_distributed, setup_and_first_step_peaks
from record import recorded

GB = 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="2 layers of dim 64 on 4 processes, in seconds")
    parser.add_argument("--heap", action="store_true", help="without return_freed_memory (glibc keeps freed memory)")
    parser.add_argument("--steps", type=int, default=1, help="steps to train; the later ones' peaks are printed too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LlamaConfig(dim=1024, n_layers=args.layers, n_heads=16, n_kv_heads=16, ffn_hidden=4096,
                         vocab_size=32000, max_seq_len=64)
    if args.smoke:
        config, args.processes = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128,
                                             vocab_size=256, max_seq_len=64), 4
    layout = dict(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=3,
                  return_freed_memory="--heap" not in sys.argv)  # --heap: glibc's default, as a plain run has it
    dp = args.processes // 4
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.u16"
        np.random.default_rng(0).integers(0, config.vocab_size, 20_000).astype(np.uint16).tofile(tokens)
        results = run_distributed(setup_and_first_step_peaks, args.processes, config, str(tokens), args.processes,
                                  layout, steps=args.steps, timeout=1800)
    whole = config.num_parameters()
    print(f"model: {whole:,} parameters ({whole * 4 / GB:.2f} GB fp32); layout tp2 x pp2 x dp{dp}, ZeRO-3, fp32")
    print("| rank | tp,pp,dp | shard GB | steady GB | largest tensor GB | baseline GB | setup peak GB | "
          "first-step peak GB | bound GB | setup s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b = rank_memory_bound(config, layout, dp, r["pp"], r["baseline"])
        print(f"| {r['rank']} | {r['tp']},{r['pp']},{r['dp']} | {b['shard'] / GB:.2f} | {b['steady'] / GB:.2f} | "
              f"{b['largest'] / GB:.3f} | {r['baseline'] / GB:.2f} | {r['setup'] / GB:.2f} | {r['step'] / GB:.2f} | "
              f"{b['bound'] / GB:.2f} | {r['setup_s']:.1f} |")
    if args.steps > 1:
        later = [peak for r in results for peak in r["steps"][1:]]
        print(f"peaks of steps 2-{args.steps} per rank: {min(later) / GB:.2f}-{max(later) / GB:.2f} GB")
    worst = max(max(r["setup"], r["step"]) - r["baseline"] for r in results)
    print(f"largest growth over the baseline: {worst / GB:.2f} GB; whole model fp32: {whole * 4 / GB:.2f} GB")


if __name__ == "__main__":
    with recorded(__file__, "Setup memory per rank", about=__doc__, when=not sys.argv[1:]):
        sys.exit(main())
