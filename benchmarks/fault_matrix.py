"""The fault matrix: every way a process fails (``MGPU_FAULT``'s kinds: an exception, ``sys.exit``, ``os._exit``,
SIGINT, SIGTERM, SIGKILL, SIGSTOP, SIGSEGV, a GIL-holding sleep, a process-group abort) at every place where it hurts
(inside the backward pass, inside a collective, inside a synchronous checkpoint save, in the background writer of a
checkpoint, inside an emergency save, while a checkpoint is restored), on rank 0 and on rank 1 of a 2-process
``mgpu-train`` job of the tiny model on torch's elastic agent (``cluster.max_restarts``). Each run must end

- with exit status 0 (the job recovered by itself),
- on the weights of the fault-free run (the same command without the fault, run once and shared by every entry), bit
  for bit, with the final checkpoint's global step equal to the run's steps (no step applied twice, none skipped),
- having resumed only from published checkpoints (``Resumed at step N from .../step-0000000N``: never a ``.partial``
  folder; the loader verifies each file's checksum before it reads it, so a damaged one is refused, not loaded).

It prints one row per entry: kind, phase, rank -> outcome, restarts, seconds. Each entry is the ``mgpu-train``
command forked from this process (``tests/forked_cli.py``, as the CLI tests run it: torch and DeepSpeed are imported
once), in its own session, whose leftover processes are killed after it.

Where each phase acts (``lightning_mgpu.resilience.strikes``): backward and collective at step 3 (after the checkpoint
of step 2); save and flush at the checkpoint of step 4 (``checkpoint.async_save`` off and on); emergency at the
emergency checkpoint of step 3 (the same rank is sent SIGUSR2 inside the backward pass of step 2, a preemption);
restore while the first restart restores step 2 (rank 1 - r is SIGKILLed as step 3 begins, to end the first attempt).

A failed background write (an exception in one rank's background writer, ``raise@flush``) is checked for more: the
output names the write that failed, and no resume reads the checkpoint it was writing, only an older published one
(its ``.partial`` folder is never loaded).

``--smoke`` runs the fault-free run and two entries: SIGSEGV inside a collective on rank 1, and a failed background
write on rank 0 (every rank's write fails at once since the ranks agree on its status: 5.8 s a run here, no longer
the collective timeout).
``--only KIND@PHASE:RANK,...`` runs the chosen entries.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cli_helpers import BIN, RESTARTABLE, cli_args  # noqa: E402
from forked_cli import run_cli  # noqa: E402
from helpers import make_token_file  # noqa: E402
from record import recorded  # noqa: E402
from smoke import SMOKE  # noqa: E402

from lightning_mgpu.checkpoint.universal import read_model_weights  # noqa: E402
from lightning_mgpu.resilience.elastic import ATTEMPTS  # noqa: E402
from lightning_mgpu.resilience.strikes import KINDS, PHASES  # noqa: E402

STEPS, EVERY = 6, 2
#: the step each phase's fault counts (see the module docstring)
PHASE_STEP = {"backward": 3, "collective": 3, "save": 4, "flush": 4, "emergency": 3, "restore": 2}
RANKS = (0, 1)
SMOKE_ENTRIES = (("SIGSEGV", "collective", 1), ("raise", "flush", 0))
#: what a failed background write says on every rank (lightning_mgpu.callbacks.checkpoint.CheckpointWriteError)
WRITE_FAILED = "could not be written in the background"
#: seconds a collective waits for a rank before the others name it lost (a stopped or GIL-holding rank)
TIMEOUT_S = 10


def command(token_file: Path, run_dir: Path, phase: Optional[str]) -> list[str]:
    background = "true" if phase == "flush" else "false"
    return [str(BIN / "mgpu-train"), *cli_args(token_file, STEPS), *RESTARTABLE, "checkpoint.save_last=true",
            f"checkpoint.every_n_steps={EVERY}", f"checkpoint.async_save={background}", "cluster.max_restarts=3",
            f"parallel.timeout={TIMEOUT_S}", "throughput.enabled=false", f"hydra.run.dir={run_dir}"]


def environment(kind: str, phase: str, rank: int) -> dict[str, str]:
    """The fault's variables: ``MGPU_FAULT``, with the preemption an emergency save needs and the failure a restore
    needs."""
    env = {"MGPU_FAULT": f"{kind}@{phase}:{rank}:{PHASE_STEP[phase]}"}
    if phase == "emergency":
        env.update(MGPU_SIGNAL_RANK_AT=f"{rank}:{PHASE_STEP[phase] - 1}", MGPU_SIGNAL="SIGUSR2")
    if phase == "restore":
        env["MGPU_KILL_RANK_AT"] = f"{1 - rank}:{PHASE_STEP[phase] + 1}"
    return env


def launch(token_file: Path, run_dir: Path, phase: Optional[str], env: dict) -> tuple[int, str, float]:
    """Run one job in its own session; kill what is left of that session after it (a stopped rank the agent could
    not reap, for one); (exit status, output, seconds)."""
    pid_file = run_dir.with_suffix(".pid")
    begin = time.perf_counter()
    proc = run_cli(command(token_file, run_dir, phase), cwd=run_dir.parent, timeout=600,
                   env={**os.environ, **env}, start_new_session=True,
                   preexec_fn=lambda: pid_file.write_text(str(os.getpid())))
    seconds = time.perf_counter() - begin
    session = int(pid_file.read_text())
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getsid(process.pid) == session:
                process.send_signal(signal.SIGKILL)
    return proc.returncode, proc.stdout + proc.stderr, seconds


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The final checkpoint's weights and global step."""
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    _, weights = read_model_weights(final)
    state = torch.load(final / "trainer_state.pt", weights_only=True, map_location="cpu")
    return weights, int(state["global_step"])


