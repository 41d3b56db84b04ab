"""Tensor (and sequence) parallelism, alone and with ZeRO over data-parallel replicas, against one process.

Every run of 2 ranks is one launch (``two_ranks``), every run of 4 ranks another (``four_ranks``): each builds its own
Trainer in turn."""

from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import STEPS, TINY, SaveAtStep, assert_bf16_curve, assert_parity, fit, in_turn, reference

from lightning_mgpu.testing import run_distributed

# tp=4 needs 4 key/value heads; vocab 66 is not a multiple of 4, so the vocabulary is padded to 68.
TINY_KV4 = replace(TINY, n_kv_heads=4, vocab_size=66)
TIED = replace(TINY, tie_embeddings=True)
SEQUENCE_PARALLEL = {"tp2": False, "tp2_sp": True}


@pytest.fixture(scope="module")
def two_ranks(token_file):
    """Every run of this file on 2 ranks, in one launch: name -> each rank's result."""
    calls = {name: (fit, (token_file, 2), dict(tensor_parallel_size=2, sequence_parallel=sp))
             for name, sp in SEQUENCE_PARALLEL.items()}
    calls["tied"] = (fit, (token_file, 2), dict(model=TIED, tensor_parallel_size=2))
    calls["bf16"] = (fit, (token_file, 2), dict(precision="bf16-mixed", tensor_parallel_size=2,
                                                sequence_parallel=True, zero_stage=1))
    calls.update({f"count_{name}_{n}": (_count_one_step, (token_file, n, sp), {})
                  for name, sp in SEQUENCE_PARALLEL.items() for n in (2, 3)})
    results = run_distributed(in_turn, 2, calls)
    return {name: [r[name] for r in results] for name in calls}


@pytest.fixture(scope="module")
def four_ranks(token_file, tmp_path_factory):
    """Every run of this file on 4 ranks, in one launch: name -> each rank's result."""
    ckpt = str(tmp_path_factory.mktemp("tp_resume") / "ckpt")
    kw = dict(tensor_parallel_size=2, zero_stage=2)
    calls = {"tp4": (fit, (token_file, 4), dict(model=TINY_KV4, tensor_parallel_size=4))}
    calls.update({f"zero{stage}": (fit, (token_file, 4), dict(tensor_parallel_size=2, zero_stage=stage))
                  for stage in (1, 2, 3)})
    calls["whole"] = (fit, (token_file, 4), dict(max_steps=6, callbacks=[SaveAtStep(3, ckpt)], **kw))
    calls["resumed"] = (fit, (token_file, 4), dict(max_steps=6, ckpt_path=ckpt, **kw))
    results = run_distributed(in_turn, 4, calls)
    return {name: [r[name] for r in results] for name in calls}


@pytest.mark.parametrize("name", SEQUENCE_PARALLEL)
def test_tp2_matches_single_process(two_ranks, ref, name):
    assert_parity(two_ranks[name], ref)


def test_tp2_keeps_tied_embeddings_tied(two_ranks, token_file):
    expected = reference(token_file, steps=STEPS, clip=0.3, model=TIED)
    assert_parity(two_ranks["tied"], expected)


def test_tp4_with_padded_vocabulary_matches_single_process(four_ranks, token_file):
    expected = reference(token_file, steps=STEPS, clip=0.3, model=TINY_KV4)
    assert_parity(four_ranks["tp4"], expected)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_tp2_dp2_zero_matches_single_process(four_ranks, ref, zero_stage):
    assert_parity(four_ranks[f"zero{zero_stage}"], ref)


def test_save_resume_tp2_dp2_zero2_is_bit_identical(four_ranks):
    whole, resumed = four_ranks["whole"][0]["losses"], four_ranks["resumed"][0]["losses"]
    assert resumed == whole[3:]


class CountTensorParallelCollectives(L.Callback):
    """Wraps torch.distributed's collectives during one training step and counts those on the tp group,
    split into forward and backward (a call made while autograd runs a backward graph)."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._originals: dict = {}

    def on_train_batch_start(self, trainer, *args) -> None:
        tp_group = trainer.strategy.layout.group("tp")
        for name in self.NAMES:
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*a, _name=name, _original=original, **kw):
                if kw.get("group") is tp_group:
                    phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                    self.counts[(_name, phase)] = self.counts.get((_name, phase), 0) + 1
                return _original(*a, **kw)

            setattr(dist, name, counted)

    def on_train_batch_end(self, *args) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _count_one_step(rank, token_file, n_layers, sequence_parallel):
    counter = CountTensorParallelCollectives()
    fit(rank, token_file, 2, max_steps=1, model=replace(TINY, n_layers=n_layers), callbacks=[counter],
        tensor_parallel_size=2, sequence_parallel=sequence_parallel)
    return counter.counts


@pytest.mark.parametrize("name", SEQUENCE_PARALLEL)
def test_collectives_per_block_are_megatrons_minimum(two_ranks, name):
    sequence_parallel = SEQUENCE_PARALLEL[name]
    micro_batches = 4  # global batch 8 / micro-batch 2, one data-parallel replica
    per_layers = {n: two_ranks[f"count_{name}_{n}"][0] for n in (2, 3)}
    # Exact per step: every count is the micro-batch count times a whole number per micro-batch.
    per_block = {key: per_layers[3].get(key, 0) - per_layers[2].get(key, 0)
                 for key in set(per_layers[2]) | set(per_layers[3])}
    per_block = {k: v for k, v in per_block.items() if v}
    if sequence_parallel:
        expected_block = {("all_gather_single", "forward"): 2, ("reduce_scatter_single", "forward"): 2,
                          ("all_gather_single", "backward"): 2, ("reduce_scatter_single", "backward"): 2}
        # Outside the blocks: embedding (reduce-scatter / all-gather), final norm (all-gather / reduce-scatter),
        # vocabulary-parallel cross-entropy (2 all-reduces, forward only).
        outside = {("reduce_scatter_single", "forward"): 1, ("all_gather_single", "forward"): 1,
                   ("all_reduce", "forward"): 2, ("all_gather_single", "backward"): 1,
                   ("reduce_scatter_single", "backward"): 1}
    else:
        expected_block = {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
        # Outside: embedding (forward), cross-entropy (2, forward), final norm's gradient (backward).
        outside = {("all_reduce", "forward"): 3, ("all_reduce", "backward"): 1}
    assert per_block == {k: micro_batches * v for k, v in expected_block.items()}
    keys = set(outside) | set(expected_block)
    assert per_layers[2] == {k: micro_batches * (outside.get(k, 0) + 2 * expected_block.get(k, 0)) for k in keys}


def test_tp2_sp_bf16_mixed_follows_fp32(two_ranks, ref):
    assert_bf16_curve(two_ranks["bf16"], ref)
