"""Each pipeline schedule's timeline as ``mgpu-train parallel.pipeline_timeline=true`` records it: the last of three
steps of an 8-layer model (dim 256) on 2 CPU processes, 4 micro-batches, the shortest step of three runs. A run writes
``timeline.json`` (the actions of each pipeline rank) beside its ``timeline.png``; the first is kept in
``docs/pictures/data/timeline-SCHEDULE.json`` and drawn, as the run draws the second, by
``lightning_mgpu.parallel.timeline.plot_timeline``.

    python docs/pictures/schedules.py                       # runs mgpu-train 3 times a schedule (about 6 minutes)
    python docs/pictures/schedules.py --smoke --out DIR     # draws the kept timelines into DIR, no run
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_mgpu.layout import MULTI_STAGE_SCHEDULES, SCHEDULES, stage_ids  # noqa: E402
from pictures.common import DATA, check_commands, expect, mgpu_train, options  # noqa: E402

PICTURES = tuple(f"timeline-{s}.png" for s in SCHEDULES)
#: P pipeline ranks, M micro-batches (global batch / micro-batch), the steps of each run, runs per schedule
P, M, STEPS, TRIES = 2, 4, 3, 3
COMMON = ["trainer.devices=2", f"parallel.pipeline_parallel_size={P}", "parallel.pipeline_timeline=true",
          "parallel.zero_stage=1", "model.dim=256", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=768",
          "model.n_layers=8", "data.seq_len=128", f"data.global_batch_size={2 * M}", "data.micro_batch_size=2",
          f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"]


def virtual(schedule: str) -> int:
    """Stage chunks per rank: two for the multi-stage schedules (a V for zbv and dualpipev), else one."""
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def overrides(schedule: str) -> list[str]:
    return [f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_pipeline_size={virtual(schedule)}", *COMMON]


def data_file(schedule: str) -> Path:
    return DATA / f"timeline-{schedule}.json"


def record() -> None:
    """Train :data:`TRIES` times per schedule; keep the ``timeline.json`` of the run whose step was shortest (a step
    that other work on the machine slowed down shows its waits, not the schedule's)."""
    from lightning_mgpu.parallel.timeline import load_actions

    def makespan(run_dir: Path) -> float:
        actions = [a for rank in load_actions(run_dir / "timeline.json")[0] for a in rank]
        return max(a.end for a in actions) - min(a.start for a in actions)

    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            runs = [mgpu_train(overrides(schedule), Path(tmp) / f"{schedule}-{i}") for i in range(TRIES)]
            shutil.copyfile(min(runs, key=makespan) / "timeline.json", data_file(schedule))


def check(schedule: str, per_rank, title: str) -> None:
    """What the chart shows: one row per pipeline rank, each stage chunk's forward and backward of every micro-batch
    exactly once, on the rank that holds that chunk, for the schedule named in the title."""
    expect(title.startswith(f"{schedule}, P={P}, M={M}, V={virtual(schedule)}:"), (schedule, title))
    expect(len(per_rank) == P, (schedule, len(per_rank)))
    for rank, actions in enumerate(per_rank):
        expect({a.stage for a in actions} == set(stage_ids(P, virtual(schedule), schedule, rank)), (schedule, rank))
    done = Counter((a.kind, a.stage, a.microbatch) for actions in per_rank for a in actions)
    for kind in "FB":
        for stage in range(P * virtual(schedule)):
            for microbatch in range(M):
                expect(done[(kind, stage, microbatch)] == 1, (schedule, kind, stage, microbatch))


def draw(out: Path) -> list[Path]:
    from lightning_mgpu.parallel.timeline import load_actions, plot_timeline

    paths = []
    for schedule, picture in zip(SCHEDULES, PICTURES):
        per_rank, title = load_actions(data_file(schedule))
        check(schedule, per_rank, title)
        paths.append(plot_timeline(per_rank, out / picture, title))
        print(f"drew {paths[-1]}", flush=True)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    opts = options(argv, __doc__)
    if opts.smoke:
        check_commands([overrides(s) for s in SCHEDULES])
    else:
        record()
    return draw(opts.out)


if __name__ == "__main__":
    main()
