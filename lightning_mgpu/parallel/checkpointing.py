"""Activation checkpointing of a model's blocks, applied by the parallelisation step (:func:`parallelize`) after the
stage split, or by the module itself when it is not trained under MGPUStrategy. The model file only names the mode
(``LlamaConfig.activation_checkpointing``); this is where it takes effect.

Each block's ``forward`` is replaced, on the instance, by one that runs the original under
``torch.utils.checkpoint.checkpoint`` (non-reentrant) while training with gradients on. Parameter and module names do
not change (a wrapper module would add a level to every name, and with it to checkpoints, plans and Hugging Face
names).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

#: What selective checkpointing keeps: the outputs of the projections (``nn.Linear`` runs as ``mm``/``addmm``), the
#: expensive part of a block. Everything else is recomputed in backward: attention (``bmm`` is left out, so a math
#: attention kernel does not keep its ``s x s`` scores), the norms, the element-wise ops, and the tensor-parallel
#: collectives between them (as often as under full recomputation).
_KEPT_BY_SELECTIVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

#: The attribute a checkpointed block carries: its mode.
MARK = "activation_checkpointing"


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpoint_blocks(blocks: Iterable[nn.Module], mode: str) -> int:
    """Make every block of ``blocks`` recompute in backward: all of its forward (``"full"``: only its input is kept),
    or all but its projections (``"selective"``); ``"none"`` changes nothing. A block already checkpointed is left as
    it is. Returns the number of blocks changed."""
    if mode == "none":
        return 0
    context = {"context_fn": _selective_context} if mode == "selective" else {}
    changed = 0
    for block in blocks:
        if getattr(block, MARK, None) is not None:
            continue
        original = block.forward

        def recomputed(*args: Any, _original=original, _block=block, **kwargs: Any) -> Any:
            if _block.training and torch.is_grad_enabled():
                return checkpoint(_original, *args, use_reentrant=False, **context, **kwargs)
            return _original(*args, **kwargs)

        block.forward = recomputed
        setattr(block, MARK, mode)
        changed += 1
    return changed
