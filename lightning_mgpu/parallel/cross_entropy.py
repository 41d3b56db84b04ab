"""Cross-entropy over logits sharded along the vocabulary, without ever forming the whole logits.

Written by hand (after Megatron's ``vocab_parallel_cross_entropy``) because the logits are plain local
shards: each rank holds ``[tokens, vocab / T]``. Forward runs two all-reduces over the group (the
row-wise max, then the target logit and the sum of exponentials packed together); backward needs none.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from lightning_mgpu.parallel.tensor import VocabParallelOutput


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any,
                ignore_index: int) -> torch.Tensor:
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = target - vocab_start
        here = (local_target >= 0) & (local_target < logits.shape[-1])
        safe_target = local_target.masked_fill(~here, 0)
        target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        exp = shifted.exp()
        packed = torch.stack([target_logit, exp.sum(dim=-1)])
        dist.all_reduce(packed, group=group)
        target_logit, sum_exp = packed[0], packed[1]
        loss = sum_exp.log() - target_logit
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, reused as the gradient
        ctx.save_for_backward(exp, safe_target, here & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, safe_target, hit, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses (``[...]``) from this rank's logits shard ``[..., vocab_shard]`` starting at ``vocab_start``."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group, ignore_index)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, head: Optional[nn.Module] = None,
                  ignore_index: int = -100, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """Next-token loss of ``logits [..., vocab]`` against ``target [...]``, for a whole or sharded head: the mean
    over the targets that are not ``ignore_index`` (``reduction="mean"``), or their sum (``"sum"``, for a caller that
    divides by a count over more than these logits, e.g. a whole global batch).

    Pass the module that produced the logits as ``head``: when a tensor-parallel plan has turned it into
    a :class:`VocabParallelOutput`, the loss is computed over the shards; otherwise this is
    ``F.cross_entropy``. The same training step thus runs with and without tensor parallelism.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} is not supported; choose 'mean' or 'sum'")
    logits, target = logits.flatten(0, -2), target.flatten()
    if not isinstance(head, VocabParallelOutput):
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)
    losses = vocab_parallel_cross_entropy(logits, target, head.vocab_start, head.group, ignore_index)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum().clamp(min=1)


@torch.no_grad()
def gather_logits(logits: torch.Tensor, head: Optional[nn.Module] = None) -> torch.Tensor:
    """The whole logits ``[..., vocab]`` (padding removed) on every rank, for sampling and metrics.

    Not differentiable; the identity when ``head`` is not a :class:`VocabParallelOutput`.
    """
    if not isinstance(head, VocabParallelOutput):
        return logits
    T = head.tp_size
    front = logits.movedim(-1, 0).contiguous()
    out = front.new_empty((front.shape[0] * T, *front.shape[1:]))
    dist.all_gather_single(out, front, group=head.group)
    return out.movedim(0, -1)[..., : head.vocab_size]
