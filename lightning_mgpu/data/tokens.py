"""Data modules over flat token streams (one, or a weighted blend), with sampling owned by the data module.

The sequence of global batches depends only on the seed and the global batch size, never on the
number of ranks or the layout: global batch ``k`` is drawn from ``numpy.random.default_rng([seed, k])``,
and data-parallel rank ``d`` takes the ``d``-th contiguous slice of it (:mod:`lightning_mgpu.data.blend`).
Because of that, Lightning must not inject a ``DistributedSampler`` (the loaders here are iterable, so it does
not). Tokens are bytes unless a tokenizer is given; then the corpus and text files are prepared with it
(:mod:`lightning_mgpu.data.prepare`) into the cache directory.
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu.data.batching import BatchPlan
from lightning_mgpu.data.blend import Blend, sample_starts
from lightning_mgpu.data.corpus import cache_dir, encode_bytes, stdlib_source_files, stdlib_token_file, \
    write_token_file
from lightning_mgpu.data.manifest import TOKEN_DTYPES, Manifest, open_tokens, tokenizer_match_problems
from lightning_mgpu.problems import format_problems

__all__ = ["StdlibCorpusDataModule", "TextFilesDataModule", "TokenFileDataModule", "sample_starts"]


class _WindowBatches(IterableDataset):
    """Yields this rank's slice ``[per_rank, seq_len + 1]`` of global batches ``first_step, first_step+1, ...``
    of one token stream or a :class:`Blend`."""

    def __init__(self, tokens: Union[np.ndarray, Blend], seq_len: int, seed: int, plan: BatchPlan, dp_rank: int,
                 first_step: Callable[[], int], num_steps: Optional[int], skip: frozenset[int] = frozenset()) -> None:
        self.blend = tokens if isinstance(tokens, Blend) else Blend.of([tokens])
        self.seq_len, self.seed, self.plan = seq_len, seed, plan
        self.dp_rank, self.first_step, self.num_steps, self.skip = dp_rank, first_step, num_steps, skip

    def __iter__(self) -> Iterator[torch.Tensor]:
        drawn = self.first_step()  # read per iterator: each epoch continues where the last one stopped
        step, stop = global_batch_index(drawn, self.skip), None if self.num_steps is None else drawn + self.num_steps
        lo, hi = self.dp_rank * self.plan.per_rank, (self.dp_rank + 1) * self.plan.per_rank
        while stop is None or drawn < stop:
            if step not in self.skip:
                yield torch.from_numpy(self.blend.windows(self.seed, step, self.plan.global_batch_size, self.seq_len,
                                                          lo, hi))
                drawn += 1
            step += 1

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("the training stream is endless; stop it with Trainer(max_steps=...)")
        return self.num_steps


def global_batch_index(drawn: int, skip: frozenset[int]) -> int:
    """The global batch drawn after ``drawn`` others when the batches in ``skip`` are never drawn."""
    index = drawn
    for skipped in sorted(skip):
        if skipped <= index:
            index += 1
    return index


#: A weighted token source: (a directory written by mgpu-prepare or a flat token file, weight).
WeightedSource = tuple[Union[str, Path], float]


class TokenFileDataModule(L.LightningDataModule):
    """Causal-LM windows from pre-tokenised, memory-mapped tokens: a directory written by ``mgpu-prepare`` (its
    manifest gives the dtype and is checked against the token file), a flat ``uint16``/``uint32`` token file, or
    ``sources``, several of them mixed by weight.

    The last ``val_fraction`` of every stream is held out for validation. Each training batch is one
    rank's share of one global batch (``global_batch_size / dp`` samples), split into micro-batches by
    the strategy; ``batch_plan`` says how. With ``tokenizer`` (a path), prepared sources must have been made with
    it.
    """

    def __init__(self, path: Optional[str | Path] = None, seq_len: int = 128, global_batch_size: int = 16,
                 micro_batch_size: int = 4, seed: int = 1234, dtype: str = "uint16", val_fraction: float = 0.01,
                 val_batches: int = 4, sources: Optional[Sequence[WeightedSource]] = None,
                 tokenizer: Optional[str | Path] = None, skip_batches: Sequence[int] = ()) -> None:
        super().__init__()
        problems = []
        if dtype not in TOKEN_DTYPES:
            problems.append(f"data.dtype={dtype!r} is not a token dtype; choose 'uint16' or 'uint32'")
        if not (0.0 < val_fraction < 1.0):
            problems.append(f"data.val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
        if seq_len < 1:
            problems.append(f"data.seq_len={seq_len} must be positive")
        if path is not None and sources:
            problems.append("give data.path (one source) or data.sources (a blend), not both")
        if any(not isinstance(b, int) or b < 0 for b in skip_batches):
            problems.append(f"data.skip_batches={list(skip_batches)} must hold global batch numbers >= 0 (counted from "
                            "0, as the steps that would draw them)")
        if problems:
            raise ValueError(format_problems("Invalid data settings", problems))
        self.path = Path(path) if path is not None else None
        self.sources = [(Path(p), float(w)) for p, w in sources] if sources else None
        self.tokenizer = Path(tokenizer) if tokenizer is not None else None
        self.seq_len, self.seed, self.dtype = seq_len, seed, dtype
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.val_fraction, self.val_batches = val_fraction, val_batches
        self.skip_batches = frozenset(skip_batches)
        self.batch_plan: Optional[BatchPlan] = None
        self._dp_rank = 0
        self._start_step = 0
        self._train: Optional[Blend] = None
        self._val: Optional[Blend] = None

    # ------------------------------------------------------------------------------------ loading
    def token_file(self) -> Path:
        """The token file (or prepared directory) to read; subclasses build theirs here."""
        if self.path is None:
            raise ValueError("no token source: give data.path (a directory written by mgpu-prepare or a token file) "
                             "or data.sources")
        if not self.path.exists():
            raise FileNotFoundError(f"data.path={str(self.path)!r} does not exist; give a directory written by "
                                    "mgpu-prepare or an existing token file")
        return self.path

    def weighted_sources(self) -> list[WeightedSource]:
        """Every source with its weight: ``sources``, or the one token file with weight 1."""
        return list(self.sources) if self.sources else [(self.token_file(), 1.0)]

    def prepare_data(self) -> None:
        self.weighted_sources()

    def setup(self, stage: str) -> None:
        dp_rank, dp_size = _data_parallel_coords(self.trainer)
        self.batch_plan = BatchPlan(self.global_batch_size, self.micro_batch_size, dp_size, self.seq_len)
        self._dp_rank = dp_rank
        sources = self.weighted_sources()
        opened = [open_tokens(path, self.dtype) for path, _ in sources]
        prepared: list[tuple[str, Manifest]] = [(str(path), m) for (path, _), (_, m) in zip(sources, opened) if m]
        sha = None
        if self.tokenizer is not None and prepared:
            from lightning_mgpu.data.tokenizer import Tokenizer

            sha = Tokenizer(self.tokenizer).sha256
        problems = tokenizer_match_problems(prepared, sha, f"data.tokenizer={str(self.tokenizer)!r}")
        train, val = [], []
        for (path, _), (tokens, _) in zip(sources, opened):
            split = int(len(tokens) * (1.0 - self.val_fraction))
            for name, part, out in (("training", tokens[:split], train), ("validation", tokens[split:], val)):
                out.append(part)
                if len(part) < self.seq_len + 2:
                    problems.append(f"the {name} split of {path} has {len(part)} tokens, fewer than data.seq_len + 2 "
                                    f"= {self.seq_len + 2}; use more data or a shorter seq_len")
        if problems:
            raise ValueError(format_problems("Invalid data", problems))
        weights, names = [w for _, w in sources], [str(p) for p, _ in sources]
        self._train, self._val = Blend.of(train, weights, names), Blend.of(val, weights, names)

    # -------------------------------------------------------------------------------- dataloaders
    def train_dataloader(self) -> DataLoader:
        ds = _WindowBatches(self._train, self.seq_len, self.seed, self.batch_plan, self._dp_rank, self._next_batch,
                            None, self.skip_batches)
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
        """The data position: the next global batch to draw, and what the batches are drawn with."""
        return {"next_global_batch": self._next_batch(), "seed": self.seed, "global_batch_size": self.global_batch_size,
                "sources": [[str(path), weight] for path, weight in self.sources] if self.sources else
                [[str(self.path), 1.0]] if self.path is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position. Resuming with another seed, global batch or blend is allowed (a new data
        mixture for the rest of a run is a normal choice) but warned about: the batches from here on are not the ones
        the interrupted run would have drawn."""
        self._start_step = int(state["next_global_batch"])
        now = self.state_dict()
        changed = [key for key in ("seed", "global_batch_size", "sources") if key in state and state[key] != now[key]]
        if changed:
            rank_zero_warn(f"resuming at global batch {self._start_step} with other data settings than the checkpoint's "
                           f"({', '.join(f'{k}: {state[k]} -> {now[k]}' for k in changed)}): the batches from here on "
                           "differ from those the interrupted run would have drawn")


