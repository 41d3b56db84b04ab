"""A lost rank on NCCL, through ``mgpu-train`` on two GPUs: the survivor names it, as on gloo
(``tests/cli/test_lost_rank.py``). With torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` the communicator's
watchdog tears the survivor down before Python sees an error; ``lightning_mgpu.resilience.nccl`` sets ``2`` (abort,
raise in Python) and the Flight Recorder's dump on a timed-out collective into the run directory.

Needs two CUDA devices: NCCL refuses two ranks of one communicator on one device, so one GPU cannot lose a rank."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import TINY_ARGS

from lightning_mgpu.resilience.nccl import DUMP_PREFIX

BIN = Path(sys.executable).parent
TIMEOUT_S = 20

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a lost rank on NCCL needs 2 "
                                                  "GPUs: NCCL refuses two ranks of one communicator on one device")]


def run_with_a_fault(token_file, run_dir: Path, fault: str) -> subprocess.CompletedProcess:
    """A 2-GPU job whose rank 1 meets ``fault`` (``MGPU_<KIND>_RANK_AT``) at step 2, no restarts; its process group is
    killed after 180 s (a stopped rank would outlive it)."""
    proc = subprocess.Popen(
        [str(BIN / "mgpu-train"), "trainer=gpu", "trainer.devices=2", "data=tokens",
         f"data.path={token_file}", "trainer.max_steps=4", f"parallel.timeout={TIMEOUT_S}",
         "throughput.enabled=false", *TINY_ARGS, f"hydra.run.dir={run_dir}"],
        env=dict(os.environ, **{fault: "1:2"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.mark.parametrize("fault, lost", [("MGPU_KILL_RANK_AT", "stopped responding"),
                                         ("MGPU_RAISE_RANK_AT", "failed with InjectedFault")])
def test_the_survivor_names_the_lost_rank_on_nccl(token_file, tmp_path, fault, lost):
    done = run_with_a_fault(token_file, tmp_path / "run", fault)
    assert done.returncode not in (0, None), done.stdout[-4000:]
    assert f"LostRankError: rank 1 of 2 {lost}" in done.stdout, done.stdout[-4000:]


def test_a_stopped_rank_is_named_after_the_timeout_with_the_flight_recorder_dumped(token_file, tmp_path):
    run_dir = tmp_path / "run"
    done = run_with_a_fault(token_file, run_dir, "MGPU_STOP_RANK_AT")
    assert done.returncode not in (0, None), done.stdout[-4000:]
    assert "LostRankError: rank 1 of 2 stopped responding" in done.stdout, done.stdout[-4000:]
    assert list(run_dir.glob(f"{DUMP_PREFIX}0*")), sorted(p.name for p in run_dir.iterdir())
