"""ParallelLayout: rank arithmetic, groups and validation, without processes."""

import pytest

from lightning_mgpu.layout import ModelShape, ParallelLayout
from lightning_mgpu.split_rules import sequence_problems

LLAMA_8B = ModelShape(n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256)


def test_tp_is_innermost_then_pp_then_dp():
    layout = ParallelLayout(world_size=16, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.size("dp") == 4
    assert layout.coords(0) == {"tp": 0, "cp": 0, "pp": 0, "dp": 0, "rep": 0}
    assert layout.coords(1) == {"tp": 1, "cp": 0, "pp": 0, "dp": 0, "rep": 0}
    assert layout.coords(2) == {"tp": 0, "cp": 0, "pp": 1, "dp": 0, "rep": 0}
    assert layout.coords(7) == {"tp": 1, "cp": 0, "pp": 1, "dp": 1, "rep": 0}
    for r in range(16):
        assert layout.global_rank_of(**layout.coords(r)) == r


def test_replicas_are_outermost_and_zero_partitions_inside_each():
    layout = ParallelLayout(world_size=16, tensor_parallel_size=2, replicas=2, replica_update="local", sync_every=4)
    assert (layout.size("dp"), layout.size("rep"), layout.size("data"), layout.size("dp_cp")) == (4, 2, 8, 4)
    assert layout.coords(9) == {"tp": 1, "cp": 0, "pp": 0, "dp": 0, "rep": 1}
    for r in range(16):
        assert layout.global_rank_of(**layout.coords(r)) == r
    assert layout.group_ranks("dp")[0] == [0, 2, 4, 6]  # gradients reduce inside a replica
    assert layout.group_ranks("rep")[0] == [0, 8]  # the same place in each replica: the outer step's group
    view = layout.planned_at(11)  # tp 1, dp 1 of replica 1: reads the samples of data rank 1 * 4 + 1
    assert (view.rank("data"), view.rank("dp"), view.rank("rep"), view.rank("dp_cp")) == (5, 1, 1, 1)
    assert ParallelLayout(world_size=4, replicas=1).size("data") == 4


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(world_size=6, replicas=4, replica_update="local"), "replicas=4 does not divide the 6 data-parallel ranks; "
                                                               "choose 1, 2, 3, 6"),
    (dict(world_size=4, replicas=2), "replicas=2 splits the data-parallel ranks into groups"),
    (dict(world_size=4, replicas=2, replica_update="local", sync_every=0), "sync_every=0 must be a positive integer"),
    (dict(world_size=4, replicas=2, replica_update="gossip"), "replica_update='gossip' is unknown"),
    (dict(world_size=4, replicas=2, replica_update="local", zero_stage=1, offload_optimizer="cpu"),
     "replica_update='local' cannot run with ZeRO offload"),
])
def test_replica_rules_name_the_value_and_the_fix(kwargs, fragment):
    with pytest.raises(ValueError, match="Invalid parallel layout") as err:
        ParallelLayout(**kwargs)
    assert fragment in str(err.value)


