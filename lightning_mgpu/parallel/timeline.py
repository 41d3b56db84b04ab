"""Pipeline timelines: when each forward / backward action ran on each rank, the bubble, and a Gantt chart.

Recording wraps the three per-micro-batch methods of a ``PipelineStage`` (forward, backward, and the
zero-bubble schedules' separate weight-gradient step) with wall-clock timers. Times are
``time.perf_counter()``, one system-wide monotonic clock on Linux, so ranks of one machine are
comparable; ranks on different machines are not.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence


#: A ``PipelineStage``'s per-micro-batch methods and the letter of their action (torch's ``_Action`` names).
ACTION_METHODS = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


@dataclass(frozen=True)
class Action:
    """One action of one micro-batch on one stage: kind "F", "B" or "W", wall-clock start and end (s)."""

    step: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


class PipelineTimeline:
    """Records this rank's actions, step by step (``MGPUStrategy(pipeline_timeline=True)`` turns it on)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.step = -1
        self.recording = False

    def next_step(self) -> None:
        """Start recording the next training step."""
        self.step += 1
        self.recording = True

    def pause(self) -> None:
        """Stop recording (evaluation passes are not part of a training step)."""
        self.recording = False

    def instrument(self, stage: Any) -> None:
        """Time ``stage``'s forward, backward and weight-gradient calls."""
        for method, kind in ACTION_METHODS:
            original = getattr(stage, method)

            def timed(chunk_id: int, *args: Any, _original=original, _kind=kind, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = _original(chunk_id, *args, **kwargs)
                if self.recording:
                        self.actions.append(Action(self.step, stage.stage_index, _kind, chunk_id, start,
                                               time.perf_counter()))
                return out

            setattr(stage, method, timed)

    def of_step(self, step: int) -> list[Action]:
        return [a for a in self.actions if a.step == step]


def chunks_in_flight(actions: Sequence[Action]) -> int:
    """The most stage chunks whose activations one rank held at once in the last step of ``actions`` (its timeline):
    a forward adds one; the backward that frees them removes it (the weight-gradient step, when the schedule splits it
    off, since the input-gradient step leaves what the weight gradients need)."""
    last = [a for a in actions if a.step == max(b.step for b in actions)]
    split = {(a.stage, a.microbatch) for a in last if a.kind == "W"}
    held = most = 0
    for a in sorted(last, key=lambda a: a.start):
        if a.kind == "F":
            held += 1
            most = max(most, held)
        elif a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
            held -= 1
    return most


def bubble_fraction(per_rank: Sequence[Sequence[Action]]) -> float:
    """Idle share of the step: ``1 - busy / (ranks * makespan)``, the makespan from the first action on any
    rank to the last one on any rank."""
    actions = [a for rank in per_rank for a in rank]
    if not actions:
        raise ValueError("no pipeline actions recorded; was the timeline enabled and a step run?")
    span = max(a.end for a in actions) - min(a.start for a in actions)
    busy = sum(a.end - a.start for a in actions)
    return 1.0 - busy / (len(per_rank) * span)


def replayed_bubble(per_rank: Sequence[Sequence[Action]]) -> float:
    """The bubble the same step would have had if every action took the time it measured and every message between
    stages arrived at once: each rank replays its own actions in the order it ran them, each starting when its rank
    is free and what it needs is done (a forward needs the previous stage's forward of its micro-batch; an input
    gradient, the next stage's, or the last stage's own forward; a weight gradient, its own input gradient).

    Measured minus replayed is what the messages and the time between actions cost (point-to-point latency, Python);
    replayed minus ``lightning_mgpu.layout.theoretical_bubble`` is what unequal action times cost (a backward that is not twice a
    forward, a first or last stage with more work)."""
    last_stage = max(a.stage for rank in per_rank for a in rank)
    queues = [sorted(rank, key=lambda a: a.start) for rank in per_rank]
    done: dict[tuple[str, int, int], float] = {}
    free, busy, position = [0.0] * len(queues), 0.0, [0] * len(queues)
    while any(position[r] < len(q) for r, q in enumerate(queues)):
        progressed = False
        for r, queue in enumerate(queues):
            while position[r] < len(queue):
                a = queue[position[r]]
                need = _dependency(a, last_stage)
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need is not None else 0.0)
                free[r] = done[(a.kind, a.stage, a.microbatch)] = start + (a.end - a.start)
                busy += a.end - a.start
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded actions wait on one another: not one step of one pipeline")
    return 1.0 - busy / (len(queues) * max(free))


