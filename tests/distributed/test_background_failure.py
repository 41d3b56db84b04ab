"""A background write that fails on one rank after its files (before the checksums every rank exchanges) fails on
every rank at once, naming that rank, instead of leaving the others waiting for the collective timeout."""

from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lightning_mgpu.checkpoint import background
from lightning_mgpu.testing import run_distributed

TIMEOUT_S = 6  # the collective timeout: a rank left waiting would fail only after it


def _finish_with_rank_1_failing(rank: int, directory: str) -> str:
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    (Path(directory) / f"rank{rank}.bin").write_bytes(bytes([rank]) * 8)
    written: Future = Future()
    if rank == 1:
        written.set_exception(RuntimeError("disk quota exceeded"))
    else:
        written.set_result(None)
    done: Future = Future()
    background._finish(written, done, Path(directory), dist.group.WORLD, step=4)
    return background.BackgroundSave(Path(directory), 4, 0.0, done).error()


def test_one_ranks_failed_write_fails_every_rank_at_once(tmp_path):
    results = run_distributed(_finish_with_rank_1_failing, 2, str(tmp_path), timeout=TIMEOUT_S * 3)
    error0, error1 = results
    # rank 0 hears rank 1's own error (left waiting, it would fail with gloo's "Timed out waiting 60000ms")
    assert "rank 1: RuntimeError: disk quota exceeded" in error0, error0
    assert error1 == "RuntimeError: disk quota exceeded", error1  # rank 1 keeps its own
    assert not (tmp_path / "checksums.json").exists()  # never published: no checksum list
