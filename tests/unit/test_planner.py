"""The planner without processes: parameter counts, memory and time arithmetic, the search, mgpu-plan, and
throughput counted per data-parallel replica."""

import ast
from pathlib import Path

import pytest
from cli_helpers import resolved

from lightning_mgpu.callbacks import throughput
from lightning_mgpu.cli.plan import compose_plan_config, main, plan_report
from lightning_mgpu.models import Llama, LlamaConfig
from lightning_mgpu.models.llama_plan import llama_stages
from lightning_mgpu.planner import GPUS, ClusterSpec, estimate_memory, plan_layouts, rank_parameters
from lightning_mgpu.planner.hardware import gpu_by_device_name
from lightning_mgpu.planner.memory import model_state_bytes
from lightning_mgpu.planner.model_stats import model_flops_per_token
from lightning_mgpu.planner.search import Candidate, evaluate

CFG = LlamaConfig(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=250, max_seq_len=64)
PACKAGE = Path(__file__).resolve().parents[2] / "lightning_mgpu"


def test_parameter_counts_match_the_model_and_its_stages():
    model = Llama(CFG)
    assert rank_parameters(CFG) == sum(p.numel() for p in model.parameters()) == CFG.num_parameters()
    stages = llama_stages(model, [0, 1, 2], 3)
    for rank in range(3):
        assert rank_parameters(CFG, pp=3, pp_rank=rank) == sum(p.numel() for p in stages[rank].parameters())


def test_model_states_follow_deepspeed_per_zero_stage():
    psi, n = 1_000_000, 4
    bf16 = {z: model_state_bytes(psi, z, n, "bf16-mixed") for z in range(4)}
    assert sum(bf16[0].values()) == 16 * psi  # 2 + 2 + 4 master + 8 Adam
    assert bf16[2]["parameters"] + bf16[2]["gradients"] + bf16[2]["optimizer"] == pytest.approx((2 + 14 / n) * psi)
    assert bf16[3]["parameters"] + bf16[3]["gradients"] + bf16[3]["optimizer"] == pytest.approx(16 / n * psi)
    fp32 = model_state_bytes(psi, 3, n, "32-true")
    assert fp32["parameters"] + fp32["gradients"] + fp32["optimizer"] == pytest.approx(20 / n * psi)  # master kept
    assert model_state_bytes(psi, 0, n, "32-true")["optimizer"] == 8 * psi  # fp32 ZeRO-0: no master copy


def test_sequence_parallelism_and_recomputation_shrink_activations():
    big = LlamaConfig.from_name("llama3_8b")
    kw = dict(cfg=big, seq_len=8192, micro_batch=1, pp=1, dp=8, zero_stage=1)
    plain = estimate_memory(tp=2, **kw).activations
    sp = estimate_memory(tp=2, sequence_parallel=True, **kw).activations
    recompute = estimate_memory(tp=2, sequence_parallel=True, recompute=True, **kw).activations
    assert recompute < sp < plain


def test_search_finds_layouts_that_fit_and_reports_honest_mfu():
    cluster = ClusterSpec(1, 8, GPUS["h100_80gb"])
    rows = plan_layouts(LlamaConfig.from_name("llama3_8b"), cluster, seq_len=8192, global_batch=128)
    fitting = [r for r in rows if r.fits]
    assert fitting and not rows[-1].fits  # some fit, some (e.g. ZeRO-0 without recompute) do not
    assert all(r.memory.total <= 0.9 * 80e9 for r in fitting)
    best = fitting[0]
    assert 0 < best.time.mfu <= 0.5  # never above the stated achievable fraction
    assert best.time.tokens_per_second_per_gpu == pytest.approx(128 * 8192 / best.time.total / 8)


def test_mgpu_plan_prints_a_table_and_command_lines(capsys):
    main(["recipe=llama3_70b_8node", "plan.top=5"])
    out = capsys.readouterr().out
    assert "llama3_70b: 70.55B parameters; 8 x 8 H100-SXM5-80GB" in out
    assert "best layouts:" in out and "mgpu-train recipe=llama3_70b_8node parallel.tensor_parallel_size=" in out
    assert "no layout fits" in plan_report(compose_plan_config(["model=llama3_405b", "trainer.devices=8",
                                                                "plan.gpu=a100_80gb"]))


