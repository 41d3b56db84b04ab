"""``mgpu-plan``'s whole run. With ``plan.tokens``: each fitting layout's time to train, GPU-hours, energy and cost,
the expected failure overhead included; with ``plan.deadline_hours``: the node counts whose best layout finishes in
time, cheapest first; with ``plan.scaling_curve``: tokens/s per GPU and scaling efficiency against the node count,
printed and drawn. The formulas are :mod:`lightning_mgpu.planner.run_cost`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from omegaconf import DictConfig

from lightning_mgpu.planner import GPUS, ClusterSpec, PlanRow, plan_layouts
from lightning_mgpu.planner.adapters import trained_parameters
from lightning_mgpu.planner.goodput import (CHECKPOINT_BYTES_PER_PARAMETER, plan_goodput, save_seconds,
                                            snapshot_seconds)
from lightning_mgpu.planner.run_cost import (RunCost, RunSettings, node_counts, rank_for_deadline, run_cost,
                                             scaling_efficiency)

GB = 1e9
#: The layout columns, as the planner's table heads them.
LAYOUT_HEAD = f"{'tp':>3} {'cp':>3} {'pp':>3} {'V':>2} {'dp':>4} {'zero':>4} {'mb':>3} {'ckpt':>4}"
RUN_HEAD = f"{'days':>8} {'GPU-hours':>11} {'MWh':>8} {'cost':>12}"


@dataclass(frozen=True)
class ScalePoint:
    """One node count of the scaling curve: how many layouts the search found, the best fitting one (None: none
    fits), its goodput and whole run (None without ``plan.tokens``), and its scaling efficiency."""

    nodes: int
    gpus: int
    layouts: int
    row: Optional[PlanRow]
    goodput: float = 0.0
    run: Optional[RunCost] = None
    efficiency: float = 0.0


def whole_run_lines(cfg: DictConfig, model, cluster: ClusterSpec, precision: str, rows: list[PlanRow],
                    mine: Optional[PlanRow]) -> list[str]:
    """Every whole-run section the config asks for (none when ``plan.tokens``, ``plan.deadline_hours`` and
    ``plan.scaling_curve`` are all null); ``rows``: the fitting layouts of the table."""
    pl = cfg.plan
    settings = run_settings(cfg, cluster)
    lines = [] if settings is None else cost_lines(cfg, model, cluster, rows, mine, settings)
    if pl.deadline_hours is None and pl.scaling_curve is None:
        return lines
    points = scaling_points(cfg, model, cluster, precision, settings)
    lines += scaling_lines(cfg, points)
    if pl.deadline_hours is not None:
        lines += deadline_lines(cfg, points)
    if pl.scaling_curve is not None:
        title = (f"{cfg.model.name} ({model.num_parameters() / 1e9:.1f}B) on {cluster.gpus_per_node} x "
                 f"{cluster.gpu.name} per node; sequence {cfg.data.seq_len}, global batch {cfg.data.global_batch_size}")
        draw_scaling_curve(points, str(pl.scaling_curve), title)
        lines.append(f"scaling curve drawn: {pl.scaling_curve}")
    return lines


def run_settings(cfg: DictConfig, cluster: ClusterSpec) -> Optional[RunSettings]:
    """The run's prices and powers (the GPU kind's board power unless ``plan.gpu_power_w``); None without tokens."""
    pl = cfg.plan
    if pl.tokens is None:
        return None
    power = pl.gpu_power_w if pl.gpu_power_w is not None else cluster.gpu.board_power_w
    return RunSettings(pl.tokens, pl.price_per_gpu_hour, power, pl.node_overhead_w, pl.pue)


def checkpoint_bytes(model) -> float:
    """A checkpoint's bytes: what each trained parameter keeps (weights, master, moments); an adapter run's leave the
    frozen base out (:func:`~lightning_mgpu.planner.adapters.trained_parameters`)."""
    saved = trained_parameters(model)
    return CHECKPOINT_BYTES_PER_PARAMETER * (model.num_parameters() if saved is None else saved)


def checkpoint_seconds(cfg: DictConfig, model, cluster: ClusterSpec, zero_stage: int, dp: int) -> tuple[float, float]:
    """(how long one checkpoint blocks training, how long its background write runs): the whole write and 0, or with
    ``checkpoint.async_save`` the snapshot of each GPU's share and the write."""
    ckpt_bytes = checkpoint_bytes(model)
    write = save_seconds(ckpt_bytes, cluster.nodes, cfg.plan.write_gbs_per_node * GB)
    if not cfg.checkpoint.async_save:
        return write, 0.0
    copies = 1 if zero_stage in (1, 2) else dp
    return snapshot_seconds(ckpt_bytes, cluster.world_size, copies, cfg.plan.snapshot_gbs_per_gpu * GB), write


