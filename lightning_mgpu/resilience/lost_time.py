"""Where the wall time of a job that failed and restarted went, from the job's own records: every second between its
start and its end is either a step at the uninterrupted run's mean step time or named by a bucket.

The records are the run directory's (:mod:`lightning_mgpu.resilience.restarts`): rank 0's step log (``steps.csv``:
every optimizer step's end, per attempt), each restarted attempt's times (``restarts.jsonl``: its process began, its
run's objects built, process group up, engine built, checkpoint restored) and the agent's record of each failed
attempt (``attempts.jsonl``: when it saw the attempt end and with what status); with the faults' times when they are
known (a chaos run's). Between the last step of an attempt and the restore of the next one that stepped, the time is
split by those timestamps; within attempts, each step's duration is compared with the mean step of a reference run
(the same job uninterrupted, its steps without a checkpoint): the first steps after a restore, the steps that carried
a periodic checkpoint and the other steps each form a bucket, less the reference's own excess for the same kinds of
step. The mean, not the median: on shared cores step times are skewed (a median of 77-79 ms against a mean of 97-112
ms in two runs here), and a sum of steps against the median charges every step the skew. What is left is the
difference in the runs' start and end (set-up before the first step, the last save and exit).

Google's goodput buckets (scheduling, runtime start, program start, checkpoint, lost progress) name the same costs for a
whole cluster; here they are one job's, from its records rather than a fleet's telemetry. Reads files only.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_mgpu.resilience.restarts import read_restarts, read_step_log

#: The agent's record of the attempts that failed (``lightning_mgpu.resilience.elastic.ATTEMPTS``; not imported, so
#: that reading records imports no part of torch's agent).
ATTEMPTS = "attempts.jsonl"
#: Exit status of a preempted rank (``lightning_mgpu.resilience.preemption.REQUEUE_EXIT``).
PREEMPTED = 75
#: Steps after a restore counted as its first steps (a bucket of their own).
FIRST_STEPS = 20
#: The buckets, in the order a restart meets them; the last two are the machine's, not a restart's.
RESTART_BUCKETS = ("step cut short", "emergency checkpoint", "noticed", "failed attempts", "stop and fork",
                   "build", "process group", "engine", "restore", "first steps", "re-trained steps",
                   "periodic saves")
MACHINE_BUCKETS = ("other steps", "start and end")
#: The phases of a restarted attempt in ``restarts.jsonl``, each named by the bucket its time goes to.
PHASES = (("forked", "stop and fork"), ("built", "build"), ("grouped", "process group"), ("set_up", "engine"),
          ("restored", "restore"))


@dataclass
class Job:
    """One run's records: its start and end (unix seconds, taken by whoever started it), its steps by attempt, its
    restarted attempts' times, the agent's failed attempts and the faults sent to it as (unix time, signal name)."""

    began: float
    ended: float
    steps: dict[int, list[tuple[int, float]]]
    restarts: list[dict] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)

    @classmethod
    def read(cls, run_dir: Path, began: float, ended: float, faults: list[tuple[float, str]] = ()) -> "Job":
        path = Path(run_dir) / ATTEMPTS
        attempts = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        return cls(began, ended, read_step_log(run_dir), read_restarts(run_dir), attempts, sorted(faults))

    def durations(self, every: int, first: int = FIRST_STEPS) -> list[tuple[str, float]]:
        """(kind, seconds) of every step but the job's very first (its set-up is the start): ``first`` (one of the first
        ``first`` steps after a restore, from the restore), ``save`` (a step after a periodic checkpoint's, whose
        blocking part it holds) or ``other``."""
        return [(kind, seconds) for _, kind, seconds in self._steps(every, first)]

    def other_step_means(self, every: int, first: int = FIRST_STEPS) -> dict[str, Optional[float]]:
        """The mean of the ``other`` steps in the first attempt and in the restarted ones (None where there are none):
        a restart that left its later steps slower would show here; steps that only move with the machine's load move
        in every attempt alike."""
        by_attempt: dict[str, list[float]] = {"first attempt": [], "restarted attempts": []}
        for number, kind, seconds in self._steps(every, first):
            if kind == "other":
                by_attempt["restarted attempts" if number else "first attempt"].append(seconds)
        return {name: statistics.fmean(d) if d else None for name, d in by_attempt.items()}

    def _steps(self, every: int, first: int) -> list[tuple[int, str, float]]:
        restored = {r["attempt"] - 1: r["restored"] for r in self.restarts}
        out = []
        for number, steps in sorted(self.steps.items()):
            previous = restored.get(number) if number else None
            for index, (step, end) in enumerate(steps):
                if previous is not None:
                    kind = "first" if number and index < first else "save" if (step - 1) % every == 0 else "other"
                    out.append((number, kind, end - previous))
                previous = end
        return out

    def median_step(self) -> float:
        return statistics.median(d for _, d in self.durations(1 << 62, 0))

    def mean_step(self, every: int) -> float:
        """The mean of the steps that carried no periodic checkpoint (the cost of a step, noise and all)."""
        return statistics.fmean(d for kind, d in self.durations(every, 0) if kind == "other")


def excess(durations: list[tuple[str, float]], step_s: float) -> dict[str, float]:
    """Seconds beyond ``step_s`` summed by kind of step."""
    out = dict.fromkeys(("first", "save", "other"), 0.0)
    for kind, seconds in durations:
        out[kind] += seconds - step_s
    return out


def lost_time(job: Job, reference: Job, every: int, step_s: Optional[float] = None,
              first: int = FIRST_STEPS) -> dict[str, float]:
    """Seconds ``job`` took beyond ``reference`` (the same run uninterrupted), by bucket; they sum to the difference of
    their wall times. ``step_s``: what a step costs (by default the reference's :meth:`Job.mean_step`)."""
    step_s = reference.mean_step(every) if step_s is None else step_s
    buckets = dict.fromkeys(RESTART_BUCKETS + MACHINE_BUCKETS, 0.0)
    for gap in gaps(job):
        for name, seconds in gap.items():
            buckets[name] += seconds
    mine, theirs = job.durations(every, first), reference.durations(every, first)
    buckets["re-trained steps"] = (len(mine) - len(theirs)) * step_s
    ours, base = excess(mine, step_s), excess(theirs, step_s)
    buckets["first steps"] = ours["first"]
    buckets["periodic saves"] = ours["save"] - base["save"]
    buckets["other steps"] = ours["other"] - base["other"]
    buckets["start and end"] = (job.ended - job.began) - (reference.ended - reference.began) - sum(buckets.values())
    return buckets


def gaps(job: Job) -> list[dict[str, float]]:
    """For each restart after which training went on: the seconds from the last step before it to the restore after
    it, split by the records' timestamps."""
    restarted = {r["attempt"] - 1: r for r in job.restarts}
    numbers = sorted(job.steps)
    return [split_gap(job, job.steps[a][-1][1], restarted[b]) for a, b in zip(numbers, numbers[1:]) if b in restarted]


def split_gap(job: Job, last_end: float, restart: dict) -> dict[str, float]:
    """One restart: the last step's end, the fault (a SIGKILL's time is work lost; a preempted attempt ends after its
    emergency checkpoint), when the agent saw that attempt and any attempts after it end that never stepped, then the
    restarted attempt's own phases."""
    out: dict[str, float] = {}
    start = restart.get("forked") or restart["built"]
    ends = [a for a in job.attempts if last_end <= a["ended"] <= start] or [{"ended": start, "status": 0}]
    seen, last_seen = ends[0]["ended"], ends[-1]["ended"]
    fault = max((t for t, _ in job.faults if t <= seen), default=last_end)
    if ends[0]["status"] == PREEMPTED:
        out["emergency checkpoint"] = seen - last_end
    else:
        cut = min(max(fault - last_end, 0.0), seen - last_end)
        out["step cut short"], out["noticed"] = cut, seen - last_end - cut
    out["failed attempts"] = last_seen - seen
    previous = last_seen
    for key, bucket in PHASES:
        if restart.get(key) is not None:
            out[bucket] = out.get(bucket, 0.0) + restart[key] - previous
            previous = restart[key]
    return out
