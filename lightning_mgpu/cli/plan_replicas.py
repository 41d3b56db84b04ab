"""``mgpu-plan`` for replicas that synchronise every ``H`` steps (``parallel.replica_update`` local or async).

Each replica runs its inner steps on its own GPUs, so the search runs over one replica: its GPUs, its share of the
global batch, ZeRO over its own data ranks, and the outer step's fp32 copies counted in the optimizer's memory. Then
a block says what the outer step costs (:mod:`lightning_mgpu.planner.replicas`): extra memory, bytes per outer
step and the link bandwidth that keeps it hidden at the configured layout's estimated inner step.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.cli.rule_base import keyed
from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner import ClusterSpec, PlanRow, plan_layouts
from lightning_mgpu.planner.replicas import (ReplicaTraffic, master_share, outer_copy_bytes,
                                             replica_cluster_problems, replica_traffic)
from lightning_mgpu.planner.search import USABLE_MEMORY
from lightning_mgpu.precision import replica_precision_problems
from lightning_mgpu.split_rules import copies_inside, replica_problems, steps_apart

GB = 1e9
#: The ``parallel.*`` overrides that say how replicas synchronise: the suggested command lines keep them (a layout's
#: own overrides set every other ``parallel.*`` setting).
REPLICA_KEYS = ("parallel.replicas", "parallel.replica_update", "parallel.sync_every", "parallel.max_staleness",
                "parallel.outer_optimizer")
#: A link between sites to put the outer step's wait on a scale: 10 Gbit/s, in bytes/s.
SLOW_LINK = 1.25e9


def steps_alone(cfg: DictConfig) -> bool:
    """Whether the replicas step alone between outer steps (``local``, ``async``: the layout's own rule)."""
    return steps_apart(cfg.parallel.replica_update)


def replica_plan_problems(cfg: DictConfig, cluster: ClusterSpec) -> list[str]:
    """The replica settings as ``mgpu-train`` asks them (the data ranks left to each layout), and what the plan of
    one replica needs: replicas of whole nodes or of parts of one node, and a global batch they share evenly."""
    from lightning_mgpu.parallel.replicas import OuterOptimizer

    p = cfg.parallel
    raw = replica_problems(None, p.replicas, p.replica_update, p.sync_every, max_staleness=p.max_staleness)
    raw += OuterOptimizer.of(OmegaConf.to_container(p.outer_optimizer, resolve=True)).problems()
    if raw or not steps_alone(cfg):
        return keyed(raw, cfg.trainer)
    raw += replica_cluster_problems(cluster, p.replicas)
    out = keyed(raw, cfg.trainer)
    if not raw and cfg.data.global_batch_size % p.replicas:
        out.append(f"data.global_batch_size={cfg.data.global_batch_size} does not split over parallel.replicas="
                   f"{p.replicas}; use a multiple of {p.replicas}")
    return out


def with_outer_copies(model: LlamaConfig, cluster: ClusterSpec, row: PlanRow, parallel: DictConfig) -> PlanRow:
    """``row`` (a layout of one replica) with the outer step's fp32 copies added to its optimizer memory."""
    c, p = row.candidate, parallel
    extra = outer_copy_bytes(master_share(model, c.tp, c.pp, c.virtual, c.dp * c.cp, c.zero_stage),
                             p.outer_optimizer.momentum, p.replica_update, p.replicas, p.max_staleness)
    memory = dataclasses.replace(row.memory, optimizer=row.memory.optimizer + extra)
    return PlanRow(c, memory, row.time, memory.total <= USABLE_MEMORY * cluster.gpu.memory_bytes)


def replica_rows(cfg: DictConfig, model: LlamaConfig, inner: ClusterSpec, precision: str) -> list[PlanRow]:
    """The search over one replica's GPUs and share of the batch, without the layouts the outer step refuses, with
    its copies counted; ordered as :func:`~lightning_mgpu.planner.search.plan_layouts` orders them."""
    p = cfg.parallel
    rows = plan_layouts(model, inner, cfg.data.seq_len, cfg.data.global_batch_size // p.replicas, precision,
                        cfg.plan.achievable, cfg.optim.name)
    rows = [with_outer_copies(model, inner, r, p) for r in rows
            if not replica_precision_problems(precision, r.candidate.zero_stage, p.replica_update)
            and not _drifting_copies(p, r.candidate)]
    return sorted(rows, key=lambda r: (not r.fits, r.time.total, r.memory.total))


def _drifting_copies(p: DictConfig, c) -> list:
    """The layout rule that an ``async`` replica above a staleness bound of 0 holds no two copies of a weight."""
    copies = copies_inside(c.tp, c.cp, c.dp, c.zero_stage)
    return replica_problems(None, p.replicas, p.replica_update, p.sync_every, False, p.max_staleness, copies)


def traffic_of(cfg: DictConfig, model: LlamaConfig, inner: ClusterSpec, row: PlanRow, precision: str) -> ReplicaTraffic:
    """The outer step of the configured layout ``row`` (planned on one replica's GPUs ``inner``)."""
    c, p = row.candidate, cfg.parallel
    share = master_share(model, c.tp, c.pp, c.virtual, c.dp * c.cp, c.zero_stage)
    return replica_traffic(share, p.replicas, p.sync_every, inner.world_size, p.outer_optimizer.momentum, precision,
                           row.time.total, p.replica_update, p.max_staleness)


def _rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second / GB:.3g} GB/s ({bytes_per_second * 8 / GB:.3g} Gbit/s)"


def replica_lines(cfg: DictConfig, traffic: ReplicaTraffic) -> list[str]:
    """The block ``mgpu-plan`` prints for replicas: memory, bytes per outer step, bandwidth to keep it hidden."""
    t, p, o = traffic, cfg.parallel, cfg.parallel.outer_optimizer
    H, step = t.sync_every, t.step_seconds
    copies = "the weights of the last outer step and the outer momentum" if o.momentum > 0 else \
        "the weights of the last outer step (no outer momentum)"
    return ["", f"replicas: {t.replicas} of {t.gpus_per_replica} GPUs each (replica_update={p.replica_update}, an "
                f"outer step every sync_every={H} inner steps, outer {o.name} lr {o.lr} momentum {o.momentum})",
            f"  extra memory: {t.extra_memory / GB:.2f} GB per GPU of fp32 copies ({copies}; "
            f"{t.share / 1e6:,.0f}M parameters on the fullest rank), counted in the optim column",
            f"  cross-replica bytes per outer step: {t.outer_bytes / GB:.2f} GB per GPU, "
            f"{t.site_outer_bytes / GB:.1f} GB per replica (its site link), {t.job_outer_bytes / GB:.1f} GB for the "
            f"job; sync would send {t.sync_bytes / GB:.2f} GB per GPU every step ({H * t.sync_bytes / GB:.1f} GB "
            f"in {H} steps)",
            f"  bandwidth to keep it hidden behind {H} inner steps of {step:.2f} s: {_rate(t.bandwidth_per_gpu)} per "
            f"GPU, {_rate(t.bandwidth_per_site)} per site link (sync, every step: "
            f"{_rate(t.sync_bytes * t.gpus_per_replica / step)} per site link)",
            f"  the outer step waits for its all-reduce: a site link of B bytes/s adds {t.site_outer_bytes / GB:.1f} "
            f"GB / B every {H} steps ({t.site_outer_bytes / SLOW_LINK:.1f} s at {SLOW_LINK * 8 / GB:.0f} Gbit/s, "
            f"{t.site_outer_bytes / SLOW_LINK / (H * step):.0%} of the round's {H * step:.0f} s)"]