def test_mgpu_plan_evaluates_the_configured_layout_itself():
    """A recipe's own layout is not one the search tries (V=5): it gets its own line, with the numbers the planner
    gives that exact layout and a verdict that changes with the memory it needs."""
    cfg = compose_plan_config(["recipe=llama3_70b_8node"])
    line = next(x for x in plan_report(cfg).splitlines() if x.startswith("this configuration:"))
    assert "tp 8 x pp 4 (V 5, interleaved_1f1b) x dp 2, ZeRO-1, micro-batch 1, full recompute, sequence parallel" in line
    own = evaluate(resolved(cfg).model, ClusterSpec(8, 8, GPUS["h100_80gb"]), 8192, 512,
                   Candidate(8, 4, 2, 1, 1, 5, True, "interleaved_1f1b", True))
    assert f"{own.memory.total / 1e9:.1f} GB per GPU" in line and f"step {own.time.total:.2f} s" in line
    assert own.fits and "fits;" in line
    no_recompute = plan_report(compose_plan_config(["recipe=llama3_70b_8node", "model.activation_checkpointing=none",
                                                    "data.micro_batch_size=8"]))
    assert "does not fit in 90% of 80 GB" in next(x for x in no_recompute.splitlines() if x.startswith("this conf"))


def test_overlap_hides_data_parallel_communication_behind_compute_up_to_its_length():
    """With overlap (CUDA's default at ZeRO 2 and 3) the gradient reductions hide behind the backward passes (2/3 of
    the compute) without a pipeline, never behind a pipeline schedule (it reduces after its last backward); ZeRO-3's
    gathers hide behind the step's compute, ZeRO-1/2's gathers of the updated weights after the step behind nothing;
    ZeRO 0 and 1 hide nothing. Hidden time is reported, never subtracted twice."""
    from lightning_mgpu.planner.time import estimate_step_time

    model = LlamaConfig.from_name("llama3_8b")
    two_nodes = ClusterSpec(2, 8, GPUS["h100_80gb"])
    for kw in (dict(tp=1, pp=1, zero_stage=1, micro_batch=1), dict(tp=1, pp=1, zero_stage=3, micro_batch=4),
               dict(tp=2, pp=2, zero_stage=1, micro_batch=1), dict(tp=8, pp=1, zero_stage=2, micro_batch=2)):
        plain = estimate_step_time(model, two_nodes, 4096, 64, overlap=False, **kw)
        hidden = estimate_step_time(model, two_nodes, 4096, 64, **kw)
        assert plain.data_parallel_hidden == 0.0
        assert hidden.data_parallel + hidden.data_parallel_hidden == pytest.approx(plain.data_parallel)
        assert hidden.compute == plain.compute and hidden.total <= plain.total
        assert hidden.without_overlap == pytest.approx(plain.total)  # the bound mgpu-plan prints beside the step
        n = 16 // (kw["tp"] * kw["pp"])  # ring collectives over the data-parallel ranks, across the two nodes
        ring = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
        moved = {op: sum(b for (axis, o), b in plain.volume.items() if axis == "dp_cp" and o == op) * share
                 / GPUS["h100_80gb"].inter_node_bandwidth for op, share in ring.items()}
        reduction, gathers = moved["all_reduce"] + moved["reduce_scatter"], moved["all_gather"]
        assert plain.data_parallel == pytest.approx(reduction + gathers)
        backward = 2 / 3 * plain.compute if kw["pp"] == 1 and kw["zero_stage"] >= 2 else 0.0
        prefetched = min(gathers, plain.compute) if kw["zero_stage"] == 3 else 0.0
        assert hidden.data_parallel_hidden == pytest.approx(min(reduction, backward) + prefetched)
    for kw in (dict(tp=2, pp=2, zero_stage=2, micro_batch=1), dict(tp=1, pp=1, zero_stage=1, micro_batch=1)):
        unhidden = estimate_step_time(model, two_nodes, 4096, 64, **kw)
        assert unhidden.data_parallel_hidden == 0 and unhidden.data_parallel > 0


