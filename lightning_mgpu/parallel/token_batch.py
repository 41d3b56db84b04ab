"""A batch as the user's loader yields it, read for what pipeline stages and context shards carry: token ids, labels,
and -- where the model takes them -- a collator's ``attention_mask`` and ``position_ids``.

The first stage takes the token ids and the last the targets; a ``[batch, seq]`` padding mask and positions travel
with the hidden states to the stages between (a ``transformers`` model's stages take them; ``LLMModule`` reads its
documents from the tokens and takes neither). A ``TensorDataset`` yields ``[ids]`` or ``[ids, labels]``, a collator a
mapping, a token-window loader the bare tensor: each is read the same way by ``LLMModule`` and by the hooks of a
``transformers`` model, so that a loader's container never changes what trains. Anything else is refused with every
problem at once, naming what the stages take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

#: The keys a batch given as a mapping may hold where only token ids and labels travel.
BATCH_KEYS = ("input_ids", "labels")
#: ... and where the model's stages also take a collator's padding mask and positions.
MODEL_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
#: What a batch may be, for the refusal.
ACCEPTED = ("a tensor of token ids [batch, seq]; a list or tuple (token ids[, labels]) as a TensorDataset yields; or "
            "a mapping with input_ids and optionally {keys}, each of the ids' shape")
FIX = ("yield only those (pack sequences without padding, so that no mask is needed), or use "
       "pipeline_parallel_size=1 with a training_step of your own")


@dataclass(frozen=True)
class TokenBatch:
    """A batch's parts, each ``[batch, seq]`` or None."""

    ids: torch.Tensor
    labels: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None


def token_batch(batch: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(token ids, labels or None) of ``batch``; a ``ValueError`` naming every problem otherwise."""
    read = read_batch(batch, BATCH_KEYS)
    return read.ids, read.labels


def read_batch(batch: Any, keys: tuple[str, ...] = MODEL_KEYS) -> TokenBatch:
    """The parts of ``batch`` that a mapping may hold under ``keys``; a ``ValueError`` naming every problem otherwise
    (a key outside ``keys``, a part that is not ``[batch, seq]`` like the ids, a padding mask of other values than 0
    and 1)."""
    parts, problems = _parts(batch, keys)
    ids = parts.get("input_ids")
    kinds = [f"the {_NAMES.get(key, key)} are {_described(value)}, not a 2-D tensor [batch, seq]"
             for key, value in parts.items()
             if value is not None and not (isinstance(value, torch.Tensor) and value.dim() == 2)]
    problems += kinds
    if ids is not None and not kinds:
        problems += _shape_problems(parts)
    if problems:
        listed = "; ".join(problems)
        accepted = ACCEPTED.format(keys=", ".join(k for k in keys if k != "input_ids"))
        raise ValueError(f"the model takes {accepted}; got {_described(batch)}: {listed}. Fix: {FIX}")
    return TokenBatch(ids, parts.get("labels"), parts.get("attention_mask"), parts.get("position_ids"))


_NAMES = {"input_ids": "token ids", "labels": "labels", "attention_mask": "attention_mask values",
          "position_ids": "position_ids"}


def _shape_problems(parts: dict[str, Any]) -> list[str]:
    ids, problems = parts["input_ids"], []
    for key, value in parts.items():
        if key != "input_ids" and value is not None and value.shape != ids.shape:
            what = "labels have" if key == "labels" else f"{key} has"
            fix = ": give one label per token (-100 where none counts)" if key == "labels" else ""
            problems.append(f"the {what} shape {list(value.shape)}, the token ids {list(ids.shape)}{fix}")
    mask = parts.get("attention_mask")
    if mask is not None and mask.shape == ids.shape and not bool(((mask == 0) | (mask == 1)).all()):
        problems.append("attention_mask holds values other than 0 and 1: give a padding mask (1 for a token, 0 for "
                        "padding), or documents as position_ids restarting at 0")
    return problems


def _parts(batch: Any, keys: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """(parts by key, problems) by the container's kind, before the parts themselves are checked."""
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}, []
    if isinstance(batch, (list, tuple)):
        if not 1 <= len(batch) <= 2:
            return {}, [f"{len(batch)} elements where the stages take 1 (token ids) or 2 (and labels)"]
        return {"input_ids": batch[0], "labels": batch[1] if len(batch) == 2 else None}, []
    if isinstance(batch, Mapping):
        extra = sorted(str(key) for key in batch if key not in keys)
        problems = [f"keys {extra} that cannot travel between stages"] if extra else []
        if "input_ids" not in batch:
            problems.append("no input_ids")
        return {key: batch.get(key) for key in keys}, problems
    return {}, [f"a {type(batch).__name__}"]


def _described(value: Any) -> str:
    """A batch or part of one in a few words: tensors by shape, containers by their parts."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_described(v) for v in value)})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {_described(v)}" for key, v in value.items()) + "}"
    return type(value).__name__
