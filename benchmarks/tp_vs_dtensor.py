"""Tensor parallelism at tp=2 on CPU: MGPUStrategy against Lightning's ModelParallelStrategy with a DTensor plan.

Both sides train the same Llama from the same initial weights (``LLMModule.configure_model``, seed 0) on the
same batches, with the same AdamW and schedule; two processes of one thread each, gloo. Each strategy trains
STEPS steps per round; rounds alternate so that machine noise hits both. Prints the median step time of each
side and their ratio, ours / theirs (goal: <= 1.0), and never fails on a timing.

The two sides do the same work:

- MGPUStrategy: Megatron-style tensor parallelism with sequence parallelism; the output projection is split
  over the vocabulary and the cross-entropy is computed over the logits' shards (they are never gathered).
- ModelParallelStrategy + DTensor: torchtitan's Llama plan with sequence parallelism; the output projection
  keeps its logits sharded over the vocabulary (``Shard(-1)``, as a DTensor) and the cross-entropy runs under
  ``loss_parallel()``. Its backward must run under that context too; Lightning calls ``backward`` outside any
  context of ``training_step``, so the module's ``backward`` hook enters it.

After the first round the script checks that both sides compute the same thing: their step-0 losses (same
weights, same batch) must agree to LOSS_RTOL, or it stops before printing any timing; the losses of later
steps (after identical updates) are printed side by side.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=4096,
                          max_seq_len=256),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=256, max_seq_len=32))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 8, 15, 3, 3), (16, 2, 2, 1, 1))
OPTIM = dict(lr=1e-3, warmup_steps=5, max_steps=1000)
LOSS_RTOL = 1e-5  # fp32; both sides sum the same products in different orders


class RandomTokens(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, MODEL.vocab_size, (SEQ + 1,), generator=torch.Generator().manual_seed(i))


class StepRecorder(L.Callback):
    """Wall time and loss of each training step (the loss is read after the time is taken)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)
        self.losses.append(float((outputs["loss"] if isinstance(outputs, dict) else outputs).detach()))


class DTensorLLMModule(LLMModule):
    """LLMModule under ModelParallelStrategy: torch's DTensor tensor-parallel plan with loss-parallel cross-entropy."""

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
        super().configure_model()  # the whole model from init_seed: the same weights as MGPUStrategy starts from
        mesh = self.device_mesh["tensor_parallel"]
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                # logits stay sharded over the vocabulary, as a DTensor, for loss_parallel()
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
        parallelize_module(self.model, mesh, plan)
        for layer in self.model.layers:
            parallelize_module(layer, mesh, {
                "attention_norm": SequenceParallel(),
                # the attention's inputs: x, cos, sin and the document-mask bias (None without documents)
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                desired_input_layouts=(Replicate(), None, None, None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over the vocabulary-sharded logits; a plain tensor, the same on every rank."""
        from torch.distributed.tensor.parallel import loss_parallel

        inputs, targets = batch[:, :-1], batch[:, 1:]
        with loss_parallel():
            loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        return loss.to_local()  # replicated: each rank's local value is the whole loss; differentiable

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward call, under loss_parallel(): the sharded cross-entropy's backward needs it."""
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(loss, *args, **kwargs)


def train(rank: int, which: str) -> tuple[list[float], list[float]]:
    """Train STEPS steps with one side; (step times, losses) of every step."""
    recorder = StepRecorder()
    if which == "mgpu":
        strategy, module = MGPUStrategy(tensor_parallel_size=2, sequence_parallel=True), LLMModule(MODEL, **OPTIM)
    else:
        strategy, module = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), \
            DTensorLLMModule(MODEL, **OPTIM)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[recorder],
                        use_distributed_sampler=False)  # both tensor-parallel ranks read the same batch
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=BATCH))
    return recorder.times, recorder.losses


def check_same_loss(losses: dict[str, list[float]]) -> None:
    """Print both sides' losses; raise unless their step-0 losses (same weights, same batch) agree."""
    ours, theirs = losses["mgpu"], losses["dtensor"]
    print("loss per step, MGPUStrategy / ModelParallelStrategy+DTensor: "
          + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(ours[:3], theirs[:3]))
          + f", ..., {ours[-1]:.6f}/{theirs[-1]:.6f}")
    if abs(ours[0] - theirs[0]) > LOSS_RTOL * abs(ours[0]):
        raise RuntimeError(f"step-0 losses differ: MGPUStrategy {ours[0]:.7f}, DTensor {theirs[0]:.7f} (rtol "
                           f"{LOSS_RTOL}); the two sides do not compute the same thing, so their times do not compare")


def main() -> None:
    times: dict[str, list[float]] = {"mgpu": [], "dtensor": []}
    for round_ in range(ROUNDS):
        losses = {}
        for which in times:
            step_times, losses[which] = run_distributed(train, 2, which)[0]
            times[which] += step_times[WARMUP:]
        if round_ == 0:
            check_same_loss(losses)
    mgpu, dtensor = statistics.median(times["mgpu"]), statistics.median(times["dtensor"])
    print(f"model dim={MODEL.dim} layers={MODEL.n_layers} vocab={MODEL.vocab_size}, batch {BATCH}x{SEQ}, tp=2, "
          f"sequence parallel, vocabulary-parallel cross-entropy on both sides, 2 CPU processes, "
          f"{ROUNDS} rounds x {STEPS - WARMUP} timed steps")
    print(f"median step: MGPUStrategy {mgpu * 1e3:.1f} ms, ModelParallelStrategy+DTensor (loss_parallel) "
          f"{dtensor * 1e3:.1f} ms")
    print(f"ratio ours/theirs = {mgpu / dtensor:.3f} (goal <= 1.0)")
    sys.stdout.flush()

if __name__ == "__main__":
    with recorded(__file__, "Tensor parallelism against DTensor", about=__doc__):
        main()
