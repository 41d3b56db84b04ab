"""``mgpu-train ... dry_run=true``: a launch's own ``parallelize()`` of every distinct rank, on the meta device, in one
process.

No GPU, no process group and no memory for weights: for every pipeline rank (and the first and last tensor-parallel
rank, the only ones whose vocabulary shards can differ) the module is built on the meta device and split by the
function a launch calls, in the same order (tensor-parallel plan, context parallelism, stage split, activation
checkpointing, compile), and its parameters counted. Each count must equal
the planner's (:func:`lightning_mgpu.planner.model_stats.rank_parameter_split`), a mixture of experts' routed experts
and the rest apart, and the bytes of weights, gradients and optimizer state under the run's ZeRO stage come from the
planner's measured model (:func:`lightning_mgpu.planner.memory.rank_model_state_bytes`: the routed experts partitioned
over the ranks that hold the same experts, the rest over every data x context rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning_mgpu.cli.build import build_module, build_strategy
from lightning_mgpu.cli.spec import RunSpec
from lightning_mgpu.hf import adopt as adopt_hf_model
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.parallelize import parallelize
from lightning_mgpu.models.moe import moe_layers
from lightning_mgpu.optim.choice import muon_steps
from lightning_mgpu.buckets import persistence_threshold
from lightning_mgpu.planner.memory import rank_model_state_bytes
from lightning_mgpu.planner.model_stats import RankParameters, rank_parameter_split
from lightning_mgpu.planner.replicas import replica_traffic
from lightning_mgpu.split_rules import steps_apart
from lightning_mgpu.strategy import MGPUStrategy

GB = 1e9


@dataclass(frozen=True)
class RankShare:
    """What one (tensor, pipeline) rank of a layout holds."""

    tp_rank: int
    pp_rank: int
    stages: list[int]
    parameters: int
    planned: int
    bytes: dict[str, float]
    experts: int = 0  #: of ``parameters``, those of routed experts (a mixture-of-experts model)
    planned_experts: int = 0

    @property
    def as_planned(self) -> bool:
        return self.parameters == self.planned and self.experts == self.planned_experts


def rank_shares(spec: RunSpec) -> tuple[ParallelLayout, list[RankShare]]:
    """The layout of the run and, for each pipeline rank (tensor ranks first and last), its built share: the module
    built on the meta device and split by :func:`~lightning_mgpu.parallel.parallelize.parallelize` for that rank,
    the same function in the same order as a launch, with stand-ins for the rank's process groups."""
    cfg, model_config, strategy = spec.config, spec.model, build_strategy(spec)
    layout = spec.layout.build(spec.world_size, devices_per_node=cfg.trainer.devices)
    T, P = layout.size("tp"), layout.size("pp")
    shares = []
    for tp_rank in sorted({0, T - 1}):
        for pp_rank in range(P):
            kept = built_share(spec, layout, strategy, tp_rank, pp_rank)
            ids = layout.stage_ids(pp_rank)
            routed = routed_experts(kept)
            experts = sum(p.numel() for p in kept.parameters() if id(p) in routed)
            matrices = sum(p.numel() for n, p in kept.named_parameters() if muon_steps(n, p.shape))
            held = RankParameters(sum(p.numel() for p in kept.parameters()) - experts, experts,
                                  sum(p.numel() for p in kept.parameters()) - matrices, **frozen_share(kept))
            planned = rank_parameter_split(model_config, T, P, len(ids), pp_rank, stage_ids=ids,
                                           boundaries=strategy.pipeline_boundaries, ep=layout.size("ep"))
            states = rank_model_state_bytes(held, layout.zero_stage, layout.size("dp_cp"), layout.size("ep"),
                                            str(cfg.trainer.precision), P > 1,  # ZeRO over data x context
                                            overlap=cfg.trainer.accelerator != "cpu", optimizer=cfg.optim.name)
            shares.append(RankShare(tp_rank, pp_rank, ids, held.total, planned.total, states, held.experts,
                                    planned.experts))
    shares.sort(key=lambda share: (share.pp_rank, share.tp_rank))
    return layout, shares


def routed_experts(kept: torch.nn.Module) -> set[int]:
    """The ids of a built share's routed experts' parameters: the package's experts, and those expert parallelism
    split (``expert_partition``: a ``transformers`` model's, counted apart by the planner only when split)."""
    return {id(p) for layer in moe_layers(kept) for p in layer.experts.parameters()} | {
        id(p) for p in kept.parameters() if getattr(p, "expert_partition", None) is not None}


def frozen_share(kept: torch.nn.Module) -> dict:
    """``RankParameters``' frozen fields of a built share (``adapters=lora`` freezes the base): what it stores without
    a gradient, master or optimizer state, and the trainable parameters ZeRO-3 would keep whole (at most the
    engine's persistence threshold), so the dry run's model states count them as the planner does."""
    expert_ids = routed_experts(kept)
    frozen = [p for p in kept.parameters() if not p.requires_grad]
    if not frozen:
        return {}
    threshold = persistence_threshold(max(p.numel() for p in kept.parameters()))
    return dict(frozen=sum(p.numel() for p in frozen if id(p) not in expert_ids),
                experts_frozen=any(id(p) in expert_ids for p in frozen),
                persistent=sum(p.numel() for p in kept.parameters() if p.requires_grad and p.numel() <= threshold))


def built_share(spec: RunSpec, layout: ParallelLayout, strategy: MGPUStrategy, tp_rank: int, pp_rank: int
                ) -> torch.nn.Module:
    """What the rank at (``tp_rank``, ``pp_rank``) keeps of the run's module, built and split on the meta device."""
    with torch.device("meta"):
        module = build_module(spec)
        module.configure_model()
    view = layout.planned_at(layout.global_rank_of(tp=tp_rank, pp=pp_rank))
    adopt_hf_model(module, view)  # a transformers model: the hooks its config implies, as a launch gives them
    return parallelize(module, view, torch.device("meta"), strategy.tensor_parallel_plan,
                       strategy.pipeline_boundaries).module


