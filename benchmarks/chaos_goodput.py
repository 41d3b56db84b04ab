"""Goodput under chaos: a 2-process ``mgpu-train`` job of the tiny model runs on torch's elastic agent
(``cluster.max_restarts``) while a chaos thread sends it faults at seeded, exponentially distributed intervals (one
chaos run per mean interval, 20 s and 60 s), each to one of the job's ranks chosen at random: SIGKILL (a lost rank:
the agent stops the other rank and restarts both from the newest checkpoint) or SIGTERM (a preemption: an emergency
checkpoint, exit 75, a restart with no step lost), chosen at random. Each chaos run ends on the weights of the same run
uninterrupted, bit for bit (both save their last step: ``checkpoint.save_last``).

The uninterrupted run (the same command, under the agent too) runs before, between and after the chaos runs, so that
each chaos run has one on either side: the effective training time is their mean wall time over the chaos run's,
printed with the range the uninterrupted runs' spread gives it. The time a chaos run lost (its wall time less theirs)
is split from the job's own records (``lightning_mgpu.resilience.lost_time``: rank 0's step log, each restarted
attempt's timestamps, the agent's record of each failed attempt) and the faults' times into buckets that a restart
causes -- the step a SIGKILL cut short, the emergency checkpoint of a SIGTERM, the agent noticing, attempts that
failed before stepping, the agent's stop and fork, building the run's objects, the process group, the engine, the
restore, the first steps after the restore beyond the uninterrupted runs' mean step, the re-trained steps at that
mean, the periodic saves beyond the uninterrupted run's -- and two that the machine's load causes: the other steps
beyond the mean (less the uninterrupted run's own; the mean of those steps in the chaos run's first attempt and in its
restarted attempts, printed beside the uninterrupted runs', shows whether a restart left its later steps slower) and
the runs' start and end. The restart latency is from each SIGKILL to the restarted attempt's first optimizer step.

``--steps N`` and ``--gaps 20,60`` change the run (a short profiling run: ``--steps 3000 --gaps 20``). The smoke mode
runs one short job with no fault (and so no agent), as its own reference, forked from this process rather than started
as a fresh interpreter: it measures nothing.

``--record PATH`` writes the timeline of the first uninterrupted run and the first chaos run as JSON: every fault
(seconds from the start, signal), the step the job had reached and its attempt, read from its ``progress.json`` every
half second, and the job's ``restarts.jsonl`` and ``attempts.jsonl`` (``docs/pictures/chaos.py`` draws it). The smoke
mode always writes it, into its temporary folder without the option.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cli_helpers import TINY_ARGS  # noqa: E402
from forked_cli import popen_cli  # noqa: E402
from helpers import make_token_file  # noqa: E402
from record import recorded  # noqa: E402
from smoke import SMOKE, sized  # noqa: E402

from lightning_mgpu.checkpoint.universal import read_model_weights  # noqa: E402
from lightning_mgpu.resilience.lost_time import MACHINE_BUCKETS, RESTART_BUCKETS, Job, lost_time  # noqa: E402
from lightning_mgpu.resilience.restarts import PROGRESS  # noqa: E402

BIN = Path(sys.executable).parent


def option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


#: steps of the run, checkpoint interval, mean seconds between faults (one chaos run each), whether faults are sent
STEPS, EVERY, MEAN_GAPS_S, FAULTS = sized(
    (int(option("--steps", "12000")), 100, tuple(float(g) for g in option("--gaps", "20,60").split(",")), True),
    (10, 5, (4.0,), False))
#: seconds between two readings of the job's progress (the recorded timeline)
SAMPLE_S = 0.5


def command(token_file: Path, run_dir: Path, restarts: int) -> list[str]:
    return [str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}",
            "parallel.zero_stage=1", f"trainer.max_steps={STEPS}", f"checkpoint.every_n_steps={EVERY}",
            "checkpoint.resume=auto", "checkpoint.save_last=true", "checkpoint.async_save=true",
            "throughput.enabled=false",
            f"cluster.max_restarts={restarts}", "parallel.timeout=20", *TINY_ARGS, f"hydra.run.dir={run_dir}"]


def ranks_of(agent: psutil.Process) -> list[psutil.Process]:
    """The job's training processes: every process below the agent (it forks the ranks of every attempt)."""
    try:
        return agent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def chaos(agent: psutil.Process, mean_gap_s: float, stop: threading.Event, done: list) -> None:
    """Until ``stop``: after an exponentially distributed wait of mean ``mean_gap_s`` (seeded), a SIGKILL or a SIGTERM,
    at random, to one of the job's ranks, at random."""
    rng = random.Random(0)
    while not stop.wait(rng.expovariate(1.0 / mean_gap_s)):
        ranks = ranks_of(agent)
        if not ranks:
            continue
        victim, sig = rng.choice(ranks), rng.choice([signal.SIGKILL, signal.SIGTERM])
        try:
            victim.send_signal(sig)
            done.append((time.time(), victim.pid, signal.Signals(sig).name))
        except psutil.NoSuchProcess:  # it ended between the listing and the signal: the next round picks again
            continue


