"""The planner's step time against published training runs: fitted on one set, judged on another.

The runs (:mod:`lightning_mgpu.planner.published_runs`) are bf16 on the planner's GPU kinds. The fitting set is of
stacks comparable to this one (PyTorch, ZeRO-3-style full sharding, fused attention); the held-out set adds NeMo's
Megatron-core runs with tensor, pipeline (interleaved) and context parallelism up to 405B, and BLOOM's. Each is
planned with the settings it published: its ZeRO stage (3 for full sharding, 1 for an optimizer that shards only its
state), tensor, pipeline, virtual-stage, context and expert sizes, micro-batch, global batch and sequence, and full
recomputation where the run used activation checkpointing (selective checkpointing is planned as none). Two constants
per GPU kind are fitted, by :func:`fit_fractions` on the fitting set alone: the fraction of the bf16 peak the weight
matmuls reach (``GPUSpec.achievable``) and the fraction the attention kernel reaches
(``GPUSpec.attention_achievable``, :mod:`lightning_mgpu.planner.efficiency`). The held-out runs chose nothing; their
error is the planner's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from lightning_mgpu.planner.hardware import GPUS, ClusterSpec, GPUSpec
from lightning_mgpu.planner.published_runs import PUBLISHED_RUNS, PublishedRun
from lightning_mgpu.planner.time import estimate_step_time

#: Calibration assumptions, printed above the tables.
ASSUMPTIONS = ("bf16, no fp8; ZeRO-3-style full sharding (llm-foundry FSDP FULL_SHARD, torchtitan FSDP2, NeMo "
               "AutoModel FSDP2) planned as ZeRO-3, Megatron's distributed optimizer (NeMo) and DeepSpeed's bf16 "
               "optimizer (BLOOM) as ZeRO-1 with nothing overlapped, interleaved pipelines as interleaved 1F1B; "
               "activation checkpointing planned as full recomputation, selective as none; MPT, GPT-3, BLOOM and "
               "Nemotron-4 (two-matrix MLPs) planned as the Llama of equal dim, depth, heads and parameters; the "
               "planner's overlap of data-parallel communication; 8 GPUs per node")


@dataclass(frozen=True)
class CalibrationRow:
    run: PublishedRun
    predicted: float  #: tokens per second per GPU
    no_overlap: float  #: tokens per second per GPU if no communication ran behind compute (a lower bound)
    compute_s: float = 0.0  #: the planned step's compute term, seconds

    @property
    def error(self) -> float:
        return self.predicted / self.run.tokens_per_s_per_gpu - 1.0

    @property
    def compute_share(self) -> float:
        """The planned compute over the published step: above 1, compute alone is planned longer than the run took."""
        published_step = self.run.global_batch * self.run.seq_len / (self.run.tokens_per_s_per_gpu * self.run.gpus)
        return self.compute_s / published_step


def predict(run: PublishedRun, gpu: Optional[GPUSpec] = None, achievable: Optional[float] = None) -> CalibrationRow:
    """The planner's figures for ``run`` on ``gpu`` (the run's own GPU kind by default)."""
    gpus_per_node = min(8, run.gpus)
    cluster = ClusterSpec(run.gpus // gpus_per_node, gpus_per_node, gpu or GPUS[run.gpu])
    time = estimate_step_time(run.model, cluster, run.seq_len, run.global_batch, run.micro_batch,
                              run.tensor_parallel, run.pipeline, run.zero_stage, virtual=run.virtual,
                              schedule="interleaved_1f1b" if run.virtual > 1 else "1f1b", recompute=run.recompute,
                              achievable=achievable, context=run.context, ep=run.expert)
    bound = time.tokens_per_step / (time.total + time.data_parallel_hidden) / time.world_size
    return CalibrationRow(run, time.tokens_per_second_per_gpu, bound, time.compute)


def calibration_rows(achievable: Optional[float] = None, role: Optional[str] = None) -> list[CalibrationRow]:
    """The planner's tokens per second per GPU for every published run of ``role`` (all by default)."""
    return [predict(run, achievable=achievable) for run in PUBLISHED_RUNS if role in (None, run.role)]


def mean_absolute_error(rows: list[CalibrationRow]) -> float:
    """Mean absolute percentage error of ``rows`` as a fraction."""
    return sum(abs(r.error) for r in rows) / len(rows)


def _fit_error(gpu_key: str, matmul: float, attention: float, saturation: float) -> float:
    """Mean absolute error over the fitting runs of ``gpu_key`` with these constants."""
    spec = dataclasses.replace(GPUS[gpu_key], achievable=matmul, attention_achievable=attention,
                               saturation_tokens=saturation)
    return mean_absolute_error([predict(r, spec) for r in PUBLISHED_RUNS if r.role == "fit" and r.gpu == gpu_key])


