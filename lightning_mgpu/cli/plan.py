"""``mgpu-plan``: memory and step time of candidate layouts for a model on a cluster, best first.

Composed like ``mgpu-train`` (same configs, recipes and overrides): the model from ``model``, the sequence
length and global batch from ``data``, the cluster from ``trainer.num_nodes`` x ``trainer.devices`` and
``plan.gpu``. Prints a table and the best layouts as ``mgpu-train`` command lines; with ``plan.tokens``, each
layout's whole run (time, GPU-hours, energy, cost), with ``plan.deadline_hours`` the node counts that finish in time,
cheapest first, and with ``plan.scaling_curve`` a picture of the scaling over node counts.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_mgpu.cli.config import register_configs
from lightning_mgpu.cli.paths import conf_dir
from lightning_mgpu.cli.errors import ConfigError, exit_on_refusal
from lightning_mgpu.cli.rules import plan_problems
from lightning_mgpu.cli.fast_exit import skip_final_garbage_collection
from lightning_mgpu.cli.plan_replicas import (REPLICA_KEYS, replica_lines, replica_plan_problems, replica_rows,
                                             steps_alone, traffic_of, with_outer_copies)
from lightning_mgpu.planner import GPUS, ClusterSpec, PlanRow, plan_layouts
from lightning_mgpu.planner.replicas import replica_cluster
from lightning_mgpu.layout import chunks_per_rank, stage_ids
from lightning_mgpu.planner.experts import IMBALANCE, expert_load
from lightning_mgpu.planner.memory import stage_memory
from lightning_mgpu.planner.model_stats import max_rank_split
from lightning_mgpu.cli.plan_run import checkpoint_bytes, checkpoint_seconds, whole_run_lines
from lightning_mgpu.planner.goodput import plan_goodput
from lightning_mgpu.planner.search import USABLE_MEMORY, Candidate, evaluate

GB = 1e9


def plan_report(cfg: DictConfig, overrides: Sequence[str] = ()) -> str:
    """The planner's table and suggested command lines for a composed config; with replicas that step alone
    (``parallel.replica_update`` local or async), of one replica, and the outer step's cost."""
    model, problems = plan_problems(cfg)
    if problems:
        raise ConfigError(problems)
    cluster = ClusterSpec(cfg.trainer.num_nodes, cfg.trainer.devices, GPUS[cfg.plan.gpu])
    problems = replica_plan_problems(cfg, cluster)
    if problems:
        raise ConfigError(problems)
    on_cpu = cfg.trainer.accelerator == "cpu"  # a plan is for GPUs: assume trainer=gpu (bf16-mixed)
    precision = "bf16-mixed" if on_cpu else str(cfg.trainer.precision)
    alone = steps_alone(cfg)
    inner = replica_cluster(cluster, cfg.parallel.replicas) if alone else cluster
    rows = replica_rows(cfg, model, inner, precision) if alone else \
        plan_layouts(model, cluster, cfg.data.seq_len, cfg.data.global_batch_size, precision, cfg.plan.achievable,
                     cfg.optim.name)
    lines = header_lines(cfg, model, cluster, inner, precision, rows) + table_lines(rows[: cfg.plan.top])
    mine, configured = configured_layout_lines(cfg, model, inner, precision, rows)
    lines += configured
    if alone and cfg.parallel.replicas > 1 and mine is not None:
        lines += replica_lines(cfg, traffic_of(cfg, model, inner, mine, precision))
    if mine is not None:
        lines += goodput_lines(cfg, model, cluster, mine.time.total)
    lines += whole_run_lines(cfg, model, cluster, precision, [r for r in rows[: cfg.plan.top] if r.fits], mine)
    return "\n".join(lines + command_lines(cfg, overrides, [r for r in rows if r.fits], on_cpu))


