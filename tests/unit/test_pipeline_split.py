"""Pipeline stages without processes: which rank runs which stage, how blocks are split, and what is refused."""

from dataclasses import replace

import pytest
import torch

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.models import Llama, LlamaConfig
from lightning_mgpu.models.llama_plan import balanced_boundaries, llama_stages

CFG = LlamaConfig(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=32)


@pytest.mark.parametrize("schedule, V, expected", [
    ("1f1b", 1, [[0], [1], [2], [3]]),
    ("interleaved_1f1b", 2, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("zbv", 2, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ("dualpipev", 2, [[0, 7], [1, 6], [2, 5], [3, 4]]),
])
def test_stage_placement(schedule, V, expected):
    layout = ParallelLayout(world_size=4, pipeline_parallel_size=4, pipeline_schedule=schedule, virtual_pipeline_size=V)
    assert [layout.stage_ids(r) for r in range(4)] == expected
    assert layout.num_stages == sum(len(ids) for ids in expected)
    assert all(layout.stage_owner(s) == r for r, ids in enumerate(expected) for s in ids)


def test_balanced_boundaries_put_extra_blocks_in_the_middle():
    assert balanced_boundaries(8, 4) == [0, 2, 4, 6, 8]
    assert balanced_boundaries(6, 4) == [0, 1, 3, 5, 6]
    assert balanced_boundaries(2, 2) == [0, 1, 2]


def test_stages_chained_compute_the_whole_model():
    torch.manual_seed(0)
    model = Llama(CFG)
    tokens = torch.randint(0, 64, (2, 12))
    expected = model(tokens)
    stages = llama_stages(model, [0, 1, 2], 3, boundaries=[0, 1, 4, 6])
    assert [len(s.layers) for s in stages.values()] == [1, 3, 2]
    assert stages[0].tok_embeddings is model.tok_embeddings and stages[2].output is model.output
    x = tokens
    for i in range(3):
        x = stages[i](x)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_bad_splits_list_every_problem():
    with pytest.raises(ValueError) as err:
        llama_stages(Llama(replace(CFG, tie_embeddings=True)), [0], 3, boundaries=[0, 4, 2, 6])
    message = str(err.value)
    assert "pipeline_boundaries=[0, 4, 2, 6] must be 4 strictly increasing block indices" in message
    assert "e.g. [0, 2, 4, 6]" in message
    assert "tie_embeddings=True cannot be split" in message
