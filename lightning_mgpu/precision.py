"""MGPUPrecision: Lightning precision strings mapped onto the DeepSpeed engine's precision settings."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_mgpu.problems import Problem, raise_problems
from lightning_mgpu.split_rules import steps_apart

#: Accepted Trainer ``precision=`` values.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")

#: fp8 matmul recipes (torchao's names): ``rowwise`` scales each row of an activation and each output feature of a
#: weight apart (torchtitan's default); ``tensorwise`` one scale per tensor (faster kernels, coarser). Scales are
#: rounded down to powers of two in both (``lightning_mgpu.fp8.scaling``).
FP8_RECIPES = ("rowwise", "tensorwise")


def fp8_problems(fp8: Optional[str]) -> list[Problem]:
    """The rule: fp8 is off (``None``) or one of torchao's recipes; the base precision is any supported one (torchao
    casts bf16, fp16 and fp32 alike, and fp16's loss scale is absorbed by the dynamic scales)."""
    if fp8 is None or fp8 in FP8_RECIPES:
        return []
    return [Problem("fp8", fp8, "is not one of torchao's float8 training recipes",
                    f"choose {' or '.join(repr(r) for r in FP8_RECIPES)}, or leave it unset (off)")]


def pipeline_precision_problems(precision: str, pipeline_parallel_size: int) -> list[Problem]:
    """The rule: fp16's dynamic loss scaling cannot follow a pipeline schedule, which runs backward itself."""
    if pipeline_parallel_size > 1 and str(precision) == "16-mixed":
        return [Problem("precision", "16-mixed", "is not supported with pipeline parallelism (the schedule runs "
                        "backward outside DeepSpeed's loss scaler)", "use 'bf16-mixed' or '32-true'")]
    return []


def replica_precision_problems(precision: str, zero_stage: int, replica_update: str) -> list[Problem]:
    """The rule: the outer step of replicas that step apart (``local``, ``async``) updates the fp32 master weights,
    which a ZeRO-0 engine in bf16 or fp16 keeps inside its optimizer wrapper out of reach."""
    if steps_apart(replica_update) and zero_stage == 0 and str(precision) != "32-true":
        return [Problem("zero_stage", 0, f"with precision={str(precision)!r} keeps no fp32 master weights the outer "
                        f"step of replica_update={replica_update!r} can update",
                        "use zero_stage >= 1, or precision='32-true'")]
    return []


def fp8_layout_problems(fp8: Optional[str], context_parallel_size: int, expert_parallel_size: int) -> list[Problem]:
    """The rule: fp8 experts are scaled per expert and per token group a rank sends; under context parallelism a
    group is a shard of a sequence whose scale must span the whole sequence, which an expert-parallel group spanning
    the context ranks cannot reduce (its ranks hold different experts)."""
    if fp8 is None or context_parallel_size <= 1 or expert_parallel_size <= 1:
        return []
    return [Problem("expert_parallel_size", expert_parallel_size, f"with context_parallel_size="
                    f"{context_parallel_size} and fp8={fp8!r} would scale each context rank's tokens of an expert "
                    "apart, unlike one process", "use expert_parallel_size=1 with context parallelism, or "
                    "context_parallel_size=1")]


class MGPUPrecision(Precision):
    """Precision served by the DeepSpeed engine.

    * ``32-true``: fp32 everywhere.
    * ``bf16-mixed``: bf16 parameters and activations, fp32 master weights and optimizer state kept by DeepSpeed.
    * ``bf16-true``: the same engine settings; the module is also built in bf16 (less memory at init).
    * ``16-mixed``: fp16 with fp32 master weights and dynamic loss scaling; a step whose gradients overflow
      is skipped on every rank (the overflow check is global) and the scale is halved.

    ``fp8="rowwise"`` or ``"tensorwise"`` (default ``None``: off) also runs every linear layer's matmuls in fp8 with
    torchao's dynamic scaling, over any of the precisions above (``bf16-mixed`` for real runs, ``32-true`` for exact
    emulated tests): ``lightning_mgpu.fp8``, applied by the strategy once the model is split.

    Gradient clipping is done by DeepSpeed over the global norm, so ``clip_gradients`` here does nothing.
    """

    def __init__(self, precision: str = "32-true", fp8: Optional[str] = None) -> None:
        precision = str(precision)
        problems = [] if precision in SUPPORTED_PRECISIONS else [Problem(
            "precision", precision, "is not supported by MGPUStrategy",
            f"choose one of {', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}")]
        raise_problems("Invalid precision", problems + fp8_problems(fp8))
        self.precision, self.fp8 = precision, fp8

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16}.get(
            self.precision, torch.float32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        if self.precision != "bf16-true":
            yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Backward is run by the strategy through the DeepSpeed engine, micro-batch by micro-batch."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (all micro-batches' forward and backward), then one engine step (clip + update)."""
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            raise RuntimeError("training_step returned None, which would skip the backward of every rank's "
                               "micro-batches; MGPUStrategy needs a loss from every training_step")
        return model.parallel_context.engine_step()  # MGPUStrategy hands every module its context in setup

    def clip_gradients(self, optimizer: Any, clip_val: Optional[float] = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """DeepSpeed clips by the global norm inside ``engine.step()``."""


def as_mgpu_precision(plugin: Precision) -> MGPUPrecision:
    """The MGPUPrecision equivalent of the plugin Lightning picked from ``Trainer(precision=...)``."""
    if isinstance(plugin, MGPUPrecision):
        return plugin
    return MGPUPrecision(getattr(plugin, "precision", "32-true"))
