"""The hooks MGPUStrategy calls on a LightningModule, declared in one place.

Every hook is optional. A plain LightningModule without any of them trains with data parallelism and ZeRO exactly as
under DDP (``tests/distributed/test_lightning_conformance.py``); a layout that needs a hook the module lacks is
refused at ``setup`` by the hook's name. ``LLMModule`` implements all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from lightning_mgpu.layout import ModelShape, ParallelLayout


@dataclass
class ParallelContext:
    """What MGPUStrategy tells the module about the run it is part of, handed over in ``setup`` as
    ``module.parallel_context`` (a module trained by another strategy has none): the layout, this rank's pipeline,
    the micro-batches of a step, the last step's gradient norm, and the engine's optimizer step."""

    layout: ParallelLayout
    num_microbatches: int
    engine_step: Callable[[], None]
    pipeline: Optional[Any] = None  #: ``lightning_mgpu.parallel.pipeline.Pipeline`` with pipeline parallelism
    last_grad_norm: Optional[float] = None  #: the global norm before clipping, after a step that updated

    @property
    def replicas(self) -> int:
        """Data-parallel ranks of this rank's replica: those whose gradients average together every step."""
        return self.layout.size("dp")

    @property
    def data_ranks(self) -> int:
        """Ranks that train on different samples: the data-parallel ranks of every replica."""
        return self.layout.size("data")


def parallel_context(module: object) -> Optional[ParallelContext]:
    """``module``'s parallel context (``None`` when MGPUStrategy does not train it)."""
    context = getattr(module, "parallel_context", None)
    return context if isinstance(context, ParallelContext) else None


@runtime_checkable
class ParallelModule(Protocol):
    """What a LightningModule may define for tensor and pipeline parallelism and for building on the meta device."""

    @property
    def model_shape(self) -> ModelShape:
        """The sizes that constrain a split (heads, key/value heads, MLP width, layers); the layout is checked against
        them at ``setup``."""

    def tensor_parallel_plan(self) -> dict[str, str]:
        """``{module name pattern: style}`` for ``tensor_parallel_size > 1`` (see :mod:`lightning_mgpu.parallel.plan`)."""

    def pipeline_stages(self, stage_ids: list[int], num_stages: int,
                        boundaries: Optional[list[int]] = None) -> nn.ModuleDict:
        """Keep only stages ``stage_ids`` of ``num_stages``; return them in one ``ModuleDict`` keyed by stage id, which
        the module then holds (it is what the engine wraps)."""

    def pipeline_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first stage's input, the last stage's target) of a training or evaluation batch."""

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro-batch from the last stage's output."""

    def context_parallel_batch(self, *sequences: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This context rank's chunks of each ``[batch, seq]`` tensor, for ``context_parallel_size > 1`` (its attention
        must expose a replaceable ``kernel``, which ``parallelize`` swaps)."""

    def compiled_blocks(self) -> tuple[Optional[str], list[nn.Module]]:
        """(``torch.compile`` backend or ``None``, the blocks to compile one by one) of the module as it is now."""

    def checkpointed_blocks(self) -> tuple[str, list[nn.Module]]:
        """(activation checkpointing mode, the blocks it applies to) of the module as it is now (after a stage split,
        only this rank's blocks): ``parallelize`` applies it (:mod:`lightning_mgpu.parallel.checkpointing`)."""

    def checkpoint_record(self) -> dict[str, Any]:
        """Plain data (strings, numbers, lists, dicts) that every checkpoint of the run holds beside Lightning's state:
        what a reader needs that the weights do not say (the adapters' configuration and the base they adapt)."""

    def initial_value(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Part ``index`` of parameter ``name``'s initial value, whose whole tensor has shape ``shape``. Defining it lets
        the strategy build ``configure_model`` on the meta device and give each rank only its share. ``name`` is the
        parameter's name in the LightningModule; with pipeline parallelism the stage container's key is replaced by
        ``model.`` (the container is expected at ``self.model``, as ``LLMModule`` keeps it), so a name does not depend
        on the layout. Buffers must be created on a real device (they have no initial value to ask for). Under ZeRO-3
        each module's parameters are partitioned as soon as they are filled, so ``configure_optimizers`` sees them
        partitioned: read a parameter's shape with :func:`lightning_mgpu.parameter_shape`, not ``param.shape``."""


#: The hooks above, by name: what :func:`hook` may look up. Two more are not in the protocol, for a model whose code
#: is not ours (``lightning_mgpu.hf``; ``LLMModule`` has the replaceable ``kernel`` and the package's own experts
#: instead): ``context_parallel_attention(group, rank, size) -> int`` wires a module's attention and inputs for ``size``
#: context ranks itself and returns the number of attention layers wired (0: the module cannot be context-parallel);
#: ``expert_parallel(layout) -> list[str]`` keeps this rank's experts and routes tokens to the others' (notes).
HOOKS = ("model_shape", "tensor_parallel_plan", "pipeline_stages", "pipeline_batch", "pipeline_loss",
         "context_parallel_batch", "context_parallel_attention", "compiled_blocks", "checkpointed_blocks", "initial_value",
         "checkpoint_record", "expert_parallel")


#: Where hooks given on a module's behalf are attached (``lightning_mgpu.hf`` gives them for a ``transformers`` model):
#: consulted for each hook the module does not define itself.
ADAPTER_ATTRIBUTE = "_mgpu_adapter_hooks"


def hook(module: object, name: str) -> Optional[Callable[..., Any]]:
    """``module``'s hook ``name`` (one of :data:`HOOKS`, declared in :class:`ParallelModule`), or the one attached on
    its behalf, or ``None`` when neither defines it."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not a hook of lightning_mgpu.contract.ParallelModule; declare it there first")
    for owner in (module, getattr(module, ADAPTER_ATTRIBUTE, None)):
        value = getattr(owner, name, None)
        if callable(value):
            return value
    return None


def model_shape_of(module: object) -> Optional[ModelShape]:
    """The shape ``module`` declares (a property, not a callable hook), or the one attached on its behalf."""
    for owner in (module, getattr(module, ADAPTER_ATTRIBUTE, None)):
        shape = getattr(owner, "model_shape", None)
        if isinstance(shape, ModelShape):
            return shape
    return None


def builds_on_meta(module: object) -> bool:
    """Whether MGPUStrategy builds ``module``'s ``configure_model`` on the meta device: when it defines
    ``initial_value``, so that each rank can be given only its own share."""
    return hook(module, "initial_value") is not None
