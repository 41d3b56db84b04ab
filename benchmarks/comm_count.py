"""What counting every collective costs a step: the package's Llama at tp2 + sequence parallelism on two CPU
processes, trained with and without ``CommunicationCounter`` (a ``TorchDispatchMode`` on while a step runs), the two
alternating in rounds so that machine noise hits both. Without the callback nothing is installed. Prints the median
step times with their range and their ratio, and the bytes the counter saw in a step.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mgpu import MGPUStrategy  # noqa: E402
from lightning_mgpu.callbacks.comm import CommunicationCounter  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402
from step_timer import QuietLLMModule, Timer  # noqa: E402

DIM, LAYERS, HEADS, FFN, VOCAB = sized((256, 4, 8, 768, 256), (32, 2, 4, 64, 64))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 8, 12, 2, 3), (16, 2, 2, 1, 1))



def timed(rank: int, counting: bool) -> tuple[list[float], int]:
    timer, counter = Timer(), CommunicationCounter(log=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS + 1, logger=False,
                        callbacks=[timer, counter] if counting else [timer],
                        strategy=MGPUStrategy(tensor_parallel_size=2, sequence_parallel=True),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    model = LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=HEADS, ffn_hidden=FFN, vocab_size=VOCAB,
                        max_seq_len=SEQ + 1)
    tokens = torch.randint(0, VOCAB, (BATCH * (STEPS + 1), SEQ + 1), generator=torch.Generator().manual_seed(0))
    trainer.fit(QuietLLMModule(model, lr=1e-3, warmup_steps=1), train_dataloaders=DataLoader(tokens, batch_size=BATCH))
    return timer.times[WARMUP:], counter.last.bytes() if counting else 0


def main() -> None:
    off, on, counted = [], [], 0
    for _ in range(ROUNDS):
        off += run_distributed(timed, 2, False)[0][0]
        times, counted = run_distributed(timed, 2, True)[0]
        on += times
    print(f"Llama {DIM} wide, {LAYERS} layers, batch {BATCH} x {SEQ}, tp2 + sequence parallel on 2 CPU processes "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end)")
    for name, times in (("without the counter", off), ("with CommunicationCounter", on)):
        print(f"{name}: median step {statistics.median(times) * 1e3:.1f} ms (range {min(times) * 1e3:.1f}-"
              f"{max(times) * 1e3:.1f}, {len(times)} steps)")
    print(f"counted {counted:,} bytes a step on rank 0; ratio with / without: "
          f"{statistics.median(on) / statistics.median(off):.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "The communication counter's cost", about=__doc__):
        main()
