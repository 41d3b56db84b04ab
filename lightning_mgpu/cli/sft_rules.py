"""The rules of ``data=sft``: ``data.path`` is a directory written by ``mgpu-prepare --chat`` whose conversations all
fit a packed sequence of ``data.seq_len + 1`` tokens, trained with document masks (attention within a conversation)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from lightning_mgpu.cli.run_data import RunData

_PREPARE = "mgpu-prepare --chat --tokenizer DIR --out OUT --max-tokens {n} FILES"


def sft_problems(cfg: DictConfig, data: RunData) -> list[str]:
    """Every problem of ``data=sft``, each with the value, the rule and the fix."""
    d = cfg.data
    capacity = d.seq_len + 1 if isinstance(d.seq_len, int) else None
    fix = _PREPARE.format(n=capacity or "N")
    if not d.path or d.path == "???":
        return [f"data.path is not set: data=sft reads a directory of conversations written by {fix}"]
    if not data.prepared:
        return [f"data.path={d.path!r} is not a directory written by mgpu-prepare; prepare it with {fix}"]
    source = data.prepared[0]
    if source.manifest is None:
        return [f"data.path: {source.error}"]
    out = []
    if not d.get("document_mask"):
        out.append("data.document_mask=false with data=sft: packed conversations would attend to each other; set "
                   "data.document_mask=true (the default of data=sft)")
    if not source.manifest.chat:
        return out + [f"data.path={d.path!r} holds plain tokens, no answer mask (prepared without --chat); prepare "
                      f"the conversations with {fix}"]
    if capacity is not None:
        out += _length_problems(Path(source.path), source.manifest.chat, capacity, fix)
    return out


def _length_problems(directory: Path, chat: dict, capacity: int, fix: str) -> list[str]:
    """Conversations longer than a packed sequence (they are packed whole, never split)."""
    starts = np.fromfile(directory / chat["documents_file"], dtype=np.uint64)
    lengths = np.diff(starts)
    longest = int(lengths.max()) if len(lengths) else 0
    if longest <= capacity:
        return []
    over = int((lengths > capacity).sum())
    return [f"data.seq_len={capacity - 1}: {over} conversation(s) of {directory} are longer than a packed sequence "
            f"of seq_len + 1 = {capacity} tokens (the longest {longest}); set data.seq_len>={longest - 1}, or prepare "
            f"again with {fix} (--overlong truncate to keep them cut)"]
