"""``MGPUStrategy(zero_stage=2)`` and ``(zero_stage=3)`` against Lightning's own ``DeepSpeedStrategy(stage=2/3)`` on
the same plain LightningModule (a ``transformers`` Llama trained with AdamW, fp32), side by side in one run.

On CPU (2 processes, gloo) Lightning's ``DeepSpeedStrategy`` refuses to start ("only supported on CUDA GPUs"): the
script prints that refusal with MGPUStrategy's figures beside it. With CUDA it runs both on every visible GPU (one
process per GPU, forked) and prints the ratio of the median step times and the largest loss difference.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
import transformers  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mgpu import MGPUStrategy  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402
from step_timer import Timer  # noqa: E402

DIM, LAYERS, HEADS, FFN, VOCAB = sized((512, 4, 8, 1376, 4096), (64, 2, 4, 128, 256))
SEQ, BATCH, STEPS, WARMUP = sized((256, 8, 8, 2), (16, 2, 2, 1))
CUDA = torch.cuda.is_available()
DEVICES = max(1, torch.cuda.device_count()) if CUDA else 2


class PlainModule(L.LightningModule):
    """A user's module: a ``transformers`` Llama built from a seed, AdamW, nothing about parallelism."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ + 1))
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.llm(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * DEVICES * (STEPS + 1), SEQ + 1), generator=torch.Generator().manual_seed(0))


def timed(rank: int, kind: str, stage: int) -> tuple[Optional[list[float]], list[float], str]:
    """(step times after the warm-up, losses, the refusal) of one strategy on this rank."""
    strategy = MGPUStrategy(zero_stage=stage) if kind == "mgpu" else DeepSpeedStrategy(stage=stage)
    timer, module = Timer(), PlainModule()
    trainer = L.Trainer(accelerator="gpu" if CUDA else "cpu", devices=DEVICES, strategy=strategy,
                        max_steps=STEPS + 1, logger=False, callbacks=[timer], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    try:
        trainer.fit(module, train_dataloaders=DataLoader(batches(), batch_size=BATCH))
    except RuntimeError as refused:
        return None, [], str(refused)
    return timer.times[WARMUP:], module.losses, ""


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s (range {min(times):.3f}-{max(times):.3f})"


def main() -> None:
    where = f"{DEVICES} GPU process(es)" if CUDA else f"{DEVICES} CPU processes (load average {os.getloadavg()[0]:.1f})"
    print(f"transformers Llama {DIM} wide, {LAYERS} layers, vocabulary {VOCAB}, batch {BATCH} x {SEQ} per rank, "
          f"AdamW, fp32, on {where}")
    refusal = ""
    for stage in (2, 3):
        ours, our_losses, _ = run_distributed(timed, DEVICES, "mgpu", stage)[0]
        if refusal:  # refused at stage 2 already, for the accelerator, whatever the stage
            theirs = None
        else:
            theirs, their_losses, refusal = run_distributed(timed, DEVICES, "deepspeed", stage)[0]
        line = f"ZeRO-{stage}: MGPUStrategy {spread(ours)}"
        if theirs is None:
            print(f"{line}; DeepSpeedStrategy(stage={stage}) refused: {refusal}")
            continue
        gap = max(abs(a - b) for a, b in zip(our_losses, their_losses))
        print(f"{line}; DeepSpeedStrategy {spread(theirs)}; ratio MGPUStrategy / DeepSpeedStrategy "
              f"{statistics.median(ours) / statistics.median(theirs):.2f}x; largest loss difference {gap:.1e}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "ZeRO-2/3 against Lightning's DeepSpeedStrategy", about=__doc__):
        main()
