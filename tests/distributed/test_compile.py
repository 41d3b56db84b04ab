"""``model.compile``: each block compiled by torch.compile, composed with tensor and sequence parallelism, selective and
full activation checkpointing and pipeline stages, at parity with one uncompiled process (loss and gradient
norm to 1e-5 fp32). The tests compile with ``aot_eager`` (dynamo's capture of forward and backward, without inductor's
code generation, which takes 15-30 s per layout on these CPUs; inductor was measured at parity by hand on the same
layouts, see docs/concepts/model.md)."""

from dataclasses import replace

import pytest
from helpers import TINY, assert_parity, fit, reference

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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_blocks_match_one_uncompiled_process(token_file, name):
    layout, checkpointing = LAYOUTS[name]
    model = replace(TINY, compile=True, compile_backend="aot_eager", activation_checkpointing=checkpointing)
    results = run_distributed(_compiled_fit, 2, token_file, 2, max_steps=STEPS, model=model, **layout)
    assert_parity(results, reference(token_file, steps=STEPS, clip=0.3))
    for r in results:
        assert r["graphs"] >= 1 and r["breaks"] == 0, (r["rank"], r["graphs"], r["breaks"])


def test_compiled_blocks_under_zero3_are_refused_before_any_step(token_file):
    model = replace(TINY, compile=True, compile_backend="aot_eager")
    with pytest.raises(Exception, match="cannot compile blocks under ZeRO-3"):
        run_distributed(fit, 2, token_file, 2, max_steps=1, model=model, zero_stage=3)
