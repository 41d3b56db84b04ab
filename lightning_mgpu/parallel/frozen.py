"""A pipeline rank whose own parameters are all frozen (the first stage of a fine-tune that freezes the embeddings and
the first layers) trains like every other rank: its optimizer has nothing to step, and says so.

The user's ``configure_optimizers`` builds its optimizer from ``self.parameters()`` that require gradients; on such a
rank that list is empty and torch refuses it ("optimizer got an empty parameter list"), and the stage's output needs
no gradient at all, so the pipeline schedule has no backward to run. DeepSpeed, for its part, makes every rank of the
model-parallel group join the global gradient norm's all-reduce at each step. So the rank holds one trainable
element, zero, that its stage adds to its output multiplied by zero: the output is unchanged bit for bit, the
element's gradient is zero on every step, and the rank goes through the same engine, optimizer and collectives as the
others. It is left out of checkpoints and exports (:data:`PLACEHOLDER` is not a parameter of the model).

Written here because neither Lightning nor DeepSpeed has a notion of a rank with nothing to train: DeepSpeed's own
pipeline engine assumes every stage holds trainable parameters.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn

from lightning_mgpu.layout import ParallelLayout

#: The placeholder's name in the stage that holds it and, while the optimizer is built, in the LightningModule.
PLACEHOLDER = "frozen_rank_placeholder"


def trains_nothing(module: nn.Module) -> bool:
    """Whether every parameter ``module`` holds is frozen (``requires_grad=False``)."""
    return not any(p.requires_grad for p in module.parameters())


def hold_placeholder(stages: nn.ModuleDict, device: torch.device) -> nn.Parameter:
    """Give this rank's first stage the placeholder and the hook that adds it, times zero, to the stage's output."""
    stage = next(iter(stages.values()))
    placeholder = nn.Parameter(torch.zeros(1, device=device))
    stage.register_parameter(PLACEHOLDER, placeholder)

    def add_zero(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + getattr(module, PLACEHOLDER).sum() * 0

    stage.register_forward_hook(add_zero)
    return placeholder


def is_placeholder(name: str) -> bool:
    """Whether a parameter name (of the engine's module) is the placeholder's."""
    return name.rpartition(".")[2] == PLACEHOLDER


class ShownToOptimizer:
    """While the user's ``configure_optimizers`` runs: the placeholder among the LightningModule's parameters, so that
    ``self.parameters()`` is not empty; gone from it afterwards (the stage keeps it)."""

    def __init__(self, module: nn.Module, placeholder: Optional[nn.Parameter]) -> None:
        self.module, self.placeholder = module, placeholder

    def __enter__(self) -> None:
        if self.placeholder is not None:
            self.module.register_parameter(PLACEHOLDER, self.placeholder)

    def __exit__(self, *exc: Any) -> None:
        if self.placeholder is not None:
            del self.module._parameters[PLACEHOLDER]



def user_optimizers(module: nn.Module, kept: nn.Module, layout: ParallelLayout, device: torch.device) -> tuple:
    """Lightning's (optimizers, LR scheduler configs) from the user's ``configure_optimizers``, run with a placeholder
    among the module's parameters if this rank holds pipeline stages (``kept``) whose parameters are all frozen."""
    frozen = layout.size("pp") > 1 and trains_nothing(kept)
    with ShownToOptimizer(module, hold_placeholder(kept, device) if frozen else None):
        return _init_optimizers_and_lr_schedulers(module)
