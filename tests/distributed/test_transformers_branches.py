"""Two branches of the ``transformers`` path no other test reaches, each against one process running the same model on
the same global batches (loss and gradient norm every step, within 1e-5): tensor x context parallelism (tp2 x cp2:
the vocabulary-parallel loss divided by ``num_items_in_batch``, the count each context rank is handed), and sequence
parallelism with pipeline stages (tp2 + SP x pp2, 1F1B over 2 micro-batches). One launch of 4 ranks runs both."""

from __future__ import annotations

import pytest
from hf_helpers import fit_hf, global_batches, single_process
from helpers import max_abs_diff

from lightning_mgpu.testing import run_distributed

LAYOUTS = {"tp2_cp2": dict(tensor_parallel_size=2, context_parallel_size=2),
           "tp2_sp_pp2": dict(tensor_parallel_size=2, sequence_parallel=True, pipeline_parallel_size=2,
                              num_microbatches=2)}


@pytest.fixture(scope="module")
def both_layouts():
    """Each layout's 4 ranks (3 steps of a 2-layer Llama), from one launch."""
    results = run_distributed(lambda rank: {name: fit_hf(rank, "llama", 4, **kw) for name, kw in LAYOUTS.items()}, 4)
    return {name: [r[name] for r in results] for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_transformers_branch_matches_one_process(both_layouts, layout):
    results = both_layouts[layout]
    expected = single_process("llama", global_batches(results))
    for r in results:
        assert max_abs_diff(r["losses"], expected["losses"]) < 1e-5, (layout, r["rank"], r["losses"],
                                                                      expected["losses"])
        assert max_abs_diff(r["grad_norms"], expected["grad_norms"]) < 1e-5, (layout, r["rank"], r["grad_norms"],
                                                                              expected["grad_norms"])
    coords = {(r["coords"]["tp"], r["coords"]["pp"]) for r in results}
    P = LAYOUTS[layout].get("pipeline_parallel_size", 1)
    assert coords == {(t, p) for t in range(2) for p in range(P)}, coords  # the layout asked for is the one that ran
    if P == 1:
        assert {r["attention"] for r in results} == {"mgpu_context_parallel"}
