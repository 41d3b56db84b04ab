"""A mixture-of-experts run's bad inputs, refused before launch with the key, the value, the rule and the fix, all at
once: expert counts and sizes that do not divide, capacity settings that cannot work, MoE options on a dense
model."""

import pytest
from cli_helpers import composed

from lightning_mgpu.cli.spec import config_problems

MOE = ["model.num_experts=8", "model.expert_hidden=64"]
BAD = [
    (["trainer.devices=2", "parallel.expert_parallel_size=2"],
     "parallel.expert_parallel_size=2 needs a mixture-of-experts model (num_experts=0)"),
    ([*MOE, "trainer.devices=6", "parallel.expert_parallel_size=4"],
     "parallel.expert_parallel_size=4 does not divide the 6 data x context ranks it folds over; choose 1, 2"),
    (["model.num_experts=6", "model.expert_hidden=64", "trainer.devices=4", "parallel.expert_parallel_size=4"],
     "parallel.expert_parallel_size=4 does not divide num_experts=6"),
    ([*MOE, "model.experts_per_token=9"], "experts_per_token=9 must be between 1 and num_experts=8"),
    ([*MOE, "model.capacity_factor=0"], "capacity_factor=0.0 cannot keep any token"),
    ([*MOE, "model.aux_loss=always"], "aux_loss='always' is unknown"),
    ([*MOE, "trainer.devices=2", "parallel.expert_parallel_size=2", "checkpoint.format=deepspeed",
      "checkpoint.every_n_steps=10"], "expert_parallel_size=2 saves its experts in universal checkpoints only"),
    (["model.experts_per_token=4"], "experts_per_token=4 only apply to a mixture-of-experts model"),
    ([*MOE, "model.dense_layers=4"], "dense_layers=4 must be in [0, n_layers=4)"),
    ([*MOE, "model.dim=48", "model.n_heads=6", "model.n_kv_heads=3", "trainer.devices=3",
      "parallel.tensor_parallel_size=3"], "parallel.tensor_parallel_size=3 does not divide expert_hidden=64"),
]


@pytest.mark.parametrize("overrides, fragment", BAD, ids=[f[:40] for _, f in BAD])
def test_each_bad_moe_input_is_named_with_its_fix(overrides, fragment):
    problems = config_problems(composed(*overrides))
    assert any(fragment in p for p in problems), problems


def test_a_valid_expert_parallel_run_is_clean():
    assert config_problems(composed(*MOE, "trainer.devices=4", "parallel.expert_parallel_size=4")) == []