def problems(code: int, out: str, run_dir: Path, reference: dict[str, torch.Tensor],
             failed_write: bool = False) -> list[str]:
    """What is wrong with one run's end (nothing: it recovered exactly); ``failed_write``: an entry whose background
    write fails, which must be named and whose checkpoint must never be resumed from."""
    if code != 0:
        return [f"exit status {code}"]
    found = failed_write_problems(out) if failed_write else []
    weights, step = final_state(run_dir)
    differ = [k for k in reference if not torch.equal(reference[k], weights[k])]
    if differ:
        found.append(f"{len(differ)} tensors differ from the fault-free run")
    if step != STEPS:
        found.append(f"final global step {step}, not {STEPS}")
    for resumed_at, path in re.findall(r"Resumed at step (\d+) from (\S+)", out):
        if Path(path).name != f"step-{int(resumed_at):08d}":
            found.append(f"resumed from {path}, not a published checkpoint of step {resumed_at}")
    return found


def failed_write_problems(out: str) -> list[str]:
    """A failed background write of the checkpoint of step ``PHASE_STEP["flush"]``: named, and never read back."""
    found = [] if WRITE_FAILED in out else [f"no line says the write failed ('{WRITE_FAILED}')"]
    loaded = [int(step) for step, _ in re.findall(r"Resumed at step (\d+) from (\S+)", out)
              if int(step) >= PHASE_STEP["flush"]]
    return found + [f"resumed at step {step}, from the checkpoint whose write failed" for step in loaded]


def restarts(run_dir: Path) -> int:
    path = run_dir / ATTEMPTS
    return sum('"then": "restart"' in line for line in path.read_text().splitlines()) if path.is_file() else 0


def entries() -> list[tuple[str, str, int]]:
    args = sys.argv[1:]
    if "--only" in args:
        chosen = args[args.index("--only") + 1].split(",")
        return [(c.split("@")[0], c.split("@")[1].split(":")[0], int(c.split(":")[1])) for c in chosen]
    if SMOKE:
        return list(SMOKE_ENTRIES)
    return [(kind, phase, rank) for phase in PHASES for kind in KINDS for rank in RANKS]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    token_file = make_token_file(tmp)
    code, out, seconds = launch(token_file, tmp / "fault-free", None, {})
    if code != 0:
        raise SystemExit(f"the fault-free run failed ({code}):\n{out[-4000:]}")
    reference, _ = final_state(tmp / "fault-free")
    print(f"fault-free run: {STEPS} steps, checkpoint every {EVERY}, {seconds:.1f} s (load average "
          f"{os.getloadavg()[1]:.1f})", flush=True)
    print("| kind | phase | rank | outcome | restarts | seconds |\n| --- | --- | --- | --- | --- | --- |", flush=True)
    failed = 0
    for kind, phase, rank in entries():
        run_dir = tmp / f"{kind}-{phase}-{rank}"
        code, out, seconds = launch(token_file, run_dir, phase, environment(kind, phase, rank))
        wrong = problems(code, out, run_dir, reference, failed_write=(kind, phase) == ("raise", "flush"))
        failed += bool(wrong)
        (tmp / f"{run_dir.name}.log").write_text(out)
        outcome = "; ".join(wrong) if wrong else "bit-identical"
        print(f"| {kind} | {phase} | {rank} | {outcome} | {restarts(run_dir)} | {seconds:.1f} |", flush=True)
    print(f"{len(entries()) - failed} of {len(entries())} runs ended bit-identical to the fault-free run (each run's "
          f"output in {tmp})")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # reading the final checkpoints in this one process, as intended
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with recorded(__file__, "The fault matrix", about=__doc__, when=not sys.argv[1:]):
        main()
