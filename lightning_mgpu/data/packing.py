"""Whole documents packed into fixed-length sequences: best-fit decreasing.

Documents are taken longest first and each goes into the open sequence with the least room that still holds it (a
new sequence when none does); no document is split. The result depends only on the lengths (ties broken by the
documents' order), so every rank packs the same sequences. Room left at the end of a sequence is filled with the
end-of-document token, each one a document of its own that no loss counts: with the package's document masks it
attends to nothing before it and nothing attends to it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: The packing algorithm, as the manifest, the printed line and the docs name it.
ALGORITHM = "best-fit decreasing"


@dataclass(frozen=True)
class Packing:
    """Sequences of ``capacity`` tokens, each a list of document indices in the order they are laid out."""

    capacity: int
    sequences: list[list[int]]
    used_tokens: int  #: document tokens placed (the rest is padding)

    @property
    def efficiency(self) -> float:
        """Share of the sequences' tokens that are documents' (1.0: no padding)."""
        return self.used_tokens / max(1, self.capacity * len(self.sequences))


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> Packing:
    """Pack documents of ``lengths`` into sequences of ``capacity`` tokens (each length at most ``capacity``)."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"{len(too_long)} document(s) longer than the sequence ({capacity} tokens), e.g. document "
                         f"{too_long[0][0]} of {too_long[0][1]} tokens; prepare with --max-tokens {capacity} or use a "
                         "longer data.seq_len")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sequences: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, sequence index), sorted
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            sequences.append([i])
            left, s = capacity - lengths[i], len(sequences) - 1
        else:
            left, s = room.pop(at)
            sequences[s].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(room, (left, s))
    return Packing(capacity, sequences, int(sum(lengths)))


def lay_out(packing: Packing, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray, pad_id: int,
            sequence: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, answer mask) of one packed sequence, padded with ``pad_id`` (mask 0) to ``capacity``."""
    ids = np.full(packing.capacity, pad_id, dtype=np.int64)
    answer = np.zeros(packing.capacity, dtype=bool)
    at = 0
    for d in packing.sequences[sequence]:
        lo, hi = int(starts[d]), int(starts[d + 1])
        ids[at:at + hi - lo] = tokens[lo:hi]
        answer[at:at + hi - lo] = mask[lo:hi] != 0
        at += hi - lo
    return ids, answer


__all__ = ["ALGORITHM", "Packing", "best_fit_decreasing", "lay_out"]