def progress(run_dir: Path, start: float, stop: threading.Event, samples: list) -> None:
    """Every ``SAMPLE_S`` until ``stop`` (and once more then): [seconds from ``start``, step, attempt] from the job's
    ``progress.json``, which rank 0 rewrites after every step (see ``lightning_mgpu.resilience.restarts``)."""
    while True:
        ended = stop.wait(SAMPLE_S)
        with contextlib.suppress(OSError, ValueError, KeyError):  # not written yet, or replaced while read
            reached = json.loads((run_dir / PROGRESS).read_text())
            samples.append([round(time.time() - start, 2), reached["step"], reached["attempt"]])
        if ended:
            return


@dataclass
class Run:
    """One run: its directory, wall seconds, faults sent as [seconds from the start, pid, signal], progress samples,
    the job's records (:class:`~lightning_mgpu.resilience.lost_time.Job`) and the machine's 1-minute load average at
    its end (other jobs on the cores make the wall times of two runs incomparable)."""

    run_dir: Path
    wall_s: float
    faults: list
    samples: list
    job: Job
    load: float

    def median_step(self) -> float:
        return self.job.median_step()


def start_job(args: list[str], cwd: Path):
    """The job in its own session, its output piped: a fresh interpreter, as a user starts it; the smoke mode forks it
    from this process instead (``tests/forked_cli.py``, as ``fault_matrix.py`` runs its jobs), which has imported
    torch, Lightning and DeepSpeed already (an interpreter's imports are most of a 10-step job's CPU time)."""
    if SMOKE:
        return popen_cli(args, cwd=cwd, start_new_session=True)
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def run(token_file: Path, run_dir: Path, mean_gap_s: Optional[float]) -> Run:
    """The job, with faults every ``mean_gap_s`` on average (None: none)."""
    done, samples = [], []
    began, start = time.time(), time.perf_counter()
    proc = start_job(command(token_file, run_dir, 50 if FAULTS else 0), run_dir.parent)
    stop = threading.Event()
    thread = threading.Thread(target=chaos, args=(psutil.Process(proc.pid), mean_gap_s, stop, done), daemon=True)
    reader = threading.Thread(target=progress, args=(run_dir, began, stop, samples), daemon=True)
    reader.start()
    if mean_gap_s is not None and FAULTS:
        thread.start()
    out, err = proc.communicate(timeout=3600)
    wall_s, ended = time.perf_counter() - start, time.time()
    out += err or ""
    stop.set()
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"the {'chaos' if mean_gap_s else 'uninterrupted'} run failed ({proc.returncode}):\n"
                         f"{out[-4000:]}")
    job = Job.read(run_dir, began, began + wall_s, [(t, name) for t, _, name in done])
    return Run(run_dir, wall_s, [[round(t - began, 2), pid, name] for t, pid, name in done], samples, job,
               os.getloadavg()[0])


def latencies(job: Job) -> list[float]:
    """From each SIGKILL to the first optimizer step of the attempt restarted after it."""
    out = []
    for record in job.restarts:
        began = record.get("forked") or record["built"]
        cause = max(((t, name) for t, name in job.faults if t < began), default=None)
        if cause is not None and cause[1] == "SIGKILL":
            out.append(record["stepped"] - cause[0])
    return out


def mean_buckets(chaos_run: Run, references: list[Run], step_s: float) -> dict[str, float]:
    """The chaos run's lost seconds by bucket, against each of ``references`` (the uninterrupted runs beside it), the
    mean of those."""
    each = [lost_time(chaos_run.job, ref.job, EVERY, step_s) for ref in references]
    return {name: statistics.fmean(b[name] for b in each) for name in each[0]}


