"""A run whose memory cannot fit is refused before launch: the estimate per process (CPU, all processes of a machine
together) or per GPU, the limit, and changes that fit, in the problem list of every refusal (exit status 2).
No test here trains: the refusal happens before any process starts."""

import re
import resource

import pytest
import torch
from forked_cli import run_cli
from cli_helpers import BIN, composed, recipe_overrides, resolved

from lightning_mgpu.cli import memory_check
from lightning_mgpu.cli.paths import recipes_dir
from lightning_mgpu.cli.errors import EXIT_REFUSED, ConfigError
from lightning_mgpu.cli.memory_check import memory_budget, memory_problems, run_memory
from lightning_mgpu.cli.validate import check_run
from lightning_mgpu.models import Llama, LlamaConfig
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.planner.model_stats import max_rank_parameters
from lightning_mgpu.planner.memory import activation_bytes, estimate_memory
from lightning_mgpu.planner.process import (CPU_ACTIVATION_FACTOR, CPU_STATE_FACTOR, CPU_STATE_FACTOR_KEPT_HEAP,
                                            PROCESS_BASELINE_BYTES, process_memory)

#: The layout the kernel killed (exit 137, 12.6 GB per process on a 24 GB machine) without a message.
LLAMA3_1B_TP2 = ["model=llama3_1b", "trainer.devices=2", "parallel.tensor_parallel_size=2", "parallel.zero_stage=1"]
#: A GPU job at SLURM submission: with no GPU visible, its memory is checked against plan.gpu's preset.
GPU_8B = ["model=llama3_8b", "trainer=gpu", "cluster=slurm", "parallel.zero_stage=0", "data.seq_len=8192",
          "data.micro_batch_size=4", "data.global_batch_size=64"]
GPU_70B = ["model=llama3_70b", "trainer=gpu", "cluster=slurm", "trainer.num_nodes=4", "parallel.zero_stage=1",
           "data.seq_len=8192", "data.micro_batch_size=2", "data.global_batch_size=64"]


def needs_of(cfg) -> float:
    """Estimated bytes of a composed run on what it shares: one GPU, or this machine for all its processes."""
    budget = memory_budget(cfg)
    return budget.processes * run_memory(resolved(cfg), budget.on_gpu).total


#: Too big for any machine's host memory (fp32 70B on 2 processes): refused wherever the suite runs.
LLAMA3_70B_CPU = ["model=llama3_70b", "trainer.devices=2", "parallel.zero_stage=1"]


@pytest.fixture
def machine_of_25_gb(monkeypatch):
    """The machine issue 13 measured on (25.3 GB, where llama3_1b at tp2 was killed), whatever machine runs this."""
    monkeypatch.setattr(memory_check, "host_memory", lambda: (25.3e9, "this machine's physical memory"))


