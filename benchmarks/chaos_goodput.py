"""Goodput under chaos: a 2-process ``mgpu-train`` job of the tiny model runs under its supervisor
(``cluster.max_restarts``) while a chaos thread, every 15-25 s, picks one of the job's ranks at random and either
SIGKILLs it (a lost rank: the job fails and restarts from the newest checkpoint) or sends it SIGTERM (a preemption: an
emergency checkpoint, exit 75, restart with no step lost). The job ends on the weights of the same run uninterrupted,
bit for bit (both save their last step: ``checkpoint.save_last``), and the effective training time is the
uninterrupted run's wall time (the same command, supervised too) over the chaos run's: the share of the wall time that trained, what failures and
restarts cost aside. The restarts and lost steps are the job's own record (``restarts.jsonl``). The smoke mode runs
one short job beside the chaos thread with no fault (and so no supervisor), as its own reference: it measures
nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cli_helpers import TINY_ARGS  # noqa: E402
from helpers import make_token_file  # noqa: E402
from smoke import sized  # noqa: E402

from lightning_mgpu.checkpoint.universal import read_model_weights  # noqa: E402

BIN = Path(sys.executable).parent
#: steps of the run, checkpoint interval, seconds between faults (uniform in this range), faults at most
STEPS, EVERY, GAP_S, FAULTS = sized((12000, 100, (15.0, 25.0), 12), (10, 5, (4.0, 4.0), 0))


def command(token_file: Path, run_dir: Path, restarts: int) -> list[str]:
    return [str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}",
            "parallel.zero_stage=1", f"trainer.max_steps={STEPS}", f"checkpoint.every_n_steps={EVERY}",
            "checkpoint.resume=auto", "checkpoint.save_last=true", "checkpoint.async_save=true",
            "throughput.enabled=false",
            f"cluster.max_restarts={restarts}", "parallel.timeout=20", *TINY_ARGS, f"hydra.run.dir={run_dir}"]


def ranks_of(supervisor: psutil.Process) -> list[psutil.Process]:
    """The job's training processes: every process below the supervisor (its attempts are forked from it)."""
    try:
        return supervisor.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def chaos(supervisor: psutil.Process, stop: threading.Event, done: list) -> None:
    rng = random.Random(0)
    while len(done) < FAULTS and not stop.wait(rng.uniform(*GAP_S)):
        ranks = ranks_of(supervisor)
        if not ranks:
            continue
        victim, sig = rng.choice(ranks), rng.choice([signal.SIGKILL, signal.SIGTERM])
        try:
            victim.send_signal(sig)
            done.append((round(time.time(), 1), victim.pid, signal.Signals(sig).name))
        except psutil.NoSuchProcess:  # it ended between the listing and the signal: the next round picks again
            continue


def run(token_file: Path, run_dir: Path, faults: bool) -> tuple[float, list]:
    start, done = time.perf_counter(), []
    proc = subprocess.Popen(command(token_file, run_dir, 50 if FAULTS else 0), cwd=run_dir.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stop = threading.Event()
    thread = threading.Thread(target=chaos, args=(psutil.Process(proc.pid), stop, done), daemon=True)
    if faults:
        thread.start()
    out, _ = proc.communicate(timeout=3600)
    stop.set()
    if proc.returncode != 0:
        raise SystemExit(f"the {'chaos' if faults else 'uninterrupted'} run failed ({proc.returncode}):\n{out[-4000:]}")
    return time.perf_counter() - start, done


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp)
    chaos_s, faults = run(token_file, tmp / "chaos", faults=True)
    whole_s, _ = run(token_file, tmp / "whole", faults=False) if FAULTS else (chaos_s, [])
    if not FAULTS:  # the smoke mode: the job is its own reference
        (tmp / "whole").symlink_to(tmp / "chaos")
    final = f"checkpoints/step-{STEPS:08d}"
    _, want = read_model_weights(tmp / "whole" / final)
    _, got = read_model_weights(tmp / "chaos" / final)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    records = [json.loads(line) for line in (tmp / "chaos" / "restarts.jsonl").read_text().splitlines()] \
        if (tmp / "chaos" / "restarts.jsonl").exists() else []
    kinds = {name: sum(1 for *_, n in faults if n == name) for name in ("SIGKILL", "SIGTERM")}
    print(f"{STEPS} steps, checkpoint every {EVERY} (in the background); {len(faults)} faults "
          f"({kinds['SIGKILL']} SIGKILL, {kinds['SIGTERM']} SIGTERM to a random rank), {len(records)} restarts, "
          f"{sum(r['lost_steps'] for r in records)} steps lost and trained again")
    print(f"uninterrupted {whole_s:.1f} s, under chaos {chaos_s:.1f} s: effective training time "
          f"{whole_s / chaos_s:.1%}; final weights max |diff| {diff:.1e}")
    if diff != 0.0 or not torch.isfinite(torch.tensor(diff)):
        raise SystemExit("the run under chaos did not end on the uninterrupted run's weights")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
