"""DualPipeV with its forward / backward pairs overlapped on two threads against torch's sequential pairs, side by side.

The package's mixture of experts (4 layers, one per stage, the first dense; 8 experts, top-2) at expert parallel 2 x
pipeline parallel 2 on 4 forked gloo processes with one thread each, ZeRO-1, 4 micro-batches of one sequence per
replica. Each round trains ``STEPS`` steps sequentially, then the same steps overlapped, in the same processes; the
figures are medians over the steps after the first of every round. Printed: the step time of each and their ratio, the
time per step during which a forward and a backward ran at once on a rank (from the pipeline timeline; 0 when
sequential), and the largest loss and grad-norm difference between the two.

What it measures on CPU: two Python threads in one process on cores shared by the 4 ranks (2 cores here), so an
all-to-all waiting in gloo leaves its core to the other thread's matmuls, but the two threads' computations compete
for the same cores and for the interpreter's lock. It says what the overlap costs or saves there, not what it does on
GPUs with NCCL: ``--cuda`` runs the same on 4 GPUs with NCCL and a wider model (``make gpu-check`` runs it, and with
fewer than 4 GPUs prints that it needs them).

Usage: python benchmarks/pipeline_overlap.py [--smoke | --cuda]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lightning as L  # noqa: E402
from helpers import GLOBAL_BATCH, OPTIM, fit, make_token_file  # noqa: E402
from moe_helpers import TINY_MOE  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402
from step_timer import QuietLLMModule, Timer  # noqa: E402

from lightning_mgpu.testing import run_distributed  # noqa: E402

MODEL = sized(replace(TINY_MOE, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=1024,
                      max_seq_len=256, num_experts=8, experts_per_token=2, expert_hidden=256, dense_layers=1),
              replace(TINY_MOE, n_layers=4, dense_layers=1))
SEQ, STEPS, ROUNDS = sized((256, 6, 2), (32, 2, 1))
CUDA = "--cuda" in sys.argv[1:]
if CUDA:
    MODEL = replace(MODEL, dim=1024, n_heads=8, n_kv_heads=8, ffn_hidden=2816, vocab_size=4096, max_seq_len=2048,
                    expert_hidden=1408)
    SEQ, STEPS = 2048, 10
LAYOUT = dict(expert_parallel_size=2, pipeline_parallel_size=2, zero_stage=1, pipeline_schedule="dualpipev",
              virtual_pipeline_size=2, pipeline_timeline=True)


class Switch(L.Callback):
    """Turns the overlap on or off before the first step (on CPU it is off by default)."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def on_train_start(self, trainer, module) -> None:
        trainer.strategy.pipeline.overlap.enable(self.on)


def concurrent_seconds(actions: list) -> float:
    """Seconds of the last step during which a forward and a backward ran at once on this rank."""
    last = [a for a in actions if a.step == max(b.step for b in actions)]
    forwards = [a for a in last if a.kind == "F"]
    backwards = [a for a in last if a.kind in ("B", "I")]
    return sum(max(0.0, min(f.end, b.end) - max(f.start, b.start)) for f in forwards for b in backwards)


def _rank(rank: int, token_file: Path, devices: int) -> dict:
    out: dict = {True: [], False: []}
    for _ in range(ROUNDS):
        for on in (False, True):
            timer = Timer()
            module = QuietLLMModule(MODEL, **OPTIM, global_batch_size=GLOBAL_BATCH)
            result = fit(rank, token_file, devices, max_steps=STEPS, module=module, check_layout=False,
                         callbacks=[timer, Switch(on)], data=dict(micro_batch_size=1, seq_len=SEQ),
                         trainer_kw=dict(accelerator="gpu") if CUDA else None, **LAYOUT)
            out[on].append(dict(times=timer.times, concurrent=concurrent_seconds(result["timeline"]),
                                losses=result["losses"], grad_norms=result["grad_norms"]))
    return out


def main() -> None:
    if CUDA and torch.cuda.device_count() < 4:
        print(f"ratio overlapped / sequential: not run: ep2 x pp2 needs 4 GPUs, found {torch.cuda.device_count()}")
        return
    token_file = make_token_file(Path(tempfile.mkdtemp()), n_tokens=400_000 if CUDA else 60_000,
                                 vocab=MODEL.vocab_size)
    results = run_distributed(_rank, 4, token_file, 4, timeout=1200)
    step = {on: statistics.median(t for r in results for run in r[on] for t in run["times"]) for on in (False, True)}
    concurrent = {on: statistics.median(run["concurrent"] for r in results for run in r[on]) for on in (False, True)}
    diff = {key: max(abs(a - b) for r in results for s, o in zip(r[False], r[True])
                     for a, b in zip(s[key], o[key])) for key in ("losses", "grad_norms")}
    where = "4 GPUs, NCCL" if CUDA else f"4 processes, {torch.get_num_threads()} thread each, gloo"
    print(f"ep2 x pp2 DualPipeV, {where}, {ROUNDS} rounds of {STEPS} steps")
    print(f"step s: sequential {step[False]:.4f}, overlapped {step[True]:.4f}")
    print(f"forward beside backward per step (rank median): sequential {concurrent[False]:.4f} s, "
          f"overlapped {concurrent[True]:.4f} s")
    print(f"max difference overlapped - sequential: loss {diff['losses']:.1e}, grad norm {diff['grad_norms']:.1e}")
    print(f"ratio overlapped / sequential: {step[True] / step[False]:.3f}")


if __name__ == "__main__":
    with recorded(__file__, "DualPipeV's forward and backward overlapped", about=__doc__, when="--cuda" not in sys.argv[1:]):
        sys.exit(main())