def goodput_lines(cfg: DictConfig, model, cluster: ClusterSpec, step_s: float) -> list[str]:
    """The configured layout's expected effective training time under failures, and the Young/Daly interval."""
    pl, every = cfg.plan, cfg.checkpoint.every_n_steps
    ckpt_bytes = checkpoint_bytes(model)
    par = cfg.parallel
    dp = cluster.world_size // (par.tensor_parallel_size * par.pipeline_parallel_size * par.context_parallel_size)
    snapshot, write = checkpoint_seconds(cfg, model, cluster, par.zero_stage, dp)
    g = plan_goodput(cluster.world_size, pl.gpu_mtbf_hours, every or 1, step_s, snapshot, pl.restart_s, write)
    save = g.save_s
    best_steps = max(1, round(g.best_interval_s / step_s))
    rate = (f"the snapshot at {pl.snapshot_gbs_per_gpu:g} GB/s per GPU (plan.snapshot_gbs_per_gpu; "
            f"checkpoint.async_save writes the rest in the background, {write:.1f} s)" if cfg.checkpoint.async_save else
            f"at {pl.write_gbs_per_node:g} GB/s per node (plan.write_gbs_per_node)")
    lines = ["", f"failures: one every {g.job_mtbf_s / 3600:.1f} h for {cluster.world_size} GPUs (one GPU's MTBF "
                 f"{pl.gpu_mtbf_hours:,.0f} h, plan.gpu_mtbf_hours); a checkpoint ({ckpt_bytes / GB:.0f} GB) blocks "
                 f"{save:.1f} s, {rate}, a restart {pl.restart_s:.0f} s (plan.restart_s)"]
    now = (f"checkpoint every {every} steps = {g.interval_s:,.0f} s: effective training time {g.fraction:.1%}; "
           if every else "no periodic checkpoints (checkpoint.every_n_steps): every failure restarts from step 0; ")
    return lines + [now + f"Young/Daly: every {g.best_interval_s:,.0f} s = checkpoint.every_n_steps={best_steps} "
                          f"({g.best_fraction:.1%})"]


def header_lines(cfg: DictConfig, model, cluster: ClusterSpec, inner: ClusterSpec, precision: str,
                 rows: list) -> list[str]:
    """What is planned: the model, the cluster (and the replica the table is of), the batch, the compute rate."""
    gpu, seq, batch = cluster.gpu, cfg.data.seq_len, cfg.data.global_batch_size
    lines = [f"{cfg.model.name}: {model.num_parameters() / 1e9:.2f}B parameters{_active(model)}; {cluster.nodes} x "
             f"{cluster.gpus_per_node} {gpu.name} ({gpu.memory_bytes / GB:.0f} GB, "
             f"{gpu.bf16_peak_flops / 1e12:.0f} TFLOP/s bf16); sequence {seq}, global batch {batch} "
             f"({batch * seq:,} tokens); {precision}; matmuls at "
             f"{gpu.achievable if cfg.plan.achievable is None else cfg.plan.achievable:.1%} of peak"
             f"{' (calibrated for this GPU)' if cfg.plan.achievable is None else ''}, less in micro-batches of "
             f"few tokens, attention at {gpu.attention_achievable or gpu.achievable:.1%}"]
    if steps_alone(cfg):
        replicas = cfg.parallel.replicas
        lines.append(f"{replicas} replica{'s' if replicas > 1 else ''} stepping alone "
                     f"(replica_update={cfg.parallel.replica_update}): the layouts are one replica's, on its "
                     f"{inner.world_size} GPUs with {batch // replicas} of the global batch; ZeRO-0 is left out "
                     f"where the outer step refuses it")
    fitting = sum(1 for r in rows if r.fits)
    return lines + [f"{len(rows)} layouts, {fitting} fit in {gpu.memory_bytes / GB:.0f} GB"]


def _active(model) -> str:
    """A mixture of experts' active parameters and routing, for the header ("" for a dense model)."""
    if not model.num_experts:
        return ""
    shared = f" + {model.shared_experts} shared" if model.shared_experts else ""
    return (f" ({model.num_parameters(active=True) / 1e9:.2f}B active: {model.num_experts} experts, top-"
            f"{model.experts_per_token}{shared})")


