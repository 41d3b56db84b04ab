"""Context parallelism for a ``transformers`` causal LM, through its own attention interface.

Each context rank keeps two of ``2C`` chunks of every sequence (:mod:`lightning_mgpu.parallel.context`). Two things
are plugged into the model, and its code is not changed:

* a forward pre-hook on the causal LM cuts ``input_ids`` to this rank's chunks and passes their ``position_ids`` in
  the whole sequence (so the model's rotary embeddings are right) and ``shift_labels`` (the labels shifted over the
  *whole* sequence, then cut: shifting a chunk would lose the target of its last token);
* the attention function, registered in ``transformers.AttentionInterface`` and selected by the model's
  ``_attn_implementation``, gathers keys and values over the context group and attends causally chunk by chunk; the
  mask function registered under the same name builds no mask (the chunks' causal structure is the kernel's).

Packed documents (``position_ids`` that restart, as a collator or ``HFCausalLM`` with ``eod_token_id`` gives them
for the whole sequence) follow the split: the pre-hook numbers the documents of the whole sequence by the breaks in its
positions (:func:`~lightning_mgpu.hf.documents.document_numbers`) and cuts the positions to the chunks; the attention
then lets each local query see the gathered keys of its own document up to itself.

Each rank's loss is its summed loss over the whole sequence's count of targets divided by ``C``, so that the
strategy's average over the context ranks is the mean over the sequence.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from lightning_mgpu.hf.documents import document_numbers
from lightning_mgpu.hf.model import HFModel
from lightning_mgpu.parallel.context import ContextParallelAttention, chunk_positions, shard_sequence
from lightning_mgpu.problems import Problem, raise_problems

#: The name the attention and mask functions are registered under in ``transformers``.
ATTENTION_NAME = "mgpu_context_parallel"
IGNORE_INDEX = -100


class _Documents:
    """The documents of the sequence the model runs now, set by the pre-hook for every attention layer: each local
    query's and each (whole-sequence) key's document number and the queries' places in the whole sequence; ``keys``
    is None when the sequence is one document. The mask is built by the first layer and shared by the rest."""

    def __init__(self) -> None:
        self.queries: Optional[torch.Tensor] = None
        self.keys: Optional[torch.Tensor] = None
        self.places: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None

    def set(self, numbers: Optional[torch.Tensor], places: torch.Tensor) -> None:
        self.keys, self.places, self.bias = numbers, places, None
        self.queries = None if numbers is None else numbers.index_select(1, places)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``[batch, 1, s/C, s]`` additive: 0 where a local query may see a key (same document, not after it)."""
        if self.bias is None or self.bias.dtype != dtype:
            index = torch.arange(self.keys.shape[1], device=self.keys.device)
            allowed = (self.queries[:, :, None] == self.keys[:, None, :]) & \
                (index[None, None, :] <= self.places[None, :, None])
            self.bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, float("-inf"))[:, None]
        return self.bias


