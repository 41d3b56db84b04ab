"""fp8 matmuls with torchao's dynamic scaling, whose scales are reduced over the splits of a parallel layout.

A linear layer's three GEMMs (output, grad_input, grad_weight) each cast two operands to fp8 with a scale computed
from the operand's absolute maximum (``amax``): over a whole tensor (``tensorwise``) or along one axis (``rowwise``,
torchao's ``axiswise``). Each operand's two dimensions may be split over ranks by the layout:

* ``input`` ``[tokens, in_features]``, ``weight_t`` ``[in_features, out_features]``,
  ``grad_output`` ``[tokens, out_features]``;
* in_features are split by a row-parallel layer (tensor parallelism), out_features by a column-parallel layer or the
  vocabulary-parallel head, the tokens of a sequence by context parallelism.

Where a scale spans a split dimension, the amax is reduced (MAX) over that split's process group, so that every rank
casts with the scale one process would compute for the whole matrix: every layout's first step then casts as one
process does (later steps drift, as fp8 rounds the layouts' fp32 reduction orders apart).
Data and pipeline parallelism split no matrix (each micro-batch is whole on its rank), so they need no reduction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
from torchao.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

@dataclass(frozen=True)
class Splits:
    """The process groups splitting a matmul's dimensions on this rank (``None``: whole here)."""

    in_features: Any = None
    out_features: Any = None
    tokens: Any = None


@dataclass(frozen=True)
class Fp8Spec:
    """One layer's fp8 matmul: the recipe (torchao's config) and the splits its scales are reduced over.

    ``emulate=None`` decides per call: emulated (fp8 rounding, fp32 matmul) off CUDA, torchao's fp8 kernels on CUDA."""

    recipe: str = "rowwise"
    splits: Splits = Splits()
    emulate: Optional[bool] = None

    @property
    def config(self) -> Float8LinearConfig:
        return _configs(self.recipe)

    def mm_config(self, device: torch.device) -> LinearMMConfig:
        """torchao's per-GEMM settings (fast accumulation in the output GEMM, as ``Float8Linear`` has it)."""
        emulate = device.type != "cuda" if self.emulate is None else self.emulate
        c = self.config
        return LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in (
            c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))


_CONFIGS: dict[str, Float8LinearConfig] = {}


def _configs(recipe: str) -> Float8LinearConfig:
    """torchao's recipe with every scale rounded down to a power of two (its rowwise recipe does so already): a scale
    that is not a power of two moves with the last bit of its amax, which a layout's fp32 summation order changes, and
    fp8's rounding then turns that 1e-7 into whole fp8 steps; a power of two moves only when the amax crosses one."""
    if recipe not in _CONFIGS:
        _CONFIGS[recipe] = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                               round_scales_to_power_of_2=True)
    return _CONFIGS[recipe]


def reduced_amax(t: torch.Tensor, granularity: ScalingGranularity, axis: Optional[int],
                 groups: tuple[Any, Any]) -> torch.Tensor:
    """torchao's amax of ``t`` (2-D), reduced by MAX over the groups of the dimensions the scale spans: ``groups``
    split dims ``(0, 1)``; an ``axis`` scale spans that dim only, a tensorwise one both.

    Written here rather than through torchao's ``reduce_amax=True``, which takes one device mesh: a tensorwise scale
    under tensor x context parallelism spans two groups."""
    amax = tensor_to_amax(t, False, None, granularity, axis).float()  # exact for bf16/fp16; every backend reduces fp32
    return reduce_max(amax, groups if granularity is ScalingGranularity.TENSORWISE else (groups[axis % 2 - 2],))


def reduce_max(amax: torch.Tensor, groups: tuple[Any, ...]) -> torch.Tensor:
    """``amax`` (fp32) made its MAX over each group that is set and has more than one rank, in place: the amax of the
    whole matrix, on every rank of the split."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def cast(t: torch.Tensor, cast_config: CastConfig, spec: Fp8Spec, role: GemmInputRole, axis: int,
         groups: tuple[Any, Any], mm_config: LinearMMConfig) -> torch.Tensor:
    """``t`` (2-D) as torchao's fp8 tensor for one GEMM, scaled along ``axis`` (rowwise) or whole (tensorwise) with
    the amax reduced over ``groups``; unchanged where the recipe keeps that operand in high precision."""
    if cast_config.scaling_type is ScalingType.DISABLED:
        return t
    granularity = cast_config.scaling_granularity
    axiswise = get_maybe_axiswise_dim(axis, granularity)
    amax = reduced_amax(t, granularity, axiswise, groups)
    scale = amax_to_scale(amax, cast_config.target_dtype, spec.config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, mm_config, role, axiswise)


class Fp8Matmul(torch.autograd.Function):
    """``x @ weight_t`` with every GEMM of forward and backward in fp8, as torchao's ``matmul_with_hp_or_float8_args``
    computes it (the same casts, axes and GEMM order, so that on one process it equals ``convert_to_float8_training``),
    with each amax reduced over the splits of ``spec``. Written beside torchao's rather than calling it: torchao's
    reduces no amax over a tensor-parallel or context-parallel split, which the package's own layers need."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_t: torch.Tensor, spec: Fp8Spec) -> torch.Tensor:
        ctx.save_for_backward(x, weight_t)
        ctx.spec = spec
        c, s, mm = spec.config, spec.splits, spec.mm_config(x.device)
        x2 = x.reshape(-1, x.shape[-1])
        xq = cast(x2, c.cast_config_input, spec, GemmInputRole.INPUT, -1, (s.tokens, s.in_features), mm)
        wq = cast(weight_t, c.cast_config_weight, spec, GemmInputRole.WEIGHT, 0, (s.in_features, s.out_features), mm)
        out = torch.mm(xq, wq)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight_t = ctx.saved_tensors
        spec = ctx.spec
        c, s, mm = spec.config, spec.splits, spec.mm_config(grad_output.device)
        go = grad_output.reshape(-1, grad_output.shape[-1])
        go_groups, x_groups = (s.tokens, s.out_features), (s.tokens, s.in_features)
        goq = cast(go, c.cast_config_grad_output, spec, GemmInputRole.GRAD_OUTPUT, -1, go_groups, mm)
        wq = cast(weight_t, c.cast_config_weight_for_grad_input, spec, GemmInputRole.WEIGHT, -1,
                  (s.in_features, s.out_features), mm)
        grad_input = torch.mm(goq, wq.t()).reshape(*grad_output.shape[:-1], weight_t.shape[0])
        go_w = cast(go, c.cast_config_grad_output_for_grad_weight, spec, GemmInputRole.GRAD_OUTPUT, 0, go_groups, mm)
        x_w = cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, spec, GemmInputRole.INPUT, 0,
                   x_groups, mm)
        grad_weight = torch.mm(go_w.t(), x_w)
        return grad_input, grad_weight.t(), None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: Fp8Spec) -> torch.Tensor:
    """``F.linear`` in fp8: the bias is added afterwards in the output's precision, as torchao's ``Float8Linear``."""
    out = Fp8Matmul.apply(x, weight.t(), spec)
    return out if bias is None else out + bias.to(out.dtype)
