"""Published training runs the planner's step time is fitted to, and the planner's prediction for each.

Each run is bf16 (no fp8) on one of the planner's GPU kinds, trained by a stack comparable to this one (PyTorch,
ZeRO-3-style full sharding of parameters, gradients and optimizer state, fused attention, no hand-written kernels
beyond that): MosaicML's llm-foundry (FSDP ``FULL_SHARD``, amp_bf16) and torchtitan (FSDP2, eager). The planner
models a run as this project would run it: ZeRO-3 over the data-parallel ranks (tensor parallelism where the run used
it), the published micro-batch, global batch and sequence, and full recomputation where the run used activation
checkpointing (selective checkpointing is planned as none: it recomputes no matmul). A model that is not a Llama
(llm-foundry's MPT: multi-head attention, a 4 x dim GELU MLP, tied embeddings, vocabulary 50,368) is planned as the
Llama with the same dim, depth, heads and parameter count (SwiGLU width 8/3 x dim).

The fitted constant is :attr:`~lightning_mgpu.planner.hardware.GPUSpec.achievable` per GPU kind. Runs marked
``fitted=False`` are reported, not fitted, with the reason the planner does not model them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.hardware import GPUS, ClusterSpec
from lightning_mgpu.planner.time import estimate_step_time

LLM_FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md (H100 80GB BF16)"
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"

#: Calibration assumptions, printed above the table.
ASSUMPTIONS = ("bf16, no fp8; ZeRO-3-style full sharding (llm-foundry FSDP FULL_SHARD, torchtitan FSDP2) planned as "
               "ZeRO-3; activation checkpointing planned as full recomputation, selective as none; MPT planned as "
               "the Llama of equal dim, depth, heads and parameters; the planner's overlap of data-parallel "
               "communication; 8 GPUs per node")


def _mpt(dim: int, n_layers: int, n_heads: int, seq: int) -> LlamaConfig:
    return LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, ffn_hidden=round(8 * dim / 3),
                       vocab_size=50368, max_seq_len=seq, tie_embeddings=True)


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement: what ran, on what, and the tokens per second per GPU it reached."""

    name: str
    source: str
    model: LlamaConfig
    gpu: str  #: a key of ``GPUS``
    gpus: int
    tensor_parallel: int
    seq_len: int
    micro_batch: int
    global_batch: int
    recompute: bool
    tokens_per_s_per_gpu: float
    fitted: bool = True
    why_not: str = ""


def _llama(name: str, seq: int) -> LlamaConfig:
    return LlamaConfig.from_name(name, max_seq_len=seq)


PUBLISHED_RUNS: list[PublishedRun] = [
    PublishedRun("MPT-70B", LLM_FOUNDRY, _mpt(8192, 80, 64, 2048), "h100_80gb", 64, 1, 2048, 8, 2048, True, 1039),
    PublishedRun("MPT-30B", LLM_FOUNDRY, _mpt(7168, 48, 56, 2048), "h100_80gb", 32, 1, 2048, 14, 1344, True, 2308),
    PublishedRun("MPT-30B", LLM_FOUNDRY, _mpt(7168, 48, 56, 4096), "h100_80gb", 8, 1, 4096, 1, 168, True, 1802),
    PublishedRun("MPT-13B", LLM_FOUNDRY, _mpt(5120, 40, 40, 4096), "h100_80gb", 8, 1, 4096, 10, 240, True, 4717),
    PublishedRun("MPT-7B", LLM_FOUNDRY, _mpt(4096, 32, 32, 2048), "h100_80gb", 8, 1, 2048, 6, 48, False, 10643),
    PublishedRun("MPT-7B", LLM_FOUNDRY, _mpt(4096, 32, 32, 8192), "h100_80gb", 8, 1, 8192, 8, 128, True, 6935),
    PublishedRun("Llama 3.1 405B", TORCHTITAN, _llama("llama3_405b", 8192), "h100_80gb", 128, 8, 8192, 2, 32, True, 109),
    PublishedRun("Llama 3 8B", TORCHTITAN, _llama("llama3_8b", 8192), "a100_80gb", 64, 1, 8192, 1, 64, False, 2904),
    PublishedRun("Llama 3 70B", TORCHTITAN, _llama("llama3_70b", 8192), "a100_80gb", 64, 1, 8192, 1, 64, True, 331),
    PublishedRun("Llama 3.1 8B", TORCHTITAN, _llama("llama3_8b", 8192), "h100_80gb", 8, 1, 8192, 2, 16, False, 5762,
                 fitted=False, why_not="its H100s ran at a 500 W power limit (700 W is the SXM5 rating the peak "
                                       "assumes)"),
    PublishedRun("MPT-1B", LLM_FOUNDRY, _mpt(2048, 24, 16, 2048), "h100_80gb", 8, 1, 2048, 14, 112, False, 45455),
    PublishedRun("MPT-7B", LLM_FOUNDRY, _mpt(4096, 32, 32, 65536), "h100_80gb", 8, 1, 65536, 1, 16, True, 1956,
                 fitted=False, why_not="attention at 65,536 tokens runs far below the matmuls' rate; the planner "
                                       "counts its FLOPs at the same rate"),
]


@dataclass(frozen=True)
class CalibrationRow:
    run: PublishedRun
    predicted: float  #: tokens per second per GPU

    @property
    def error(self) -> float:
        return self.predicted / self.run.tokens_per_s_per_gpu - 1.0


def calibration_rows(achievable: Optional[float] = None) -> list[CalibrationRow]:
    """The planner's tokens per second per GPU for every published run (``achievable``: the GPUs' own by default)."""
    rows = []
    for run in PUBLISHED_RUNS:
        gpus_per_node = min(8, run.gpus)
        cluster = ClusterSpec(run.gpus // gpus_per_node, gpus_per_node, GPUS[run.gpu])
        time = estimate_step_time(run.model, cluster, run.seq_len, run.global_batch, run.micro_batch,
                                  run.tensor_parallel, 1, 3, recompute=run.recompute, achievable=achievable)
        rows.append(CalibrationRow(run, time.tokens_per_second_per_gpu))
    return rows


def calibration_table(achievable: Optional[float] = None) -> str:
    """The rows as a Markdown table, the assumptions in its header."""
    lines = [f"Planner step time against published runs. Assumed: {ASSUMPTIONS}. Compute at "
             + ", ".join(f"{g.name} {g.achievable:.0%}" for g in GPUS.values()) + " of the bf16 peak.", "",
             "| run | GPUs | layout | sequence | micro x global batch | checkpointing | published tok/s/GPU | "
             "predicted | error | fitted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in calibration_rows(achievable):
        r = row.run
        layout = f"ZeRO-3 x {r.gpus // r.tensor_parallel}" + (f", tp {r.tensor_parallel}" if r.tensor_parallel > 1
                                                              else "")
        lines.append(f"| {r.name} | {r.gpus} x {GPUS[r.gpu].name} | {layout} | {r.seq_len:,} | {r.micro_batch} x "
                     f"{r.global_batch} | {'full' if r.recompute else 'none/selective'} | "
                     f"{r.tokens_per_s_per_gpu:,.0f} | {row.predicted:,.0f} | {row.error:+.0%} | "
                     f"{'yes' if r.fitted else 'no: ' + r.why_not} |")
    return "\n".join(lines)