def message_waits(per_rank: Sequence[Sequence[Action]]) -> list[float]:
    """Seconds between the end of an action on one rank and the start of the action on another rank that needed it,
    where that rank had nothing else to do meanwhile: what a point-to-point message (and the Python between the two
    actions) cost in that step, one figure per such wait."""
    by_key = {(a.kind, a.stage, a.microbatch): (r, a) for r, rank in enumerate(per_rank) for a in rank}
    last_stage = max(a.stage for rank in per_rank for a in rank)
    waits = []
    for r, rank in enumerate(per_rank):
        ordered = sorted(rank, key=lambda a: a.start)
        for before, a in zip([None] + ordered[:-1], ordered):
            need = _dependency(a, last_stage)
            if need is None or need not in by_key or by_key[need][0] == r:
                continue
            sent = by_key[need][1].end
            if before is None or before.end <= sent:  # idle from when the input was ready until it started
                waits.append(a.start - sent)
    return waits


def start_delays(per_rank: Sequence[Sequence[Action]]) -> dict[str, float]:
    """Mean seconds, per action kind, between the moment an action could have started (its rank free and its input
    done, on any rank) and its start: the cost of messages and of the code between actions, which a replay with
    instant messages (:func:`replayed_bubble`) removes."""
    ends = {(a.kind, a.stage, a.microbatch): a.end for rank in per_rank for a in rank}
    last_stage = max(a.stage for rank in per_rank for a in rank)
    first = min(a.start for rank in per_rank for a in rank)  # every rank is free from the step's first action on
    delays: dict[str, list[float]] = {}
    for rank in per_rank:
        ordered = sorted(rank, key=lambda a: a.start)
        for before, a in zip([None] + ordered[:-1], ordered):
            need = _dependency(a, last_stage)
            ready = max(before.end if before is not None else first, ends.get(need, first) if need else first)
            delays.setdefault(a.kind, []).append(max(0.0, a.start - ready))
    return {kind: sum(d) / len(d) for kind, d in delays.items()}


def _dependency(a: Action, last_stage: int) -> tuple[str, int, int] | None:
    """The action whose result ``a`` needs (None for the first stage's forwards)."""
    if a.kind == "F":
        return None if a.stage == 0 else ("F", a.stage - 1, a.microbatch)
    if a.kind == "B":
        return ("F", a.stage, a.microbatch) if a.stage == last_stage else ("B", a.stage + 1, a.microbatch)
    return ("B", a.stage, a.microbatch)


def plot_timeline(per_rank: Sequence[Sequence[Action]], path: str | Path, title: str = "") -> Path:
    """Write a Gantt chart (one row per pipeline rank, forward / backward / weight colours, micro-batch labels)."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("plot_timeline needs matplotlib: pip install 'lightning_mgpu[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    t0 = min(a.start for rank in per_rank for a in rank)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(per_rank) + 1.2))
    for row, actions in enumerate(per_rank):
        for a in actions:
            ax.broken_barh([((a.start - t0) * 1e3, (a.end - a.start) * 1e3)], (row - 0.4, 0.8),
                           facecolors=colours[a.kind], edgecolor="white", linewidth=0.5)
            ax.text((a.start - t0 + (a.end - a.start) / 2) * 1e3, row, str(a.microbatch), ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, ["forward", "backward", "weight grad"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or f"bubble {bubble_fraction(per_rank):.1%}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_actions(per_rank: Sequence[Sequence[Action]], path: str | Path, title: str = "") -> Path:
    """Write one step's actions, a list per pipeline rank, and the chart's title as JSON (``timeline.json`` beside
    ``mgpu-train``'s ``timeline.png``); :func:`load_actions` reads them back."""
    path = Path(path)
    path.write_text(json.dumps({"title": title, "ranks": [[asdict(a) for a in rank] for rank in per_rank]}))
    return path


def load_actions(path: str | Path) -> tuple[list[list[Action]], str]:
    """The actions per pipeline rank and the title that :func:`save_actions` wrote."""
    record = json.loads(Path(path).read_text())
    return [[Action(**a) for a in rank] for rank in record["ranks"]], record["title"]


def gather_step(timeline: "PipelineTimeline | None", layout: Any, step: int) -> list[list[Action]] | None:
    """One step's actions of the first model replica's pipeline ranks (tp rank 0, dp rank 0), ordered by pipeline
    rank, on global rank 0 (``None`` elsewhere). Collective: every rank calls it."""
    import torch.distributed as dist

    mine = timeline.of_step(step) if timeline is not None else []
    coords = layout.coords(dist.get_rank())
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, (coords, mine))
    if dist.get_rank() != 0:
        return None
    rows = {c["pp"]: actions for c, actions in box if c["tp"] == 0 and c["dp"] == 0 and c["rep"] == 0}
    return [rows[p] for p in sorted(rows)]
