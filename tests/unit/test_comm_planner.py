"""The planner's step volume against figures worked by hand for the tiny Llama (dim 32, 2 blocks, 4 heads of 8, 2
key/value heads, MLP 64, vocabulary 64, untied head): 22,688 parameters, 90,752 bytes in fp32."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import TINY

from lightning_mgpu.planner.communication import StepShape, step_volume

# A micro-batch of 2 x 16 tokens: 32 tokens x 32 wide x 4 bytes = 4,096 bytes of activations.
ACT, NORM, M = 4096, 32 * 4, 4
PARAMS = 4 * (2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32) + 64 * 32 + 32 + 64 * 32)


def test_tensor_parallel_bytes_worked_by_hand():
    plain = step_volume(TINY, StepShape(16, 2, M, tp=2, element_bytes=4))
    # per block: 2 forward all-reduces of ACT, 2 backward of ACT + the norm's weight gradient; the embedding's
    # forward, the final norm's backward; the loss's 3 fp32 values per token
    per_micro = 2 * (2 * ACT + 2 * (ACT + NORM)) + ACT + (ACT + NORM) + 3 * 32 * 4
    assert plain == {("tp", "all_reduce"): M * per_micro} and M * per_micro == 167_936
    sp = step_volume(TINY, StepShape(16, 2, M, tp=2, sequence_parallel=True, element_bytes=4))
    # all-gathers: 2 norms forward + 2 row-parallel backward per block, the embedding's backward, the final norm's
    # forward; reduce-scatters the other way, the norms' packing T x their weight gradient behind
    assert sp[("tp", "all_gather")] == M * (2 * 4 * ACT + 2 * ACT) == 163_840
    assert sp[("tp", "reduce_scatter")] == M * (2 * (2 * ACT + 2 * (ACT + 2 * NORM)) + ACT + ACT + 2 * NORM) == 168_960
    assert sp[("tp", "all_reduce")] == M * 3 * 32 * 4


def test_zero_bytes_worked_by_hand():
    assert PARAMS == 90_752
    volume = {stage: step_volume(TINY, StepShape(16, 2, 2, dp=2, zero_stage=stage, element_bytes=4))
              for stage in range(4)}
    assert volume[0] == {("dp_cp", "all_reduce"): PARAMS}
    assert volume[1] == {("dp_cp", "all_reduce"): PARAMS, ("dp_cp", "all_gather"): PARAMS}
    # ZeRO-2 reduces each of the 2 micro-batches' gradients; ZeRO-3 gathers the weights in every forward and backward
    assert volume[2] == {("dp_cp", "all_reduce"): 2 * PARAMS, ("dp_cp", "all_gather"): PARAMS}
    assert volume[3] == {("dp_cp", "all_gather"): 4 * PARAMS, ("dp_cp", "reduce_scatter"): 2 * PARAMS}
    # under a pipeline the schedule runs inside one coalesced reduction
    piped = step_volume(TINY, StepShape(16, 2, 2, pp=2, dp=2, zero_stage=2, element_bytes=4), pp_rank=0)
    stage0 = 4 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32 + 64 * 32)  # block 0 and the embedding
    assert piped[("dp_cp", "all_reduce")] == stage0 and piped[("pp", "send")] == 2 * ACT


def test_pipeline_sends_skip_a_neighbour_on_the_same_rank():
    # ZBV on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (1 -> 2 passes without a send)
    shape = StepShape(16, 2, M, pp=2, schedule="zbv", virtual=2, element_bytes=4)
    cfg = dataclasses.replace(TINY, n_layers=4)
    for rank in (0, 1):
        volume = step_volume(cfg, shape, pp_rank=rank)
        assert volume[("pp", "send")] == volume[("pp", "recv")] == 2 * M * ACT


def test_mgpu_plan_prints_the_bytes_per_axis_and_the_share_inside_a_node():
    """Llama-3 8B at tp2 + SP x dp16 on 4 nodes of 8, ZeRO-1: tp stays in a node (2 ranks), ZeRO's group spans the
    nodes; the printed bytes are the step volume's, the share inside a node tp's share of them."""
    import re

    from cli_helpers import composed, resolved

    from lightning_mgpu.cli.plan import plan_report

    cfg = composed("trainer=gpu", "model=llama3_8b", "trainer.devices=8", "trainer.num_nodes=4",
                   "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true", "parallel.zero_stage=1",
                   "data.seq_len=4096", "data.global_batch_size=64", "data.micro_batch_size=1",
                   "model.activation_checkpointing=none")
    line = next(line for line in plan_report(cfg).splitlines() if line.startswith("communication per step"))
    printed = {axis: float(gb) for axis, gb in re.findall(r"(\w+) (\d+\.\d+) GB", line)}
    volume = step_volume(resolved(cfg).model, StepShape(4096, 1, 4, tp=2, dp=16, zero_stage=1,
                                                        sequence_parallel=True))
    tp = sum(b for (axis, _), b in volume.items() if axis == "tp")
    dp = sum(b for (axis, _), b in volume.items() if axis == "dp_cp")
    assert printed == {"tp": pytest.approx(tp / 1e9, abs=0.006), "dp_cp": pytest.approx(dp / 1e9, abs=0.006)}
    assert f"{tp / (tp + dp):.0%} of the bytes inside a node" in line
