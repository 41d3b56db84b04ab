"""Sampling windows from one token stream or a weighted blend of several.

Global batch ``k`` is drawn from ``numpy.random.default_rng([seed, k])`` alone: first the source of each of its
samples (by weight), then each sample's start in its source. The draw depends only on the seed, ``k``, the global
batch size and the sources, never on the layout; data-parallel rank ``d`` takes the ``d``-th contiguous slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_mgpu.problems import format_problems


def sample_starts(seed: int, step: int, global_batch_size: int, n_tokens: int, seq_len: int) -> np.ndarray:
    """Start offsets of the ``global_batch_size`` windows of global batch ``step`` in one stream."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=global_batch_size)


def weight_problems(weights: Sequence[float], names: Sequence[str]) -> list[str]:
    """Every weight that is not a finite number > 0."""
    out = []
    for name, w in zip(names, weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            out.append(f"{name}: weight={w!r} must be a number > 0 (weights are relative: 0.7 and 0.3, or 7 and 3)")
    return out


@dataclass(frozen=True)
class Blend:
    """Token streams and their shares of the samples (weights normalised to sum to 1)."""

    parts: tuple[np.ndarray, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, parts: Sequence[np.ndarray], weights: Sequence[float] | None = None,
           names: Sequence[str] | None = None) -> "Blend":
        weights = [1.0] * len(parts) if weights is None else list(weights)
        names = list(names) if names is not None else [f"source {i}" for i in range(len(parts))]
        problems = weight_problems(weights, names)
        if not parts:
            problems.append("no token sources: give data.path or data.sources")
        if len(weights) != len(parts):
            problems.append(f"{len(parts)} sources but {len(weights)} weights")
        if problems:
            raise ValueError(format_problems("Invalid blend", problems))
        total = float(sum(weights))
        return cls(tuple(parts), tuple(w / total for w in weights))

    def draw(self, seed: int, step: int, global_batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, start offset) of every sample of global batch ``step``. One source draws exactly as
        :func:`sample_starts`."""
        if len(self.parts) == 1:
            starts = sample_starts(seed, step, global_batch_size, len(self.parts[0]), seq_len)
            return np.zeros(global_batch_size, dtype=np.int64), starts
        rng = np.random.default_rng([seed, step])
        which = rng.choice(len(self.parts), size=global_batch_size, p=self.weights)
        highs = np.array([len(p) - seq_len - 1 for p in self.parts])
        return which, rng.integers(0, highs[which])

    def windows(self, seed: int, step: int, global_batch_size: int, seq_len: int, lo: int, hi: int) -> np.ndarray:
        """Samples ``lo:hi`` of global batch ``step``: ``[hi - lo, seq_len + 1]`` int64 tokens."""
        which, starts = self.draw(seed, step, global_batch_size, seq_len)
        return np.stack([self.parts[w][s:s + seq_len + 1] for w, s in zip(which[lo:hi], starts[lo:hi])]).astype(
            np.int64)
