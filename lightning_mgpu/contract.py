"""The hooks MGPUStrategy calls on a LightningModule, declared in one place.

Every hook is optional. A plain LightningModule without any of them trains with data parallelism and ZeRO exactly as
under DDP (``tests/distributed/test_lightning_conformance.py``); a layout that needs a hook the module lacks is
refused at ``setup`` by the hook's name. ``LLMModule`` implements all of them.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch
from torch import nn

from lightning_mgpu.layout import ModelShape


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

    def checkpointed_blocks(self) -> tuple[str, list[nn.Module]]:
        """(activation checkpointing mode, the blocks it applies to) of the module as it is now (after a stage split,
        only this rank's blocks): ``parallelize`` applies it (:mod:`lightning_mgpu.parallel.checkpointing`)."""

    def initial_value(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Part ``index`` of parameter ``name``'s initial value, whose whole tensor has shape ``shape``. Defining it lets
        the strategy build ``configure_model`` on the meta device and give each rank only its share. ``name`` is the
        parameter's name in the LightningModule; with pipeline parallelism the stage container's key is replaced by
        ``model.`` (the container is expected at ``self.model``, as ``LLMModule`` keeps it), so a name does not depend
        on the layout. Buffers must be created on a real device (they have no initial value to ask for). Under ZeRO-3
        each module's parameters are partitioned as soon as they are filled, so ``configure_optimizers`` sees them
        partitioned: read a parameter's shape with :func:`lightning_mgpu.parameter_shape`, not ``param.shape``."""


def builds_on_meta(module: object) -> bool:
    """Whether MGPUStrategy builds ``module``'s ``configure_model`` on the meta device: when it defines
    ``initial_value``, so that each rank can be given only its own share."""
    return callable(getattr(module, "initial_value", None))
