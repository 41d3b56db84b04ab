"""Training time blocked per checkpoint, synchronous against background saves (``PeriodicCheckpoint(async_save=True)``,
``checkpoint.async_save``), for the tiny model and a ~100M-parameter one. Two CPU processes, dp2 ZeRO-1, fp32; a
universal checkpoint every 5 steps; each save's blocked time is what ``PeriodicCheckpoint.blocked_s`` records on rank 0
(from the call, including any wait for the save before, to its return: synchronously, the write and the checksums
too); the median over the saves after the first. The whole run's wall time is printed beside it: the background
writes compete with training for the same two cores, so the wall time shows what the overlap costs here.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
from helpers import make_token_file  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.callbacks import PeriodicCheckpoint  # noqa: E402
from lightning_mgpu.data import TokenFileDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODELS = {"tiny": LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=256),
          "100M": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048, vocab_size=8192,
                              max_seq_len=256)}
MODELS = sized(MODELS, {"tiny": MODELS["tiny"]})
EVERY, STEPS = sized((5, 15), (2, 4))  # the first save is left out (it also creates the background groups)


def run(rank: int, token_file: Path, model: LlamaConfig, directory: Path, async_save: bool) -> tuple[list, float]:
    saver = PeriodicCheckpoint(directory, every_n_steps=EVERY, async_save=async_save)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MGPUStrategy(zero_stage=1), max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[saver])
    data = TokenFileDataModule(token_file, seq_len=32, global_batch_size=2, micro_batch_size=1, seed=0)
    start = time.perf_counter()
    trainer.fit(LLMModule(model), data)
    return saver.blocked_s, time.perf_counter() - start


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp, n_tokens=50_000, vocab=256)
    print(f"{'model':>6} {'params':>8} {'sync blocked s':>15} {'async blocked s':>16} {'async / sync':>13} "
          f"{'sync run s':>11} {'async run s':>12}")
    for name, model in MODELS.items():
        figures = {}
        for mode in (False, True):
            directory = tmp / f"{name}-{'async' if mode else 'sync'}"
            blocked, wall = run_distributed(run, 2, token_file, model, directory, mode, timeout=1800)[0]
            figures[mode] = (statistics.median(blocked[1:] or blocked), wall)
            shutil.rmtree(directory, ignore_errors=True)
        (sync_s, sync_wall), (async_s, async_wall) = figures[False], figures[True]
        print(f"{name:>6} {model.num_parameters() / 1e6:7.1f}M {sync_s:15.3f} {async_s:16.3f} "
              f"{async_s / sync_s:12.1%} {sync_wall:11.1f} {async_wall:12.1f}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    with recorded(__file__, "Checkpoints in the background", about=__doc__):
        main()
