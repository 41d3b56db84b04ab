"""Context parallelism: sequences split over ranks, alone and with tensor, pipeline and ZeRO data parallelism, against
one process (loss and gradient norm, 1e-5 fp32, 10 steps)."""

import pytest
from helpers import assert_parity, fit, reference

from lightning_mgpu.testing import run_distributed


@pytest.fixture(scope="module")
def ref(token_file):
    return reference(token_file, steps=10, clip=0.3)


LAYOUTS = {
    "cp2": (2, dict(context_parallel_size=2)),
    "cp4": (4, dict(context_parallel_size=4)),
    "cp2_tp2_sp": (4, dict(context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True)),
    "cp2_pp2": (4, dict(context_parallel_size=2, pipeline_parallel_size=2)),
    "cp2_dp2_zero1": (4, dict(context_parallel_size=2, zero_stage=1)),
    "cp2_dp2_zero3": (4, dict(context_parallel_size=2, zero_stage=3)),
    "cp2_tp2_pp2": (8, dict(context_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_single_process(token_file, ref, name):
    devices, kw = LAYOUTS[name]
    assert_parity(run_distributed(fit, devices, token_file, devices, **kw), ref)
