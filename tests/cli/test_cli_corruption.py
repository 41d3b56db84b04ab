"""Silent data corruption through ``mgpu-train`` on torch's elastic agent: one bit flipped in rank 1's copy of the
weights (three data-parallel copies, ZeRO-0) is caught by the next fingerprint check, which names rank 1, sets aside
the checkpoints written since the copies last agreed and exits with 75; the agent's restart resumes from before the
flip and reruns those steps. A flip that does not come back (transient) lets the run end with the weights, bit for bit,
of a run that never met it; one that comes back on the rerun (persistent), once or at every step, stops the job with
77, not restarted, the agent's record naming the rank and its host."""

import json
import os
import re
import socket
from pathlib import Path

import torch
from safetensors.torch import load_file

from cli_helpers import BIN, TINY_ARGS
from forked_cli import run_cli

from lightning_mgpu.callbacks import newest_checkpoint

FAULTY_DEVICE_EXIT = 77  # docs/concepts/failures.md
STEPS, FLIP_AT = 5, 3  # checks after steps 2 and 4 (as the next begins); the flip, after 3 steps, is found after 4


def launch(token_file, run_dir: Path, env: dict) -> tuple[int, str]:
    proc = run_cli([str(BIN / "mgpu-train"), "trainer.devices=3", "data=tokens", f"data.path={token_file}",
                    *TINY_ARGS, "data.global_batch_size=6", "parallel.zero_stage=0", f"trainer.max_steps={STEPS}",
                    "sdc.every_n_steps=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=4",
                    "checkpoint.resume=auto", "checkpoint.save_consolidated_weights=true", "throughput.enabled=false",
                    "cluster.max_restarts=2", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                   env=dict(os.environ, **env), timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_flipped_bit_is_caught_named_rolled_back_and_found_transient(token_file, tmp_path):
    code, output = launch(token_file, tmp_path / "run", {"MGPU_FLIP_RANK_AT": f"1:{FLIP_AT}"})
    assert code == 0, output[-3000:]
    assert "silent data corruption: rank 1 holds a copy of " in output, output[-3000:]
    assert "differs from its data-parallel peers at step 4 (the copies agreed at step 2)" in output
    assert re.search(r"attempt 1 failed: rank \d exited with status 75; restart 1 of 2", output)
    assert "Resumed at step 2 from" in output
    assert "the rerun of steps 3-4 left every copy equal at step 4: the fault found there on rank(s) [1] was " \
        "transient; training goes on" in output
    checkpoints = tmp_path / "run" / "checkpoints"
    # checkpoint step-N holds N steps: 3 was saved before the flip, but after the last check, so it is set aside too;
    # 5 is the step that found it; the rerun wrote 3-5 again
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step-00000002", "step-00000003", "step-00000003.corrupt", "step-00000004", "step-00000004.corrupt",
        "step-00000005", "step-00000005.corrupt"]
    code, clean = launch(token_file, tmp_path / "clean", {})
    assert code == 0 and "silent data corruption: " not in clean  # no finding (the startup line says "check every")
    got = load_file(newest_checkpoint(checkpoints) / "model.safetensors")
    expected = load_file(newest_checkpoint(tmp_path / "clean" / "checkpoints") / "model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_flip_that_comes_back_on_the_rerun_stops_as_a_faulty_device(token_file, tmp_path):
    """The same flip in every attempt (``MGPU_FAULT_ATTEMPTS=every``): the rerun names rank 1 on the same host again,
    and the job stops with 77 although restarts were left."""
    code, output = launch(token_file, tmp_path / "run", {"MGPU_FLIP_RANK_AT": f"1:{FLIP_AT}",
                                                         "MGPU_FAULT_ATTEMPTS": "every"})
    assert code == FAULTY_DEVICE_EXIT, output[-3000:]
    assert "Found again on the rerun of these steps, on the same host(s) [" in output, output[-3000:]
    assert re.search(rf"attempt 2 failed: rank \d exited with status {FAULTY_DEVICE_EXIT} \(faulty device\); not "
                     "restarted", output)
    assert "transient" not in output
    # the agent's record of the attempt names the rank found persistent and its host (here, this machine)
    host = socket.gethostname()
    assert "corrupted their weights again on the rerun" in output and f"persistent: rank(s) [1] on host(s) " \
        f"['{host}']" in output, output[-3000:]
    last = json.loads((tmp_path / "run" / "attempts.jsonl").read_text().splitlines()[-1])
    assert last["then"] == "faulty device" and last["status"] == FAULTY_DEVICE_EXIT and \
        last["persistent"] == {"1": host}, last
    # the rerun's checkpoints after step 2 are set aside beside the first attempt's; step 2 stays for a restart elsewhere
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir()) == [
        "step-00000002", "step-00000003.corrupt", "step-00000003.corrupt-2", "step-00000004.corrupt",
        "step-00000004.corrupt-2", "step-00000005.corrupt", "step-00000005.corrupt-2"]


def test_a_flip_at_every_step_is_named_persistent_at_the_first_check_of_the_rerun(token_file, tmp_path):
    """Rank 1 flips a bit as every step begins, in every attempt (a device that keeps computing wrong): the first check
    (as step 2 begins) names it, the restart reruns from step 0 (no checkpoint predates the corruption), meets it at
    the same check, and the job stops with 77, the agent's record naming rank 1 on this host persistent."""
    code, output = launch(token_file, tmp_path / "run", {"MGPU_FLIP_RANK_AT": "1:1,1:2,1:3,1:4",
                                                         "MGPU_FAULT_ATTEMPTS": "every"})
    assert code == FAULTY_DEVICE_EXIT, output[-3000:]
    found = "silent data corruption: rank 1 holds a copy of model.tok_embeddings.weight that differs from its " \
            "data-parallel peers at step 2 (the copies agreed at step 0)"
    assert output.count(found) == 2 and "transient" not in output, output[-3000:]
    # three ranks on this one host: the named one shares it with two that agree, so one device is at fault; said by
    # the ranks and by the agent's line on the attempt
    beside = f"rank 1 shares host {socket.gethostname()} with ranks [0, 2], whose copies agree: one device"
    assert output.count(beside) == 3 and f"corrupted their weights again on the rerun ({beside}" in output, output
    records = [json.loads(line) for line in (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()]
    assert [(r["status"], r["then"]) for r in records] == [(75, "restart"), (FAULTY_DEVICE_EXIT, "faulty device")]
    assert records[-1]["persistent"] == {"1": socket.gethostname()}, records
