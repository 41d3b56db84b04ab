"""Tensor (and sequence) parallelism, alone and with ZeRO over data-parallel replicas, against one process."""

from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import STEPS, TINY, SaveAtStep, assert_bf16_curve, assert_parity, fit, reference

from lightning_mgpu.testing import run_distributed

# tp=4 needs 4 key/value heads; vocab 66 is not a multiple of 4, so the vocabulary is padded to 68.
TINY_KV4 = replace(TINY, n_kv_heads=4, vocab_size=66)



@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tp2_matches_single_process(token_file, ref, sequence_parallel):
    results = run_distributed(fit, 2, token_file, 2, tensor_parallel_size=2, sequence_parallel=sequence_parallel)
    assert_parity(results, ref)


def test_tp2_keeps_tied_embeddings_tied(token_file):
    tied = replace(TINY, tie_embeddings=True)
    expected = reference(token_file, steps=STEPS, clip=0.3, model=tied)
    assert_parity(run_distributed(fit, 2, token_file, 2, model=tied, tensor_parallel_size=2), expected)


def test_tp4_with_padded_vocabulary_matches_single_process(token_file):
    expected = reference(token_file, steps=STEPS, clip=0.3, model=TINY_KV4)
    results = run_distributed(fit, 4, token_file, 4, model=TINY_KV4, tensor_parallel_size=4)
    assert_parity(results, expected)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_tp2_dp2_zero_matches_single_process(token_file, ref, zero_stage):
    results = run_distributed(fit, 4, token_file, 4, tensor_parallel_size=2, zero_stage=zero_stage)
    assert_parity(results, ref)


def test_save_resume_tp2_dp2_zero2_is_bit_identical(token_file, tmp_path):
    kw = dict(tensor_parallel_size=2, zero_stage=2)
    ckpt = str(tmp_path / "ckpt")
    whole = run_distributed(fit, 4, token_file, 4, max_steps=6, callbacks=[SaveAtStep(3, ckpt)], **kw)[0]["losses"]
    resumed = run_distributed(fit, 4, token_file, 4, max_steps=6, ckpt_path=ckpt, **kw)[0]["losses"]
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


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_collectives_per_block_are_megatrons_minimum(token_file, sequence_parallel):
    micro_batches = 4  # global batch 8 / micro-batch 2, one data-parallel replica
    per_layers = {n: run_distributed(_count_one_step, 2, token_file, n, sequence_parallel)[0] for n in (2, 3)}
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


def test_tp2_sp_bf16_mixed_follows_fp32(token_file, ref):
    assert_bf16_curve(run_distributed(fit, 2, token_file, 2, precision="bf16-mixed", tensor_parallel_size=2,
                                      sequence_parallel=True, zero_stage=1), ref)
