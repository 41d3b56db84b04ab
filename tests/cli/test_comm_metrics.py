"""``mgpu-train ... throughput.count_communication=true`` logs every collective of a step as ``comm/*`` in
metrics.csv: the tiny Llama at tp2 + SP sends per step the bytes worked by hand in tests/unit/test_comm_planner.py."""

import sys
from pathlib import Path

from cli_helpers import TINY_ARGS, read_metric
from forked_cli import run_cli

BIN = Path(sys.executable).parent


def test_mgpu_train_logs_the_bytes_of_every_collective(token_file, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}",
                    "trainer.max_steps=2", *TINY_ARGS, "parallel.tensor_parallel_size=2",
                    "parallel.sequence_parallel=true", "throughput.count_communication=true",
                    f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = run_dir / "metrics.csv"
    # 4 micro-batches of 2 x 16 tokens, 32 wide, fp32: 10 all-gathers of 4,096 bytes each (see the unit test)
    assert read_metric(metrics, "comm/tp/all_gather_bytes") == [163_840.0, 163_840.0]
    assert read_metric(metrics, "comm/tp/reduce_scatter_calls") == [40.0, 40.0]
