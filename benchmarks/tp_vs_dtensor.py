"""Tensor parallelism at tp=2 on CPU: MGPUStrategy against Lightning's ModelParallelStrategy with a DTensor plan.

The same Llama, the same batch shape, the same AdamW; two processes of one thread each, gloo. Each strategy
trains STEPS steps per round; rounds alternate so that machine noise hits both. Prints the median
step-time ratio, ours / theirs (goal: <= 1.0).

The DTensor side is the plan a Lightning user writes today (torchtitan's Llama plan with the logits
gathered for a plain cross-entropy, since Lightning runs backward outside a ``loss_parallel`` context).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.models import Llama, LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402

MODEL = LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=4096, max_seq_len=256)
SEQ, BATCH, STEPS, WARMUP, ROUNDS = 128, 8, 15, 3, 3
OPTIM = dict(lr=1e-3, warmup_steps=5, max_steps=1000)


class RandomTokens(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, MODEL.vocab_size, (SEQ + 1,), generator=torch.Generator().manual_seed(i))


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t)


class DTensorLLMModule(LLMModule):
    """LLMModule whose ``configure_model`` applies torch's DTensor tensor-parallel plan (ModelParallelStrategy)."""

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        if self.model is not None:
            return
        torch.manual_seed(self.hparams.init_seed)
        self.model = Llama(self.config)
        mesh = self.device_mesh["tensor_parallel"]
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        parallelize_module(self.model, mesh, plan)
        for layer in self.model.layers:
            parallelize_module(layer, mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })


def train(rank: int, which: str) -> list[float]:
    timer = StepTimer()
    if which == "mgpu":
        strategy, module = MGPUStrategy(tensor_parallel_size=2, sequence_parallel=True), LLMModule(MODEL, **OPTIM)
    else:
        strategy, module = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), \
            DTensorLLMModule(MODEL, **OPTIM)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[timer],
                        use_distributed_sampler=False)
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=BATCH))
    return timer.times[WARMUP:]


def main() -> None:
    times: dict[str, list[float]] = {"mgpu": [], "dtensor": []}
    for _ in range(ROUNDS):
        for which in times:
            times[which] += run_distributed(train, 2, which)[0]
    ours, theirs = statistics.median(times["mgpu"]), statistics.median(times["dtensor"])
    print(f"model dim={MODEL.dim} layers={MODEL.n_layers} vocab={MODEL.vocab_size}, batch {BATCH}x{SEQ}, tp=2, "
          f"sequence parallel, 2 CPU processes, {ROUNDS} rounds x {STEPS - WARMUP} timed steps")
    print(f"median step: MGPUStrategy {ours * 1e3:.1f} ms, ModelParallelStrategy+DTensor {theirs * 1e3:.1f} ms")
    print(f"ratio ours/theirs = {ours / theirs:.3f} (goal <= 1.0)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