def fit_fractions(gpu_key: str, saturation: float) -> tuple[float, float, float]:
    """(error, matmul fraction, attention fraction) that minimise the mean absolute error over the fitting runs of
    ``gpu_key`` alone at ``saturation`` tokens: a grid of 0.02 (matmuls 0.40-0.90, attention 0.10-0.60), then one of
    0.0025 x 0.005 around its best. A grid, not ``scipy.optimize``: the error is piecewise (overlap hides communication
    up to a share of compute) and has flat stretches a gradient method stalls on."""
    coarse = min((_fit_error(gpu_key, 0.40 + 0.02 * i, 0.10 + 0.02 * j, saturation), 0.40 + 0.02 * i,
                  0.10 + 0.02 * j) for i in range(26) for j in range(26))
    return min((_fit_error(gpu_key, coarse[1] + 0.0025 * i, coarse[2] + 0.005 * j, saturation),
                round(coarse[1] + 0.0025 * i, 4), round(coarse[2] + 0.005 * j, 3))
               for i in range(-4, 5) for j in range(-4, 5))


def fit_constants(kinds: tuple[str, ...] = ("a100_80gb", "h100_80gb")) -> dict:
    """The constants fitted on the fitting set alone: one ``saturation_tokens`` for every GPU kind (0 to 2,048 in
    steps of 128, the value with the least error summed over the kinds), and each kind's (matmul, attention)
    fractions at it (:func:`fit_fractions`). Takes about a minute."""
    best: tuple = (float("inf"),)
    for saturation in range(0, 2049, 128):
        fits = {kind: fit_fractions(kind, saturation) for kind in kinds}
        best = min(best, (sum(f[0] for f in fits.values()), saturation, fits))
    return {"saturation_tokens": best[1], **{kind: fit[1:] for kind, fit in best[2].items()}}


def _layout(r: PublishedRun) -> str:
    dp = r.gpus // (r.tensor_parallel * r.pipeline * r.context)
    axes = [f"ZeRO-{r.zero_stage} x {dp}"] + [f"{name} {n}" for name, n in (
        ("tp", r.tensor_parallel), ("pp", r.pipeline), ("vp", r.virtual), ("cp", r.context), ("ep", r.expert)) if n > 1]
    return ", ".join(axes)


def calibration_table(achievable: Optional[float] = None, role: Optional[str] = None) -> str:
    """The rows of ``role`` (all by default) as a Markdown table, the assumptions in its header."""
    lines = [f"Planner step time against published runs. Assumed: {ASSUMPTIONS}. Compute at "
             + ", ".join(f"{g.name} {g.achievable:.1%} (matmuls) / {g.attention_achievable or g.achievable:.0%} "
                         f"(attention)" for g in GPUS.values()) + " of the bf16 peak.", "",
             "| run | GPUs | layout | sequence | micro x global batch | checkpointing | published tok/s/GPU | "
             "predicted | error | no overlap | planned compute / published step | set |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in calibration_rows(achievable, role):
        r = row.run
        role_text = {"fit": "fit", "held_out": "held out"}.get(r.role, "left out: " + r.why_not)
        lines.append(f"| {r.name} | {r.gpus} x {GPUS[r.gpu].name} | {_layout(r)} | {r.seq_len:,} | {r.micro_batch} "
                     f"x {r.global_batch} | {'full' if r.recompute else 'none/selective'} | "
                     f"{r.tokens_per_s_per_gpu:,.0f} | {row.predicted:,.0f} | {row.error:+.0%} | "
                     f"{row.no_overlap:,.0f} | {row.compute_share:.2f} | {role_text} |")
    return "\n".join(lines)


def source_repository(run: PublishedRun) -> str:
    """``owner/name`` of the GitHub repository a run's figure comes from."""
    return "/".join(run.source.split("github.com/", 1)[1].split("/")[:2])


def held_out_summary() -> str:
    """The held-out runs' mean absolute percentage error and worst run, one line each, and the fitting set's; then the
    held-out runs by source, with their mean signed error (a stack the planner is slow or fast on shows as a bias)."""
    lines = []
    for role, label in (("fit", "fitting set"), ("held_out", "held-out set")):
        rows = calibration_rows(role=role)
        worst = max(rows, key=lambda r: abs(r.error))
        lines.append(f"{label}: {len(rows)} runs, mean absolute error {mean_absolute_error(rows):.1%}, worst "
                     f"{worst.error:+.0%} ({worst.run.name}, {worst.run.gpus} x {GPUS[worst.run.gpu].name}, "
                     f"sequence {worst.run.seq_len:,})")
    by_source: dict[str, list[CalibrationRow]] = {}
    for row in calibration_rows(role="held_out"):
        by_source.setdefault(source_repository(row.run), []).append(row)
    lines.append("held-out set by source: " + "; ".join(
        f"{name} {len(rows)} run{'s' if len(rows) > 1 else ''}, mean error "
        f"{sum(r.error for r in rows) / len(rows):+.1%}" for name, rows in by_source.items()))
    return "\n".join(lines)
