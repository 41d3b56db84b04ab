"""Tensor parallel 2 of one ``transformers`` Llama under ``MGPUStrategy`` and under transformers' own tensor
parallelism (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))``: DTensor weights), two CPU
processes, side by side in one run.

The same weights (one saved directory, loaded by both), the same batches, AdamW at the same learning rate, no
clipping, fp32. ``MGPUStrategy`` runs the model as it is inside a plain LightningModule (its tensor-parallel plan from
its config, sequence parallelism, ZeRO-0); transformers' side is a plain loop (forward with ``labels=``, backward,
``optimizer.step()``). Each is timed per step after a warm-up; the two alternate in rounds so that machine noise
hits both. Prints the median step times with their range, their ratio, the largest loss difference and the machine's
load average; then further steps of each, timed operator by operator (``step_timer.OpTimes``: matmuls, attention,
other operators, and what ran outside operators -- collectives and their waits, Python, Lightning), which says how
much of the gap communication and overhead could close: the step cannot drop below its operators' time. Needs
``accelerate`` (``pip install -e .[benchmarks]``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mgpu import MGPUStrategy  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402
from step_timer import OpTimes, StepBreakdown, Timer, breakdown_line  # noqa: E402

DIM, LAYERS, HEADS, FFN, VOCAB = sized((512, 4, 8, 1376, 4096), (64, 2, 4, 128, 256))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((256, 8, 8, 2, 2), (16, 2, 2, 1, 1))
BREAKDOWN = sized(4, 1)  # further steps, timed operator by operator
LR = 1e-3


def save_model(directory: str) -> None:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=SEQ + 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * (STEPS + 1 + BREAKDOWN), SEQ + 1),
                         generator=torch.Generator().manual_seed(0))


class HFModule(L.LightningModule):
    """A user's module around the saved model: nothing about parallelism."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.llm = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.llm(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def mgpu(rank: int, directory: str) -> tuple[list[float], list[float], str]:
    timer, module, breakdown = Timer(), HFModule(directory), StepBreakdown(STEPS + 1)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS + 1 + BREAKDOWN, logger=False,
                        callbacks=[timer, breakdown],
                        strategy=MGPUStrategy(tensor_parallel_size=2, sequence_parallel=True),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=DataLoader(batches(), batch_size=BATCH))
    return timer.times[WARMUP:STEPS], module.losses, breakdown_line(breakdown.steps)


def hf_tp(rank: int, directory: str) -> tuple[list[float], list[float], str]:
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              distributed_config=DistributedConfig(tp_size=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    times, losses, last, split = [], [], time.perf_counter(), []
    for index, batch in enumerate(batches().split(BATCH)):
        start, ops = time.perf_counter(), OpTimes() if index > STEPS else None  # as StepBreakdown: from its start
        with ops or contextlib.nullcontext():
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if ops:
            split.append((ops.seconds, now - start))
    dist.destroy_process_group()
    return times[1 + WARMUP:STEPS + 1], losses, breakdown_line(split)


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s (range {min(times):.3f}-{max(times):.3f}, {len(times)} steps)"


def main() -> None:
    own, theirs, loss_gap = [], [], 0.0
    with tempfile.TemporaryDirectory() as directory:
        save_model(directory)
        for _ in range(ROUNDS):
            load = os.getloadavg()[0]
            own_times, own_losses, own_split = run_distributed(mgpu, 2, directory)[0]
            hf_times, hf_losses, hf_split = run_distributed(hf_tp, 2, directory)[0]
            own, theirs = own + own_times, theirs + hf_times
            loss_gap = max([loss_gap] + [abs(a - b) for a, b in zip(own_losses, hf_losses)])
    print(f"transformers Llama {DIM} wide, {LAYERS} layers, vocabulary {VOCAB}, batch {BATCH} x {SEQ}, AdamW, fp32, "
          f"tensor parallel 2 on 2 CPU processes (load average {load:.1f} on {os.cpu_count()} cores before the last "
          f"round)")
    print(f"MGPUStrategy (tp2 + sequence parallel): {spread(own)}")
    print(f"transformers' tensor parallelism (DTensor): {spread(theirs)}")
    print(f"ratio MGPUStrategy / transformers: {statistics.median(own) / statistics.median(theirs):.2f}x; "
          f"largest loss difference over {STEPS + 1 + BREAKDOWN} steps: {loss_gap:.1e}")
    print(f"{BREAKDOWN} further steps of each in the last round, timed operator by operator (rank 0, medians; not "
          f"among the steps above):\n"
          f"  MGPUStrategy: {own_split}\n  transformers: {hf_split}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "Tensor parallel 2 against transformers' own", about=__doc__):
        main()
