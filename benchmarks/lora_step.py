"""LoRA against full fine-tuning, and the same PEFT model under Lightning's ``DDPStrategy`` against ``MGPUStrategy``:
step time and the memory a rank's training adds, two CPU processes (gloo), side by side in one run.

A user's LightningModule around a ``transformers`` Llama (hidden 256, 4 layers, 8 heads, vocabulary 1,024, sequence
128, 8 sequences a step), AdamW:

* ``lora``: wrapped by ``peft.get_peft_model`` (rank 16 on every linear layer), under ``MGPUStrategy(zero_stage=2)``;
* ``full``: every weight trains, same strategy;
* ``lora_ddp``: the LoRA model under Lightning's ``DDPStrategy``.

Lightning's ``DeepSpeedStrategy`` refuses a CPU ("only supported on CUDA GPUs"): its column needs a GPU
(``make gpu-check``). Each run is timed per step after a warm-up, the three alternating in rounds so that machine noise
hits all; the memory is the peak resident growth of rank 0 from the start of ``fit`` to its end (model states, the
engine's buckets and the activations). Prints the medians and the ratios.
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
from lightning_mgpu.testing import reset_peak_resident, resident_bytes, run_distributed  # noqa: E402
from step_timer import Timer  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

DIM, LAYERS, HEADS, FFN, VOCAB = sized((256, 4, 8, 768, 1024), (32, 2, 4, 64, 64))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 8, 12, 3, 3), (16, 2, 3, 1, 1))
KINDS = ("lora", "full", "lora_ddp")


class FineTune(L.LightningModule):
    """What a user writes: the model, PEFT's LoRA when asked, AdamW over what trains."""

    def __init__(self, lora: bool, shape: tuple[int, ...] = (DIM, LAYERS, HEADS, FFN, VOCAB, SEQ)) -> None:
        """``shape``: (hidden, layers, heads, MLP width, vocabulary, longest sequence) of the Llama."""
        super().__init__()
        dim, layers, heads, ffn, vocab, seq = shape
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=ffn,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=heads // 2, max_position_embeddings=seq,
                                          attn_implementation="sdpa")
        torch.manual_seed(0)
        self.llm = transformers.LlamaForCausalLM(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            self.llm = get_peft_model(self.llm, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.llm(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def timed(rank: int, kind: str) -> tuple[list[float], float]:
    timer = Timer()
    strategy = "ddp" if kind == "lora_ddp" else MGPUStrategy(zero_stage=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[timer])
    data = torch.randint(0, VOCAB, (2 * BATCH * (STEPS + 1), SEQ), generator=torch.Generator().manual_seed(0))
    module = FineTune(lora=kind != "full")
    start = resident_bytes()
    reset_peak_resident()
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=BATCH))
    return timer.times[WARMUP:], resident_bytes("VmHWM") - start


def main() -> None:
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    memory: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(ROUNDS):
        for kind in KINDS:
            step_times, grown = run_distributed(timed, 2, kind)[0]
            times[kind] += step_times
            memory[kind].append(grown)
    median = {kind: statistics.median(times[kind]) for kind in KINDS}
    peak = {kind: statistics.median(memory[kind]) / 2**20 for kind in KINDS}
    for kind in KINDS:
        print(f"{kind}: median step {median[kind] * 1e3:.1f} ms, rank 0's fit added {peak[kind]:.1f} MB at its peak")
    print(f"ratio LoRA / full fine-tuning (MGPUStrategy ZeRO-2, dp2): step {median['lora'] / median['full']:.3f}, "
          f"memory {peak['lora'] / peak['full']:.3f}")
    print(f"ratio MGPUStrategy ZeRO-2 / DDPStrategy (LoRA, dp2): step {median['lora'] / median['lora_ddp']:.3f}, "
          f"memory {peak['lora'] / peak['lora_ddp']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "LoRA against full fine-tuning: step time and memory", about=__doc__):
        main()
