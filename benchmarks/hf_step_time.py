"""Step time of the same tiny Llama trained as a ``transformers`` model as it is and as the package's own ``LLMModule``,
on one layout (tensor parallel 2 with sequence parallelism, ZeRO-1), two CPU processes.

Both are the same shape (hidden 256, 4 layers, 8 heads, 4 key/value heads, vocabulary 256, sequence 128) trained by
``Trainer(strategy=MGPUStrategy(...))`` on the same batches with AdamW and clipping; the ``transformers`` model gets its
plan from its config (``lightning_mgpu.hf``). Each is timed per step after a warm-up, alternating in rounds so that
machine noise hits both. Prints the median step times and their ratio.
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
import transformers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mgpu import MGPUStrategy  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from step_timer import QuietLLMModule, Timer  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

DIM, LAYERS, HEADS, KV, FFN, VOCAB = sized((256, 4, 8, 4, 768, 256), (32, 2, 4, 2, 64, 64))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 8, 20, 5, 3), (16, 2, 3, 1, 1))
LAYOUT = dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1)


class HFModule(L.LightningModule):
    """A user's module around a ``transformers`` Llama of the benchmark's shape: nothing about parallelism."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          num_key_value_heads=KV, max_position_embeddings=SEQ + 1,
                                          attn_implementation="sdpa")
        self.llm = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.llm(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * (STEPS + 1), SEQ + 1), generator=torch.Generator().manual_seed(0))


def timed(rank: int, kind: str) -> list[float]:
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(**LAYOUT), max_steps=STEPS + 1,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    if kind == "hf":
        module = HFModule()
    else:
        module = QuietLLMModule(LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV, ffn_hidden=FFN,
                                       vocab_size=VOCAB, max_seq_len=SEQ + 1), lr=1e-3, warmup_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader(tokens(), batch_size=BATCH))
    return timer.times[WARMUP:]


def main() -> None:
    hf, own = [], []
    for _ in range(ROUNDS):
        hf += run_distributed(timed, 2, "hf")[0]
        own += run_distributed(timed, 2, "own")[0]
    h, o = statistics.median(hf), statistics.median(own)
    print(f"median step on 2 CPU processes, tp2 + sequence parallel, ZeRO-1: transformers LlamaForCausalLM as it is "
          f"{h * 1e3:.1f} ms; LLMModule {o * 1e3:.1f} ms")
    print(f"ratio transformers / LLMModule: {h / o:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "A Hugging Face model as it is", about=__doc__):
        main()
