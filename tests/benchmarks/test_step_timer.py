"""The benchmarks' operator timer (``benchmarks/step_timer.py``): each operator in one bucket, collectives in none."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from step_timer import OpTimes, breakdown_line  # noqa: E402


def _buckets_after(work) -> dict:
    ops = OpTimes()
    with ops:
        work()
    return {name: seconds > 0 for name, seconds in ops.seconds.items()}


def test_each_operator_lands_in_its_own_bucket_and_a_collective_in_none(tmp_path):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    q = k = v = torch.randn(1, 2, 16, 8)
    assert _buckets_after(lambda: a @ b) == {"matmuls": True, "attention": False, "other": False}
    assert _buckets_after(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)) == {
        "matmuls": False, "attention": True, "other": False}
    assert _buckets_after(lambda: a + b) == {"matmuls": False, "attention": False, "other": True}
    ours = not dist.is_initialized()  # a test session's worker may hold a one-process group already
    if ours:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert _buckets_after(lambda: dist.all_reduce(a)) == {"matmuls": False, "attention": False, "other": False}
    finally:
        if ours:
            dist.destroy_process_group()


def test_the_line_gives_each_buckets_median_and_the_rest_of_the_step_outside_operators():
    """Three steps worked by hand: matmuls 1.0, 3.0, 2.0 (median 2.0); attention 0.25 each; other 0.5, 0.5, 1.0 (0.5);
    walls 2.0, 4.5, 4.0 (median 4.0), so outside operators 0.25, 0.75, 0.75 (median 0.75)."""
    steps = [(dict(matmuls=1.0, attention=0.25, other=0.5), 2.0), (dict(matmuls=3.0, attention=0.25, other=0.5), 4.5),
             (dict(matmuls=2.0, attention=0.25, other=1.0), 4.0)]
    assert breakdown_line(steps) == ("matmuls 2.000 s, attention 0.250 s, other operators 0.500 s, "
                                     "outside operators 0.750 s (step 4.000 s)")