def report(chaos_run: Run, beside: list[Run], everyone: list[Run], mean_gap_s: float) -> dict:
    """Print one chaos run beside the uninterrupted ones (``beside``: before and after it; ``everyone``: all of them);
    return what ``--record`` keeps of it."""
    final = f"checkpoints/step-{STEPS:08d}"
    _, want = read_model_weights(beside[0].run_dir / final)
    _, got = read_model_weights(chaos_run.run_dir / final)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    job, step_s = chaos_run.job, statistics.fmean(r.job.mean_step(EVERY) for r in everyone)
    kinds = {name: sum(1 for *_, n in chaos_run.faults if n == name) for name in ("SIGKILL", "SIGTERM")}
    faults, whole_s = max(1, len(chaos_run.faults)), statistics.fmean(r.wall_s for r in beside)
    walls = [r.wall_s for r in everyone]
    print(f"mean {mean_gap_s:.0f} s between faults: {len(chaos_run.faults)} faults ({kinds['SIGKILL']} SIGKILL, "
          f"{kinds['SIGTERM']} SIGTERM to a random rank), {len(job.restarts)} restarts, "
          f"{sum(r['lost_steps'] for r in job.restarts)} steps lost and trained again")
    print(f"  under chaos {chaos_run.wall_s:.1f} s (load average {chaos_run.load:.1f}): effective training time "
          f"{whole_s / chaos_run.wall_s:.1%} (the uninterrupted runs' spread: {min(walls) / chaos_run.wall_s:.1%} to "
          f"{max(walls) / chaos_run.wall_s:.1%}); final weights max |diff| {diff:.1e}")
    print(f"  a step at the uninterrupted runs' mean: {step_s * 1000:.1f} ms (steps without a checkpoint)")
    buckets = mean_buckets(chaos_run, beside, step_s)
    lost_s, restart_s = chaos_run.wall_s - whole_s, sum(buckets[b] for b in RESTART_BUCKETS)
    machine_s = sum(buckets[b] for b in MACHINE_BUCKETS)
    print(f"  lost {lost_s:.1f} s against the uninterrupted runs beside it; by bucket, seconds in all and per fault:")
    print("  | bucket | s | s per fault |\n  | --- | --- | --- |")
    for name, seconds in buckets.items():
        print(f"  | {name} | {seconds:.2f} | {seconds / faults:.3f} |")
    print(f"  restarts' buckets {restart_s:.1f} s ({restart_s / faults:.2f} s per fault); the machine's (other steps, "
          f"start and end) {machine_s:.1f} s, {abs(machine_s) / max(abs(lost_s), 1e-9):.1%} of the time lost; "
          f"without the machine's: {1 - restart_s / chaos_run.wall_s:.1%} of the chaos run trained")
    print_step_means(job, beside)
    if spans := latencies(job):
        print(f"  from a SIGKILL to the next optimizer step: median {statistics.median(spans):.2f} s, "
              f"max {max(spans):.2f} s ({len(spans)} restarts)")
    if diff != 0.0 or not torch.isfinite(torch.tensor(diff)):
        raise SystemExit("the run under chaos did not end on the uninterrupted run's weights")
    return {"mean_gap_s": mean_gap_s, "chaos_s": chaos_run.wall_s, "weights_max_diff": diff,
            "faults": chaos_run.faults, "restarts": job.restarts, "attempts": job.attempts,
            "chaos": chaos_run.samples, "lost_s": buckets, "latencies_s": spans}


def print_step_means(job: Job, beside: list[Run]) -> None:
    """The mean of the other steps in the chaos run's first attempt, in its restarted attempts and in the uninterrupted
    runs beside it: whether the other steps' bucket is a restart's (the restarted attempts alone slower) or the
    machine's (every attempt moving alike)."""
    ours = {name: m for name, m in job.other_step_means(EVERY).items() if m is not None}
    theirs = statistics.fmean(r.job.mean_step(EVERY) for r in beside)
    print(f"  other steps' mean: {', '.join(f'{name} {m * 1000:.1f} ms' for name, m in ours.items())}; the "
          f"uninterrupted runs beside it {theirs * 1000:.1f} ms")


def record_path(tmp: Path) -> Optional[Path]:
    """Where ``--record PATH`` asks for the timeline; in the smoke mode, the temporary folder without it."""
    args = sys.argv[1:]
    if "--record" in args:
        return Path(args[args.index("--record") + 1]).resolve()
    return tmp / "timeline.json" if SMOKE else None


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp)
    wholes, chaos_runs = [run(token_file, tmp / "whole-0", None)], []
    for i, gap in enumerate(MEAN_GAPS_S if FAULTS else ()):  # each chaos run between two uninterrupted ones
        chaos_runs.append(run(token_file, tmp / f"chaos-{gap:.0f}", gap))
        wholes.append(run(token_file, tmp / f"whole-{i + 1}", None))
    walls = [r.wall_s for r in wholes]
    print(f"{STEPS} steps, checkpoint every {EVERY} (in the background); uninterrupted, {len(wholes)} runs "
          f"(before, between and after the chaos runs): {', '.join(f'{w:.1f}' for w in walls)} s (spread "
          f"{(max(walls) - min(walls)) / min(walls):.1%}; median step "
          f"{', '.join(f'{r.median_step() * 1000:.1f}' for r in wholes)} ms, mean "
          f"{', '.join(f'{r.job.mean_step(EVERY) * 1000:.1f}' for r in wholes)} ms; load average "
          f"{', '.join(f'{r.load:.1f}' for r in wholes)})")
    recorded = [report(c, wholes[i:i + 2], wholes, gap) for i, (c, gap) in enumerate(zip(chaos_runs, MEAN_GAPS_S))] \
        or [report(wholes[0], wholes, wholes, MEAN_GAPS_S[0])]
    record = record_path(tmp)
    if record is not None:  # the first chaos run, as docs/pictures/chaos.py draws it
        record.write_text(json.dumps({"steps": STEPS, "every": EVERY, "whole_s": wholes[0].wall_s,
                                      "whole": wholes[0].samples, **recorded[0]}))
        print(f"timeline of faults and restarts: {record} ({len(recorded[0]['chaos'])} readings of the job's progress)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the section is the default run's; --steps/--gaps variants (the restart buckets' section) write none
    variant = any(arg.startswith(("--steps", "--gaps")) for arg in sys.argv[1:])
    with recorded(__file__, "Goodput under chaos with every bucket", about=__doc__, when=not variant):
        main()