def test_context_parallel_sits_between_tp_and_pp_and_shares_zero_with_dp():
    layout = ParallelLayout(world_size=16, tensor_parallel_size=2, context_parallel_size=2, pipeline_parallel_size=2)
    assert (layout.size("dp"), layout.size("cp"), layout.size("dp_cp")) == (2, 2, 4)
    assert layout.coords(2) == {"tp": 0, "cp": 1, "pp": 0, "dp": 0, "rep": 0}
    assert layout.coords(13) == {"tp": 1, "cp": 0, "pp": 1, "dp": 1, "rep": 0}
    for r in range(16):
        assert layout.global_rank_of(**layout.coords(r)) == r
    assert layout.group_ranks("cp")[0] == [0, 2]
    assert layout.group_ranks("pp")[0] == [0, 4]
    assert layout.group_ranks("dp")[0] == [0, 8]
    assert layout.group_ranks("dp_cp")[0] == [0, 2, 8, 10]  # ranks with the same weights: ZeRO's group
    assert layout.group_ranks("mp")[0] == [0, 1, 4, 5]  # one replica's sequence part: the whole model once
    for axis in ("tp", "cp", "pp", "dp", "dp_cp", "mp"):
        flat = sorted(r for g in layout.group_ranks(axis) for r in g)
        assert flat == list(range(16)), axis
    # 8-GPU nodes: tp x cp = 2 x 4 fits in a node, so both exchanges stay inside it
    node = ParallelLayout(world_size=16, tensor_parallel_size=2, context_parallel_size=4, devices_per_node=8)
    for axis in ("tp", "cp"):
        assert all(len({r // 8 for r in g}) == 1 for g in node.group_ranks(axis))


@pytest.mark.parametrize("seq_len, C, T, sp, fragment", [
    (20, 4, 1, False, "seq_len=20 is not a multiple of 8 (context_parallel_size=4 gives each rank 2 of 8 equal "
                      "chunks); use 16 or 24"),
    (20, 2, 4, True, "multiple of 8"),
    (6, 1, 4, True, "seq_len=6 is not a multiple of 4"),
])
def test_sequence_split_rule_names_the_nearest_valid_lengths(seq_len, C, T, sp, fragment):
    problems = sequence_problems(seq_len, C, T, sp)
    assert len(problems) == 1 and fragment in problems[0], problems
    assert sequence_problems(32, C, T, sp) == []


def test_groups_partition_the_world():
    layout = ParallelLayout(world_size=16, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.group_ranks("tp")[0] == [0, 1]
    assert layout.group_ranks("pp")[0] == [0, 2]
    assert layout.group_ranks("dp")[0] == [0, 4, 8, 12]
    assert layout.group_ranks("mp")[1] == [4, 5, 6, 7]
    for axis in ("tp", "pp", "dp", "mp"):
        flat = sorted(r for g in layout.group_ranks(axis) for r in g)
        assert flat == list(range(16)), axis


def test_eight_gpu_nodes_keep_tp_inside_a_node():
    layout = ParallelLayout(world_size=64, tensor_parallel_size=8, pipeline_parallel_size=2, devices_per_node=8)
    for group in layout.group_ranks("tp"):
        assert len({r // 8 for r in group}) == 1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(world_size=6, tensor_parallel_size=4), "world_size=6 is not divisible by"),
    (dict(world_size=4, zero_stage=4), "zero_stage=4 is not a ZeRO stage"),
    (dict(world_size=4, offload_optimizer="cpu"), "offload_optimizer='cpu' needs ZeRO"),
    (dict(world_size=4, zero_stage=2, offload_params="cpu"), "offload_params='cpu' needs ZeRO stage 3"),
    (dict(world_size=4, zero_stage=1, offload_optimizer="disk"), "offload_optimizer='disk' is not an offload device"),
    (dict(world_size=4, sequence_parallel=True), "sequence_parallel=True needs tensor_parallel_size > 1"),
    (dict(world_size=4, pipeline_schedule="zigzag"), "pipeline_schedule='zigzag' is unknown"),
    (dict(world_size=4, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b"),
     "needs virtual_pipeline_size >= 2"),
    (dict(world_size=4, virtual_pipeline_size=2, pipeline_schedule="1f1b"), "needs a multi-stage schedule"),
    (dict(world_size=4, pipeline_parallel_size=2, pipeline_schedule="zbv", virtual_pipeline_size=2, zero_stage=3),
     "zero_stage=3 cannot run pipeline_schedule='zbv'"),
    (dict(world_size=4, pipeline_parallel_size=4, num_microbatches=2), "needs num_microbatches >= pipeline_parallel_size=4"),
    (dict(world_size=4, pipeline_parallel_size=4, pipeline_schedule="dualpipev", virtual_pipeline_size=2,
          num_microbatches=4), "needs num_microbatches >= its 2*pipeline_parallel_size=8 stages"),
    (dict(world_size=0), "world_size=0 must be a positive integer"),
    (dict(world_size=4, tensor_parallel_size=-1), "tensor_parallel_size=-1 must be a positive integer"),
    (dict(world_size=3, tensor_parallel_size=3, model=LLAMA_8B), "tensor_parallel_size=3 does not divide n_heads=32"),
    (dict(world_size=64, pipeline_parallel_size=64, model=LLAMA_8B), "64 stages is more than the model's n_layers=32"),
])
def test_each_rule_names_value_and_fix(kwargs, fragment):
    with pytest.raises(ValueError, match="Invalid parallel layout") as err:
        ParallelLayout(**kwargs)
    assert fragment in str(err.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as err:
        ParallelLayout(world_size=7, tensor_parallel_size=3, zero_stage=5, pipeline_schedule="nope",
                       offload_params="cpu", model=LLAMA_8B)
    message = str(err.value)
    for fragment in ("world_size=7", "zero_stage=5", "pipeline_schedule='nope'", "offload_params='cpu'",
                     "n_heads=32", "n_kv_heads=8"):
        assert fragment in message
    assert message.count("\n  - ") >= 6


def test_fix_suggests_valid_tp_sizes():
    with pytest.raises(ValueError) as err:
        ParallelLayout(world_size=8, tensor_parallel_size=3, model=LLAMA_8B)
    assert "choose 1, 2, 4 or 8" in str(err.value)


def test_tp_across_nodes_warns_with_the_cost():
    with pytest.warns(UserWarning, match="inter-node"):
        ParallelLayout(world_size=32, tensor_parallel_size=16, devices_per_node=8)


def test_groups_need_init():
    layout = ParallelLayout(world_size=2)
    with pytest.raises(RuntimeError, match="init_groups"):
        layout.group("dp")
    with pytest.raises(ValueError, match="axis='xy' is unknown"):
        layout.size("xy")
