"""GPU check (``make gpu-check`` runs it; never part of the test suite's timings): the same PEFT LoRA model under
``MGPUStrategy(zero_stage=2)`` and under Lightning's own ``DeepSpeedStrategy(stage=2)`` on one GPU, side by side in
one run: median step time and peak CUDA memory of each, and their ratios (goal: no slower, no more memory).

A user's LightningModule around a ``transformers`` Llama (hidden 2,048, 16 layers, 16 heads, vocabulary 32,000,
sequence 2,048, 4 sequences a step, about 1.1B parameters) wrapped by ``peft.get_peft_model`` (rank 16 on every
linear layer), bf16-mixed, AdamW over what trains. Lightning's ``DeepSpeedStrategy`` runs only on CUDA ("only
supported on CUDA GPUs"), which is why this comparison is a GPU check; each side runs in a process of its own (each
starts DeepSpeed and a process group).

    python benchmarks/gpu_lora_strategies.py [--steps 12]

``--smoke``: a tiny model for three steps on the CPU in this process, Lightning's default strategy standing in for
``DeepSpeedStrategy`` (the figures then measure nothing); without ``--smoke`` it needs CUDA and says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from gpu_llama_mfu import ON_GPU, StepTimer
from lora_step import FineTune
from lightning_mgpu import MGPUStrategy
from smoke import SMOKE, sized

DIM, LAYERS, HEADS, FFN, VOCAB = sized((2048, 16, 16, 5632, 32000), (32, 2, 4, 64, 64))
SEQ, BATCH = sized((2048, 4), (16, 2))
WARMUP = 3


def measured(kind: str, steps: int) -> dict:
    """Median step time (after the warm-up) and peak CUDA memory of one run of ``kind``: ``mgpu``, ``deepspeed`` or
    ``lightning`` (Lightning's default strategy, the smoke mode's stand-in)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    timer = StepTimer()
    strategy = {"mgpu": lambda: MGPUStrategy(zero_stage=2), "deepspeed": lambda: DeepSpeedStrategy(stage=2),
                "lightning": lambda: "auto"}[kind]()
    trainer = L.Trainer(accelerator="gpu" if ON_GPU else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed" if ON_GPU else "32-true", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[timer])
    data = torch.randint(0, VOCAB, (BATCH * steps, SEQ), generator=torch.Generator().manual_seed(0))
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    module = FineTune(lora=True, shape=(DIM, LAYERS, HEADS, FFN, VOCAB, SEQ))  # lora_step's, at this size
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=BATCH))
    peak = torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else 0.0
    return {"step_s": statistics.median(timer.times[WARMUP - 1:] or timer.times), "peak_gib": peak}


def in_own_process(kind: str, steps: int) -> dict:
    """:func:`measured` in a fresh interpreter (``--run KIND``), whose last line is its JSON."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", kind, "--steps", str(steps)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--run", choices=["mgpu", "deepspeed", "lightning"], help="one side, in this process")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, MGPUStrategy alone, on the CPU")
    args = parser.parse_args()
    if args.run:
        print(json.dumps(measured(args.run, args.steps)))
        return 0
    if SMOKE:
        mine, theirs = measured("mgpu", 3), measured("lightning", 3)
        print(f"ratio MGPUStrategy / DeepSpeedStrategy (LoRA, ZeRO-2, one GPU): step "
              f"{mine['step_s'] / theirs['step_s']:.3f}, memory n/a (smoke: the CPU, Lightning's default strategy in "
              "DeepSpeedStrategy's place, which needs CUDA)")
        return 0
    if not ON_GPU:
        print("gpu_lora_strategies.py needs CUDA (torch.cuda.is_available() is False): Lightning's DeepSpeedStrategy "
              "runs only on CUDA GPUs; run it on a GPU, or with --smoke")
        return 2
    result = {kind: in_own_process(kind, args.steps) for kind in ("mgpu", "deepspeed")}
    for kind, name in (("mgpu", "MGPUStrategy(zero_stage=2)"), ("deepspeed", "DeepSpeedStrategy(stage=2)")):
        print(f"{name}: median step {result[kind]['step_s'] * 1e3:.1f} ms, peak memory {result[kind]['peak_gib']:.2f} GiB")
    step = result["mgpu"]["step_s"] / result["deepspeed"]["step_s"]
    memory = result["mgpu"]["peak_gib"] / result["deepspeed"]["peak_gib"]
    print(f"ratio MGPUStrategy / DeepSpeedStrategy (LoRA, ZeRO-2, one GPU): step {step:.3f}, memory {memory:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
