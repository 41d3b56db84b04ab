"""Context parallelism for a ``transformers`` causal LM, through its own attention interface.

Each context rank keeps two of ``2C`` chunks of every sequence (:mod:`lightning_mgpu.parallel.context`). Two things
are plugged into the model, and its code is not changed:

* a forward pre-hook on the causal LM cuts ``input_ids`` to this rank's chunks and passes their ``position_ids`` in
  the whole sequence (so the model's rotary embeddings are right) and ``shift_labels`` (the labels shifted over the
  *whole* sequence, then cut: shifting a chunk would lose the target of its last token);
* the attention function, registered in ``transformers.AttentionInterface`` and selected by the model's
  ``_attn_implementation``, gathers keys and values over the context group and attends causally chunk by chunk; the
  mask function registered under the same name builds no mask (the chunks' causal structure is the kernel's).

Each rank's loss is its summed loss over the whole sequence's count of targets divided by ``C``, so that the
strategy's average over the context ranks is the mean over the sequence.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.parallel.context import ContextParallelAttention, chunk_positions, shard_sequence

#: The name the attention and mask functions are registered under in ``transformers``.
ATTENTION_NAME = "mgpu_context_parallel"
IGNORE_INDEX = -100


def _attention(kernel: ContextParallelAttention):
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if attention_mask is not None or dropout:
            raise ValueError("context parallelism takes no attention mask and no attention dropout: pack sequences "
                             "without padding and set attention_dropout=0")
        return kernel.attend_local(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None

    return attention


def _cut_inputs(group_rank: int, size: int):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("under context parallelism call the model with input_ids= (and labels=): each rank cuts "
                             "its chunks of the sequence and their positions itself")
        _refuse_what_does_not_split(ids, kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None))
        positions = chunk_positions(ids.shape[1], group_rank, size, device=ids.device)
        kwargs["input_ids"] = ids.index_select(1, positions)
        kwargs["position_ids"] = positions.unsqueeze(0).expand(ids.shape[0], -1)
        labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is not None or shifted is not None:
            if shifted is None:
                shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
            kwargs["shift_labels"] = shard_sequence(shifted, group_rank, size)
            kwargs["labels"] = kwargs["shift_labels"]
            # The strategy averages the context ranks' losses with equal weights; the sequence's last token has no
            # target, so the ranks count different numbers of them: each divides its sum by the whole count / C.
            kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum() / size
        return args, kwargs

    return pre_hook


def _refuse_what_does_not_split(ids: torch.Tensor, mask: Optional[torch.Tensor],
                                positions: Optional[torch.Tensor]) -> None:
    """A collator's ``attention_mask`` of ones and ``position_ids`` of ``0 ... seq - 1`` say what the chunks' causal
    attention does already; a padding mask with holes, or positions that restart (packed documents), cannot be cut
    into chunks: a ``ValueError`` naming each key given so."""
    problems = []
    if mask is not None and not bool((mask != 0).all()):
        problems.append(f"attention_mask has {int((mask == 0).sum())} padding position(s) (zeros): a padding mask "
                        "with holes cannot be split over context ranks; pack sequences without padding (every "
                        "attention_mask value 1, or no attention_mask)")
    if positions is not None:
        whole = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        if positions.shape[-1] != ids.shape[1] or not torch.equal(positions.expand_as(ids), whole):
            problems.append("position_ids are not 0 ... seq - 1 in every row (packed documents): their boundaries do "
                            "not follow the sequence split under context parallelism; give no position_ids, or use "
                            "context_parallel_size=1")
    if problems:
        raise ValueError("Cannot split this batch over context-parallel ranks: " + "; ".join(problems))


def apply_context_parallel(found: HFModel, group: Any, rank: int, size: int) -> int:
    """Wire the model's attention and inputs for ``size`` context ranks; the number of attention layers that now
    attend over the whole sequence."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention(ContextParallelAttention(group, rank, size)))
    AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)
    found.model.set_attn_implementation(ATTENTION_NAME)
    found.model.register_forward_pre_hook(_cut_inputs(rank, size), with_kwargs=True)
    return len(found.base.layers)  # one attention per decoder layer
