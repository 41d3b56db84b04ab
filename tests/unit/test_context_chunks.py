"""Context parallelism without processes: the balanced chunks, the sequence rule's errors, and the planner's terms."""

import dataclasses

import pytest
import torch

from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.parallel.context import chunk_ids, chunk_positions, shard_sequence
from lightning_mgpu.planner import GPUS, ClusterSpec, estimate_memory, estimate_step_time


def test_two_chunks_per_rank_an_early_and_a_late_one_give_every_rank_the_same_causal_work():
    assert chunk_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for C in (2, 4, 8):
        # a query chunk g attends to g + 1 key chunks: every rank's total is 2C + 1
        assert {sum(g + 1 for g in chunk_ids(r, C)) for r in range(C)} == {2 * C + 1}
        together = torch.cat([chunk_positions(8 * C, r, C) for r in range(C)])
        assert sorted(together.tolist()) == list(range(8 * C))  # every token on exactly one rank
    x = torch.arange(32).view(2, 16)
    assert shard_sequence(x, 1, 2).tolist() == [list(range(4, 12)), list(range(20, 28))]
    # the contiguous split (kept for the benchmark) is unbalanced: the last rank does C times the first one's work
    assert [sum(g + 1 for g in chunk_ids(r, 4, balanced=False)) for r in range(4)] == [1, 2, 3, 4]


def test_a_sequence_that_does_not_split_names_the_nearest_lengths():
    with pytest.raises(ValueError, match="is not a multiple of 4 .*use 16 or 20"):
        chunk_positions(18, 0, 2)


CFG = LlamaConfig.from_name("llama3_8b")


def test_the_planner_gives_each_context_rank_its_share_of_tokens_and_of_zero():
    one = estimate_memory(CFG, 32768, 1, 1, 1, 8, 3, recompute=True)
    split = estimate_memory(CFG, 32768, 1, 1, 1, 4, 3, recompute=True, context=2)  # same 8 GPUs: dp 4 x cp 2
    assert split.optimizer == one.optimizer and split.parameters == one.parameters  # ZeRO over dp x cp = 8 ranks
    assert 0.4 < split.activations / one.activations < 0.6  # half the tokens, plus the gathered keys and values


def test_the_planner_times_the_key_value_exchange_over_the_context_group():
    # no micro-batch term: a sequence split in two is two half-size micro-batches a rank, which it slows
    cluster = ClusterSpec(1, 8, dataclasses.replace(GPUS["h100_80gb"], saturation_tokens=0.0))
    plain = estimate_step_time(CFG, cluster, 32768, 8, 1, 1, 1, 3, recompute=True)
    split = estimate_step_time(CFG, cluster, 32768, 8, 1, 1, 1, 3, recompute=True, context=2)
    assert plain.context_parallel == 0.0
    kv = 2.0 * 2 * 32768 * CFG.n_kv_heads * CFG.head_dim  # bf16 keys and values of one sequence
    microbatches = 8 // 4  # global batch 8 over 4 replicas of 1 sample
    expected = 3 * CFG.n_layers * microbatches * (2 - 1) / 2 * kv / GPUS["h100_80gb"].intra_node_bandwidth
    assert split.context_parallel == pytest.approx(expected)  # gather, its reduce-scatter, and a re-gather
    assert split.compute == pytest.approx(plain.compute)  # the same FLOPs over the same GPUs
