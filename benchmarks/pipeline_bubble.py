"""Measured pipeline bubble of every schedule next to its theoretical one, on CPU processes.

For P in {2, 4} pipeline ranks and M in {4, 8, 16} micro-batches, each schedule trains a few steps with
``MGPUStrategy(pipeline_timeline=True)``; the last step's timeline gives the measured bubble
(``1 - busy / (ranks * makespan)``), printed beside ``theoretical_bubble``. Prints the worst excess in
percentage points. Tiny CPU stages make point-to-point latency a visible share of each action, so
measured bubbles run above theory; with P=4 on a 2-core machine four processes share two cores, so an
action's wall time includes waiting for a core and the P=4 figures overstate the bubble.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import TINY, fit, make_token_file  # noqa: E402

from lightning_mgpu.layout import SCHEDULES, layout_problems  # noqa: E402
from lightning_mgpu.parallel.timeline import bubble_fraction, theoretical_bubble  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402

MODEL = replace(TINY, dim=256, n_heads=8, n_kv_heads=4, ffn_hidden=768, n_layers=8, max_seq_len=256)
STEPS, SEQ, MICRO = 3, 128, 2


def measure(token_file: Path, schedule: str, P: int, M: int) -> float:
    V = 1 if schedule in ("gpipe", "1f1b") else 2
    results = run_distributed(fit, P, token_file, P, max_steps=STEPS, model=MODEL, clip=None,
                              data=dict(global_batch_size=M * MICRO, micro_batch_size=MICRO, seq_len=SEQ),
                              pipeline_parallel_size=P, pipeline_schedule=schedule, virtual_pipeline_size=V,
                              pipeline_timeline=True)
    return bubble_fraction([[a for a in r["timeline"] if a.step == STEPS - 1] for r in results])


def main() -> None:
    token_file = make_token_file(Path(tempfile.mkdtemp()), n_tokens=50_000)
    worst = (float("-inf"), "")
    print(f"{'schedule':<24} {'P':>2} {'M':>3} {'measured':>9} {'theory':>7} {'excess':>7}")
    for P in (2, 4):
        for M in (4, 8, 16):
            for schedule in SCHEDULES:
                V = 1 if schedule in ("gpipe", "1f1b") else 2
                refused = layout_problems(world_size=P, pipeline_parallel_size=P, pipeline_schedule=schedule,
                                          virtual_pipeline_size=V, num_microbatches=M)
                if refused:
                    print(f"{schedule:<24} {P:>2} {M:>3}  refused: {refused[0]}")
                    continue
                measured = measure(token_file, schedule, P, M)
                theory = theoretical_bubble(schedule, P, M, V)
                excess = 100 * (measured - theory)
                worst = max(worst, (excess, f"{schedule} P={P} M={M}"))
                print(f"{schedule:<24} {P:>2} {M:>3} {measured:>9.1%} {theory:>7.1%} {excess:>+6.1f}pp", flush=True)
    print(f"worst excess over theory: {worst[0]:+.1f} percentage points ({worst[1]})")


if __name__ == "__main__":
    main()
