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
