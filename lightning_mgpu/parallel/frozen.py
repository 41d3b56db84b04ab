"""A pipeline stage whose own parameters are all frozen (the first stage of a fine-tune that freezes the embeddings and
the first layers) trains like every other: its optimizer may have nothing to step, and says so.

The user's ``configure_optimizers`` builds its optimizer from ``self.parameters()`` that require gradients; on a rank
whose stages are all frozen that list is empty and torch refuses it ("optimizer got an empty parameter list"); a frozen
stage's output needs no gradient at all, so the schedule has no backward to run through it; and DeepSpeed makes every
rank of the model-parallel group join the global gradient norm's all-reduce at each step. So each such stage holds
one trainable element, zero, that it adds to its output multiplied by zero: the output is unchanged bit for bit, the
element's gradient is zero on every step, and the rank goes through the same engine, optimizer and collectives as the
others. Placeholders are left out of checkpoints and exports (:data:`PLACEHOLDER` is not a parameter of the model).

Under expert parallelism a pipeline rank without routed experts (DeepSeek V3's dense first layers alone on a stage)
holds a second placeholder, tagged as a split expert (``expert_partition``): DeepSpeed reduces the gradient norm over
the tensor x pipeline ranks once per expert optimizer group (ZeRO 1-3) and the package's expert-aware norm (ZeRO-0)
runs where expert parameters are, so every pipeline rank needs one for the stages' collectives to meet.

Written here because neither Lightning nor DeepSpeed has a notion of a rank with nothing to train: DeepSpeed's own
pipeline engine assumes every stage holds trainable parameters, and its experts are on every pipeline rank.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn

from lightning_mgpu.layout import ParallelLayout

#: The placeholder's name in the stage that holds it and, while the optimizer is built, in the LightningModule.
PLACEHOLDER = "frozen_rank_placeholder"
#: The expert placeholder's name, on the first stage of a pipeline rank without experts under expert parallelism.
EXPERT_PLACEHOLDER = "expert_rank_placeholder"


def trains_nothing(module: nn.Module) -> bool:
    """Whether every parameter ``module`` holds is frozen (``requires_grad=False``)."""
    return not any(p.requires_grad for p in module.parameters())


def hold_placeholder(stage: nn.Module, device: torch.device, name: str = PLACEHOLDER,
                     requires_grad: bool = True) -> nn.Parameter:
    """Give ``stage`` the placeholder ``name`` and the hook that adds it, times zero, to the stage's output."""
    placeholder = nn.Parameter(torch.zeros(1, device=device), requires_grad=requires_grad)
    stage.register_parameter(name, placeholder)

    def add_zero(module: nn.Module, args: Any, output: Any) -> Any:
        zero = getattr(module, name).sum() * 0
        if isinstance(output, tuple):  # (hidden states, positions[, padding mask]) of packed documents
            return (output[0] + zero, *output[1:])
        return output + zero

    stage.register_forward_hook(add_zero)
    return placeholder


def is_placeholder(name: str) -> bool:
    """Whether a parameter name (of the engine's module) is a placeholder's."""
    return name.rpartition(".")[2] in (PLACEHOLDER, EXPERT_PLACEHOLDER)


def expert_placeholder(kept: nn.ModuleDict, layout: ParallelLayout, device: torch.device) -> list[nn.Parameter]:
    """The expert placeholder of this rank, when its stages (``kept``) hold no expert parameter under expert and
    pipeline parallelism (none otherwise). It trains where the other pipeline ranks' experts train (one small
    all-reduce over the pipeline ranks, on every rank): frozen experts form no expert optimizer group at ZeRO 1-2."""
    if layout.size("ep") == 1 or layout.size("pp") == 1:
        return []
    mine = [p for p in kept.parameters() if getattr(p, "expert_partition", None) is not None]
    trains = torch.tensor([float(any(p.requires_grad for p in mine))], device=device)
    torch.distributed.all_reduce(trains, op=torch.distributed.ReduceOp.MAX, group=layout.group("pp"))
    if mine:
        return []
    first = next(iter(kept.values()))
    placeholder = hold_placeholder(first, device, EXPERT_PLACEHOLDER, bool(trains.item()))
    placeholder.expert_partition = (layout.rank("ep"), layout.size("ep"))  # tagged as a split expert's shard
    return [placeholder] if placeholder.requires_grad else []


class ShownToOptimizer:
    """While the user's ``configure_optimizers`` runs: the placeholders among the LightningModule's parameters, so that
    ``self.parameters()`` holds them; gone from it afterwards (the stages keep them)."""

    def __init__(self, module: nn.Module, placeholders: list[nn.Parameter]) -> None:
        self.module, self.names = module, {f"{PLACEHOLDER}_{i}": p for i, p in enumerate(placeholders)}

    def __enter__(self) -> None:
        for name, placeholder in self.names.items():
            self.module.register_parameter(name, placeholder)

    def __exit__(self, *exc: Any) -> None:
        for name in self.names:
            del self.module._parameters[name]


def user_optimizers(module: nn.Module, kept: nn.Module, layout: ParallelLayout, device: torch.device) -> tuple:
    """Lightning's (optimizers, LR scheduler configs) from the user's ``configure_optimizers``, run with a placeholder
    for each of this rank's pipeline stages (``kept``) whose parameters are all frozen. Per stage, not per rank: under
    a schedule that splits backward into input and weight parts (zero bubble, ZBV, DualPipeV) a frozen stage beside a
    trained one on the same rank would otherwise hand back no input gradient, and the stages before it on other ranks
    would compute none of their weights' gradients (measured: 5.5e-3 in loss, with no error)."""
    stages = list(kept.values()) if layout.size("pp") > 1 else []
    frozen = [hold_placeholder(stage, device) for stage in stages if trains_nothing(stage)]
    with ShownToOptimizer(module, frozen + expert_placeholder(kept, layout, device)):
        return _init_optimizers_and_lr_schedulers(module)
