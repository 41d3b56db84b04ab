"""Resume on another layout: a universal checkpoint written by one layout continues on another, and every step
after the resume matches the uninterrupted single-process run to 1e-5."""

from dataclasses import replace

import pytest
from helpers import TINY, fit, max_abs_diff, reference

from lightning_mgpu.testing import run_distributed

MODEL = replace(TINY, n_layers=4)  # four blocks: enough for pp2 with two interleaved stages per rank
ONE = dict(devices=1)
PAIRS = [
    (dict(devices=4, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1), dict(devices=4, zero_stage=3)),
    (dict(devices=2, zero_stage=2), dict(devices=2, tensor_parallel_size=2)),
    (dict(devices=4, tensor_parallel_size=2, zero_stage=2), ONE),
    (dict(devices=2, pipeline_parallel_size=2), dict(devices=2, pipeline_parallel_size=2,
                                                     pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2)),
    (ONE, dict(devices=4, pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True)),
    (dict(devices=4, zero_stage=3), dict(devices=4, tensor_parallel_size=2, zero_stage=1)),
]


def describe(layout):
    return "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


@pytest.fixture(scope="module")
def ref(token_file):
    return reference(token_file, steps=6, clip=0.3, model=MODEL)


def train(token_file, layout, **kw):
    layout = dict(layout)
    devices = layout.pop("devices")
    return run_distributed(fit, devices, token_file, devices, model=MODEL, **kw, **layout)


@pytest.mark.parametrize("before, after", PAIRS, ids=[f"{describe(a)}->{describe(b)}" for a, b in PAIRS])
def test_resume_on_another_layout_continues_the_run(token_file, tmp_path, ref, before, after):
    ckpt = str(tmp_path / "ckpt")
    first = train(token_file, before, max_steps=3, save_to=ckpt)
    resumed = train(token_file, after, max_steps=6, ckpt_path=ckpt)
    for r in first:
        assert max_abs_diff(r["losses"], ref["losses"][:3]) < 1e-5
    for r in resumed:
        assert max_abs_diff(r["losses"], ref["losses"][3:]) < 1e-5
        assert max_abs_diff(r["grad_norms"], ref["grad_norms"][3:]) < 1e-5
