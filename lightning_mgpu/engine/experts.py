"""The expert-parameter contract with DeepSpeed: which parameters are experts, and over which ranks ZeRO treats them.

DeepSpeed reduces a parameter's gradient over an expert-data-parallel group, and partitions it there, when the
parameter carries ``allreduce=False`` and a ``group_name`` naming groups registered in ``deepspeed.utils.groups``
(ZeRO 0-2), and ZeRO-3 when it also carries the ``autoep_expert`` placement family; it gives those groups only to
an engine that finds a mixture-of-experts module in the model. Our layers are not DeepSpeed's (its own routes with
noise and loops over experts in Python), so this module registers the layout's own "ep" and "edp" groups under the
name DeepSpeed would give them, tags the parameters, and shows the engine a parameterless marker module for as long
as ``deepspeed.initialize`` looks for one. Gradients are summed over the edp group and divided by the whole
data x context size, which is the mean over every token: each expert's gradient already holds the contributions of
every token routed to it from the whole expert-parallel group.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from lightning_mgpu.layout import ParallelLayout


def group_name(layout: ParallelLayout) -> str:
    """The name DeepSpeed gives the groups of expert parallel size ``Ep`` (it parses the size back out of it)."""
    return f"ep_size_{layout.size('ep')}"


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that only some data x context ranks hold (tagged by ``lightning_mgpu.parallel.experts``)."""
    return [p for p in module.parameters() if getattr(p, "expert_partition", None) is not None]


def register_groups(layout: ParallelLayout) -> None:
    """Put this rank's "ep" and "edp" groups where DeepSpeed looks them up (``deepspeed.utils.groups``)."""
    from deepspeed.utils import groups

    name = group_name(layout)
    groups._EXPERT_PARALLEL_GROUP[name] = layout.group("ep")
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = layout.group("edp")
    ranks = {axis: next(r for r in layout.group_ranks(axis) if torch.distributed.get_rank() in r)
             for axis in ("ep", "edp")}
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ranks["ep"]
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = ranks["edp"]


def tag_parameters(module: nn.Module, layout: ParallelLayout) -> int:
    """Mark every expert parameter of ``module`` for DeepSpeed; the number marked."""
    name = group_name(layout)
    params = expert_parameters(module)
    for p in params:
        p.allreduce, p.group_name = False, name
        p.ds_zero_placement_family, p.ds_zero_partition_group_name = "autoep_expert", name
    return len(params)


@contextlib.contextmanager
def shown_to_engine(module: nn.Module, layout: ParallelLayout, zero_stage: int) -> Iterator[None]:
    """While the engine is built, ``module`` holds a marker DeepSpeed recognises as a mixture-of-experts layer (when
    it has expert parameters); the marker is gone afterwards, so nothing else DeepSpeed scans for finds it.

    No marker where the experts are all frozen (adapters on the attention) at ZeRO 1 and 2: their optimizer refuses a
    model with expert layers whose parameter groups hold no expert ("None of the param groups are marked as MoE"), and
    frozen experts need none of its expert-data-parallel reduction. The parameters are tagged all the same: untagged,
    the engine's first broadcast would copy data rank 0's experts over the other expert-parallel ranks' own (8e-5 in
    the first loss of a tiny Qwen3-MoE at ep2). ZeRO-3 keeps the marker: it partitions the frozen experts too, over the
    expert-data-parallel ranks."""
    experts = expert_parameters(module)
    if layout.size("ep") == 1 or not experts:
        yield
        return
    register_groups(layout)
    tag_parameters(module, layout)  # also what keeps DeepSpeed's first broadcast of the weights within each expert group
    if zero_stage in (1, 2) and not any(p.requires_grad for p in experts):
        yield
        return
    module.add_module("_deepspeed_moe_marker", _marker(layout))
    try:
        yield
    finally:
        del module._deepspeed_moe_marker


def _marker(layout: ParallelLayout) -> nn.Module:
    """A parameterless module DeepSpeed takes for one of its own expert layers (ZeRO-3 accepts only that kind)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    class ExpertMarker(AutoEPMoELayer):
        def __init__(self) -> None:  # none of AutoEPMoELayer's construction: there is nothing to replace
            nn.Module.__init__(self)
            self.num_experts = layout.size("ep")

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            """The groups are the layout's, registered already."""

        def forward(self, *args, **kwargs):
            raise RuntimeError("the expert marker is not a layer")

    return ExpertMarker()


