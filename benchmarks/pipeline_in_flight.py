"""Activations each pipeline rank holds in flight, measured from the schedules torch runs, next to the planner's count.

For P = 4 pipeline ranks and M in {4, 8, 16} micro-batches (DualPipeV: 8 and 16, it needs 2 P), every schedule trains two steps on CPU processes with
``MGPUStrategy(pipeline_timeline=True)``; each rank's last-step timeline gives the most stage chunks whose activations
it held at once (``lightning_mgpu.parallel.timeline.chunks_in_flight``), printed beside
``lightning_mgpu.planner.memory.in_flight_chunks``, which the planner multiplies by a chunk's activations.

Usage: python benchmarks/pipeline_in_flight.py
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

from lightning_mgpu.layout import SCHEDULES  # noqa: E402
from lightning_mgpu.parallel.timeline import chunks_in_flight  # noqa: E402
from lightning_mgpu.planner.memory import in_flight_chunks  # noqa: E402
from lightning_mgpu.testing import run_distributed  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

MODEL = replace(TINY, n_layers=sized(8, 4))
P, MICRO = sized((4, 2), (2, 1))


def main() -> None:
    token_file = make_token_file(Path(tempfile.mkdtemp()))
    print(f"| schedule | V | M | measured chunks per rank 0..{P - 1} | planned | planned >= measured |")
    print("|---|---|---|---|---|---|")
    for schedule in sized(SCHEDULES, ("1f1b",)):
        V = 1 if schedule in ("gpipe", "1f1b") else 2
        for M in sized((4, 8, 16), (4,)):
            if schedule == "dualpipev" and M < 2 * P:  # it needs 2 P micro-batches at least (a launch refuses fewer)
                continue
            results = run_distributed(fit, P, token_file, P, max_steps=sized(2, 1), model=MODEL, clip=None,
                                      data=dict(global_batch_size=M * MICRO, micro_batch_size=MICRO),
                                      pipeline_parallel_size=P, pipeline_schedule=schedule, virtual_pipeline_size=V,
                                      pipeline_timeline=True)
            measured = [chunks_in_flight(r["timeline"]) for r in results]
            planned = [in_flight_chunks(schedule, P, V, rank, M) for rank in range(P)]
            covered = all(p >= m for p, m in zip(planned, measured))
            print(f"| {schedule} | {V} | {M} | {measured} | {planned} | {'yes' if covered else 'NO'} |", flush=True)


if __name__ == "__main__":
    with recorded(__file__, "Pipeline chunks in flight", about=__doc__, markdown=True):
        sys.exit(main())
