"""The causal-LM loss of a ``transformers`` model whose head is split over the vocabulary.

``transformers``' ``ForCausalLMLoss`` upcasts the logits, shifts the labels left by one (padding with the ignore index)
and takes ``cross_entropy`` (a mean, or a sum over ``num_items_in_batch``). On a :class:`VocabParallelOutput` head each
rank holds a slice of the vocabulary, so the same steps run on the slices through
:func:`lightning_mgpu.parallel.cross_entropy.cross_entropy` and the full logits are never formed. Installed as the
model's ``loss_function`` (``transformers`` reads it in every causal LM's ``forward`` when ``labels=`` is given), so a
``training_step`` returning ``model(input_ids=x, labels=x).loss`` is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.parallel.cross_entropy import cross_entropy

IGNORE_INDEX = -100


def causal_lm_loss(head: Callable[[], nn.Module]) -> Callable[..., torch.Tensor]:
    """``transformers``' causal-LM loss over the logits of ``head()`` (looked up at each call: the plan replaces the
    head after this is installed)."""

    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                      num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = IGNORE_INDEX,
                      shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        if num_items_in_batch is None:
            return cross_entropy(logits, shift_labels, head=head(), ignore_index=ignore_index)
        total = cross_entropy(logits, shift_labels, head=head(), ignore_index=ignore_index, reduction="sum")
        return total / torch.as_tensor(num_items_in_batch, device=total.device)

    return loss_function
