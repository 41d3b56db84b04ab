"""The memory check and ``mgpu-plan`` read ``adapters.*`` from the composed config: with ``adapters=lora`` over a
Qwen3-8B directory (its config.json only) the frozen base costs its bf16 storage alone, worked by hand."""

import re

from cli_helpers import HF_FAMILIES, composed, resolved

from lightning_mgpu.cli.memory_check import run_memory
from lightning_mgpu.cli.plan import plan_report
from lightning_mgpu.planner.adapters import LoraShape

#: One 8-GPU node, ZeRO-1 over 8, no tensor or pipeline parallelism: every rank holds the whole model.
RUN = ["model=hf", f"model.path={HF_FAMILIES / 'qwen3_8b'}", "trainer=gpu", "trainer.devices=8", "parallel.zero_stage=1",
       "data.seq_len=4096", "data.micro_batch_size=1", "data.global_batch_size=64"]
LORA = ["adapters=lora", "adapters.rank=8", "adapters.targets=[q_proj,v_proj]"]
#: Qwen3-8B's parameters (hidden 4096, 36 layers, 32 + 8 heads of 128, MLP 12288, vocabulary 151,936, untied head)
N = 8_190_735_360
#: rank 8 on q_proj (4096 -> 4096) and v_proj (4096 -> 1024) of 36 layers: 8 (4096 + 4096) + 8 (4096 + 1024) each
ADAPTERS = 36 * (8 * (4096 + 4096) + 8 * (4096 + 1024))
#: ZeRO-1's bucket: a quarter of the parameters, at most 5e8 elements, bf16
BUCKET = 500_000_000 * 2


def test_memory_check_counts_the_base_as_frozen():
    lora = resolved(composed(*RUN, *LORA))
    assert lora.model.adapters == LoraShape(8, ("q_proj", "v_proj"))
    # frozen: 2 B; adapters: bf16 weight and gradient, fp32 master and Adam moments over 8 ranks: 2 + 2 + 12 / 8
    assert run_memory(lora, True).model_states == 2 * (N + ADAPTERS) + (2 + 12 / 8) * ADAPTERS + BUCKET
    assert run_memory(resolved(composed(*RUN)), True).model_states == (2 + 2 + 12 / 8) * N + BUCKET


def test_plan_counts_the_base_as_frozen():
    report = plan_report(composed(*RUN, *LORA, "plan.per_stage=true"), [])
    params, grads, optim = re.search(r"\n\s+0\s+0\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", report).groups()
    assert (params, grads, optim) == ("16.4", "0.0", "0.0")  # 2 (N + ADAPTERS) = 16.4 GB; 3.8M adapters: 0.0 GB
    full = plan_report(composed(*RUN, "plan.per_stage=true"), [])
    assert re.search(r"\n\s+0\s+0\s+16\.4\s+16\.4\s+12\.3\s", full)  # 2 N, 2 N, 12 N / 8


def test_dry_run_counts_the_frozen_base_as_the_planner_does():
    """The dry run's model states of each built tensor rank (PEFT's module on meta, split) equal the planner's at tp2
    ZeRO-3, where the adapters at or below the persistence threshold (100,000 elements here) are also kept whole."""
    from lightning_mgpu.cli.dry_run import rank_shares
    from lightning_mgpu.cli.spec import run_spec
    from lightning_mgpu.planner.memory import rank_model_state_bytes
    from lightning_mgpu.planner.model_stats import rank_parameter_split

    cfg = composed(*RUN, "parallel.tensor_parallel_size=2", "parallel.zero_stage=3", "adapters=lora")
    spec = run_spec(cfg, launching=False)
    planned = rank_parameter_split(spec.model, 2)
    # rank 16 at tp 2, per layer: q 16 x 4096 + 2048 x 16, k and v 16 x 4096 + 512 x 16, o 16 x 2048 + 4096 x 16,
    # gate and up 16 x 4096 + 6144 x 16, down 16 x 6144 + 4096 x 16: every matrix at most 98,304 elements
    assert planned.persistent == 36 * (98_304 + 2 * 73_728 + 98_304 + 3 * 163_840)
    _, shares = rank_shares(spec)
    assert len(shares) == 2
    for share in shares:
        assert share.bytes == rank_model_state_bytes(planned, 3, 4, 1, "bf16-mixed", False, overlap=True)


def test_memory_refusal_says_what_trains():
    """A LoRA run that cannot fit (a Llama-3-70B base whole on each of 16 GPUs) is refused with the adapters' count:
    80 layers x 16 (8192 + 8192) q, 16 (8192 + 1024) k and v, 16 (8192 + 8192) o, 16 (8192 + 28672) gate, up, down."""
    from lightning_mgpu.cli.memory_check import memory_problems

    cfg = composed("model=hf", f"model.path={HF_FAMILIES / 'llama3_70b'}", "trainer=gpu", "trainer.devices=8",
                   "trainer.num_nodes=2", "parallel.zero_stage=1", "data.seq_len=4096", "data.micro_batch_size=1",
                   "data.global_batch_size=64", "adapters=lora")
    adapters = 80 * 16 * (2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 3 * (8192 + 28672))
    [refusal] = memory_problems(resolved(cfg))
    assert f"; {adapters / 1e6:,.1f}M train (adapters), the rest is the frozen base" in refusal, refusal


def test_the_packages_own_model_counts_its_base_as_frozen_too():
    """``adapters=lora`` on the package's llama3_8b (hidden 4096, 32 layers, 32 + 8 heads of 128, MLP 14336,
    vocabulary 128,256): rank 8 on wq (4096 -> 4096) and wv (4096 -> 1024) of 32 layers; the base stored alone."""
    own = ["model=llama3_8b", "trainer=gpu", "trainer.devices=8", "parallel.zero_stage=1", "data.seq_len=4096",
           "data.micro_batch_size=1", "data.global_batch_size=64"]
    lora = resolved(composed(*own, "adapters=lora", "adapters.rank=8", "adapters.targets=[wq,wv]"))
    assert lora.model.adapters == LoraShape(8, ("q_proj", "v_proj"))
    n = lora.model.num_parameters()
    adapters = 32 * (8 * (4096 + 4096) + 8 * (4096 + 1024))
    assert run_memory(lora, True).model_states == 2 * (n + adapters) + (2 + 12 / 8) * adapters + BUCKET
