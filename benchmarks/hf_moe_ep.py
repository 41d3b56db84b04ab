"""Step time and memory per rank of a ``transformers`` Qwen3-MoE trained as it is with its experts split by expert
parallelism (ep2) against the same model with every expert on every rank (ep1), and against the package's own
mixture of experts of the same shape at ep2; two CPU processes, data parallel 2, ZeRO-1, fp32.

The shape: hidden 128, 4 layers, 8 heads (4 key/value heads of 16), 16 experts of hidden 64, top 4, vocabulary 256,
sequence 128, micro-batch 4 per rank. Each run is ``Trainer(strategy=MGPUStrategy(...))`` with AdamW and clipping on
the same batches, timed per step after a warm-up; the runs alternate in rounds so that machine noise hits each.
Memory: the parameter elements each rank holds, and the bytes of every live tensor of the rank's process before the
second optimizer step (weights, gradients, AdamW's moments, DeepSpeed's fp32 partitions). Prints the medians and the
ratios ep2 / ep1 and transformers / package at ep2.
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

from helpers import MeasureBeforeSecondStep  # noqa: E402
from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402
from step_timer import QuietLLMModule, Timer  # noqa: E402

DIM, LAYERS, HEADS, KV, EXPERTS, TOP, EXPERT_HIDDEN, VOCAB = sized((128, 4, 8, 4, 16, 4, 64, 256),
                                                                  (32, 2, 4, 2, 4, 2, 16, 64))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 4, 16, 4, 3), (16, 2, 3, 1, 1))
RUNS = {"transformers ep1": ("hf", 1), "transformers ep2": ("hf", 2), "package ep2": ("own", 2)}


class HFModule(L.LightningModule):
    """A user's module around a ``transformers`` Qwen3-MoE of the benchmark's shape: nothing about parallelism."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=4 * DIM,
                                             num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                             num_key_value_heads=KV, head_dim=DIM // HEADS, num_experts=EXPERTS,
                                             num_experts_per_tok=TOP, moe_intermediate_size=EXPERT_HIDDEN,
                                             norm_topk_prob=True, max_position_embeddings=SEQ + 1,
                                             attn_implementation="sdpa")
        torch.manual_seed(0)
        self.llm = transformers.Qwen3MoeForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.llm(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def own_module() -> LLMModule:
    return QuietLLMModule(LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV, ffn_hidden=4 * DIM,
                                 vocab_size=VOCAB, max_seq_len=SEQ + 1, qk_norm=True, num_experts=EXPERTS,
                                 experts_per_token=TOP, expert_hidden=EXPERT_HIDDEN), lr=1e-3, warmup_steps=1)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2 * BATCH * (STEPS + 1), SEQ + 1), generator=torch.Generator().manual_seed(0))


def timed(rank: int, kind: str, ep: int) -> dict:
    timer, memory = Timer(), MeasureBeforeSecondStep()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(expert_parallel_size=ep, zero_stage=1),
                        max_steps=STEPS + 1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[timer, memory])
    module = HFModule() if kind == "hf" else own_module()
    trainer.fit(module, train_dataloaders=DataLoader(tokens(), batch_size=BATCH))
    return {"times": timer.times[WARMUP:], "bytes": memory.bytes,
            "parameters": sum(p.numel() for p in module.parameters())}


def main() -> None:
    results = {name: {"times": [], "bytes": 0, "parameters": 0} for name in RUNS}
    for _ in range(ROUNDS):
        for name, (kind, ep) in RUNS.items():
            ranks = run_distributed(timed, 2, kind, ep)
            results[name]["times"] += ranks[0]["times"]
            results[name]["bytes"] = max(r["bytes"] for r in ranks)
            results[name]["parameters"] = max(r["parameters"] for r in ranks)
    print("| run (2 CPU processes, dp2, ZeRO-1, fp32) | median step ms | parameters per rank | live MB per rank |")
    print("| --- | --- | --- | --- |")
    median = {name: statistics.median(r["times"]) for name, r in results.items()}
    for name, r in results.items():
        print(f"| {name} | {median[name] * 1e3:.1f} | {r['parameters']:,} | {r['bytes'] / 2**20:.1f} |")
    hf1, hf2, own = (results[name] for name in RUNS)
    print(f"ratio ep2 / ep1 (transformers): step {median['transformers ep2'] / median['transformers ep1']:.3f}, "
          f"memory {hf2['bytes'] / hf1['bytes']:.3f}")
    print(f"ratio transformers / package at ep2: step {median['transformers ep2'] / median['package ep2']:.3f}, "
          f"memory {hf2['bytes'] / own['bytes']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "A transformers mixture of experts split by expert parallelism: step time and memory", about=__doc__):
        main()