def layout_goodput(cfg: DictConfig, model, cluster: ClusterSpec, row: PlanRow) -> float:
    """The expected effective training time of a layout: at ``checkpoint.every_n_steps`` where set, else at
    Young/Daly's interval (the one ``mgpu-plan`` recommends), with the failure model of the goodput lines."""
    pl, every, c = cfg.plan, cfg.checkpoint.every_n_steps, row.candidate
    save, write = checkpoint_seconds(cfg, model, cluster, c.zero_stage, c.dp)
    g = plan_goodput(cluster.world_size, pl.gpu_mtbf_hours, every or 1, row.time.total, save, pl.restart_s, write)
    return g.fraction if every else g.best_fraction


def row_run(cfg: DictConfig, model, cluster: ClusterSpec, row: PlanRow, settings: RunSettings) -> RunCost:
    t = row.time
    return run_cost(t.tokens_per_step, t.total, layout_goodput(cfg, model, cluster, row), cluster.nodes,
                    cluster.gpus_per_node, settings)


def cost_lines(cfg: DictConfig, model, cluster: ClusterSpec, rows: list[PlanRow], mine: Optional[PlanRow],
               s: RunSettings) -> list[str]:
    """The table's fitting layouts (and the configured one) as whole runs of ``plan.tokens`` tokens."""
    pl, deadline = cfg.plan, cfg.plan.deadline_hours
    step_tokens = cfg.data.global_batch_size * cfg.data.seq_len
    power = ("unknown for this GPU (no energy figure; set plan.gpu_power_w)" if s.gpu_power_w is None else
             f"{s.gpu_power_w:,.0f} W per GPU (" + ("plan.gpu_power_w" if pl.gpu_power_w is not None else
                                                   f"{cluster.gpu.name}'s board power; plan.gpu_power_w") + ")")
    lines = ["", f"whole run: {tokens_text(s.tokens)} tokens (plan.tokens) = {s.tokens / step_tokens:,.0f} steps of "
                 f"{step_tokens:,} tokens on {cluster.world_size} GPUs; {checkpoint_text(cfg)}; energy at {power} + "
                 f"{s.node_overhead_w:,.0f} W per node (plan.node_overhead_w) x PUE {s.pue:g} (plan.pue); cost at "
                 f"{s.price_per_gpu_hour:.2f} per GPU-hour (plan.price_per_gpu_hour)",
             "", f"{LAYOUT_HEAD} | {'step s':>7} {'goodput':>7} | {RUN_HEAD}"
                 + (f" | {'<= ' + format(deadline, 'g') + ' h':>9}" if deadline is not None else "")]
    for row in rows:
        run = row_run(cfg, model, cluster, row, s)
        lines.append(f"{layout_cells(row)} | {row.time.total:7.2f} {run.goodput:7.1%} | {run_cells(run)}"
                     + (f" | {'yes' if run.within(deadline) else 'no':>9}" if deadline is not None else ""))
    if mine is not None and mine.fits:
        run = row_run(cfg, model, cluster, mine, s)
        lines += ["", f"this configuration's run: {run.days:,.1f} days, {run.gpu_hours:,.0f} GPU-hours, "
                      f"{energy_text(run)}, cost {run.cost:,.0f}" + ("" if deadline is None else
                      f"; {'within' if run.within(deadline) else 'not within'} {deadline:g} h (plan.deadline_hours)")]
    return lines + ["", "days = tokens / (tokens per step / step s) / goodput / 86,400 (goodput: the expected share "
                        "of wall time that trains, failures counted); GPU-hours = days x 24 x GPUs; MWh = hours x "
                        "(GPUs x W per GPU + nodes x W per node) x PUE / 1e6; cost = GPU-hours x price per GPU-hour"]