def table_lines(rows: list) -> list[str]:
    """The table of layouts, one row each, and what its columns count (expert parallelism: a mixture of experts')."""
    moe = any(r.time.experts is not None for r in rows)
    lines = ["", f"{'tp':>3} {'cp':>3} {'pp':>3} {'V':>2} {'dp':>4}{' ep' if moe else ''} {'zero':>4} {'mb':>3} "
                 f"{'ckpt':>4} | {'params':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'buf':>5} {'total':>6} "
                 f"{'fits':>4} | {'compute':>8} {'tp':>6} {'cp':>6}{'    a2a' if moe else ''} {'bubble':>7} "
                 f"{'p2p':>6} {'dp':>6} {'step':>7} {'no-ovl':>7} | {'tok/s/GPU':>9} {'MFU':>5}"]
    for r in rows:
        c, m, t = r.candidate, r.memory, r.time
        lines.append(
            f"{c.tp:>3} {c.cp:>3} {c.pp:>3} {c.virtual:>2} {c.dp:>4}{f' {c.ep:>2}' if moe else ''} {c.zero_stage:>4} "
            f"{c.micro_batch:>3} {c.checkpointing[:4]:>4} | {m.parameters / GB:7.1f} {m.gradients / GB:6.1f} "
            f"{m.optimizer / GB:6.1f} {m.activations / GB:6.1f} {m.buffers / GB:5.1f} {m.total / GB:6.1f} "
            f"{'yes' if r.fits else 'no':>4} | {t.compute:8.2f} {t.tensor_parallel:6.2f} {t.context_parallel:6.2f}"
            f"{f' {t.expert_parallel:6.2f}' if moe else ''} {t.pipeline_bubble:7.2f} "
            f"{t.pipeline_p2p:6.2f} {t.data_parallel:6.2f} {t.total:7.2f} {t.without_overlap:7.2f} | "
            f"{t.tokens_per_second_per_gpu:9.0f} "
            f"{t.mfu:5.1%}")
    return lines + ["", "memory in GB per GPU; time in seconds per optimizer step; dp: the data-parallel communication "
                        "left after overlapping it with compute; no-ovl: the step with none of it overlapped" + ("; ep: expert-parallel ranks (of dp x cp), a2a: "
                                                                    "their token all-to-all; MFU of the active "
                                                                    "parameters" if moe else "")]


def command_lines(cfg: DictConfig, overrides: Sequence[str], fitting: list, on_cpu: bool) -> list[str]:
    """The best fitting layouts as ``mgpu-train`` command lines: the user's overrides but those a layout sets (the
    replica settings stay: a layout sets none of them)."""
    if not fitting:
        return ["", "no layout fits: use more GPUs, a shorter sequence or a smaller global batch"]
    kept = [o for o in overrides if o.startswith(REPLICA_KEYS) or not o.startswith(
        ("parallel.", "data.micro_batch_size", "model.activation_checkpointing", "plan."))]
    base = " ".join((["trainer=gpu"] if on_cpu else []) + kept)
    return ["", "best layouts:"] + [f"  mgpu-train {base + ' ' if base else ''}{' '.join(r.candidate.overrides())}"
                                    for r in fitting[: cfg.plan.commands]]


