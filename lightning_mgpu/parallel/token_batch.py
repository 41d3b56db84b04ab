"""A batch as the user's loader yields it, read for what pipeline stages carry: token ids, and labels where given.

The first stage takes the token ids and the last the targets; nothing else crosses a stage boundary (a padding mask or
positions would have to travel with the hidden states). A ``TensorDataset`` yields ``[ids]`` or ``[ids, labels]``, a
collator a mapping, a token-window loader the bare tensor: each is read the same way by ``LLMModule`` and by the hooks
of a ``transformers`` model, so that a loader's container never changes what trains. Anything else is refused with
every problem at once, naming what the stages take.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

#: The keys a batch given as a mapping may hold.
BATCH_KEYS = ("input_ids", "labels")
#: What a batch may be, for the refusal.
ACCEPTED = ("a tensor of token ids [batch, seq]; a list or tuple (token ids[, labels]) as a TensorDataset yields; or "
            "a mapping with input_ids and optionally labels, labels of the ids' shape")
FIX = ("yield only those (pack sequences without padding, so that no mask is needed), or use "
       "pipeline_parallel_size=1 with a training_step of your own")


def token_batch(batch: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(token ids, labels or None) of ``batch``; a ``ValueError`` naming every problem otherwise."""
    ids, labels, problems = _parts(batch)
    for name, value in (("token ids", ids), ("labels", labels)):
        if value is not None and not (isinstance(value, torch.Tensor) and value.dim() == 2):
            problems.append(f"the {name} are {_described(value)}, not a 2-D tensor [batch, seq]")
    if not problems and labels is not None and labels.shape != ids.shape:
        problems.append(f"the labels have shape {list(labels.shape)}, the token ids {list(ids.shape)}: give one label "
                        "per token (-100 where none counts)")
    if problems:
        listed = "; ".join(problems)
        raise ValueError(f"the model takes {ACCEPTED}; got {_described(batch)}: {listed}. Fix: {FIX}")
    return ids, labels


def _parts(batch: Any) -> tuple[Any, Any, list[str]]:
    """(ids, labels, problems) by the container's kind, before the parts themselves are checked."""
    if isinstance(batch, torch.Tensor):
        return batch, None, []
    if isinstance(batch, (list, tuple)):
        if not 1 <= len(batch) <= 2:
            return None, None, [f"{len(batch)} elements where the stages take 1 (token ids) or 2 (and labels)"]
        return batch[0], batch[1] if len(batch) == 2 else None, []
    if isinstance(batch, Mapping):
        extra = sorted(str(key) for key in batch if key not in BATCH_KEYS)
        problems = [f"keys {extra} that cannot travel between stages"] if extra else []
        if "input_ids" not in batch:
            problems.append("no input_ids")
        return batch.get("input_ids"), batch.get("labels"), problems
    return None, None, [f"a {type(batch).__name__}"]


def _described(value: Any) -> str:
    """A batch or part of one in a few words: tensors by shape, containers by their parts."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_described(v) for v in value)})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {_described(v)}" for key, v in value.items()) + "}"
    return type(value).__name__