def _attention(kernel: ContextParallelAttention, documents: _Documents):
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if attention_mask is not None or dropout:
            raise ValueError("context parallelism takes no attention mask and no attention dropout: pack sequences "
                             "without padding and set attention_dropout=0")
        if documents.keys is None:
            return kernel.attend_local(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None
        k_all, v_all = kernel.gather_keys_values(key, value)
        out = F.scaled_dot_product_attention(query, k_all, v_all, attn_mask=documents.mask(query.dtype),
                                             scale=scaling, enable_gqa=k_all.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None

    return attention


def _cut_inputs(group_rank: int, size: int, documents: Optional[_Documents] = None):
    documents = documents if documents is not None else _Documents()

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("under context parallelism call the model with input_ids= (and labels=): each rank cuts "
                             "its chunks of the sequence and their positions itself")
        given = kwargs.pop("position_ids", None)
        _refuse_what_does_not_split(ids, kwargs.pop("attention_mask", None), given)
        places = chunk_positions(ids.shape[1], group_rank, size, device=ids.device)
        whole = None if given is None else given.expand_as(ids)
        packed = whole is not None and not torch.equal(whole, torch.arange(ids.shape[1], device=ids.device)
                                                       .expand_as(ids))
        documents.set(document_numbers(whole) if packed else None, places)
        kwargs["input_ids"] = ids.index_select(1, places)
        kwargs["position_ids"] = whole.index_select(1, places) if packed else places.unsqueeze(0).expand(ids.shape[0],
                                                                                                         -1)
        labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is not None or shifted is not None:
            if shifted is None:
                shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
            kwargs["shift_labels"] = shard_sequence(shifted, group_rank, size)
            kwargs["labels"] = kwargs["shift_labels"]
            # The strategy averages the context ranks' losses with equal weights; the sequence's last token has no
            # target, so the ranks count different numbers of them: each divides its sum by the whole count / C (or
            # by the caller's num_items_in_batch / C: a global batch's count, say).
            items = kwargs.get("num_items_in_batch")
            kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum() / size if items is None else items / size
        return args, kwargs

    return pre_hook


def _refuse_what_does_not_split(ids: torch.Tensor, mask: Optional[torch.Tensor],
                                positions: Optional[torch.Tensor]) -> None:
    """A collator's ``attention_mask`` of ones says what the chunks' causal attention does already, and its
    ``position_ids`` (``[batch or 1, seq]``) give the documents; a padding mask with holes cannot be cut into chunks:
    a ``ValueError`` naming each key given so."""
    problems = []
    if mask is not None and not bool((mask != 0).all()):
        problems.append(f"attention_mask has {int((mask == 0).sum())} padding position(s) (zeros): a padding mask "
                        "with holes cannot be split over context ranks; pack sequences without padding (every "
                        "attention_mask value 1, or no attention_mask)")
    if positions is not None and (positions.dim() != 2 or positions.shape[-1] != ids.shape[1] or
                                  positions.shape[0] not in (1, ids.shape[0])):
        problems.append(f"position_ids have shape {list(positions.shape)}: give one position per token, [batch, "
                        f"seq] or [1, seq] with seq={ids.shape[1]}")
    if problems:
        raise ValueError("Cannot split this batch over context-parallel ranks: " + "; ".join(problems))


def attention_sink_problems(found: HFModel, size: int) -> list[Problem]:
    """gpt-oss's attention adds a learned per-head sink logit to each softmax's denominator (``self_attn.sinks``, handed
    to the attention function as ``s_aux``); the context-parallel kernel's softmax has no such term, so it would
    silently attend as if there were none. Refused (its sliding window is refused with the layout already)."""
    sinks = [name for name, _ in found.base.named_parameters() if name.endswith(".sinks")]
    if size == 1 or not sinks:
        return []
    return [Problem("context_parallel_size", size, f"cannot split {type(found.model).__name__}'s attention, which "
                    f"adds learned sink logits to its softmax ({len(sinks)} layers: {found.base_prefix}{sinks[0]}, "
                    "...): the context-parallel kernel has no sink term and would attend without them",
                    "use context_parallel_size=1 (tensor, pipeline, expert and data parallelism split it)")]


def apply_context_parallel(found: HFModel, group: Any, rank: int, size: int) -> int:
    """Wire the model's attention and inputs for ``size`` context ranks; the number of attention layers that now
    attend over the whole sequence. Refuses first an attention the kernel cannot compute (sinks)."""
    raise_problems("Invalid layout for this model's attention", attention_sink_problems(found, size))
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    documents = _Documents()
    AttentionInterface.register(ATTENTION_NAME, _attention(ContextParallelAttention(group, rank, size), documents))
    AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)
    found.model.set_attn_implementation(ATTENTION_NAME)
    found.model.register_forward_pre_hook(_cut_inputs(rank, size, documents), with_kwargs=True)
    return len(found.base.layers)  # one attention per decoder layer
