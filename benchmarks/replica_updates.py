"""Replica updates on the built-in corpus: the tiny Llama on 4 CPU processes, trained with ``replica_update="sync"``
(gradients over all 4 ranks every step), with ``"local"`` (2 replicas of 2 ranks, an outer step every H steps:
DiLoCo's Nesterov outer step, and plain averaging) and with ``"async"`` (DiLoCo's outer step on sharded global
weights, at most 2 rounds ahead), at equal tokens. Prints the final training loss, the validation loss, the elements
that cross between the two halves of the ranks (as if each replica were a site and the halves were joined by a slow
link: the collectives' elements, and under ``async`` the pushed and pulled slices) and the wall time.

    python benchmarks/replica_updates.py [--steps 256] [--sync-every 16] [--only async]
    # --smoke: 2 steps, H=2, 32 tokens, sync and async (the script's two kinds of run)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_mgpu import LLMModule, MGPUStrategy  # noqa: E402
from lightning_mgpu.data import StdlibCorpusDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

WORLD = 4
SEQ, VAL_BATCHES = sized((128, 4), (32, 1))
VARIANTS = {"sync": {}, "local (DiLoCo: Nesterov, lr 0.7, momentum 0.9)": {"outer_optimizer": None},
            "local (averaging: SGD, lr 1)": {"outer_optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}},
            "async (DiLoCo outer step, at most 2 rounds ahead)": {"replica_update": "async", "max_staleness": 2}}


def count_crossing(counter: list) -> None:
    """Add to ``counter[0]`` the elements of every collective whose group has ranks in both halves of the world."""
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "reduce_scatter",
                 "all_gather"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(WORLD))
            tensor = kwargs.get("tensor", args[0] if args else None)
            if len({r * 2 // WORLD for r in ranks}) > 1 and torch.is_tensor(tensor):
                counter[0] += tensor.numel()
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def train(rank: int, variant: str, steps: int, sync_every: int) -> dict:
    crossing = [0]
    count_crossing(crossing)
    extra = dict(VARIANTS[variant])
    if variant != "sync":
        extra.update(replicas=2, replica_update=extra.get("replica_update", "local"), sync_every=sync_every)
    model = LlamaConfig.from_name("tiny")
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=MGPUStrategy(zero_stage=1, **extra),
                        max_steps=steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=steps, limit_val_batches=VAL_BATCHES)
    data = StdlibCorpusDataModule(seq_len=SEQ, global_batch_size=16, micro_batch_size=4, seed=1234,
                                  val_batches=VAL_BATCHES)
    start = time.perf_counter()
    trainer.fit(LLMModule(model, lr=3e-3, warmup_steps=10, max_steps=steps, global_batch_size=16), data)
    seconds, metrics = time.perf_counter() - start, trainer.callback_metrics
    sync = trainer.strategy._replica_sync  # async: its pushes and pulls are point-to-point, not collectives
    moved = getattr(sync, "sent_elements", 0) + getattr(sync, "received_elements", 0)
    return {"train": float(metrics["train/loss"]), "val": float(metrics["val/loss"]), "elements": crossing[0] + moved,
            "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--only", choices=[v.split()[0] for v in VARIANTS], help="the variants of one update rule")
    parser.add_argument("--smoke", action="store_true", help="2 steps, H=2, 32 tokens, sync and async")
    args = parser.parse_args()
    variants = [v for v in VARIANTS if args.only is None or v.split()[0] == args.only]
    if args.smoke:
        args.steps, args.sync_every, variants = 2, 2, variants[:1] + variants[3:]
    print(f"tiny Llama, built-in corpus, {WORLD} CPU processes, ZeRO-1, global batch 16 x {SEQ} tokens, {args.steps} "
          f"steps; local: 2 replicas of 2 ranks, H={args.sync_every}")
    print("| update | train loss (last step) | val loss | elements across the halves | wall s |")
    print("|---|---|---|---|---|")
    for variant in variants:
        results = run_distributed(train, WORLD, variant, args.steps, args.sync_every, timeout=3600)
        r = results[0]
        print(f"| {variant} | {sum(x['train'] for x in results) / WORLD:.3f} | {r['val']:.3f} | "
              f"{max(x['elements'] for x in results):,} | {r['seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    with recorded(__file__, "Replica updates", about=__doc__, when="--only" not in sys.argv[1:]):
        sys.exit(main())
