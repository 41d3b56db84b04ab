"""Bytes held per rank by parameters, gradients and optimizer state under ZeRO 0-3 (bf16-mixed, Adam),
measured next to the ZeRO paper's formulas.

Measured: just before the second optimizer step (Adam moments exist, gradients not yet freed), every live
tensor in the process is found through the garbage collector (plus the parameters' ``.grad``, which only
autograd holds) and its storage counted once (model, DeepSpeed's fp32 master partitions, gradient partitions
and buckets, Adam moments: everything DeepSpeed allocates), minus the storages that exist before the
engine is built apart from the model. Paper (Rajbhandari et al. 2020, mixed precision with Adam,
K = 12): ZeRO-0 16 psi, ZeRO-1 4 psi + 12 psi / N, ZeRO-2 2 psi + 14 psi / N, ZeRO-3 16 psi / N.
Prints one row per (stage, N) and the worst measured / paper ratio.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
from helpers import make_token_file  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.data import TokenFileDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import live_tensor_bytes, run_distributed  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1024, vocab_size=256,
                          max_seq_len=64),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=256, max_seq_len=64))


def paper_bytes_per_param(stage: int, n: int) -> float:
    return {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]


class Measure(L.Callback):
    def __init__(self) -> None:
        self.after_step = 0

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        # Second step: Adam moments exist (made by the first) and this step's gradients are not yet freed.
        if trainer.global_step == 1:
            self.after_step = live_tensor_bytes(trainer.strategy.model.module)


def run(rank: int, token_file: Path, stage: int, n: int) -> float:
    measure = Measure()
    before = live_tensor_bytes()  # nothing of the model exists yet (it is built in configure_model)
    trainer = L.Trainer(accelerator="cpu", devices=n, strategy=MGPUStrategy(zero_stage=stage), precision="bf16-mixed",
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[measure])
    dm = TokenFileDataModule(token_file, seq_len=16, global_batch_size=n, micro_batch_size=1, seed=0, val_fraction=0.1)
    trainer.fit(LLMModule(MODEL), dm)
    return (measure.after_step - before) / MODEL.num_parameters()


def main() -> None:
    token_file = make_token_file(Path(tempfile.mkdtemp()), n_tokens=50_000, vocab=256)
    print(f"model: {MODEL.num_parameters() / 1e6:.2f} M parameters; bytes per parameter per rank")
    print(f"{'ZeRO':>4} {'N':>2} {'measured':>9} {'paper':>7} {'ratio':>6}")
    worst = 0.0
    for stage in sized((0, 1, 2, 3), (3,)):
        for n in sized((2, 4), (2,)):
            measured = max(run_distributed(run, n, token_file, stage, n, timeout=600))
            paper = paper_bytes_per_param(stage, n)
            worst = max(worst, measured / paper)
            print(f"{stage:>4} {n:>2} {measured:9.2f} {paper:7.2f} {measured / paper:6.2f}")
    print(f"worst measured / paper ratio: {worst:.2f}")


if __name__ == "__main__":
    main()
