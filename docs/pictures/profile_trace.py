"""One profiled step of a tp 2 x pp 2 run, drawn from its four ranks' traces (``mgpu-train profile.steps=[2]``, which
writes ``profile/step2/rank{R}.trace.json``): each rank's pipeline actions (``PP:<stage><F|B><micro-batch>``), its
optimizer step, and the collectives gloo ran for it (tensor parallelism's all-reduces, the pipeline's sends and
receives, the loss's broadcast), on one clock. The events drawn are kept in ``docs/pictures/data/profile-trace.json``
(the traces themselves are about 9 MB a rank).

    python docs/pictures/profile_trace.py                       # runs mgpu-train on 4 CPU processes (1-2 minutes)
    python docs/pictures/profile_trace.py --smoke --out DIR     # draws the kept events into DIR, no run
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pictures.common import check_commands, expect, mgpu_train, options, read_data, save, write_data  # noqa: E402

PICTURES = ("profile-trace.png",)
DATA_FILE = "profile-trace.json"
#: the step profiled (the third: the first two warm up), micro-batches per step (global batch 8 / micro-batch 2)
STEP, M = 2, 4
OVERRIDES = ["trainer.devices=4", "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2",
             "parallel.zero_stage=1", "model.dim=256", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=768",
             "model.n_layers=8", "data.seq_len=128", "data.global_batch_size=8", "data.micro_batch_size=2",
             f"trainer.max_steps={STEP + 1}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
             f"profile.steps=[{STEP}]"]
#: what the picture draws of a trace: the step, pipeline actions, the optimizer step, collectives (gloo's or NCCL's)
DRAWN = re.compile(r"^(ProfilerStep#\d+|PP:\d+[FBW]\d+|Optimizer\.step#.*|(gloo|nccl):\w+)$")
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "optimizer": "#8172B3", "all_reduce": "#C44E52",
           "send": "#64B5CD", "recv": "#64B5CD", "other": "#937860"}


def events(trace: dict) -> list[list]:
    """The drawn events of one rank's trace, ``[name, start us, duration us]``, in the trace's own clock (kineto's,
    one clock for every process of a machine)."""
    return sorted([e["name"], e["ts"], e["dur"]] for e in trace["traceEvents"]
                  if e.get("ph") == "X" and DRAWN.match(e.get("name", "")))


def record() -> None:
    from lightning_mgpu.layout import ParallelLayout

    layout = ParallelLayout(world_size=4, tensor_parallel_size=2, pipeline_parallel_size=2)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = mgpu_train(OVERRIDES, Path(tmp) / "run")
        ranks = []
        for rank in range(4):
            trace = json.loads((run_dir / "profile" / f"step{STEP}" / f"rank{rank}.trace.json").read_text())
            coords = layout.coords(rank)
            ranks.append({"rank": rank, "tp": coords["tp"], "pp": coords["pp"], "events": events(trace)})
    t0 = min(ts for r in ranks for name, ts, _ in r["events"] if name.startswith("ProfilerStep"))
    for r in ranks:  # milliseconds from the first rank's start of the step
        r["events"] = [[name, round((ts - t0) / 1e3, 3), round(dur / 1e3, 3)] for name, ts, dur in r["events"]]
    write_data(DATA_FILE, {"command": OVERRIDES, "step": STEP, "ranks": ranks})


def check(data: dict) -> None:
    """What the picture shows: four ranks, each with the profiled step, its pipeline stage's forward and backward of
    every micro-batch once, one optimizer step, and gloo's all-reduces, sends and receives."""
    expect(data["command"] == OVERRIDES, "the kept events were recorded with another command: record them again")
    expect([(r["rank"], r["tp"], r["pp"]) for r in data["ranks"]] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)],
           "not the ranks of tp 2 x pp 2")
    for r in data["ranks"]:
        names = [name for name, _, _ in r["events"]]
        expect(names.count(f"ProfilerStep#{data['step']}") == 1, (r["rank"], "no profiled step"))
        actions = sorted(n for n in names if n.startswith("PP:"))
        expect(actions == sorted(f"PP:{r['pp']}{k}{m}" for k in "FB" for m in range(M)), (r["rank"], actions))
        expect(any(n.startswith("Optimizer.step#") for n in names), (r["rank"], "no optimizer step"))
        for collective in ("gloo:all_reduce", "gloo:send", "gloo:recv"):
            expect(collective in names, (r["rank"], f"no {collective}"))


def lane(name: str) -> tuple[int, str]:
    """(0: the rank's own work, 1: its collectives; the colour key) of a drawn event."""
    if name.startswith("PP:"):
        return 0, re.match(r"PP:\d+([FBW])", name).group(1)
    if name.startswith("Optimizer.step#"):
        return 0, "optimizer"
    kind = name.split(":", 1)[1]
    return 1, kind if kind in COLOURS else "other"


def draw(data: dict, path: Path) -> Path:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    check(data)
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax = fig.subplots()
    labels = []
    for row, r in enumerate(data["ranks"]):
        top = row * 3  # three units a rank: its work, its collectives, a gap
        for name, start, duration in r["events"]:
            if name.startswith("ProfilerStep"):
                ax.broken_barh([(start, duration)], (top - 0.5, 2.0), facecolors="#EEEEEE", zorder=0)
                continue
            sub, key = lane(name)
            ax.broken_barh([(start, max(duration, 0.05))], (top + sub - 0.4, 0.8), facecolors=COLOURS[key],
                           edgecolor="white" if sub == 0 else "none", linewidth=0.5)
            if sub == 0 and key in "FBW":
                ax.text(start + duration / 2, top, name.removeprefix("PP:"), ha="center", va="center", fontsize=6,
                        color="white", clip_on=True)
        labels += [(top, f"rank {r['rank']} (tp {r['tp']}, pp {r['pp']})"), (top + 1, "collectives")]
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start on the first rank")
    legend = [Patch(color=COLOURS[k], label=text) for k, text in (
        ("F", "forward (PP:<stage>F<micro-batch>)"), ("B", "backward (PP:<stage>B<micro-batch>)"),
        ("optimizer", "optimizer step"), ("all_reduce", "gloo:all_reduce"), ("send", "gloo:send / gloo:recv"),
        ("other", "other collectives"))] + [Patch(color="#EEEEEE", label=f"ProfilerStep#{data['step']}")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(f"step {data['step']} of tp 2 x pp 2 (1F1B, {M} micro-batches) on 4 CPU processes, from each rank's "
                 "profile/step2/rank<R>.trace.json", fontsize=9)
    return save(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    opts = options(argv, __doc__)
    if opts.smoke:
        check_commands([OVERRIDES])
    else:
        record()
    return [draw(read_data(DATA_FILE), opts.out / PICTURES[0])]


if __name__ == "__main__":
    main()