class StdlibCorpusDataModule(TokenFileDataModule):
    """The built-in corpus (the Python standard library's source): needs no download. Byte tokens; with
    ``tokenizer``, each source file is a document tokenised once into the cache directory."""

    def __init__(self, seq_len: int = 128, global_batch_size: int = 16, micro_batch_size: int = 4, seed: int = 1234,
                 val_fraction: float = 0.01, val_batches: int = 4, cache: Optional[str] = None,
                 tokenizer: Optional[str | Path] = None, skip_batches: Sequence[int] = ()) -> None:
        super().__init__(None, seq_len, global_batch_size, micro_batch_size, seed, "uint16", val_fraction, val_batches,
                         tokenizer=tokenizer, skip_batches=skip_batches)
        self.cache = Path(cache) if cache else None

    def token_file(self) -> Path:
        if self.tokenizer is None:
            return stdlib_token_file(self.cache)
        import platform

        return _prepared(stdlib_source_files(), self.tokenizer, self.cache or cache_dir(),
                         f"stdlib-py{platform.python_version()}", "text")


class TextFilesDataModule(TokenFileDataModule):
    """The user's text or JSONL files (glob patterns), tokenised once into the cache directory: as bytes, or with
    ``tokenizer`` (as ``mgpu-prepare`` does, one process).

    JSONL lines contribute the string under ``text_key``; other files contribute their whole text.
    """

    def __init__(self, files: list[str] | str, seq_len: int = 128, global_batch_size: int = 16,
                 micro_batch_size: int = 4, seed: int = 1234, val_fraction: float = 0.01, val_batches: int = 4,
                 text_key: str = "text", cache: Optional[str] = None, tokenizer: Optional[str | Path] = None,
                 skip_batches: Sequence[int] = ()) -> None:
        super().__init__(None, seq_len, global_batch_size, micro_batch_size, seed, "uint16", val_fraction, val_batches,
                         tokenizer=tokenizer, skip_batches=skip_batches)
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
        if self.tokenizer is not None:
            return _prepared(files, self.tokenizer, self.cache, "text", self.text_key)
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


def _prepared(files: Sequence[Path], tokenizer: Path, cache: Path, name: str, text_key: str) -> Path:
    """A prepared directory of ``files`` tokenised with ``tokenizer`` in ``cache``, made on first use (in this
    process; every rank that finds it missing makes the same one, replaced atomically)."""
    from lightning_mgpu.data.prepare import prepare
    from lightning_mgpu.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer)
    key = hashlib.sha256(json.dumps([tok.sha256, text_key] + [(str(f.resolve()), f.stat().st_size,
                                                                 f.stat().st_mtime_ns) for f in files]).encode())
    out = cache / f"{name}-{key.hexdigest()[:16]}"
    prepare(list(files), tok.path, out, text_key=text_key, workers=1, progress=False)
    return out


def _data_parallel_coords(trainer: Optional[L.Trainer]) -> tuple[int, int]:
    """(rank, size) of this process along the data-parallel axis.

    MGPUStrategy knows its layout; any other strategy is treated as pure data parallelism.
    """
    if trainer is None:
        return 0, 1
    layout = getattr(trainer.strategy, "layout", None)
    if layout is not None:
        return layout.rank("data"), layout.size("data")  # every replica's data-parallel ranks read their own
    return trainer.global_rank, trainer.world_size