def configured_layout_lines(cfg: DictConfig, model, cluster: ClusterSpec, precision: str,
                            rows: list) -> tuple[Optional[PlanRow], list[str]]:
    """The layout the config itself asks for (a recipe's own ``virtual_pipeline_size=5``, its schedule, sequence
    parallelism), evaluated like the table's rows (on ``cluster``: one replica's GPUs where replicas step alone):
    its row, or None where it does not divide the GPUs, and lines that say whether it fits and where it ranks."""
    p = cfg.parallel
    world = cluster.world_size
    T, C, P = p.tensor_parallel_size, p.context_parallel_size, p.pipeline_parallel_size
    if world % (T * C * P):
        return None, ["", f"this configuration: tp {T} x cp {C} x pp {P} does not divide {world} GPUs"]
    bounds = None if p.pipeline_boundaries is None else tuple(p.pipeline_boundaries)
    virtual = chunks_per_rank(p.pipeline_schedule, p.virtual_pipeline_size) if P > 1 else p.virtual_pipeline_size
    mine = Candidate(T, P, world // (T * C * P), p.zero_stage, cfg.data.micro_batch_size, virtual,
                     cfg.model.activation_checkpointing == "full", p.pipeline_schedule, p.sequence_parallel, cp=C,
                     boundaries=bounds, selective=cfg.model.activation_checkpointing == "selective",
                     ep=p.expert_parallel_size)
    row = evaluate(model, cluster, cfg.data.seq_len, planned_batch(cfg), mine, precision, cfg.plan.achievable)
    if steps_alone(cfg):
        row = with_outer_copies(model, cluster, row, p)
    m, t = row.memory, row.time
    faster = sum(1 for r in rows if r.fits and r.time.total < t.total)
    verdict = (f"fits; {faster} of the {sum(1 for r in rows if r.fits)} fitting layouts above are faster" if row.fits
               else f"does not fit in {USABLE_MEMORY:.0%} of {cluster.gpu.memory_bytes / GB:.0f} GB")
    context = f" x cp {mine.cp}" if mine.cp > 1 else ""
    experts = f" (ep {mine.ep})" if model.num_experts else ""
    lines = ["", f"this configuration: tp {mine.tp}{context} x pp {mine.pp} (V {mine.virtual}, {mine.schedule}) x dp "
                 f"{mine.dp}{experts}, ZeRO-{mine.zero_stage}, micro-batch {mine.micro_batch}, "
                 f"{ {'full': 'full recompute', 'selective': 'selective recompute'}.get(mine.checkpointing, 'no recompute')}"
                 f"{', sequence parallel' if mine.sequence_parallel and mine.tp > 1 else ''}: "
                 f"{m.total / GB:.1f} GB per GPU on its most loaded pipeline rank ({m.activations / GB:.1f} "
                 f"activations), step {t.total:.2f} s ({t.without_overlap:.2f} s with nothing overlapped), MFU {t.mfu:.1%}; "
                 f"{verdict}"]
    lines += volume_lines(mine, t, cluster)
    if t.experts is not None:
        lines += expert_lines(model, mine, t)
    if cfg.plan.per_stage:
        lines += stage_lines(cfg, model, mine, precision)
    return row, lines


def volume_lines(c: Candidate, t, cluster: ClusterSpec) -> list[str]:
    """The configured layout's bytes per step by axis on its busiest pipeline rank (as ``comm/*`` counts them: an
    all-reduce's tensor, an all-gather's output, a send's tensor; ``lightning_mgpu.planner.communication``) beside
    their time, and the share inside a node and across nodes under the planned placement (tp innermost, then cp, pp,
    dp: a group stays in a node while the ranks it spans fit one)."""
    if not t.volume:
        return []
    node = cluster.gpus_per_node
    spans = {"tp": c.tp, "cp": c.tp * c.cp, "pp": c.tp * c.cp * c.pp, "ep": c.tp * c.cp * c.pp * c.ep,
             "dp_cp": cluster.world_size, "edp": cluster.world_size}
    seconds = {"tp": t.tensor_parallel, "cp": t.context_parallel, "pp": t.pipeline_p2p, "ep": t.expert_parallel,
               "dp_cp": t.data_parallel + t.data_parallel_hidden}
    by_axis: dict[str, float] = {}
    for (axis, op), b in t.volume.items():
        if op != "recv":  # a receive is the other end of a send
            by_axis[axis] = by_axis.get(axis, 0.0) + b
    inside = sum(b for axis, b in by_axis.items() if spans.get(axis, cluster.world_size) <= node)
    total = sum(by_axis.values()) or 1.0
    parts = [f"{axis} {b / GB:.2f} GB" + (f" ({seconds[axis]:.2f} s)" if axis in seconds else "")
             for axis, b in sorted(by_axis.items(), key=lambda item: -item[1])]
    return [f"communication per step on the busiest pipeline rank: {', '.join(parts)}; {inside / total:.0%} of the "
            f"bytes inside a node, {1 - inside / total:.0%} across nodes (dp_cp's time: before overlap)"]


