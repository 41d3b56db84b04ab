"""Supervised fine-tuning batches from a directory written by ``mgpu-prepare --chat``: whole conversations packed into
sequences (:mod:`lightning_mgpu.data.packing`), labels only on answer tokens.

Each sample is ``(tokens, labels)``, both ``[seq_len + 1]``: ``labels`` holds the token where the prepared mask marks
an answer and ``-100`` (ignored) elsewhere, padding included. ``LLMModule`` reads the pair (its ``token_batch``),
predicts ``labels[1:]`` from ``tokens[:-1]``, keeps attention within each conversation and restarts positions at
each one (the model's ``eod_token_id``: the manifest's end-of-document id), and divides the summed loss by the
global batch's answer-token count, reduced once a step: every layout and micro-batch split gives one process's loss.

The last ``val_fraction`` of the conversations (at least one) is held out and packed alike for validation. Global
batch ``k`` takes the packed sequences ``k * global_batch_size ...`` of a permutation drawn per pass over them from the
seed (never from the layout); data-parallel rank ``d`` takes the ``d``-th contiguous slice of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu.data.batching import BatchPlan
from lightning_mgpu.data.manifest import TOKEN_DTYPES, Manifest, read_manifest
from lightning_mgpu.data.packing import ALGORITHM, Packing, best_fit_decreasing, lay_out
from lightning_mgpu.data.tokens import _data_parallel_coords, global_batch_index

#: The label of a token no loss counts.
IGNORE_INDEX = -100


class PackedConversations:
    """One split's conversations packed into sequences of ``seq_len + 1`` tokens."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray, documents: range, seq_len: int,
                 pad_id: int) -> None:
        self.tokens, self.mask, self.pad_id = tokens, mask, pad_id
        self.starts = starts[documents.start:documents.stop + 1]
        self.packing: Packing = best_fit_decreasing(np.diff(self.starts).tolist(), seq_len + 1)
        self._order: tuple = (None, None)

    def __len__(self) -> int:
        return len(self.packing.sequences)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        ids, answer = lay_out(self.packing, self.tokens, self.mask, self.starts, self.pad_id, index)
        return ids, np.where(answer, ids, IGNORE_INDEX)

    def batch(self, seed: int, step: int, size: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``lo:hi`` of global batch ``step`` of ``size`` sequences."""
        n, picked = len(self), []
        for j in range(step * size + lo, step * size + hi):
            if self._order[0] != (seed, j // n):  # one permutation per pass over the sequences
                self._order = ((seed, j // n), np.random.default_rng([seed, j // n]).permutation(n))
            picked.append(self.sample(int(self._order[1][j % n])))
        return (torch.from_numpy(np.stack([p[0] for p in picked])),
                torch.from_numpy(np.stack([p[1] for p in picked])))

    def answer_tokens(self) -> int:
        return int(self.mask[int(self.starts[0]):int(self.starts[-1])].sum())


class _Batches(IterableDataset):
    def __init__(self, packed: PackedConversations, seed: int, plan: BatchPlan, dp_rank: int,
                 first_step: Callable[[], int], num_steps: Optional[int], skip: frozenset[int] = frozenset()) -> None:
        self.packed, self.seed, self.plan, self.dp_rank = packed, seed, plan, dp_rank
        self.first_step, self.num_steps, self.skip = first_step, num_steps, skip

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        drawn = self.first_step()
        step, stop = global_batch_index(drawn, self.skip), None if self.num_steps is None else drawn + self.num_steps
        lo, hi = self.dp_rank * self.plan.per_rank, (self.dp_rank + 1) * self.plan.per_rank
        while stop is None or drawn < stop:
            if step not in self.skip:
                yield self.packed.batch(self.seed, step, self.plan.global_batch_size, lo, hi)
                drawn += 1
            step += 1


class SFTDataModule(L.LightningDataModule):
    """Packed conversations with answer-only labels from ``path`` (written by ``mgpu-prepare --chat``)."""

    def __init__(self, path: str | Path, seq_len: int = 128, global_batch_size: int = 16, micro_batch_size: int = 4,
                 seed: int = 1234, val_fraction: float = 0.01, val_batches: int = 4,
                 tokenizer: Optional[str | Path] = None, skip_batches: Sequence[int] = ()) -> None:
        super().__init__()
        self.path, self.seq_len, self.seed = Path(path), seq_len, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.val_fraction, self.val_batches, self.tokenizer = val_fraction, val_batches, tokenizer
        self.skip_batches = frozenset(skip_batches)
        self.batch_plan: Optional[BatchPlan] = None
        self.manifest: Optional[Manifest] = None
        self._dp_rank, self._start_step = 0, 0
        self._train: Optional[PackedConversations] = None
        self._val: Optional[PackedConversations] = None

    def setup(self, stage: str) -> None:
        dp_rank, dp_size = _data_parallel_coords(self.trainer)
        self.batch_plan = BatchPlan(self.global_batch_size, self.micro_batch_size, dp_size, self.seq_len)
        self._dp_rank = dp_rank
        self._train, self._val = self.splits()
        rank_zero_info(self.describe())

    def splits(self) -> tuple[PackedConversations, PackedConversations]:
        """(training, validation) conversations, packed; an error naming the fix when the directory has none."""
        manifest = self.manifest = read_manifest(self.path)
        if not manifest.chat:
            raise ValueError(f"data.path={str(self.path)!r} holds plain tokens (no answer mask); prepare "
                             "conversations with mgpu-prepare --chat --tokenizer DIR --out OUT FILES")
        chat = manifest.chat
        tokens = np.memmap(self.path / manifest.tokens_file, dtype=TOKEN_DTYPES[manifest.dtype], mode="r")
        mask = np.memmap(self.path / chat["mask_file"], dtype=np.uint8, mode="r")
        starts = np.fromfile(self.path / chat["documents_file"], dtype=np.uint64)
        n = len(starts) - 1
        held = max(1, int(round(n * self.val_fraction)))
        if n - held < 1:
            raise ValueError(f"data.path={str(self.path)!r} has {n} conversation(s): too few to hold "
                             f"data.val_fraction={self.val_fraction} out and train on the rest; prepare more")
        return tuple(PackedConversations(tokens, mask, starts, part, self.seq_len, manifest.eod_id)
                     for part in (range(0, n - held), range(n - held, n)))

    def describe(self) -> str:
        """The packing line printed at the start of training."""
        p = self._train.packing
        return (f"packed {sum(map(len, p.sequences)):,} conversations into {len(p.sequences):,} sequences of "
                f"{p.capacity} tokens ({ALGORITHM}): {p.efficiency:.1%} of the tokens are conversations', "
                f"{self._train.answer_tokens() / max(1, p.capacity * len(p.sequences)):.1%} answers")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self._train, self.seed, self.batch_plan, self._dp_rank, self._next_batch, None,
                                   self.skip_batches), batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self._val, self.seed + 1, self.batch_plan, self._dp_rank, lambda: 0,
                                   self.val_batches), batch_size=None)

    def _next_batch(self) -> int:
        if self.trainer is None:
            return self._start_step
        return max(self._start_step, self.trainer.fit_loop.epoch_loop.batch_progress.total.ready)

    def state_dict(self) -> dict:
        return {"next_global_batch": self._next_batch(), "seed": self.seed, "global_batch_size": self.global_batch_size,
                "sources": [[str(self.path), 1.0]]}

    def load_state_dict(self, state: dict) -> None:
        self._start_step = int(state["next_global_batch"])


def held_out_prompt(path: str | Path, val_fraction: float) -> np.ndarray:
    """The first held-out conversation's tokens before its first answer token: its system and user turns and the
    assistant's header as the chat template rendered them at preparation, the prompt of the sample printed after an
    SFT run (its answer is the model's)."""
    manifest = read_manifest(Path(path))
    chat = manifest.chat or {}
    starts = np.fromfile(Path(path) / chat["documents_file"], dtype=np.uint64)
    n = len(starts) - 1
    first = n - max(1, int(round(n * val_fraction)))  # as SFTDataModule.splits holds them out
    lo, hi = int(starts[first]), int(starts[first + 1])
    tokens = np.memmap(Path(path) / manifest.tokens_file, dtype=TOKEN_DTYPES[manifest.dtype], mode="r")[lo:hi]
    mask = np.memmap(Path(path) / chat["mask_file"], dtype=np.uint8, mode="r")[lo:hi]
    answer = np.flatnonzero(mask)
    return np.asarray(tokens[:int(answer[0]) if len(answer) else len(tokens)], dtype=np.int64)


__all__ = ["IGNORE_INDEX", "PackedConversations", "SFTDataModule", "held_out_prompt"]
