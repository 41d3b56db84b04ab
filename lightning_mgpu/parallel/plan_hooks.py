"""Tensor-parallel styles that keep the module as it is and add hooks around it: for models whose code is not ours.

A model from elsewhere (a ``transformers`` decoder) cannot have its norms replaced by a :class:`ParallelNorm` without
changing what its code computes (Gemma's ``1 + weight``, Qwen3's per-head q/k norms), and its attention reshapes
with the shape of the tensor its own module received. So the region is entered where the module that holds the
column-parallel linears receives its input, and sequence parallelism shards the residual stream between the
decoder layers of a run:

====================  =====================================================================================
``enter_region``      the module's first input enters the region: copied (all-reduce of its gradient), or
                      gathered along the sequence under sequence parallelism (reduce-scatter backward); its
                      column-parallel linears then use ``colwise``
``sequence_scatter``  under sequence parallelism, the module's first input (whole on every rank) is cut to this
                      rank's sequence shard (gradient all-gathered); nothing otherwise
``sequence_gather``   under sequence parallelism, the module's output (a sequence shard) is all-gathered to the
                      whole sequence (gradient: this rank's shard); nothing otherwise
``grad_sum``          the parameters stay whole on every rank; their gradients are summed over the group
                      (each rank saw only its heads or its sequence shard: ``transformers``'
                      ``replicated_with_grad_allreduce``, and norms under sequence parallelism)
``grad_sum_sp``       ``grad_sum`` under sequence parallelism only (a norm on the residual stream)
``whole_sequence_sp`` under sequence parallelism, the module runs whole on every rank: its first input gathered
                      (gradient: this rank's shard), its output cut back to this rank's shard (gradient
                      all-gathered); for a module that mixes positions and holds no split layer (DeepSeek's
                      attention, which the model's plan leaves whole); nothing otherwise
====================  =====================================================================================

The hooks are ``torch.nn.Module`` forward hooks and tensor hooks, so parameter names, state-dict keys and the
module's own forward stay unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_mgpu.parallel.regions import CopyToRegion, GatherSequence, SplitSequence, _all_reduce, _gather_seq
from lightning_mgpu.parallel.tensor import TensorParallelLayer

#: Marks a module whose output the hooks gather along the sequence (read by the pipeline split of such models).
SEQUENCE_GATHERED = "_mgpu_sequence_gathered"


class GatherReplicatedSequence(torch.autograd.Function):
    """Sequence shard -> whole sequence, whose gradient is the same on every rank (the next consumer is replicated):
    all-gather forward, this rank's shard of the gradient backward (the adjoint of ``SplitSequence``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.per = group, x.shape[1]
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank = torch.distributed.get_rank(ctx.group)
        return grad.narrow(1, rank * ctx.per, ctx.per).contiguous(), None


def _on_first_input(transform: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward pre-hook (with keyword arguments) applying ``transform`` to the first positional argument, or to
    ``hidden_states`` when the module is called by keyword (``transformers`` calls attention that way)."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": transform(kwargs["hidden_states"])}
        raise TypeError(f"{type(module).__name__} was called without a positional input or hidden_states=; the "
                        "tensor-parallel hooks cannot find the activation to enter the region with")

    return pre_hook


def enter_region(module: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    entry = (lambda x: GatherSequence.apply(x, group)) if sequence_parallel else (lambda x: CopyToRegion.apply(x, group))
    module.register_forward_pre_hook(_on_first_input(entry), with_kwargs=True)
    return module


def sequence_scatter(module: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    if sequence_parallel:
        module.register_forward_pre_hook(_on_first_input(lambda x: SplitSequence.apply(x, group)), with_kwargs=True)
    return module


def sequence_gather(module: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    if sequence_parallel and not getattr(module, SEQUENCE_GATHERED, False):
        module.register_forward_hook(lambda m, args, out: _map_first(out, group))
        setattr(module, SEQUENCE_GATHERED, True)
    return module


def whole_sequence_sp(module: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    if sequence_parallel:
        module.register_forward_pre_hook(_on_first_input(lambda x: GatherReplicatedSequence.apply(x, group)),
                                         with_kwargs=True)
        module.register_forward_hook(lambda m, args, out: _map_first(out, group, SplitSequence))
    return module


def _map_first(out: Any, group: Any, function: type[torch.autograd.Function] = GatherReplicatedSequence) -> Any:
    if isinstance(out, torch.Tensor):
        return function.apply(out, group)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (function.apply(out[0], group), *out[1:])
    raise TypeError(f"cannot split or gather an output of type {type(out).__name__} along the sequence")


#: Set on a parameter whose gradient :func:`grad_sum` sums, so it is hooked once.
GRAD_SUMMED = "_mgpu_grad_summed"


def grad_sum(module: nn.Module, group: Any, sequence_parallel: bool = True) -> nn.Module:
    """Sum each parameter's gradient over ``group`` as autograd computes it (before it is accumulated, so an engine's
    own gradient hooks see the sum). The hooks go on at the module's first forward: a model built on the meta device
    has its parameters replaced by real ones after the plan is applied, and a hook on the meta one would be lost."""

    def hook_parameters(owner: nn.Module, args: tuple) -> None:
        for param in _whole_parameters(owner):
            if param.requires_grad and not param.is_meta and not getattr(param, GRAD_SUMMED, False):
                param.register_hook(lambda grad: _all_reduce(grad.clone(), group))
                setattr(param, GRAD_SUMMED, True)

    module.register_forward_pre_hook(hook_parameters)
    return module


def _whole_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters but those of the tensor-parallel layers inside it (a mixture of experts' shared experts,
    split by the plan): their gradients are complete shards already, and summing them would mix different shards."""
    return [param for sub in module.modules() if not isinstance(sub, TensorParallelLayer)
            for param in sub.parameters(recurse=False)]


def grad_sum_sp(module: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    return grad_sum(module, group) if sequence_parallel else module


HOOK_BUILDERS: dict[str, Callable[[nn.Module, Any, bool], nn.Module]] = {
    "enter_region": enter_region,
    "sequence_scatter": sequence_scatter,
    "sequence_gather": sequence_gather,
    "grad_sum": grad_sum,
    "grad_sum_sp": grad_sum_sp,
    "whole_sequence_sp": whole_sequence_sp,
}
