"""``model.compile``: each block compiled by torch.compile, composed with tensor and sequence parallelism, selective and
full activation checkpointing and pipeline stages, at parity with one uncompiled process (loss and gradient
norm to 1e-5 fp32). The tests compile with ``aot_eager`` (dynamo's capture of forward and backward, without inductor's
code generation, which takes 15-30 s per layout on these CPUs; inductor was measured at parity by hand on the same
layouts, see docs/concepts/model.md)."""

from dataclasses import replace

import pytest
from helpers import TINY, assert_parity, fit, in_turn, reference

from lightning_mgpu.testing import run_distributed

STEPS = 4


def _compiled_fit(rank, *args, **kwargs):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightning_mgpu.parallel.compile import MARK

    torch._dynamo.reset()
    counters.clear()
    result = fit(rank, *args, **kwargs)
    result["graphs"] = counters["stats"]["unique_graphs"]  # what dynamo compiled on this rank
    result["breaks"] = sum(counters["graph_break"].values())
    return result


LAYOUTS = {
    "tp2_sp_selective": (dict(tensor_parallel_size=2, sequence_parallel=True), "selective"),
    "pp2_zero1_full": (dict(pipeline_parallel_size=2, zero_stage=1), "full"),
}


def _refusal(rank, token_file) -> str:
    try:
        fit(rank, token_file, 2, max_steps=1, model=replace(TINY, compile=True, compile_backend="aot_eager"),
            zero_stage=3)
    except Exception as err:  # what a launch of this fit alone would raise
        return f"{type(err).__name__}: {err}"
    return "trained"


@pytest.fixture(scope="module")
def runs(token_file) -> dict[str, list]:
    """Both layouts' fits and the refused one (last) in one launch of 2 processes, each with a fresh Trainer and
    dynamo reset: each run's results of every rank, by name."""
    calls = {}
    for name, (layout, checkpointing) in LAYOUTS.items():
        model = replace(TINY, compile=True, compile_backend="aot_eager", activation_checkpointing=checkpointing)
        calls[name] = (_compiled_fit, (token_file, 2), dict(max_steps=STEPS, model=model, **layout))
    calls["zero3"] = (_refusal, (token_file,), {})
    results = run_distributed(in_turn, 2, calls, timeout=600)
    return {name: [r[name] for r in results] for name in calls}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_blocks_match_one_uncompiled_process(token_file, runs, name):
    results = runs[name]
    assert_parity(results, reference(token_file, steps=STEPS, clip=0.3))
    for r in results:
        assert r["graphs"] >= 1 and r["breaks"] == 0, (r["rank"], r["graphs"], r["breaks"])


def test_compiled_blocks_under_zero3_are_refused_before_any_step(runs):
    for refusal in runs["zero3"]:
        assert "cannot compile blocks under ZeRO-3" in refusal, refusal
