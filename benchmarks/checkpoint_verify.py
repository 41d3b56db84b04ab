"""What verifying a checkpoint's checksums adds to a resume: a ~100M-parameter model's universal checkpoint, saved
after one optimizer step, loaded by one and by two CPU processes (fp32, ZeRO-1), with and without verification
(``lightning_mgpu.checkpoint.store.verify`` replaced by a no-op), alternating, ``ROUNDS`` times each. Prints the
median time of ``strategy.load_checkpoint`` both ways, the time a full synchronous verification takes by itself, and
the growth of the load. ``--smoke``: the tiny model, one process, one round, in seconds.
"""

from __future__ import annotations

import argparse
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
from lightning_mgpu.checkpoint import store  # noqa: E402
from lightning_mgpu.data import TokenFileDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402

MODELS = {"tiny": LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=256),
          "100M": LlamaConfig(dim=768, n_layers=14, n_heads=12, n_kv_heads=4, ffn_hidden=2048, vocab_size=8192,
                              max_seq_len=256)}


ROUNDS = 3


def no_verification(path) -> None:
    """Stands in for ``store.verify``: the load without it."""


def _timed(function, seconds: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    return wrapper


def run(rank: int, devices: int, token_file: Path, model: LlamaConfig, path: str, mode: str) -> float:
    """``mode`` "save": train one step and save to ``path``; "verified" / "unverified": resume from it and take one
    more step, returning the load's seconds; "verify": a full synchronous verification alone."""
    if mode == "verify":
        torch.distributed.init_process_group("gloo")
        start = time.perf_counter()
        store.verify(path)
        return time.perf_counter() - start
    load_s: list[float] = []
    strategy = MGPUStrategy(zero_stage=1)
    strategy.load_checkpoint = _timed(strategy.load_checkpoint, load_s)
    if mode == "unverified":
        store.verify = no_verification
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1 if mode == "save" else 2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    data = TokenFileDataModule(token_file, seq_len=32, global_batch_size=2, micro_batch_size=1, seed=0,
                               val_fraction=0.1)
    trainer.fit(LLMModule(model), data, ckpt_path=None if mode == "save" else path)
    if mode == "save":
        trainer.save_checkpoint(path)
        return 0.0
    return load_s[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="the tiny model on one process, one round, in seconds")
    args = parser.parse_args()
    name, process_counts, rounds = ("tiny", (1,), 1) if args.smoke else ("100M", (1, 2), ROUNDS)
    model = MODELS[name]
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp, n_tokens=50_000, vocab=256)
    print(f"{'model':>6} {'params':>8} {'procs':>5} {'MB':>7} {'load s':>7} {'unverified':>10} {'verify alone':>12} "
          f"{'growth':>7}")
    for devices in process_counts:
        path = str(tmp / f"ckpt-{devices}")
        run_distributed(run, devices, devices, token_file, model, path, "save", timeout=900)
        times: dict[str, list[float]] = {"verified": [], "unverified": []}
        for _ in range(rounds):
            for mode in times:
                times[mode].append(run_distributed(run, devices, devices, token_file, model, path, mode,
                                                   timeout=900)[0])
        alone = run_distributed(run, devices, devices, token_file, model, path, "verify", timeout=900)[0]
        verified, unverified = (statistics.median(times[m]) for m in ("verified", "unverified"))
        megabytes = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 1e6
        print(f"{name:>6} {model.num_parameters() / 1e6:7.1f}M {devices:>5} {megabytes:7.1f} {verified:7.2f} "
              f"{unverified:10.2f} {alone:12.3f} {verified / unverified - 1:+7.1%}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    with recorded(__file__, "Checkpoint verification", about=__doc__):
        main()