def scaling_points(cfg: DictConfig, model, cluster: ClusterSpec, precision: str,
                   settings: Optional[RunSettings]) -> list[ScalePoint]:
    """At every node count (:func:`~lightning_mgpu.planner.run_cost.node_counts` up to ``plan.max_nodes``) of
    ``trainer.devices`` GPUs each, the data's global batch: the fitting layout with the least step time over
    goodput (the fastest run), and each count's tokens/s per GPU over the smallest fitting count's."""
    pl, out = cfg.plan, []
    for n in node_counts(pl.max_nodes or cluster.nodes, cluster.nodes):
        at = ClusterSpec(n, cluster.gpus_per_node, cluster.gpu)
        rows = plan_layouts(model, at, cfg.data.seq_len, cfg.data.global_batch_size, precision, pl.achievable)
        scored = [(r, layout_goodput(cfg, model, at, r)) for r in rows if r.fits]
        if not scored:
            out.append(ScalePoint(n, at.world_size, len(rows), None))
            continue
        row, goodput = min(scored, key=lambda rg: rg[0].time.total / rg[1] if rg[1] > 0 else math.inf)
        out.append(ScalePoint(n, at.world_size, len(rows), row, goodput,
                              None if settings is None else row_run(cfg, model, at, row, settings)))
    drawn = [p for p in out if p.row is not None]
    efficiency = dict(zip([p.nodes for p in drawn],
                          scaling_efficiency([p.row.time.tokens_per_second_per_gpu for p in drawn])))
    return [replace(p, efficiency=efficiency.get(p.nodes, 0.0)) for p in out]


def scaling_lines(cfg: DictConfig, points: list[ScalePoint]) -> list[str]:
    """The scaling table: a row per node count, with its whole run where ``plan.tokens`` is set."""
    runs = any(p.run is not None for p in points)
    lines = ["", f"scaling: the fastest fitting layout at each node count ({cfg.trainer.devices} GPUs a node; global "
                 f"batch {cfg.data.global_batch_size} x {cfg.data.seq_len} tokens at every count; up to plan.max_nodes); "
                 "efficiency = tokens/s per GPU over the smallest fitting count's",
             "", f"{'nodes':>5} {'GPUs':>5} | {LAYOUT_HEAD} | {'step s':>7} {'tok/s/GPU':>9} {'effic':>6} "
                 f"{'goodput':>7}" + (f" | {RUN_HEAD}" if runs else "")]
    for p in points:
        if p.row is None:
            memory = GPUS[cfg.plan.gpu].memory_bytes / GB
            lines.append(f"{p.nodes:>5} {p.gpus:>5} | " + (
                f"none of its {p.layouts} layouts fits in {memory:.0f} GB" if p.layouts else
                f"no layout: the global batch {cfg.data.global_batch_size} does not split over its data ranks"))
            continue
        t = p.row.time
        lines.append(f"{p.nodes:>5} {p.gpus:>5} | {layout_cells(p.row)} | {t.total:7.2f} "
                     f"{t.tokens_per_second_per_gpu:9.0f} {p.efficiency:6.2f} {p.goodput:7.1%}"
                     + (f" | {run_cells(p.run)}" if p.run is not None else ""))
    return lines


