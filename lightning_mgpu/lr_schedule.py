"""The learning-rate schedule both training modules share (our ``LLMModule`` and a ``transformers`` model's
``HFCausalLM``): a module of its own so that neither module imports the other."""

from __future__ import annotations

import math


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up from 0 over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
