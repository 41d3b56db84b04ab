"""The chaos run's timeline: ``benchmarks/chaos_goodput.py`` trains the tiny model under ``mgpu-train``'s restarts while a
chaos thread SIGKILLs a random rank or sends it SIGTERM, at random intervals; its ``--record`` keeps the first chaos
run's faults, the step the job had reached every half second (its ``progress.json``), its ``restarts.jsonl`` and the
time lost by kind, beside the same run uninterrupted. The record is kept in ``docs/pictures/data/chaos.json``.

    python docs/pictures/chaos.py                       # runs the benchmark (about 20 minutes on 2 cores)
    python docs/pictures/chaos.py --smoke --out DIR     # draws the kept record into DIR, no run
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pictures.common import DATA, ROOT, expect, options, read_data, save  # noqa: E402

PICTURES = ("chaos.png",)
DATA_FILE = "chaos.json"
COLOURS = {"SIGKILL": "#C44E52", "SIGTERM": "#DD8452"}


def record() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "chaos_goodput.py"), "--record", str(DATA / DATA_FILE)]
    print("python benchmarks/chaos_goodput.py --record " + str((DATA / DATA_FILE).relative_to(ROOT)), flush=True)
    subprocess.run(command, check=True)


def attempts(samples: list) -> dict[int, tuple[float, float]]:
    """Each attempt's first and last reading (seconds from the start)."""
    spans: dict[int, tuple[float, float]] = {}
    for t, _, attempt in samples:
        first, _ = spans.get(attempt, (t, t))
        spans[attempt] = (first, t)
    return spans


def check(data: dict) -> None:
    """Both runs reached the last step; every restart the job recorded is an attempt that trained."""
    for run in ("chaos", "whole"):
        expect(data[run] and data[run][-1][1] == data["steps"], f"the {run} run's last reading is not its last step")
    expect(len(data["restarts"]) == max(attempts(data["chaos"])), "restarts.jsonl and the attempts disagree")


def draw(data: dict, path: Path) -> Path:
    from matplotlib.figure import Figure

    check(data)
    fig = Figure(figsize=(11, 5.8), layout="constrained")
    step_ax, attempt_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    step_ax.plot(*zip(*[(t, s) for t, s, _ in data["whole"]]), color="grey", label="uninterrupted")
    step_ax.plot(*zip(*[(t, s) for t, s, _ in data["chaos"]]), color="#4C72B0", label="under chaos")
    for ax in (step_ax, attempt_ax):
        for t, _, signal in data["faults"]:
            ax.axvline(t, color=COLOURS[signal], linewidth=1, linestyle="--" if signal == "SIGTERM" else "-")
    for signal, colour in COLOURS.items():
        step_ax.plot([], [], color=colour, linestyle="--" if signal == "SIGTERM" else "-", label=f"{signal} to a rank")
    step_ax.set(ylabel="step reached")
    step_ax.legend(fontsize=8, loc="upper left")
    draw_attempts(attempt_ax, data)
    fig.suptitle(title(data), fontsize=9)
    return save(fig, path)


def title(data: dict) -> str:
    """What the run counted: faults, restarts, steps lost, the time lost by kind (the benchmark's buckets), wall times
    and the final weights against the uninterrupted run's."""
    kinds = {k: sum(1 for *_, s in data["faults"] if s == k) for k in COLOURS}
    lost = sum(r["lost_steps"] for r in data["restarts"])
    return "\n".join([
        f"the tiny model, {data['steps']:,} steps on 2 processes, a checkpoint every {data['every']}, a fault every "
        f"{data['mean_gap_s']:.0f} s on average", f"{len(data['faults'])} faults ({kinds['SIGKILL']} SIGKILL, "
        f"{kinds['SIGTERM']} SIGTERM), {len(data['restarts'])} restarts, {lost} steps trained again",
        "time lost to the faults: " + ", ".join(f"{k} {v:.1f} s" for k, v in data["lost_s"].items()),
        f"wall time {data['chaos_s']:.0f} s under chaos, {data['whole_s']:.0f} s uninterrupted (effective training "
        f"time {data['whole_s'] / data['chaos_s']:.1%}); final weights max |diff| {data['weights_max_diff']:.1e}"])


def draw_attempts(ax, data: dict) -> None:
    """One bar per attempt, from its first step to its last; under each restart, the steps it lost."""
    lost = {r["attempt"] - 1: r["lost_steps"] for r in data["restarts"]}  # restarts.jsonl counts attempts from 1
    for attempt, (first, last) in sorted(attempts(data["chaos"]).items()):
        ax.broken_barh([(first, last - first)], (0.2, 0.6), facecolors="#4C72B0" if attempt % 2 else "#8DA0CB")
        if attempt in lost:
            ax.text(first, 0.05 - 0.4 * (attempt % 2), str(-lost[attempt]), fontsize=6.5, ha="center", va="top")
    ax.set(xlabel="seconds from the start", yticks=[0.5], yticklabels=["attempts"], ylim=(-0.8, 1))
    ax.text(1.0, -0.55, "under each restart: steps it lost", fontsize=7, ha="right", transform=ax.transAxes)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    opts = options(argv, __doc__)
    if not opts.smoke:
        record()
    return [draw(read_data(DATA_FILE), opts.out / PICTURES[0])]


if __name__ == "__main__":
    main()
