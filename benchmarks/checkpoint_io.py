"""Universal checkpoints: save and load time and bytes on disk, for the tiny model and a ~100M-parameter model,
at two layouts (dp2 ZeRO-1, tp2), plus the time of a resharding load (saved by dp2, loaded by tp2) relative to a
same-layout load. Two CPU processes, fp32, after one optimizer step (so Adam moments exist).
"""

from __future__ import annotations

import shutil
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
from lightning_mgpu.data import TokenFileDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from smoke import sized  # noqa: E402

MODELS = {"tiny": LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=256),
          "100M": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048, vocab_size=8192,
                              max_seq_len=256)}
MODELS = sized(MODELS, {"tiny": MODELS["tiny"]})
LAYOUTS = sized({"dp2-zero1": dict(zero_stage=1), "tp2": dict(tensor_parallel_size=2)},
                {"dp2-zero1": dict(zero_stage=1)})  # the smoke mode: one layout, no resharding load


class Timed(L.Callback):
    def __init__(self) -> None:
        self.load_s = None

    def on_train_start(self, trainer, module) -> None:
        self.load_s = getattr(trainer.strategy, "_bench_load_s", None)


def run(rank, token_file, model, layout, save_to=None, load_from=None):
    strategy = MGPUStrategy(**layout)
    original = strategy.load_checkpoint

    def timed_load(path, **kw):
        start = time.perf_counter()
        out = original(path, **kw)
        strategy._bench_load_s = time.perf_counter() - start
        return out

    strategy.load_checkpoint = timed_load
    timed = Timed()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1 if load_from is None else 2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timed])
    data = TokenFileDataModule(token_file, seq_len=32, global_batch_size=2, micro_batch_size=1, seed=0,
                               val_fraction=0.1)
    trainer.fit(LLMModule(model), data, ckpt_path=load_from)
    save_s = None
    if save_to:
        start = time.perf_counter()
        trainer.save_checkpoint(save_to)
        save_s = time.perf_counter() - start
    return save_s, timed.load_s


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp, n_tokens=50_000, vocab=256)
    print(f"{'model':>6} {'params':>8} {'layout':>10} {'save s':>7} {'load s':>7} {'MB':>8}")
    for name, model in MODELS.items():
        ckpts = {}
        for lname, layout in LAYOUTS.items():
            ckpt = tmp / f"{name}-{lname}"
            save_s = run_distributed(run, 2, token_file, model, layout, save_to=str(ckpt), timeout=900)[0][0]
            load_s = run_distributed(run, 2, token_file, model, layout, load_from=str(ckpt), timeout=900)[0][1]
            ckpts[lname] = (ckpt, load_s)
            print(f"{name:>6} {model.num_parameters() / 1e6:7.1f}M {lname:>10} {save_s:7.2f} {load_s:7.2f} "
                  f"{size(ckpt) / 1e6:8.1f}", flush=True)
        if "tp2" not in LAYOUTS:
            continue
        reshard_s = run_distributed(run, 2, token_file, model, LAYOUTS["tp2"], load_from=str(ckpts["dp2-zero1"][0]),
                                    timeout=900)[0][1]
        print(f"{name:>6}: load of the dp2 checkpoint into tp2 {reshard_s:.2f} s = "
              f"{reshard_s / ckpts['tp2'][1]:.2f} x a same-layout tp2 load", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