def fp8_kernel_problems(spec: RunSpec) -> list[str]:
    """``trainer.fp8`` on GPUs: the layers whose local sizes the fp8 kernels refuse, on every pipeline rank (every
    tensor rank holds the same sizes), from the module each would build. Emulated fp8 (CPU) takes any size."""
    t = spec.config.trainer
    on_gpu = t.accelerator in ("gpu", "cuda") or (t.accelerator == "auto" and torch.cuda.is_available())
    if t.fp8 is None or not on_gpu:
        return []
    from lightning_mgpu.fp8 import kernel_size_problems, local_sizes

    strategy = build_strategy(spec)
    layout = spec.layout.build(spec.world_size, devices_per_node=t.devices)
    sizes = {}
    for pp_rank in range(layout.size("pp")):
        sizes.update(local_sizes(built_share(spec, layout, strategy, 0, pp_rank)))
    fix = "choose model sizes whose shares over parallel.tensor_parallel_size are multiples of 16, or trainer.fp8=null"
    return [f"trainer.fp8={t.fp8!r}: {problem}" for problem in kernel_size_problems(sizes, fix)]


def dry_run_report(spec: RunSpec) -> str:
    """The per-rank table; raises ``RuntimeError`` when a built count differs from the planner's."""
    cfg = spec.config
    layout, shares = rank_shares(spec)
    whole = spec.model.num_parameters()
    context = f" x cp {layout.size('cp')}" if layout.size("cp") > 1 else ""
    replicas = f" x {layout.size('rep')} replicas (an outer step every {layout.sync_every})" \
        if steps_apart(layout.replica_update) else ""
    zero_ranks = f" (over dp x cp = {layout.size('dp_cp')} ranks)" if context else ""
    moe = spec.model.num_experts > 0
    lines = [f"dry run: {layout.world_size} processes = tp {layout.size('tp')}{context} x pp {layout.size('pp')} x dp "
             f"{layout.size('dp')}{replicas}, ZeRO-{layout.zero_stage}{zero_ranks}, {cfg.trainer.precision}; the whole model has {whole:,} "
             f"parameters ({whole * 4 / GB:.1f} GB in fp32)"]
    if moe:
        lines += [expert_line(spec, layout)]
    extra = (" expert parameters | planner |", "---|---|") if moe else ("", "")
    lines += [f"| tp rank | pp rank | stages | parameters | planner |{extra[0]} weights GB | gradients GB | "
              "optimizer GB |", f"|---|---|---|---|---|{extra[1]}---|---|---|"]
    for s in shares:
        b = s.bytes
        experts = f" {s.experts:,} | {s.planned_experts:,} |" if moe else ""
        lines.append(f"| {s.tp_rank} | {s.pp_rank} | {s.stages} | {s.parameters:,} | {s.planned:,} |{experts} "
                     f"{b['parameters'] / GB:.2f} | {b['gradients'] / GB:.2f} | "
                     f"{(b['optimizer'] + b['buffers']) / GB:.2f} |")
    if steps_apart(layout.replica_update) and layout.size("rep") > 1:
        lines += ["", cross_replica_line(spec, layout, shares)]
    wrong = [s for s in shares if not s.as_planned]
    if wrong:
        raise RuntimeError("\n".join(lines) + "\nthe built shares differ from the planner's for ranks " +
                           ", ".join(f"(tp {s.tp_rank}, pp {s.pp_rank})" for s in wrong))
    return "\n".join(lines)


def expert_line(spec: RunSpec, layout: ParallelLayout) -> str:
    """Where a mixture of experts' experts are: how many each rank holds, and over which ranks ZeRO splits them."""
    m, Ep = spec.model, layout.size("ep")
    layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    return (f"experts: {m.num_experts // Ep} of {m.num_experts} (top-{m.experts_per_token}) per rank in each of "
            f"the model's {layers} mixture-of-experts layers, expert parallel {Ep} of "
            f"the {layout.size('dp_cp')} data x context ranks; ZeRO partitions expert states over the "
            f"{_ranks(layout.size('edp'))} holding the same experts, the rest over {_ranks(layout.size('dp_cp'))}; "
            f"{m.num_parameters(active=True):,} parameters active per token")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def cross_replica_line(spec: RunSpec, layout: ParallelLayout, shares: list[RankShare]) -> str:
    """What each outer step sends to the other replicas, from the fullest built rank's share of the fp32 masters
    (:func:`lightning_mgpu.planner.replicas.replica_traffic`; no step time here, so no bandwidth)."""
    zero_ranks = layout.size("dp_cp") if layout.zero_stage >= 1 else 1
    share = max(s.parameters for s in shares) / zero_ranks
    gpus = layout.world_size // layout.size("rep")
    t = replica_traffic(share, layout.size("rep"), layout.sync_every, gpus,
                        spec.config.parallel.outer_optimizer.momentum, str(spec.config.trainer.precision),
                        replica_update=layout.replica_update, max_staleness=layout.max_staleness)
    return (f"cross-replica bytes per outer step (every {t.sync_every} steps): {t.outer_bytes / GB:.2f} GB sent per "
            f"GPU (an all-reduce of its {share:,.0f} fp32 master parameters over {t.replicas} replicas), "
            f"{t.site_outer_bytes / GB:.1f} GB per replica of {gpus} GPUs, {t.job_outer_bytes / GB:.1f} GB for the "
            f"job; outer copies {t.extra_memory / GB:.2f} GB per GPU")