def expert_lines(model, c: Candidate, t) -> list[str]:
    """A mixture of experts' share of the configured layout: where its experts are, what they exchange, and the
    imbalance the busiest rank is planned at (:mod:`lightning_mgpu.planner.experts`)."""
    e = t.experts
    held = max_rank_split(model, c.tp, c.pp, c.virtual, c.ep)
    where = "across nodes" if e.across_nodes else "inside a node"
    lines = [f"experts: {model.num_experts // c.ep} of {model.num_experts} per rank in each of "
             f"{e.moe_layers:g} mixture-of-experts layers per pipeline rank (ep {c.ep}, hidden / tp {c.tp}); the "
             f"fullest rank holds {held.experts:,} expert and {held.dense:,} dense parameters, ZeRO over "
             f"{c.dp * c.cp // c.ep} and {c.dp * c.cp} ranks"]
    if c.ep > 1:
        lines.append(f"all-to-all: {e.all_to_all_bytes / GB:.1f} GB sent per GPU per step {where} "
                     f"({t.expert_parallel:.2f} s at the mean load; memory is planned for the busiest rank's "
                     f"{expert_load(model, c.ep):.2f} x the mean tokens, planner.experts.IMBALANCE={IMBALANCE})")
    if c.tp > 1:
        lines.append(f"tensor-parallel all-reduce of expert outputs: {e.tp_reduce_bytes / GB:.1f} GB per GPU per step "
                     f"({e.tp_reduce_s:.2f} s)")
    return lines


def planned_batch(cfg: DictConfig) -> int:
    """The global batch of what the table plans: one replica's share where replicas step alone."""
    return cfg.data.global_batch_size // (cfg.parallel.replicas if steps_alone(cfg) else 1)


def stage_lines(cfg: DictConfig, model, c: Candidate, precision: str) -> list[str]:
    """Every pipeline rank of a layout: the stages it holds, its model states and activations (GB per GPU)."""
    stages = stage_memory(model, cfg.data.seq_len, c.micro_batch, c.tp, c.pp, c.dp, c.zero_stage, c.virtual,
                          c.sequence_parallel, c.recompute, precision, overlap=True, context=c.cp, mode=c.checkpointing,
                          schedule=c.schedule, boundaries=c.boundaries,
                          microbatches=max(1, planned_batch(cfg) // (c.micro_batch * c.dp)), ep=c.ep,
                          optimizer=cfg.optim.name)
    lines = ["", "per pipeline rank (GB per GPU):", f"{'pp rank':>7} {'stages':>14} {'params':>7} {'grads':>6} "
             f"{'optim':>6} {'activ':>6} {'buf':>5} {'total':>6}"]
    for r, m in enumerate(stages):
        ids = ",".join(str(i) for i in stage_ids(c.pp, c.virtual, c.schedule, r))
        lines.append(f"{r:>7} {ids:>14} {m.parameters / GB:7.1f} {m.gradients / GB:6.1f} {m.optimizer / GB:6.1f} "
                     f"{m.activations / GB:6.1f} {m.buffers / GB:5.1f} {m.total / GB:6.1f}")
    return lines


def compose_plan_config(overrides: Sequence[str]) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", overrides=list(overrides))


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``mgpu-plan``: a refused configuration prints its problems and exits with status 2."""
    skip_final_garbage_collection()
    parser = argparse.ArgumentParser(
        prog="mgpu-plan", description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  mgpu-plan recipe=llama3_70b_8node\n"
               "  mgpu-plan model=llama3_8b trainer.num_nodes=2 plan.gpu=h200_141gb data.seq_len=8192\n"
               "  mgpu-plan recipe=llama3_70b_8node plan.tokens=1e12 plan.deadline_hours=720 plan.max_nodes=64 "
               "plan.scaling_curve=scaling.png")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help=f"Hydra overrides, as for mgpu-train; plan.gpu is one of {', '.join(GPUS)}")
    overrides = parser.parse_args(argv).overrides
    exit_on_refusal(lambda: print(plan_report(compose_plan_config(overrides), overrides)))


if __name__ == "__main__":
    main()
