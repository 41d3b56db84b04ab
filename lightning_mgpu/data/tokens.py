"""Data modules over a flat token stream, with sampling owned by the data module.

The sequence of global batches depends only on the seed and the global batch size, never on the
number of ranks or the layout: global batch ``k`` is drawn from ``numpy.random.default_rng([seed, k])``,
and data-parallel rank ``d`` takes the ``d``-th contiguous slice of it. Because of that, Lightning must
not inject a ``DistributedSampler`` (the loaders here are iterable, so it does not).
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu.data.batching import BatchPlan
from lightning_mgpu.data.corpus import cache_dir, encode_bytes, stdlib_token_file, write_token_file

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def sample_starts(seed: int, step: int, global_batch_size: int, n_tokens: int, seq_len: int) -> np.ndarray:
    """Start offsets of the ``global_batch_size`` windows of global batch ``step`` (layout independent)."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=global_batch_size)


class _WindowBatches(IterableDataset):
    """Yields this rank's slice ``[per_rank, seq_len + 1]`` of global batches ``first_step, first_step+1, ...``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, plan: BatchPlan, dp_rank: int,
                 first_step: Callable[[], int], num_steps: Optional[int]) -> None:
        self.tokens, self.seq_len, self.seed, self.plan = tokens, seq_len, seed, plan
        self.dp_rank, self.first_step, self.num_steps = dp_rank, first_step, num_steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        first = step = self.first_step()  # read per iterator: each epoch continues where the last one stopped
        lo, hi = self.dp_rank * self.plan.per_rank, (self.dp_rank + 1) * self.plan.per_rank
        while self.num_steps is None or step < first + self.num_steps:
            starts = sample_starts(self.seed, step, self.plan.global_batch_size, len(self.tokens), self.seq_len)
            windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts[lo:hi]]).astype(np.int64)
            yield torch.from_numpy(windows)
            step += 1

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("the training stream is endless; stop it with Trainer(max_steps=...)")
        return self.num_steps


class TokenFileDataModule(L.LightningDataModule):
    """Causal-LM windows from a pre-tokenised, memory-mapped token file (flat ``uint16`` or ``uint32``).

    The last ``val_fraction`` of the stream is held out for validation. Each training batch is one
    rank's share of one global batch (``global_batch_size / dp`` samples), split into micro-batches by
    the strategy; ``batch_plan`` says how.
    """

    def __init__(self, path: str | Path, seq_len: int = 128, global_batch_size: int = 16, micro_batch_size: int = 4,
                 seed: int = 1234, dtype: str = "uint16", val_fraction: float = 0.01, val_batches: int = 4) -> None:
        super().__init__()
        problems = []
        if dtype not in TOKEN_DTYPES:
            problems.append(f"data.dtype={dtype!r} is not a token dtype; choose 'uint16' or 'uint32'")
        if not (0.0 < val_fraction < 1.0):
            problems.append(f"data.val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
        if seq_len < 1:
            problems.append(f"data.seq_len={seq_len} must be positive")
        if problems:
            raise ValueError("Invalid data settings:\n" + "\n".join(f"  - {p}" for p in problems))
        self.path = Path(path) if path is not None else None
        self.seq_len, self.seed, self.dtype = seq_len, seed, dtype
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.val_fraction, self.val_batches = val_fraction, val_batches
        self.batch_plan: Optional[BatchPlan] = None
        self._dp_rank = 0
        self._start_step = 0
        self._train: Optional[np.ndarray] = None
        self._val: Optional[np.ndarray] = None

    # ------------------------------------------------------------------------------------ loading
    def token_file(self) -> Path:
        """The token file to read; subclasses build theirs here."""
        if not self.path.exists():
            raise FileNotFoundError(f"data.path={str(self.path)!r} does not exist; give an existing token file")
        return self.path

    def prepare_data(self) -> None:
        self.token_file()

    def setup(self, stage: str) -> None:
        dp_rank, dp_size = _data_parallel_coords(self.trainer)
        self.batch_plan = BatchPlan(self.global_batch_size, self.micro_batch_size, dp_size, self.seq_len)
        self._dp_rank = dp_rank
        tokens = np.memmap(self.token_file(), dtype=TOKEN_DTYPES[self.dtype], mode="r")
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self._train, self._val = tokens[:split], tokens[split:]
        for name, part in (("training", self._train), ("validation", self._val)):
            if len(part) < self.seq_len + 2:
                raise ValueError(f"the {name} split of {self.token_file()} has {len(part)} tokens, fewer than "
                                 f"data.seq_len + 2 = {self.seq_len + 2}; use more data or a shorter seq_len")

    # -------------------------------------------------------------------------------- dataloaders
    def train_dataloader(self) -> DataLoader:
        ds = _WindowBatches(self._train, self.seq_len, self.seed, self.batch_plan, self._dp_rank, self._next_batch,
                            None)
        return DataLoader(ds, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        ds = _WindowBatches(self._val, self.seq_len, self.seed + 1, self.batch_plan, self._dp_rank, lambda: 0,
                            self.val_batches)
        return DataLoader(ds, batch_size=None)

    # ------------------------------------------------------------------------- resumable position
    def _next_batch(self) -> int:
        """The next global batch to draw: the training batches the fit loop has taken so far (one per optimizer step,
        or ``accumulate_grad_batches`` per step), or the resumed position before any is taken. The loop's own
        count, because the loader is read one batch ahead of training and restarted every epoch."""
        if self.trainer is None:
            return self._start_step
        return max(self._start_step, self.trainer.fit_loop.epoch_loop.batch_progress.total.ready)

    def state_dict(self) -> dict:
        """The data position: the next global batch to draw."""
        return {"next_global_batch": self._next_batch(), "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        self._start_step = int(state["next_global_batch"])


class StdlibCorpusDataModule(TokenFileDataModule):
    """The built-in corpus (the Python standard library's source as bytes): needs no download."""

    def __init__(self, seq_len: int = 128, global_batch_size: int = 16, micro_batch_size: int = 4, seed: int = 1234,
                 val_fraction: float = 0.01, val_batches: int = 4, cache: Optional[str] = None) -> None:
        super().__init__(None, seq_len, global_batch_size, micro_batch_size, seed, "uint16", val_fraction, val_batches)
        self.cache = Path(cache) if cache else None

    def token_file(self) -> Path:
        return stdlib_token_file(self.cache)


class TextFilesDataModule(TokenFileDataModule):
    """The user's text or JSONL files (glob patterns), byte-tokenised once into a cached token file.

    JSONL lines contribute the string under ``text_key``; other files contribute their whole text.
    """

    def __init__(self, files: list[str] | str, seq_len: int = 128, global_batch_size: int = 16,
                 micro_batch_size: int = 4, seed: int = 1234, val_fraction: float = 0.01, val_batches: int = 4,
                 text_key: str = "text", cache: Optional[str] = None) -> None:
        super().__init__(None, seq_len, global_batch_size, micro_batch_size, seed, "uint16", val_fraction, val_batches)
        self.patterns = [files] if isinstance(files, str) else list(files)
        self.text_key = text_key
        self.cache = Path(cache) if cache else cache_dir()

    def _files(self) -> list[Path]:
        found = sorted({Path(p) for pat in self.patterns for p in glob.glob(pat, recursive=True) if Path(p).is_file()})
        if not found:
            raise FileNotFoundError(f"data.files={self.patterns!r} matched no files; check the glob patterns")
        return found

    def token_file(self) -> Path:
        files = self._files()
        key = hashlib.sha256(json.dumps([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                                         for f in files] + [self.text_key]).encode()).hexdigest()[:16]
        path = self.cache / f"text-{key}.u16"
        if not path.exists():
            write_token_file(path, (encode_bytes(t) for f in files for t in self._texts(f)))
        return path

    def _texts(self, path: Path) -> Iterator[bytes]:
        if path.suffix == ".jsonl":
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    record = json.loads(line)
                    if self.text_key not in record:
                        raise KeyError(f"{path}:{i + 1} has no {self.text_key!r} field; set data.text_key")
                    yield (record[self.text_key] + "\n").encode("utf-8")
        else:
            yield path.read_bytes() + b"\n"


def _data_parallel_coords(trainer: Optional[L.Trainer]) -> tuple[int, int]:
    """(rank, size) of this process along the data-parallel axis.

    MGPUStrategy knows its layout; any other strategy is treated as pure data parallelism.
    """
    if trainer is None:
        return 0, 1
    layout = getattr(trainer.strategy, "layout", None)
    if layout is not None:
        return layout.rank("dp"), layout.size("dp")
    return trainer.global_rank, trainer.world_size