@pytest.fixture
def at_submission(monkeypatch):
    """Outside any SLURM job and with no GPU visible: a GPU job is checked against plan.gpu's preset."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)


def at_most_4_gib() -> None:
    """Address space of the subprocess (and the processes it starts): a refusal needs under 1 GiB; a broken check then
    fails allocating instead of taking the shared machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_a_layout_that_cannot_fit_is_refused_before_launch(tmp_path):
    cfg = composed(*LLAMA3_70B_CPU)
    run_dir = tmp_path / "run"
    proc = run_cli([str(BIN / "mgpu-train"), *LLAMA3_70B_CPU, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120,
                   preexec_fn=at_most_4_gib)
    assert proc.returncode == EXIT_REFUSED, proc.stderr[-3000:]
    assert not (run_dir / "config.yaml").exists()  # refused before the run was written or any process started
    [head] = [line for line in proc.stderr.splitlines() if line.startswith("  - memory:")]
    each, total, usable, ram = map(float, re.search(
        r"trainer.devices=2 processes on this machine x an estimated peak of ([\d.]+) GB each = ([\d.]+) GB is more "
        r"than the ([\d.]+) GB usable of the ([\d.]+) GB of this machine's physical memory", head).groups())
    budget = memory_budget(cfg)
    assert total == pytest.approx(needs_of(cfg) / 1e9, abs=0.06) == pytest.approx(2 * each, abs=0.11)
    assert (usable, ram) == (pytest.approx(budget.usable / 1e9, abs=0.06), pytest.approx(budget.total / 1e9, abs=0.06))
    for fragment in (f"per process: {PROCESS_BASELINE_BYTES / 1e9:.1f} GB libraries",
                     f"({max_rank_parameters(resolved(cfg).model, 1, 1) / 1e6:,.0f}M parameters on the fullest "
                     "rank, 32-true, ZeRO-1 over 2 data-parallel ranks)",
                     "activations (micro-batch 4 x 128 tokens)", "cluster.check_memory=false launches it anyway"):
        assert fragment in proc.stderr


def test_the_issues_llama3_1b_command_is_refused_on_its_machine(machine_of_25_gb):
    """mgpu-train model=llama3_1b trainer.devices=2 parallel.tensor_parallel_size=2 parallel.zero_stage=1 was killed by
    the kernel at 12.6 GB per process on a 25.3 GB machine; it is refused before launch, naming the estimate."""
    with pytest.raises(ConfigError, match=r"memory: trainer.devices=2 processes on this machine x an estimated peak of "
                                          r"[\d.]+ GB each = [\d.]+ GB is more than the 22.8 GB usable of the 25.3 GB"):
        check_run(composed(*LLAMA3_1B_TP2))


def test_an_expert_can_turn_the_check_off(machine_of_25_gb):
    cfg = composed(*LLAMA3_1B_TP2)
    with pytest.raises(ConfigError, match="memory: trainer.devices=2 processes") as refused:
        check_run(cfg)
    # the memory-lean CPU setting is offered (here with fewer processes per machine: alone it does not fit), and the
    # estimate counts it
    assert "parallel.return_freed_memory=True" in str(refused.value).split("fixes")[-1].split("together")[-1]
    assert needs_of(composed(*LLAMA3_1B_TP2, "parallel.return_freed_memory=true")) < 0.7 * needs_of(cfg)
    check_run(composed(*LLAMA3_1B_TP2, "cluster.check_memory=false"))  # nothing else is wrong with it


def test_memory_is_estimated_only_for_a_run_without_other_problems(machine_of_25_gb):
    cfg = composed(*LLAMA3_1B_TP2, "optim.lr=-1")
    with pytest.raises(ConfigError) as err:
        check_run(cfg)
    assert err.value.problems == ["optim.lr=-1.0 must be > 0"]


@pytest.mark.parametrize("recipe", [None, *sorted(p.stem for p in recipes_dir().glob("*.yaml"))])
def test_the_default_run_and_every_recipe_fit(recipe, request):
    """``make train`` (the defaults: tiny, 2 CPU processes) and every shipped recipe, GPU recipes against the GPU
    preset they were planned for, pass."""
    cfg = composed() if recipe is None else composed(*recipe_overrides(recipe), "cluster=local")  # as inside the job
    if cfg.trainer.accelerator != "cpu":
        request.getfixturevalue("at_submission")
    assert memory_problems(resolved(cfg)) == []


def test_a_gpu_refusal_names_the_gpu_and_fixes_that_each_fit(at_submission):
    [problem] = memory_problems(resolved(composed(*GPU_8B)))
    assert re.search(r"memory: an estimated peak of [\d.]+ GB per GPU is more than the 72.0 GB usable of the 80.0 GB "
                     r"of a H100-SXM5-80GB \(plan.gpu=h100_80gb; no GPU is visible here\)", problem), problem
    assert "per GPU: " in problem and "bf16-mixed, ZeRO-0 over 8 data-parallel ranks" in problem
    fixes = re.search(r"fixes, cheapest first: (.*)", problem).group(1).split("; ")
    assert fixes[0].startswith("parallel.zero_stage=") and len(fixes) >= 2
    for fix in fixes:
        overrides, gb = re.fullmatch(r"(.*) \(([\d.]+) GB per GPU\)", fix).groups()
        fixed = composed(*GPU_8B, *overrides.split())
        assert memory_problems(resolved(fixed)) == [], fix
        assert needs_of(fixed) / 1e9 == pytest.approx(float(gb), abs=0.06)
    milder = int(fixes[0].split()[0].split("=")[1]) - 1  # the mildest ZeRO stage that fits is the one named
    assert milder == 0 or memory_problems(resolved(composed(*GPU_8B, f"parallel.zero_stage={milder}")))


def test_when_no_single_change_fits_changes_that_fit_together_are_named(at_submission):
    [problem] = memory_problems(resolved(composed(*GPU_70B)))
    overrides, gb = re.search(r"no single change fits; together: (.*) \(([\d.]+) GB per GPU\)", problem).groups()
    changes = overrides.split()
    assert len(changes) >= 2 and memory_problems(resolved(composed(*GPU_70B, *changes))) == []
    for change in changes:  # each is needed
        assert memory_problems(resolved(composed(*GPU_70B, *(c for c in changes if c != change))))


def test_every_rank_building_the_whole_model_is_a_peak_of_its_own():
    """A module built off the meta device builds the whole model (fp32; bf16 under bf16-true) and keeps its shard
    afterwards; built on meta, a rank holds its whole tensor/pipeline shard before the engine starts, except under
    ZeRO-3, which partitions each tensor as it is filled. Each is a phase of its own, before training's peak."""
    cfg = LlamaConfig.from_name("llama3_8b")
    kw = dict(cfg=cfg, seq_len=4096, micro_batch=1, tp=8, pp=1, dp=1, zero_stage=1, precision="bf16-mixed",
              host=False)
    sharded, whole = process_memory(**kw, builds_whole_model=False), process_memory(**kw, builds_whole_model=True)
    assert sharded.whole_model == 4 * max_rank_parameters(cfg, 8, 1) and whole.whole_model == 4 * cfg.num_parameters()
    # ZeRO-3 over many replicas (70B, tp1, 64 replicas): partitioned as filled, one tensor (the embedding) is whole
    big = LlamaConfig.from_name("llama3_70b")
    zero3 = process_memory(big, 4096, 1, 1, 1, 64, 3, precision="bf16-mixed", host=False, builds_whole_model=False)
    assert zero3.whole_model == 4 * big.vocab_size * big.dim < zero3.training == zero3.total
    assert whole.total == max(whole.whole_model, sharded.training) == whole.whole_model > sharded.total
    assert process_memory(**{**kw, "precision": "bf16-true"}).whole_model == 2 * cfg.num_parameters()


def test_host_and_gpu_estimates_follow_the_planner(monkeypatch):
    cfg = LlamaConfig.from_name("llama3_1b")
    kw = dict(seq_len=2048, micro_batch=2, tp=2, pp=1, dp=4, zero_stage=3, precision="bf16-mixed")
    planned = estimate_memory(cfg, **kw, overlap=True)  # a GPU overlaps communication (a second reduce bucket)
    gpu = process_memory(cfg, **kw, host=False, builds_whole_model=False)
    assert (gpu.baseline, gpu.model_states, gpu.activations) == (0, planned.model_states, planned.activations)
    offloaded = process_memory(cfg, **kw, host=False, builds_whole_model=False, offload_optimizer=True,
                               offload_params=True)  # ZeRO-3 offload: what stays on the GPU
    assert offloaded.model_states == pytest.approx(planned.gradients + planned.buffers)
    planned = estimate_memory(cfg, **kw)  # a CPU process does not overlap
    host = process_memory(cfg, **kw, host=True, builds_whole_model=False, return_freed_memory=True)
    assert host.baseline == PROCESS_BASELINE_BYTES
    assert host.model_states == pytest.approx(CPU_STATE_FACTOR * planned.model_states)
    # where the processes keep glibc's heap (the default, or the user's own threshold), the factor measured for that
    kept = process_memory(cfg, **kw, host=True, builds_whole_model=False)
    assert kept.model_states == pytest.approx(CPU_STATE_FACTOR_KEPT_HEAP * planned.model_states)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    kept = process_memory(cfg, **kw, host=True, builds_whole_model=False, return_freed_memory=True)
    assert kept.model_states == pytest.approx(CPU_STATE_FACTOR_KEPT_HEAP * planned.model_states)
    assert host.activations == pytest.approx(CPU_ACTIVATION_FACTOR * planned.activations)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_cpu_activation_factor_bounds_what_this_llama_saves(recompute):
    """Bytes autograd keeps for backward of a real forward (fp32, CPU) against the host estimate's activations."""
    cfg = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=1024, activation_checkpointing=recompute)
    model, tokens, saved = Llama(cfg), torch.randint(0, cfg.vocab_size, (2, 65)), {}
    checkpoint_blocks(model.layers, recompute)  # as parallelize (or LLMModule) applies it

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in weights)
    estimated = CPU_ACTIVATION_FACTOR * activation_bytes(cfg, 64, 2, 1, 1, 1, False, recompute == "full",
                                                         precision="32-true")
    assert measured <= estimated
    if recompute == "none":
        assert measured > estimated / 2  # an upper bound, not a wild one


def test_local_replicas_count_the_outer_steps_copies_and_partition_inside_a_replica():
    """Two fp32 copies of this rank's share (the outer weights and momentum), and ZeRO over the 2 ranks of a replica
    instead of all 4."""
    base = ["model=llama3_1b", "trainer.devices=4", "parallel.zero_stage=1", "parallel.replicas=2"]
    local = resolved(composed(*base, "parallel.replica_update=local"))
    sync_split = resolved(composed(*base))  # the same partitioning without the outer step (a launch refuses it)
    whole = resolved(composed("model=llama3_1b", "trainer.devices=4", "parallel.zero_stage=1"))
    share = local.model.num_parameters() / 2  # ZeRO-1 over a replica's 2 data-parallel ranks
    assert run_memory(local, False).model_states - run_memory(sync_split, False).model_states == \
        pytest.approx(8 * share, rel=1e-3)
    assert run_memory(sync_split, False).model_states > run_memory(whole, False).model_states  # 2 ranks, not 4