def clip_by_global_norm(module: nn.Module, layout: ParallelLayout, max_norm: float) -> torch.Tensor:
    """Clip the (already reduced) gradients of ``module`` by their global norm, counting every parameter once: a
    tensor-parallel shard on every tensor-parallel rank, a replicated parameter on tensor-parallel rank 0 only, an
    expert on the one rank of its expert-parallel group that holds it (and, whole on every tensor-parallel rank, on
    tensor-parallel rank 0 only). The norm before clipping (fp32)."""
    import torch.distributed as dist

    dense, expert = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    grads = []
    for p in module.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        square = p.grad.detach().double().square().sum().cpu()
        if not (getattr(p, "tensor_model_parallel", False) or layout.rank("tp") == 0):
            continue  # a copy another tensor-parallel rank counts (a transformers model's experts are whole there)
        if getattr(p, "expert_partition", None) is not None:
            expert += square
        else:
            dense += square
    dist.all_reduce(expert, group=layout.group("ep"))
    total = dense + expert
    dist.all_reduce(total, group=layout.group("mp"))
    norm = total.sqrt().float()
    if max_norm and max_norm > 0:
        factor = max_norm / (float(norm) + 1e-6)
        if factor < 1:
            for g in grads:
                g.mul_(factor)
    return norm


def split_expert_groups(optimizer: torch.optim.Optimizer, schedulers: list, layout: ParallelLayout) -> None:
    """Put the trained expert parameters of each of ``optimizer``'s groups into a group of their own, marked the way
    DeepSpeed wants (``moe=True``, ``name``: its groups' name), with the same settings; then give each learning-rate
    scheduler the per-group entries of the group each new one came from, so the schedule moves both alike."""
    name = group_name(layout)
    dense, moe, origin_dense, origin_moe = [], [], [], []
    for i, group in enumerate(optimizer.param_groups):
        # frozen experts stay with the rest: ZeRO 1/2 drop every frozen parameter from their groups, and a group of
        # frozen experts alone would be left empty (DeepSpeed's IndexError at start-up)
        mine = [p for p in group["params"] if getattr(p, "expert_partition", None) is not None and p.requires_grad]
        rest = [p for p in group["params"] if id(p) not in {id(q) for q in mine}]
        if rest:  # ``origin``: which of the optimizer's groups this one came from (checkpoints match them by it)
            dense.append({**group, "params": rest, "origin": i})
            origin_dense.append(i)
        if mine:
            moe.append({**group, "params": mine, "moe": True, "name": name, "origin": i})
            origin_moe.append(i)
    if not moe:
        return
    optimizer.param_groups = dense + moe
    origin = origin_dense + origin_moe
    for scheduler in schedulers:
        for attribute in ("base_lrs", "lr_lambdas", "_last_lr"):
            values = getattr(scheduler, attribute, None)
            if isinstance(values, list) and len(values) > max(origin):
                setattr(scheduler, attribute, [values[i] for i in origin])


def schedules_by_origin(states: list, groups: list[dict]) -> list:
    """Scheduler states with their per-group lists cut back to the optimizer's own groups (before experts were split
    off: ``origin``), so that a checkpoint reads the same whatever the expert-parallel size that wrote it."""
    origins = [g.get("origin", i) for i, g in enumerate(groups)]
    if origins == list(range(len(groups))):
        return states
    first = {o: origins.index(o) for o in sorted(set(origins))}
    return [_per_group(state, len(groups), lambda values: [values[i] for i in first.values()]) for state in states]


def schedules_for_groups(states: list, groups: list[dict]) -> list:
    """The inverse of :func:`schedules_by_origin` for this run's groups."""
    origins = [g.get("origin", i) for i, g in enumerate(groups)]
    if origins == list(range(len(groups))):
        return states
    return [_per_group(state, len(set(origins)), lambda values: [values[o] for o in origins]) for state in states]


def _per_group(state: dict, length: int, remap) -> dict:
    return {k: remap(v) if isinstance(v, list) and len(v) == length else v for k, v in state.items()}


def count_experts_once_at_zero3(optimizer) -> None:
    """Make ZeRO-3's global norm add the expert groups' squares over the tensor x pipeline ranks too.

    DeepSpeed's ZeRO-3 assumes expert parameters are neither tensor-parallel nor on other pipeline stages than their
    peers' (its own expert layers fold over the tensor ranks), so it sums their squares over the expert data and expert
    parallel ranks only: with tp > 1 or pp > 1 each rank's norm then misses the other slices and stages. Here the
    expert groups take the rule of every other group (tensor-parallel shards on every tensor rank, replicated
    parameters on tensor rank 0, then a sum over the tensor x pipeline ranks), before the sum over the expert-parallel
    ranks that DeepSpeed adds for them."""
    counts_every_rank = optimizer._grad_norm_counts_every_rank

    def counted_once(params, process_group) -> bool:
        if optimizer._autoep_expert_parallel_group(params) is not None:
            return False
        return counts_every_rank(params, process_group)

    optimizer._grad_norm_counts_every_rank = counted_once
