"""fp8 for the grouped experts: each expert's matmuls rounded to fp8 with torchao's scales, per expert and per group
of tokens.

A grouped GEMM multiplies the rows of each expert by that expert's weight. Its scales follow the dense recipe
(:mod:`lightning_mgpu.fp8.scaling`) with one scale set per expert for the weight and, where a scale spans tokens (the
weight-gradient GEMM's operands; every activation scale under ``tensorwise``), one per *token group*: the tokens one
micro-batch of one data-parallel rank sent to that expert. On one process an expert's tokens are one group; under
expert parallelism an expert receives a group from every rank of its group and scales each apart, so an expert's
weight gradient is the same sum of per-micro-batch products as a one-process run accumulates.

The rounding is emulated (fp8 values held in fp32, one high-precision grouped matmul) on every device: torchao's fp8
grouped GEMM (``torchao.prototype.moe_training``) is a prototype for CUDA only, with group sizes padded to 16 rows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torchao.float8.config import CastConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

from lightning_mgpu.fp8.scaling import Fp8Spec, Splits, reduce_max, reduced_amax
from lightning_mgpu.models.moe import GroupedMatmul, grouped_matmul


def _round(t: torch.Tensor, amax: torch.Tensor, cast_config: CastConfig, spec: Fp8Spec) -> torch.Tensor:
    """``t`` rounded to fp8 with the scale of ``amax`` (broadcast over ``t``), back in fp32: what torchao's emulated
    GEMM multiplies (``data.float() / scale``)."""
    scale = amax_to_scale(amax, cast_config.target_dtype, spec.config.round_scales_to_power_of_2)
    return to_fp8_saturated(t.float() * scale, cast_config.target_dtype).float() / scale


def round_rows(t: torch.Tensor, cast_config: CastConfig, spec: Fp8Spec, axis: int, groups: tuple[Any, Any],
               row_group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Activations ``[rows, features]`` in fp8: scaled per row (``axis=-1``, rowwise), or per token group and feature
    (``axis=0``), or per token group (tensorwise); ``groups`` split ``(tokens, features)``."""
    if cast_config.scaling_type is ScalingType.DISABLED:
        return t.float()
    if cast_config.scaling_granularity is ScalingGranularity.AXISWISE and axis == -1:
        return _round(t, reduced_amax(t, ScalingGranularity.AXISWISE, -1, groups), cast_config, spec)
    per_feature = t.float().abs().new_zeros(n_groups, t.shape[1]).index_reduce_(0, row_group, t.float().abs(), "amax")
    if cast_config.scaling_granularity is ScalingGranularity.TENSORWISE:
        amax = reduce_max(per_feature.amax(1, keepdim=True), groups)
    else:
        amax = reduce_max(per_feature, groups[:1])
    return _round(t, amax[row_group], cast_config, spec)


def round_weight(w: torch.Tensor, cast_config: CastConfig, spec: Fp8Spec, dim: int, groups: tuple[Any, Any]
                 ) -> torch.Tensor:
    """Stacked weights ``[experts, in, out]`` in fp8, one scale per expert and output feature (``dim=1``: over the
    input features), per expert and input feature (``dim=2``), or per expert (tensorwise)."""
    if cast_config.scaling_type is ScalingType.DISABLED:
        return w.float()
    if cast_config.scaling_granularity is ScalingGranularity.TENSORWISE:
        amax = reduce_max(w.float().abs().amax(dim=(1, 2), keepdim=True), groups)
    else:
        amax = reduce_max(w.float().abs().amax(dim=dim, keepdim=True), (groups[dim - 1],))
    return _round(w, amax, cast_config, spec)


class Fp8GroupedMatmul(torch.autograd.Function):
    """``grouped_matmul(x, w, counts)`` with the three GEMMs of forward and backward on fp8-rounded operands;
    ``token_groups`` ``[experts, sources]`` counts each expert's rows by the rank they came from (in that order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, token_groups: torch.Tensor, spec: Fp8Spec) -> torch.Tensor:
        ctx.save_for_backward(x, w, token_groups)
        ctx.spec = spec
        c, s = spec.config, spec.splits
        counts = token_groups.sum(1)
        xq = round_rows(x, c.cast_config_input, spec, -1, (s.tokens, s.in_features), *_row_groups(token_groups, x))
        wq = round_weight(w, c.cast_config_weight, spec, 1, (s.in_features, s.out_features))
        return grouped_matmul(xq, wq, counts).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, w, token_groups = ctx.saved_tensors
        spec = ctx.spec
        c, s = spec.config, spec.splits
        counts, rows = token_groups.sum(1), _row_groups(token_groups, x)
        go_groups = (s.tokens, s.out_features)
        goq = round_rows(grad_output, c.cast_config_grad_output, spec, -1, go_groups, *rows)
        wq = round_weight(w, c.cast_config_weight_for_grad_input, spec, 2, (s.in_features, s.out_features))
        grad_input = grouped_matmul(goq, wq.transpose(1, 2).contiguous(), counts).to(x.dtype)
        go_w = round_rows(grad_output, c.cast_config_grad_output_for_grad_weight, spec, 0, go_groups, *rows)
        x_w = round_rows(x, c.cast_config_input_for_grad_weight, spec, 0, (s.tokens, s.in_features), *rows)
        with torch.enable_grad():  # each expert's x_w^T @ go_w, by the grouped matmul's own backward
            probe = torch.zeros(w.shape, dtype=torch.float32, device=w.device, requires_grad=True)
            (grad_weight,) = torch.autograd.grad(grouped_matmul(x_w, probe, counts), probe, go_w)
        return grad_input, grad_weight.to(w.dtype), None, None


def _row_groups(token_groups: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's token group (expert-major, then source) and the number of groups."""
    sizes = token_groups.flatten()
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=x.device), sizes.to(x.device),
                                   output_size=x.shape[0]), sizes.numel()


class Fp8Grouped(GroupedMatmul):
    """The experts' multiplication in fp8 (set on a ``GroupedExperts`` as its ``matmul``), with the splits of each of
    its stacked weights (``w1``/``w3`` split by hidden columns, ``w2`` by hidden rows under tensor parallelism)."""

    def __init__(self, recipe: str, splits: dict[str, Splits]) -> None:
        self.specs = {name: Fp8Spec(recipe, split) for name, split in splits.items()}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, name: str,
                 token_groups: Optional[torch.Tensor] = None) -> torch.Tensor:
        groups = counts.view(-1, 1) if token_groups is None else token_groups
        return Fp8GroupedMatmul.apply(x, w, groups, self.specs[name])
