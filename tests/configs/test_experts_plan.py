"""Mixture-of-experts runs as the launcher sees them: the dry run's shares (routed experts apart) equal the planner's
under expert x tensor x pipeline parallelism, mgpu-plan reports the experts' traffic, and the memory check plans the
experts over the ranks that hold them and proposes more expert-parallel ranks."""

import re

import pytest
from cli_helpers import composed, resolved

from lightning_mgpu.cli.memory_check import memory_problems, run_memory
from lightning_mgpu.cli.plan import plan_report
from lightning_mgpu.cli.spec import run_spec
from lightning_mgpu.planner.memory import estimate_memory
from lightning_mgpu.planner.model_stats import rank_parameter_split

#: The tiny MoE recipe split every way at once: 8 processes = tp 2 x pp 2 x dp 2, the dp ranks splitting the experts.
EP2_TP2_PP2 = ["recipe=moe_tiny", "trainer.devices=8", "parallel.tensor_parallel_size=2",
               "parallel.pipeline_parallel_size=2", "parallel.expert_parallel_size=2"]


def test_the_dry_run_counts_each_ranks_experts_and_dense_parameters_as_the_planner_does():
    from lightning_mgpu.cli.dry_run import dry_run_report, rank_shares

    spec = run_spec(composed(*EP2_TP2_PP2), launching=False)
    layout, shares = rank_shares(spec)
    assert (layout.size("tp"), layout.size("pp"), layout.size("ep"), layout.size("edp")) == (2, 2, 2, 1)
    assert len(shares) == 4  # tp ranks 0 and 1 of both pipeline ranks
    m = spec.model
    for s in shares:
        planned = rank_parameter_split(m, 2, 2, 1, s.pp_rank, ep=2)
        assert (s.parameters - s.experts, s.experts) == (planned.dense, planned.experts)
        # 2 blocks a stage, each with 8 / 2 experts of hidden 64 / 2: w1, w3 [4, 64, 32], w2 [4, 32, 64]
        assert s.experts == 2 * 3 * 4 * 64 * 32
    report = dry_run_report(spec)
    assert "experts: 4 of 8 (top-2) per rank" in report and "| 0 | 0 | [0] | 70,912 | 70,912 | 49,152 | 49,152 |" \
        in report


def test_mgpu_plan_reports_the_configured_experts_and_their_all_to_all():
    cfg = composed("recipe=mixtral_8x7b_4node")
    lines = plan_report(cfg).splitlines()
    mine = next(x for x in lines if x.startswith("this configuration:"))
    assert "(ep 8)" in mine
    experts = next(x for x in lines if x.startswith("experts: "))
    assert "1 of 8 per rank" in experts
    a2a = next(x for x in lines if x.startswith("all-to-all: "))
    assert "inside a node" in a2a and "IMBALANCE=1.25" in a2a
    assert any("parallel.expert_parallel_size=" in x for x in lines if x.startswith("  mgpu-train "))


def test_the_memory_check_plans_experts_over_their_ranks_and_proposes_more_of_them(monkeypatch):
    """A GPU run of the tiny MoE recipe's shape scaled up; checked at submission against plan.gpu's preset."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    big = ["model=mixtral_8x7b", "trainer=gpu", "cluster=slurm", "trainer.devices=8", "trainer.num_nodes=4",
           "data.seq_len=4096", "data.global_batch_size=256", "data.micro_batch_size=1", "parallel.zero_stage=1",
           "model.activation_checkpointing=full"]
    spec = resolved(composed(*big, "parallel.expert_parallel_size=8"))
    need = run_memory(spec, on_gpu=True)
    planned = estimate_memory(spec.model, 4096, 1, 1, 1, 32, 1, recompute=True, overlap=True, mode="full",
                              microbatches=8, ep=8)
    assert need.model_states == pytest.approx(planned.model_states)
    [problem] = memory_problems(resolved(composed(*big)))  # every rank holding all 8 experts does not fit
    assert "of routed experts" in problem
    fixes = re.search(r"fixes, cheapest first: (.*)", problem).group(1)
    assert "parallel.expert_parallel_size=" in fixes
    ep = int(re.search(r"parallel.expert_parallel_size=(\d+)", fixes).group(1))
    assert memory_problems(resolved(composed(*big, f"parallel.expert_parallel_size={ep}"))) == []
