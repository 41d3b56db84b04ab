"""What the silent-corruption check (``sdc.every_n_steps``) costs a training step, in a live run: 2 data-parallel ranks
(ZeRO-0, one thread each) train a small Llama with the check every step; each rank times the check's own hook (the
fingerprint of its weights, the all-gather of 8 bytes per parameter tensor and the all-gather of the findings) and the
rest of the step. Prints the median milliseconds of each and their ratio; with ``every_n_steps = N`` the cost per
step is the check's time divided by N. ``resilience_cost.py`` measures the fingerprint pass alone, per million
parameters."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
from helpers import make_token_file  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.data import TokenFileDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.resilience import SilentCorruptionCheck  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=256,
                          max_seq_len=256),
              LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=256, max_seq_len=32))
SEQ, BATCH, STEPS, WARMUP = sized((128, 8, 14, 4), (16, 4, 3, 1))


class Clock(L.Callback):
    """Placed before and after the check in the callback list: ``mark`` times the check's ``on_train_batch_start``;
    the rest of the step runs from the second mark to the batch's end."""

    def __init__(self, times: dict, after_check: bool) -> None:
        self.times, self.after_check = times, after_check

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self.after_check:
            self.times["check"].append(now - self.times.pop("start"))
            self.times["step_start"] = now
        else:
            self.times["start"] = now

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.after_check:
            self.times["step"].append(time.perf_counter() - self.times.pop("step_start"))


def timed_run(rank: int, token_file: Path) -> dict:
    times: dict = {"check": [], "step": []}
    data = TokenFileDataModule(token_file, seq_len=SEQ, global_batch_size=BATCH, micro_batch_size=BATCH // 2, seed=0,
                               val_batches=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=MGPUStrategy(zero_stage=0),
                        callbacks=[Clock(times, False), SilentCorruptionCheck(every_n_steps=1), Clock(times, True)])
    module = LLMModule(MODEL, lr=1e-3, warmup_steps=2, max_steps=1000, global_batch_size=BATCH)
    trainer.fit(module, data)
    params = sum(p.numel() for p in module.parameters())
    # the check does not run as step 0 begins (nothing has changed yet): its first time is step 1's
    return {"check": times["check"][WARMUP:], "step": times["step"][WARMUP:], "params": params}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        token_file = make_token_file(Path(tmp), vocab=MODEL.vocab_size)
        results = run_distributed(timed_run, 2, token_file)
    check = statistics.median(t for r in results for t in r["check"]) * 1e3
    step = statistics.median(t for r in results for t in r["step"]) * 1e3
    print(f"{results[0]['params'] / 1e6:.2f}M parameters, 2 data-parallel ranks, ZeRO-0, one thread each, median of "
          f"{len(results[0]['check'])} steps a rank: check {check:.2f} ms, rest of the step {step:.1f} ms; the check "
          f"every step costs {100 * check / step:.2f} % of a step (every N steps: divide by N)")


if __name__ == "__main__":
    with recorded(__file__, "Silent corruption check per step, in a live run", about=__doc__):
        main()