def test_overlap_holds_a_second_reduce_bucket_at_zero_2_and_3():
    """DeepSpeed reduces one bucket while the next fills when it overlaps (ZeRO 2 and 3 on GPUs): one more bucket of
    buffers there, nothing at ZeRO 0 and 1; a GPU plan counts it, a CPU process does not."""
    n = 10_000_000
    for stage in range(4):
        plain, overlapped = (model_state_bytes(n, stage, 8, overlap=o)["buffers"] for o in (False, True))
        assert overlapped - plain == (n // 4 * 2 if stage >= 2 else 0)
    cfg = LlamaConfig.from_name("llama3_8b")
    row = evaluate(cfg, ClusterSpec(1, 8, GPUS["h100_80gb"]), 4096, 64, Candidate(1, 1, 8, 2, 1))
    assert row.memory.buffers == estimate_memory(cfg, 4096, 1, 1, 1, 8, 2, overlap=True).buffers > \
        estimate_memory(cfg, 4096, 1, 1, 1, 8, 2).buffers


def test_throughput_counts_tokens_once_per_replica():
    # tp=2 x pp=2 x dp=2 on 8 GPUs, each rank sees a batch of 4 x 1024 tokens: the job processes 2 replicas'
    # batches per step, not 8 ranks' worth (naive world-size scaling would be 4x off).
    t = throughput(tokens_per_rank_batch=4 * 1024, data_parallel_size=2, world_size=8, seconds=0.5,
                   flops_per_token=6e9, peak_flops=1e15)
    assert t.tokens_per_second == pytest.approx(2 * 4 * 1024 / 0.5)
    assert t.tflops_per_gpu == pytest.approx(2 * 4 * 1024 * 6e9 / 8 / 0.5 / 1e12)
    assert t.mfu == pytest.approx(t.tflops_per_gpu * 1e12 / 1e15)
    naive = throughput(4 * 1024, 8, 8, 0.5, 6e9, 1e15)
    assert naive.tokens_per_second / t.tokens_per_second == 4


def test_flops_per_token_is_six_n_plus_attention():
    n_matmul = CFG.num_parameters() - CFG.vocab_size * CFG.dim - CFG.dim * (2 * CFG.n_layers + 1)
    assert model_flops_per_token(CFG, 64) == 6 * n_matmul + 6 * CFG.n_layers * 64 * CFG.dim


def test_gpu_names_map_to_presets():
    assert gpu_by_device_name("NVIDIA H200") == GPUS["h200_141gb"]
    assert gpu_by_device_name("NVIDIA H100 80GB HBM3") == GPUS["h100_80gb"]
    assert gpu_by_device_name("NVIDIA A100-SXM4-80GB") == GPUS["a100_80gb"]
    assert gpu_by_device_name("Tesla T4") is None


def test_planner_imports_nothing_distributed():
    """At module level, in the planner and in every project module it imports (functions the planner never calls,
    like ParallelLayout.init_groups, may import torch.distributed when they run)."""
    files = list((PACKAGE / "planner").glob("*.py")) + [PACKAGE / "layout.py", PACKAGE / "parallel" / "timeline.py",
                                                          PACKAGE / "models" / "llama.py", PACKAGE / "models" / "llama_plan.py"]
    for path in files:
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if "distributed" in n or "deepspeed" in n or n.startswith("lightning.")]
            assert not bad, f"{path.name} imports {bad}"


def test_memory_is_that_of_the_most_loaded_pipeline_rank_and_every_rank_can_be_printed():
    """Per pipeline rank: its own parameters (all ranks together hold the model once), its blocks' activations times
    the micro-batches it holds in flight (P - r under 1F1B), and the head only where the last stage is; the plan's
    figure is the most loaded rank's."""
    from lightning_mgpu.planner.memory import activation_bytes, head_activation_bytes, stage_memory

    cfg = LlamaConfig.from_name("llama3_8b")
    kw = dict(tp=2, pp=4, dp=1, zero_stage=1, sequence_parallel=True)
    stages = stage_memory(cfg, 8192, 1, **kw)
    acts = [m.activations for m in stages]
    # 8 blocks a rank; in flight 4, 3, 2, 1 micro-batches; the head (logits and loss of one) on the last rank only
    assert acts[0] / 4 == acts[1] / 3 == acts[2] / 2
    assert acts[3] - acts[2] / 2 == pytest.approx(head_activation_bytes(cfg, 8192, 2, True, 2))
    assert estimate_memory(cfg, 8192, 1, **kw) == max(stages, key=lambda m: m.total)
    assert estimate_memory(cfg, 8192, 1, **kw).activations < activation_bytes(cfg, 8192, 1, 2, 4, 1, True, False)
    held = [rank_parameters(cfg, 2, 4, 1, r) for r in range(4)]
    assert sum(held) == rank_parameters(cfg, 2, 1, 1, 0)  # each tp rank's share of the model, once
    report = plan_report(compose_plan_config(["recipe=llama3_70b_8node", "plan.per_stage=true", "plan.top=1"]))
    rows = report.split("per pipeline rank (GB per GPU):")[1].splitlines()[2:6]
    assert [int(r.split()[0]) for r in rows] == [0, 1, 2, 3] and "0,4,8,12,16" in rows[0]


def test_selective_recomputation_is_planned_between_none_and_full():
    """Memory: the projections' outputs kept (less than none, more than full). Time: the attention scores' forward
    again and the forward's collectives again (more than none, less than full's whole second forward)."""
    cfg = LlamaConfig.from_name("llama3_8b")
    cluster = ClusterSpec(1, 8, GPUS["h100_80gb"])
    rows = {c: evaluate(cfg, cluster, 8192, 64, Candidate(2, 1, 4, 2, 1, recompute=c == "full",
                                                          selective=c == "selective"))
            for c in ("none", "selective", "full")}
    mem = {c: r.memory.activations for c, r in rows.items()}
    time = {c: r.time.total for c, r in rows.items()}
    assert mem["full"] < mem["selective"] < mem["none"]
    assert time["none"] < time["selective"] < time["full"]
    assert "model.activation_checkpointing=selective" in rows["selective"].candidate.overrides()
    assert any(r.candidate.selective for r in plan_layouts(cfg, cluster, 8192, 64))  # the search proposes it
