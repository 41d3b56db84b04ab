"""Measured pipeline bubble of every schedule next to its theoretical one, on CPU processes.

For P in {2, 4} pipeline ranks (``--p2``: P = 2 only) and M in {4, 8, 16} micro-batches, each schedule trains a few steps with
``MGPUStrategy(pipeline_timeline=True)``; the last step's timeline gives the measured bubble
(``1 - busy / (ranks * makespan)``), printed beside ``theoretical_bubble``. Prints the worst excess in
percentage points. Tiny CPU stages make point-to-point latency a visible share of each action, so
measured bubbles run above theory; with P=4 on a 2-core machine four processes share two cores, so an
action's wall time includes waiting for a core and the P=4 figures overstate the bubble.
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

from helpers import TINY, fit, make_token_file  # noqa: E402

from lightning_mgpu.layout import SCHEDULES, layout_problems, theoretical_bubble  # noqa: E402
from lightning_mgpu.parallel.timeline import bubble_fraction, message_waits, replayed_bubble, start_delays  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = sized(replace(TINY, dim=256, n_heads=8, n_kv_heads=4, ffn_hidden=768, n_layers=8, max_seq_len=256),
              replace(TINY, n_layers=4))
STEPS, SEQ, MICRO = sized((3, 128, 2), (1, 16, 1))


def measure(token_file: Path, schedule: str, P: int, M: int) -> dict:
    """The last step's bubble measured, replayed with instant messages, and what its actions and messages took."""
    V = 1 if schedule in ("gpipe", "1f1b") else 2
    results = run_distributed(fit, P, token_file, P, max_steps=STEPS, model=MODEL, clip=None,
                              data=dict(global_batch_size=M * MICRO, micro_batch_size=MICRO, seq_len=SEQ),
                              pipeline_parallel_size=P, pipeline_schedule=schedule, virtual_pipeline_size=V,
                              pipeline_timeline=True)
    per_rank = [[a for a in r["timeline"] if a.step == STEPS - 1] for r in results]
    actions = [a for rank in per_rank for a in rank]
    mean = {k: statistics.mean([a.end - a.start for a in actions if a.kind == k] or [0.0]) for k in "FBW"}
    waits = message_waits(per_rank)
    return {"measured": bubble_fraction(per_rank), "replayed": replayed_bubble(per_rank), "ms": mean,
            "wait": statistics.mean(waits) if waits else 0.0, "delays": start_delays(per_rank),
            "theory": theoretical_bubble(schedule, P, M, V)}


def main() -> None:
    token_file = make_token_file(Path(tempfile.mkdtemp()), n_tokens=50_000)
    worst = (float("-inf"), "")
    print("bubble: measured; replayed = the same actions with instant messages; theory = unit costs (F 1, B 2, or "
          "B 1 + W 1 split). excess = measured - theory = (replayed - theory: unequal action times) + (measured - "
          "replayed: messages and the time between actions)")
    print(f"{'schedule':<24} {'P':>2} {'M':>3} {'measured':>9} {'theory':>7} {'excess':>7} {'durations':>9} "
          f"{'messages':>8} {'F/B/W ms':>15} {'wait ms':>7} {'delay F/B/W ms':>15}")
    for P in sized((2,) if "--p2" in sys.argv[1:] else (2, 4), (2,)):
        for M in sized((4, 8, 16), (4,)):
            for schedule in sized(SCHEDULES, ("1f1b",)):
                V = 1 if schedule in ("gpipe", "1f1b") else 2
                refused = layout_problems(world_size=P, pipeline_parallel_size=P, pipeline_schedule=schedule,
                                          virtual_pipeline_size=V, num_microbatches=M)
                if refused:
                    print(f"{schedule:<24} {P:>2} {M:>3}  refused: {refused[0]}")
                    continue
                r = measure(token_file, schedule, P, M)
                excess = 100 * (r["measured"] - r["theory"])
                worst = max(worst, (excess, f"{schedule} P={P} M={M}"))
                ms = "/".join(f"{r['ms'][k] * 1e3:.1f}" for k in "FBW")
                delay = "/".join(f"{r['delays'].get(k, 0.0) * 1e3:.2f}" for k in "FBW")
                print(f"{schedule:<24} {P:>2} {M:>3} {r['measured']:>9.1%} {r['theory']:>7.1%} {excess:>+6.1f}pp "
                      f"{100 * (r['replayed'] - r['theory']):>+8.1f}pp {100 * (r['measured'] - r['replayed']):>+7.1f}pp "
                      f"{ms:>15} {r['wait'] * 1e3:>7.2f} {delay:>15}", flush=True)
    print(f"worst excess over theory: {worst[0]:+.1f} percentage points ({worst[1]})")


if __name__ == "__main__":
    with recorded(__file__, "Pipeline bubble", about=__doc__):
        main()
