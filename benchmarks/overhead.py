"""Step-time overhead of Trainer(strategy=MGPUStrategy()) over a hand-written PyTorch loop, one process.

Both train the same model on the same batches with AdamW, gradient clipping and a LR schedule. Each
is timed per optimizer step after a warm-up; the two alternate in rounds so that machine noise hits
both. Prints the median step-time ratio (goal: <= 1.03). ``--return-freed-memory``: the strategy with its memory-lean
CPU setting (``MGPUStrategy(return_freed_memory=True)``), to see what it costs. Also the step guard's cost
(``skip_bad_steps``, on by default: a finiteness check of the gradients; its all-gather is skipped in one process).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import make_token_file  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.data import TokenFileDataModule  # noqa: E402
from lightning_mgpu.data.tokens import sample_starts  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=256,
                          max_seq_len=256),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=256, max_seq_len=32))
SEQ, BATCH, STEPS, WARMUP, ROUNDS = sized((128, 8, 25, 5, 3), (16, 2, 3, 1, 1))
OPTIM = dict(lr=1e-3, warmup_steps=5, max_steps=1000)
LEAN = "--return-freed-memory" in sys.argv[1:]


def hand_loop(token_file: Path) -> list[float]:
    module = LLMModule(MODEL, **OPTIM)
    module.configure_model()
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    times = []
    for step in range(STEPS):
        start = time.perf_counter()
        starts = sample_starts(0, step, BATCH, len(tokens), SEQ)
        batch = torch.from_numpy(np.stack([tokens[s:s + SEQ + 1] for s in starts]).astype(np.int64))
        logits = module.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        loss.item()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None:  # batch end to batch end: data loading, step and every hook included
            self.times.append(now - self._last)
        self._last = now


class SilentLLMModule(LLMModule):
    """LLMModule without its per-step self.log calls: isolates the strategy from Lightning's logging cost."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass


def trainer_run(rank: int, token_file: Path, module_cls: type = LLMModule, guard: bool = True) -> list[float]:
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MGPUStrategy(return_freed_memory=LEAN,
                                                                            skip_bad_steps=guard),
                        max_steps=STEPS + 1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    dm = TokenFileDataModule(token_file, seq_len=SEQ, global_batch_size=BATCH, micro_batch_size=BATCH, seed=0,
                             val_fraction=0.001)
    trainer.fit(module_cls(MODEL, **OPTIM), dm)
    return timer.times[WARMUP:]


def main() -> None:
    import tempfile

    token_file = make_token_file(Path(tempfile.mkdtemp()), n_tokens=200_000, vocab=256)
    plain, ours, silent, unguarded = [], [], [], []
    for _ in range(ROUNDS):
        # the hand loop also runs in a forked child, so all four see the same process state
        plain += run_distributed(lambda rank: hand_loop(token_file), 1)[0]
        ours += run_distributed(trainer_run, 1, token_file)[0]
        silent += run_distributed(trainer_run, 1, token_file, SilentLLMModule)[0]
        unguarded += run_distributed(trainer_run, 1, token_file, SilentLLMModule, False)[0]
    p, o, q = statistics.median(plain), statistics.median(ours), statistics.median(silent)
    u = statistics.median(unguarded)
    print(f"step guard (skip_bad_steps): {q * 1e3:.1f} ms a step with it, {u * 1e3:.1f} ms without: "
          f"ratio {q / u:.3f}")
    print(f"median step: hand-written loop {p * 1e3:.1f} ms; Trainer(strategy=MGPUStrategy()) with LLMModule "
          f"{o * 1e3:.1f} ms; the same without the module's self.log calls {q * 1e3:.1f} ms")
    print(f"strategy-only overhead ratio (no logging / hand-written): {q / p:.3f}")
    print(f"overhead ratio (ours / hand-written): {o / p:.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    with recorded(__file__, "Step-time overhead on CPU", about=__doc__, when=not LEAN):
        main()