def deadline_lines(cfg: DictConfig, points: list[ScalePoint]) -> list[str]:
    """The node counts whose best layout finishes within ``plan.deadline_hours``, cheapest first; or that none
    does, and which is fastest."""
    deadline, tokens = cfg.plan.deadline_hours, tokens_text(cfg.plan.tokens)
    ranked = [p for p in points if p.run is not None]
    within, fastest = rank_for_deadline(ranked, lambda p: p.run, deadline)
    span = f"{points[0].nodes} to {points[-1].nodes} nodes"
    if fastest is None:
        return ["", f"deadline {deadline:g} h (plan.deadline_hours): no layout fits at {span}"]
    if not within:
        f = fastest.run
        return ["", f"deadline {deadline:g} h (plan.deadline_hours): NO layout at {span} finishes {tokens} tokens in "
                    f"time; the fastest: {fastest.nodes} nodes, {layout_text(fastest.row)}, {f.hours:,.0f} h "
                    f"({f.days:,.1f} days), cost {f.cost:,.0f}; raise plan.max_nodes or the deadline, or lower "
                    "plan.tokens"]
    lines = ["", f"deadline {deadline:g} h (plan.deadline_hours): {len(within)} of the {len(ranked)} node counts "
                 f"with a fitting layout finish{'es' if len(within) == 1 else ''} {tokens} tokens in time, cheapest "
                 "first:"]
    for p in within:
        r = p.run
        lines.append(f"  {p.nodes:>4} nodes: {r.hours:,.0f} h ({r.days:,.1f} days), {r.gpu_hours:,.0f} GPU-hours, "
                     f"{energy_text(r)}, cost {r.cost:,.0f}; {layout_text(p.row)}")
    return lines + [f"the cheapest in time, as overrides: trainer.num_nodes={within[0].nodes} "
                    + " ".join(within[0].row.candidate.overrides())]


def draw_scaling_curve(points: list[ScalePoint], path: str, title: str) -> None:
    """Tokens/s per GPU (planned, and times goodput) and scaling efficiency against the node count, into ``path``
    (matplotlib's Agg canvas, no display needed)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    drawn = [p for p in points if p.row is not None]
    nodes = [p.nodes for p in drawn]
    rates = [p.row.time.tokens_per_second_per_gpu for p in drawn]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    rate_ax, eff_ax = fig.subplots(1, 2)
    rate_ax.plot(nodes, rates, "o-", label="planned (failure-free)")
    rate_ax.plot(nodes, [r * p.goodput for r, p in zip(rates, drawn)], "s--", label="x goodput (failures)")
    for p, r in zip(drawn, rates):
        c = p.row.candidate
        rate_ax.annotate(f"tp{c.tp}{f' cp{c.cp}' if c.cp > 1 else ''} pp{c.pp} dp{c.dp}", (p.nodes, r),
                         textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    eff_ax.plot(nodes, [p.efficiency for p in drawn], "o-")
    eff_ax.axhline(1.0, color="grey", linestyle=":")
    for ax, label in ((rate_ax, "tokens/s per GPU"), (eff_ax, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks([p.nodes for p in points], [str(p.nodes) for p in points])
        ax.set(xlabel="nodes", ylabel=label)
        ax.grid(alpha=0.3)
    rate_ax.legend(fontsize=8)
    if not drawn:
        fig.text(0.5, 0.5, "no layout fits at any node count", ha="center")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def layout_cells(row: PlanRow) -> str:
    c = row.candidate
    return (f"{c.tp:>3} {c.cp:>3} {c.pp:>3} {c.virtual:>2} {c.dp:>4} {c.zero_stage:>4} {c.micro_batch:>3} "
            f"{c.checkpointing[:4]:>4}")


def layout_text(row: PlanRow) -> str:
    c = row.candidate
    return (f"tp {c.tp}{f' x cp {c.cp}' if c.cp > 1 else ''} x pp {c.pp} (V {c.virtual}) x dp {c.dp}, "
            f"ZeRO-{c.zero_stage}, micro-batch {c.micro_batch}, recompute {c.checkpointing}")


def run_cells(run: RunCost) -> str:
    energy = "?" if run.energy_mwh is None else f"{run.energy_mwh:,.1f}"
    return f"{run.days:8,.1f} {run.gpu_hours:11,.0f} {energy:>8} {run.cost:12,.0f}"


def energy_text(run: RunCost) -> str:
    return "energy unknown" if run.energy_mwh is None else f"{run.energy_mwh:,.1f} MWh"


def checkpoint_text(cfg: DictConfig) -> str:
    every = cfg.checkpoint.every_n_steps
    return (f"goodput with a checkpoint every {every} steps (checkpoint.every_n_steps)" if every else
            "goodput at Young/Daly's checkpoint interval (checkpoint.every_n_steps unset)")


def tokens_text(tokens: float) -> str:
    """``2T``, ``150B``, ``3.5M``: a token count as people say it."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if tokens >= scale:
            return f"{tokens / scale:.4g}{suffix}"
    return f"{tokens:g}"
