"""A dead rank does not hang the others: with rank 1 killed mid-run, rank 0 exits within the collective timeout
with an error that names rank 1."""

import os
import subprocess
import sys
import time
from pathlib import Path

from test_launch import TINY_ARGS

BIN = Path(sys.executable).parent
TIMEOUT_S = 10


def test_lost_rank_is_named_within_the_timeout(token_file, tmp_path):
    env = dict(os.environ, MGPU_KILL_RANK_AT="1:3")
    start = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}", "trainer.max_steps=8",
         f"parallel.timeout_s={TIMEOUT_S}", *TINY_ARGS, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "LostRankError: rank 1 of 2 stopped responding" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60  # startup + 3 steps + at most the collective timeout, not a hang
