"""Goodput under chaos: a 2-process ``mgpu-train`` job of the tiny model runs on torch's elastic agent
(``cluster.max_restarts``) while a chaos thread sends it faults at seeded, exponentially distributed intervals (one
chaos run per mean interval, 20 s and 60 s), each to one of the job's ranks chosen at random: SIGKILL (a lost rank:
the agent stops the other rank and restarts both from the newest checkpoint) or SIGTERM (a preemption: an emergency
checkpoint, exit 75, a restart with no step lost), chosen at random. Each chaos run ends on the weights of the same run
uninterrupted, bit for bit (both save their last step: ``checkpoint.save_last``), and its effective training time is
the uninterrupted run's wall time (the same command, under the agent too) over its own: the share of the wall time
that trained, what failures and restarts cost aside.

The time a chaos run lost (its wall time less the uninterrupted run's) is split into Google's goodput buckets, from
the job's own records (``attempts.jsonl``: when the agent saw each attempt end; ``restarts.jsonl``: when each restarted
attempt had built its engine, restored its checkpoint and finished its first optimizer step) and the faults' times:
checkpoint stalls (a preempted attempt, from the signal to its end: the step in flight and the emergency checkpoint),
restart (from a SIGKILL, or a preempted attempt's end, to the next attempt's engine: the agent noticing, stopping the
other rank, forking, process group, model and engine), restore (loading the checkpoint), re-trained steps (the steps
lost, at the uninterrupted run's time per step) and other (the rest, the shared cores' noise included: it can be
negative). The restart latency is from each SIGKILL to the restarted attempt's first optimizer step.

The smoke mode runs one short job beside the chaos thread with no fault (and so no agent), as its own reference,
forked from this process rather than started as a fresh interpreter: it measures nothing.

``--record PATH`` writes the timeline of the uninterrupted run and the first chaos run as JSON: every fault (seconds
from the start, signal), the step the job had reached and its attempt, read from its ``progress.json`` every half
second, and the job's ``restarts.jsonl`` and ``attempts.jsonl`` (``docs/pictures/chaos.py`` draws it). The smoke mode
always writes it, into its temporary folder without the option.
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
from smoke import SMOKE, sized  # noqa: E402

from lightning_mgpu.checkpoint.universal import read_model_weights  # noqa: E402
from lightning_mgpu.resilience.elastic import ATTEMPTS  # noqa: E402
from lightning_mgpu.resilience.restarts import PROGRESS, read_restarts  # noqa: E402

BIN = Path(sys.executable).parent
#: steps of the run, checkpoint interval, mean seconds between faults (one chaos run each), whether faults are sent
STEPS, EVERY, MEAN_GAPS_S, FAULTS = sized((12000, 100, (20.0, 60.0), True), (10, 5, (4.0,), False))
#: seconds between two readings of the job's progress (the recorded timeline)
SAMPLE_S = 0.5
BUCKETS = ("restart", "restore", "re-trained steps", "checkpoint stalls")


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
    """One run: its directory, wall seconds, start (unix time), faults sent as [seconds from the start, pid, signal],
    progress samples, the job's records of its restarts and of its failed attempts, and the machine's 5-minute load
    average at its end (other jobs on the cores make the wall times of two runs incomparable)."""

    run_dir: Path
    wall_s: float
    began: float
    faults: list
    samples: list
    restarts: list
    attempts: list
    load: float


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
    start, done, samples = time.perf_counter(), [], []
    began = time.time()
    proc = start_job(command(token_file, run_dir, 50 if FAULTS else 0), run_dir.parent)
    stop = threading.Event()
    thread = threading.Thread(target=chaos, args=(psutil.Process(proc.pid), mean_gap_s, stop, done), daemon=True)
    reader = threading.Thread(target=progress, args=(run_dir, began, stop, samples), daemon=True)
    reader.start()
    if mean_gap_s is not None and FAULTS:
        thread.start()
    out, err = proc.communicate(timeout=3600)
    out += err or ""
    stop.set()
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"the {'chaos' if mean_gap_s else 'uninterrupted'} run failed ({proc.returncode}):\n"
                         f"{out[-4000:]}")
    attempts = [json.loads(line) for line in (run_dir / ATTEMPTS).read_text().splitlines()] \
        if (run_dir / ATTEMPTS).is_file() else []
    return Run(run_dir, time.perf_counter() - start, began, [[round(t - began, 2), pid, name] for t, pid, name in done],
               samples, read_restarts(run_dir), attempts, os.getloadavg()[1])


def step_time(whole: Run) -> float:
    """Seconds per step of the uninterrupted run, from its first reading past step 0 to its last."""
    trained = [(t, step) for t, step, _ in whole.samples if step > 0]
    (t0, s0), (t1, s1) = trained[0], trained[-1]
    return (t1 - t0) / max(1, s1 - s0)


def lost_time(chaos_run: Run, step_s: float) -> tuple[dict[str, float], list[float]]:
    """(seconds lost per bucket, the restart latencies of the SIGKILLs): each failed attempt is matched with the
    last fault before its end; an attempt that never stepped is restart time up to the next one that did."""
    buckets, latencies = dict.fromkeys(BUCKETS, 0.0), []
    restarted = {r["attempt"]: r for r in chaos_run.restarts}
    faults = [(chaos_run.began + t, name) for t, _, name in chaos_run.faults]
    since, cause = None, None
    for ended in chaos_run.attempts:
        fault_t, name = max((f for f in faults if f[0] <= ended["ended"]), default=(ended["ended"], "SIGKILL"))
        if since is None:
            since, cause = fault_t, (fault_t, name)
            if name == "SIGTERM":  # the step in flight and the emergency checkpoint, until the ranks exited
                buckets["checkpoint stalls"] += ended["ended"] - fault_t
                since = ended["ended"]
        record = restarted.get(ended["attempt"] + 1)
        if record is None:  # the next attempt failed before its first step: its time is restart time too
            continue
        buckets["restart"] += record["set_up"] - since
        buckets["restore"] += record["restored"] - record["set_up"]
        buckets["re-trained steps"] += record["lost_steps"] * step_s
        if cause[1] == "SIGKILL":
            latencies.append(record["stepped"] - cause[0])
        since = None
    return buckets, latencies


def report(chaos_run: Run, whole: Run, mean_gap_s: float) -> dict:
    """Print one chaos run beside the uninterrupted one; return what ``--record`` keeps of it."""
    final = f"checkpoints/step-{STEPS:08d}"
    _, want = read_model_weights(whole.run_dir / final)
    _, got = read_model_weights(chaos_run.run_dir / final)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    kinds = {name: sum(1 for *_, n in chaos_run.faults if n == name) for name in ("SIGKILL", "SIGTERM")}
    buckets, latencies = lost_time(chaos_run, step_time(whole))
    lost_s = chaos_run.wall_s - whole.wall_s
    print(f"mean {mean_gap_s:.0f} s between faults: {len(chaos_run.faults)} faults ({kinds['SIGKILL']} SIGKILL, "
          f"{kinds['SIGTERM']} SIGTERM to a random rank), {len(chaos_run.restarts)} restarts, "
          f"{sum(r['lost_steps'] for r in chaos_run.restarts)} steps lost and trained again")
    print(f"  under chaos {chaos_run.wall_s:.1f} s (load average {chaos_run.load:.1f}): effective training time "
          f"{whole.wall_s / chaos_run.wall_s:.1%}; final weights max |diff| {diff:.1e}")
    print(f"  lost {lost_s:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in buckets.items())
          + f", other {lost_s - sum(buckets.values()):.1f} s; without other (the wall times' noise with it): "
          f"{1 - sum(buckets.values()) / chaos_run.wall_s:.1%} of the chaos run trained")
    if latencies:
        print(f"  from a SIGKILL to the next optimizer step: median {statistics.median(latencies):.2f} s, "
              f"max {max(latencies):.2f} s ({len(latencies)} restarts)")
    if diff != 0.0 or not torch.isfinite(torch.tensor(diff)):
        raise SystemExit("the run under chaos did not end on the uninterrupted run's weights")
    return {"mean_gap_s": mean_gap_s, "chaos_s": chaos_run.wall_s, "weights_max_diff": diff,
            "faults": chaos_run.faults, "restarts": chaos_run.restarts, "attempts": chaos_run.attempts,
            "chaos": chaos_run.samples, "lost_s": buckets, "latencies_s": latencies}


def record_path(tmp: Path) -> Optional[Path]:
    """Where ``--record PATH`` asks for the timeline; in the smoke mode, the temporary folder without it."""
    args = sys.argv[1:]
    if "--record" in args:
        return Path(args[args.index("--record") + 1]).resolve()
    return tmp / "timeline.json" if SMOKE else None


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp)
    whole = run(token_file, tmp / "whole", None)
    print(f"{STEPS} steps, checkpoint every {EVERY} (in the background); uninterrupted {whole.wall_s:.1f} s "
          f"({step_time(whole) * 1000:.1f} ms a step; load average {whole.load:.1f})")
    recorded = [report(run(token_file, tmp / f"chaos-{gap:.0f}", gap) if FAULTS else whole, whole, gap)
                for gap in MEAN_GAPS_S]
    record = record_path(tmp)
    if record is not None:  # the first chaos run, as docs/pictures/chaos.py draws it
        record.write_text(json.dumps({"steps": STEPS, "every": EVERY, "whole_s": whole.wall_s, "whole": whole.samples,
                                      **recorded[0]}))
        print(f"timeline of faults and restarts: {record} ({len(recorded[0]['chaos'])} readings of the job's progress)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
