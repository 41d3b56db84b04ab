"""Which layers of a model compute in fp8, and the sizes the GPU kernels refuse.

Every linear layer the model computes: plain ``nn.Linear`` (a Hugging Face model's as it is), the package's
column-parallel, row-parallel and vocabulary-parallel layers, and the grouped experts. A subclass of ``nn.Linear``
is left alone (the mixture-of-experts router's gate is one, computed in fp32 on purpose), and so are embeddings, norms
and the loss, which are not matmuls of a weight.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightning_mgpu.fp8.grouped import Fp8Grouped
from lightning_mgpu.fp8.scaling import Fp8Spec, Splits, fp8_linear
from lightning_mgpu.models.moe import GroupedExperts
from lightning_mgpu.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelOutput
from lightning_mgpu.problems import Problem

#: The kernels' rule: ``torch._scaled_mm`` takes a weight whose two dimensions are multiples of 16.
KERNEL_MULTIPLE = 16


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in fp8 (``fp8``: the layer's :class:`Fp8Spec`).

    A layer becomes one by changing its class in place rather than by a new module as torchao's
    ``convert_to_float8_training`` does: the module keeps its identity, so that a pipeline stage, an engine's hooks
    or a tied weight that already hold it see the change, and its parameters and state-dict keys stay as they are."""

    fp8: Fp8Spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8)


def convert_to_fp8(module: nn.Module, recipe: str, tp_group: Any = None, cp_group: Any = None) -> list[str]:
    """Make every linear layer of ``module`` compute in fp8 with ``recipe``; the names of the layers converted.

    ``tp_group``/``cp_group``: the tensor- and context-parallel groups of this rank (``None``: not split), over which
    the scales of split matrices are reduced."""
    tokens, names = cp_group, []
    for name, m in module.named_modules():
        if type(m) is nn.Linear or isinstance(m, Fp8Linear):
            m.__class__, m.fp8 = Fp8Linear, Fp8Spec(recipe, Splits(tokens=tokens))
        elif isinstance(m, (ColumnParallelLinear, VocabParallelOutput)):
            m.linear = functools.partial(fp8_linear, spec=Fp8Spec(recipe, Splits(out_features=m.group, tokens=tokens)))
        elif isinstance(m, RowParallelLinear):
            m.linear = functools.partial(fp8_linear, spec=Fp8Spec(recipe, Splits(in_features=m.group, tokens=tokens)))
        elif isinstance(m, GroupedExperts):
            columns, rows = Splits(out_features=tp_group, tokens=tokens), Splits(in_features=tp_group, tokens=tokens)
            m.matmul = Fp8Grouped(recipe, {"w1": columns, "w3": columns, "w2": rows})
        else:
            continue
        names.append(name)
    return names


def local_sizes(module: nn.Module) -> dict[str, tuple[int, int]]:
    """``{layer name: (input features, output features)}`` of this rank's part of every layer :func:`convert_to_fp8`
    converts (a stacked expert weight per expert, ``name.w1``...), from the weights' shapes (ZeRO-3's ``ds_shape``)."""
    sizes = {}
    for name, m in module.named_modules():
        if type(m) is nn.Linear or isinstance(m, (Fp8Linear, ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelOutput)):
            out_features, in_features = _shape(m.weight)
            sizes[name] = (in_features, out_features)
        elif isinstance(m, GroupedExperts):
            for weight in ("w1", "w3", "w2"):
                sizes[f"{name}.{weight}"] = tuple(_shape(getattr(m, weight))[1:])
    return sizes


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def kernel_size_problems(sizes: dict[str, tuple[int, int]], fix: str = "") -> list[Problem]:
    """The rule of the GPU kernels: each layer's local input and output features are multiples of 16. Emulated fp8
    (CPU) has no such rule."""
    out = []
    for name, dims in sizes.items():
        if any(d % KERNEL_MULTIPLE for d in dims):
            out.append(Problem(f"fp8 layer {name}", dims, f"has (input, output) features on this rank that are not "
                               f"multiples of {KERNEL_MULTIPLE}, which fp8 GEMMs on CUDA (torch._scaled_mm) require",
                               fix or "choose model sizes (over tensor_parallel_size) that are multiples of 16, or "
                               "turn fp8 off"))
    return out

