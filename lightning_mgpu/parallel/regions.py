"""The collectives of tensor and sequence parallelism, as small autograd functions.

Each function is one torch.distributed collective in forward and its adjoint in backward (Megatron's
``f``/``g`` operators and their sequence-parallel variants). They are written out here, rather than
taken from DTensor, because the layers that use them hold plain local-shard parameters, which is what
DeepSpeed ZeRO and ``torch.distributed.pipelining`` accept.

Activations are batch-first, ``[batch, seq, ...]``: sequence-parallel functions split and gather along
dim 1. The collectives are looked up on ``torch.distributed`` at call time (tests count them).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd import Function

SEQ_DIM = 1


def world(group: Any) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, s/T, ...] on each rank -> [b, s, ...] (rank order along the sequence)."""
    T = world(group)
    front = x.transpose(0, SEQ_DIM).contiguous()
    out = front.new_empty((front.shape[0] * T, *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.transpose(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, s, ...] partial sums on each rank -> this rank's [b, s/T, ...] shard of their sum."""
    T = world(group)
    check_sequence_divisible(x.shape[SEQ_DIM], T)
    front = x.transpose(0, SEQ_DIM).contiguous()
    out = front.new_empty((front.shape[0] // T, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.transpose(0, SEQ_DIM).contiguous()


def check_sequence_divisible(seq: int, T: int) -> None:
    if seq % T:
        raise ValueError(f"sequence length {seq} is not divisible by tensor_parallel_size={T}: sequence "
                         f"parallelism splits every sequence into {T} equal shards; use a sequence length that "
                         f"is a multiple of {T}, or sequence_parallel=False")


def _collective(name: str, forward: Callable, backward: Callable, doc: str) -> type[Function]:
    """An autograd function running ``forward(x, group)`` and, on the gradient, its adjoint ``backward(grad, group)``."""

    def forward_fn(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def backward_fn(ctx, grad: torch.Tensor):
        return backward(grad, ctx.group), None

    return type(name, (Function,), {"__doc__": doc, "forward": staticmethod(forward_fn),
                                    "backward": staticmethod(backward_fn)})


def _identity(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x.view_as(x)


CopyToRegion = _collective("CopyToRegion", _identity, _all_reduce,
                           "Enter the tensor-parallel region: identity forward, all-reduce of the gradient backward.")
ReduceFromRegion = _collective("ReduceFromRegion", lambda x, group: _all_reduce(x.clone(), group), _identity,
                               "Leave the region: all-reduce the partial sums forward, identity backward.")
GatherSequence = _collective("GatherSequence", _gather_seq, _reduce_scatter_seq,
                             "Sequence shard -> whole sequence: all-gather forward, reduce-scatter backward.")


def _split_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, s, ...] whole on each rank -> this rank's [b, s/T, ...] shard."""
    T = world(group)
    check_sequence_divisible(x.shape[SEQ_DIM], T)
    per = x.shape[SEQ_DIM] // T
    return x.narrow(SEQ_DIM, dist.get_rank(group) * per, per).contiguous()


SplitSequence = _collective("SplitSequence", _split_seq, _gather_seq,
                            "Whole sequence (the same on every rank) -> this rank's shard: split forward, all-gather "
                            "backward.")
ReduceScatterSequence = _collective(
    "ReduceScatterSequence", _reduce_scatter_seq, _gather_seq,
    "Partial sums over the whole sequence -> summed sequence shard: reduce-scatter forward, all-gather backward.")


def _gather_features(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[..., n/T] on each rank -> [..., n] (rank order along the last dimension)."""
    parts = [torch.empty_like(x) for _ in range(world(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_features(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[..., n] whole on each rank -> this rank's [..., n/T] chunk of the last dimension."""
    per = x.shape[-1] // world(group)
    return x.narrow(-1, dist.get_rank(group) * per, per).contiguous()


GatherFeatures = _collective("GatherFeatures", _gather_features, _split_features,
                             "Feature shards -> whole features on every rank: all-gather along the last dimension "
                             "forward, this rank's chunk of the gradient backward.")
SplitFeatures = _collective("SplitFeatures", _split_features, _gather_features,
                            "Whole features (the same on every rank) -> this rank's chunk: split forward, all-gather "
                            "of the gradient backward.")


class SharedBiasBeforeReduce(Function):
    """``bias / T`` forward, the gradient unscaled backward.

    A row-parallel layer under sequence parallelism adds its (replicated) bias before the reduce-scatter,
    so that the bias gradient is taken over the whole sequence and is complete on every rank; each rank
    contributes ``1/T`` of it to the sum.
    """

    @staticmethod
    def forward(ctx, bias: torch.Tensor, T: int) -> torch.Tensor:
        return bias / T

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ScaledGather(Function):
    """The affine part of a norm, fused with entering the tensor-parallel region.

    ``y = gather(x_hat) * weight + bias`` where ``x_hat`` is the normalised input (a sequence shard under
    sequence parallelism, else the whole sequence). The gradient arriving at ``y`` is each rank's partial
    sum (the column-parallel layers downstream each see their own columns), so the gradients of
    ``weight`` and ``bias`` are partial too. Backward packs them behind the activation gradient into the
    one collective it runs anyway (reduce-scatter, or all-reduce without sequence parallelism): every
    rank receives the complete ``weight``/``bias`` gradients with no extra collective. Megatron instead
    all-reduces such gradients once per step, which DeepSpeed's gradient hooks leave no place for.
    """

    @staticmethod
    def forward(ctx, x_hat: torch.Tensor, weight: torch.Tensor, bias: Any, group: Any,
                sequence_parallel: bool) -> torch.Tensor:
        full = _gather_seq(x_hat, group) if sequence_parallel else x_hat
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.sp, ctx.has_bias = group, sequence_parallel, bias is not None
        out = full * weight
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full, weight = ctx.saved_tensors
        reduce_dims = tuple(range(grad.dim() - 1))
        param_grads = [(grad * full).sum(reduce_dims)]
        if ctx.has_bias:
            param_grads.append(grad.sum(reduce_dims))
        packed_params = torch.cat(param_grads).to(grad.dtype)
        n = packed_params.numel()
        grad_x = grad * weight
        if ctx.sp:
            T = world(ctx.group)
            check_sequence_divisible(grad_x.shape[SEQ_DIM], T)
            chunks = grad_x.chunk(T, dim=SEQ_DIM)
            shard_shape = chunks[0].shape
            rows = torch.stack([torch.cat([c.reshape(-1), packed_params]) for c in chunks])
            out = rows.new_empty((1, rows.shape[1]))
            dist.reduce_scatter_single(out, rows.contiguous(), group=ctx.group)
            grad_x_hat, summed = out[0, :-n].view(shard_shape), out[0, -n:]
        else:
            flat = _all_reduce(torch.cat([grad_x.reshape(-1), packed_params]), ctx.group)
            grad_x_hat, summed = flat[:-n].view_as(grad_x), flat[-n:]
        d = weight.numel()
        grad_w = summed[:d].view_as(weight)
        grad_b = summed[d:].view_as(weight) if ctx.has_bias else None
        return grad_x_hat, grad_w, grad_b, None, None


class ScaleGradient(Function):
    """``x`` unchanged forward; its gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None
