"""Text / JSONL files (gzip too), Parquet files and saved ``datasets`` (Arrow) -> a prepared token directory,
tokenised in parallel processes (:mod:`lightning_mgpu.data.encoding`).

Every document (a whole text file, one JSONL line's ``text_key`` field, or one Parquet / Arrow row's ``text_key``
column: :mod:`lightning_mgpu.data.columnar`) is encoded with the tokenizer's own special tokens and followed by the
end-of-document token. Work goes to the processes in units of about :data:`UNIT_BYTES` of text and comes back in
input order, so the token file does not depend on the number of processes. The token file is written under a
temporary name and renamed, then the manifest is written: a directory with a manifest is complete, and running again
on the same inputs only checks it.

Why not litdata (Lightning's own preparation and streaming library): its optimised format stores serialised samples in
chunks that a streaming loader reads in shuffled chunk order. Training here draws each global batch's windows at
random offsets of one flat token stream from the seed and the step alone (never from the layout), which needs random
access to the whole stream; a flat memory-mapped array gives that with no format of its own.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from lightning_mgpu.data.columnar import (
    ColumnarError,
    dataset_files,
    dataset_splits,
    is_columnar,
    is_saved_dataset,
    read_columnar,
    schema_problems,
)
from lightning_mgpu.data.encoding import EncoderSettings, Unit, unit_encoder
from lightning_mgpu.data.manifest import (
    MANIFEST_FILE,
    TOKEN_DTYPES,
    TOKENS_FILE,
    Manifest,
    PreparedDataError,
    Source,
    dtype_for,
    read_manifest,
    sampled_sha256,
)
from lightning_mgpu.data.tokenizer import Tokenizer, TokenizerError, file_sha256

#: Text per unit of work sent to a process: large enough that the transfer costs nothing beside tokenising it.
UNIT_BYTES = 1 << 18
#: Problems listed at most (the rest are counted).
MAX_PROBLEMS = 20
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class PrepareError(ValueError):
    """Bad inputs: every problem, one line each, naming the file (and line)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class PrepareResult:
    manifest: Manifest
    skipped: bool  #: the directory was already up to date: nothing was tokenised
    seconds: float  #: wall time of tokenising and writing
    workers: int
    cpu_seconds: float = 0.0  #: CPU time the processes spent tokenising, all together

    @property
    def mb_per_second_per_process(self) -> float:
        return self.manifest.text_bytes / 1e6 / max(self.seconds, 1e-9) / self.workers

    @property
    def mb_per_cpu_second(self) -> float:
        """Text tokenised per second of one process's CPU time: the figure that does not depend on how many cores
        were free."""
        return self.manifest.text_bytes / 1e6 / max(self.cpu_seconds, 1e-9)


def expand_inputs(patterns: Sequence[str | Path], split: Optional[str] = None) -> list[Path]:
    """Files named by ``patterns`` (paths, or globs given as strings, ``**`` included), in the order given, each
    once; a directory written by ``datasets``' ``save_to_disk`` stands for its Arrow files (of the split ``split``
    for a ``DatasetDict``)."""
    files, problems = _expand(patterns, split)
    if problems:
        raise PrepareError(problems)
    return files


def _expand(patterns: Sequence[str | Path], split: Optional[str]) -> tuple[list[Path], list[str]]:
    """(the files :func:`expand_inputs` finds, what is wrong with the patterns)."""
    files: dict[Path, None] = {}  # insertion-ordered, each once
    problems = []
    dataset_dicts = 0

    def dataset(directory: Path) -> list[Path]:
        nonlocal dataset_dicts
        try:
            dataset_dicts += dataset_splits(directory) is not None
            return dataset_files(directory, split)
        except ColumnarError as err:
            problems.extend(err.problems)
            return []

    for pattern in patterns:
        if isinstance(pattern, Path):  # a path as it is, whatever characters it holds
            if is_saved_dataset(pattern):
                files.update(dict.fromkeys(dataset(pattern)))
                continue
            if not pattern.is_file():
                problems.append(f"input {str(pattern)!r} is not a file")
            files.setdefault(pattern)
            continue
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) if glob.has_magic(pattern) \
            else [os.path.expanduser(pattern)]
        found = []
        for m in map(Path, matches):
            if m.is_file():
                found.append(m)
            elif is_saved_dataset(m):
                found += dataset(m) or [m]  # a bad one is named, not reported as matching nothing (and dropped)
        if not found:
            if len(matches) == 1 and Path(matches[0]).is_dir():
                problems.append(f"input {pattern!r} is a directory, but not a dataset written by save_to_disk (no "
                                f"state.json or dataset_dict.json); give its files or a glob, e.g. "
                                f"'{pattern.rstrip('/')}/**/*.txt' or '{pattern.rstrip('/')}/*.parquet'")
            elif not glob.has_magic(pattern) and not Path(pattern).exists():
                problems.append(f"input {pattern!r} does not exist")
            else:
                problems.append(f"input {pattern!r} matches no file")
        files.update(dict.fromkeys(found))
    if split is not None and not dataset_dicts and not problems:
        problems.append(f"--split {split}: no input is a DatasetDict directory (one with dataset_dict.json); leave "
                        "--split out, or give the directory of the DatasetDict")
    return [f for f in files if f.is_file()], problems


def is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(_JSONL_SUFFIXES)


def describe_sources(files: Sequence[Path]) -> tuple[Source, ...]:
    out = []
    for f in files:
        st = f.stat()
        out.append(Source(str(f.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(out)


# ------------------------------------------------------------------------------------------------ reading units
def read_units(files: Sequence[Path], unit_bytes: Optional[int] = None, text_key: str = "text") -> Iterator[Unit]:
    """Raw documents of ``files`` in order, grouped into units of about ``unit_bytes`` (default
    :data:`UNIT_BYTES`; never across files). The rest of a file that cannot be read is skipped."""
    unit_bytes = unit_bytes or UNIT_BYTES
    for index, path in enumerate(files):
        if is_columnar(path):
            for column, errors in read_columnar(path, text_key, unit_bytes):
                yield index, column if column is not None else [], errors
            continue
        batch: list[tuple[int, bytes]] = []
        size = 0
        line = 0
        try:
            with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
                if is_jsonl(path):
                    for line, raw in enumerate(f, start=1):
                        if raw.strip():
                            batch.append((line, raw))
                            size += len(raw)
                        if size >= unit_bytes:
                            yield index, batch, []
                            batch, size = [], 0
                else:
                    batch.append((0, f.read()))
        except (OSError, EOFError) as err:  # unreadable, or a corrupt / truncated gzip stream
            where = f"{path}:{line + 1}" if is_jsonl(path) else str(path)
            yield index, batch, [f"{where}: cannot be read ({err.strerror or err})"]
            continue
        if batch:
            yield index, batch, []


# ---------------------------------------------------------------------------------------------------- prepare
def prepare(inputs: Sequence[str | Path], tokenizer: str | Path, out: str | Path, text_key: str = "text",
            workers: int = 1, eod_token: Optional[str] = None, overwrite: bool = False,
            progress: bool = True, split: Optional[str] = None) -> PrepareResult:
    """Tokenise ``inputs`` (paths or globs of files, or saved ``datasets`` directories) into the directory ``out``;
    return its manifest and timing. ``text_key`` is the JSONL field and the Parquet / Arrow column of the text;
    ``split`` chooses the split of a ``DatasetDict`` directory.

    Raises :class:`PrepareError` naming every bad input (and :class:`TokenizerError` for a bad tokenizer): the
    Parquet / Arrow files' schemas are all checked before anything is tokenised, and bad lines, rows and unreadable
    files are all found in one pass, and then nothing is published in ``out``.
    """
    if workers < 1:
        raise PrepareError([f"--workers={workers} must be >= 1"])
    out = Path(out)
    files, problems = _expand(inputs, split)
    _refuse(problems + schema_problems(files, text_key))  # every bad input named before anything is tokenised
    tok = Tokenizer(tokenizer)
    eod_name, eod_id = tok.eod_token(eod_token)
    sources = describe_sources(files)
    existing = _existing(out, tok, eod_id, text_key, sources, overwrite)
    if existing is not None:
        return PrepareResult(existing, True, 0.0, workers)
    dtype = dtype_for(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{TOKENS_FILE}.{os.getpid()}.tmp"
    start = time.perf_counter()
    settings: EncoderSettings = (str(tok.path), eod_id, dtype, text_key, [str(f) for f in files])
    try:
        digest, tokens, documents, text_bytes, cpu = _tokenise(files, settings, workers, tmp, dtype, progress, text_key)
        # Only now, with every input tokenised, is an earlier preparation replaced (--overwrite): the directory has no
        # manifest from here until the new one is written, so it never describes the wrong token file.
        (out / MANIFEST_FILE).unlink(missing_ok=True)
        os.replace(tmp, out / TOKENS_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    manifest = Manifest(tokenizer_path=str(tok.path), tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size,
                        eod_token=eod_name, eod_id=eod_id, dtype=dtype, token_count=tokens,
                        document_count=documents, text_bytes=text_bytes, text_key=text_key, sources=sources,
                        tokens_sha256=digest.hexdigest(), tokens_sample_sha256=sampled_sha256(out / TOKENS_FILE))
    _publish(out, manifest)
    return PrepareResult(manifest, False, seconds, workers, cpu)


def _tokenise(files: list, settings: EncoderSettings, workers: int, tmp: Path, dtype: str, progress: bool,
              text_key: str = "text") -> tuple[Any, int, int, int, float]:
    """Write every input's tokens to ``tmp`` in order; (sha256 of the tokens, tokens, documents, text bytes, CPU
    seconds of the encoders). Every bad line of every input is found before :class:`PrepareError` is raised."""
    digest, tokens, documents, text_bytes = hashlib.sha256(), 0, 0, 0
    bar, problems, cpu = None, [], 0.0
    try:
        with unit_encoder(workers, settings) as encode, open(tmp, "wb") as f:
            bar = _progress_bar(files, progress)  # after the fork: no thread of it in the workers
            for data, docs, size, bad, unit_cpu in encode(read_units(files, text_key=text_key)):
                problems += bad
                cpu += unit_cpu
                if problems:  # the run fails: only look for more problems
                    continue
                f.write(data)
                digest.update(data)
                tokens += len(data) // np.dtype(TOKEN_DTYPES[dtype]).itemsize
                documents += docs
                text_bytes += size
                if bar is not None:
                    bar.update(size)
    finally:
        if bar is not None:
            bar.close()
    _refuse(problems)
    return digest, tokens, documents, text_bytes, cpu


def _refuse(problems: list[str]) -> None:
    """Every bad input found (the first ``MAX_PROBLEMS``, then how many more)."""
    if problems:
        more = len(problems) - MAX_PROBLEMS
        raise PrepareError(problems[:MAX_PROBLEMS] + ([f"... and {more} more"] if more > 0 else []))


def _publish(out: Path, manifest: Manifest) -> None:
    """Write the manifest beside the token file by an atomic rename: a directory holds it only when it is whole."""
    written = out / f"{MANIFEST_FILE}.{os.getpid()}.tmp"
    written.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(written, out / MANIFEST_FILE)


def _existing(out: Path, tok: Tokenizer, eod_id: int, text_key: str, sources: tuple[Source, ...],
              overwrite: bool) -> Optional[Manifest]:
    """The manifest of ``out`` when it already holds these inputs tokenised alike (checksum verified); None when
    there is nothing there (or ``overwrite``); an error when it holds something else."""
    if overwrite or not (out / MANIFEST_FILE).is_file():
        if out.exists() and not out.is_dir():
            raise PrepareError([f"--out {str(out)!r} is a file; give a directory"])
        return None
    try:
        old = read_manifest(out)
    except PreparedDataError as err:
        raise PrepareError([f"{err} (or pass --overwrite to replace it)"]) from None
    fix = "give another --out, or pass --overwrite to replace it"
    if old.tokenizer_sha256 != tok.sha256:
        raise PrepareError([f"{out} was prepared with another tokenizer ({old.tokenizer_path}, sha256 "
                            f"{old.tokenizer_sha256[:12]}) than --tokenizer {tok.path} (sha256 {tok.sha256[:12]}); "
                            + fix])
    changes = []
    if old.eod_id != eod_id:
        changes.append(f"end-of-document id {old.eod_id} -> {eod_id}")
    if old.text_key != text_key and any(is_jsonl(Path(s.path)) or is_columnar(Path(s.path)) for s in sources):
        changes.append(f"--text-key {old.text_key!r} -> {text_key!r}")
    if old.sources != sources:
        before, now = {s.path: s for s in old.sources}, {s.path: s for s in sources}
        changed = [p for p in now if p in before and now[p] != before[p]]
        added, removed = [p for p in now if p not in before], [p for p in before if p not in now]
        for what, paths in (("changed since", changed), ("new", added), ("missing", removed)):
            if paths:
                changes.append(f"{len(paths)} input file(s) {what}: {', '.join(paths[:3])}"
                               + (" ..." if len(paths) > 3 else ""))
        if not changes:
            changes.append("the input files are given in another order")
    if changes:
        raise PrepareError([f"{out} already holds tokens of other inputs ({'; '.join(changes)}); {fix}"])
    if file_sha256(out / old.tokens_file) != old.tokens_sha256:
        raise PrepareError([f"{out / old.tokens_file} does not match the checksum in its manifest (changed after "
                            f"preparation); pass --overwrite to prepare it again"])
    return old


def _progress_bar(files: Sequence[Path], enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    # text bytes of a .gz, a Parquet or an Arrow file are unknown until it is read
    compressed = any(f.name.endswith(".gz") or is_columnar(f) for f in files)
    total = None if compressed else sum(f.stat().st_size for f in files)
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, mininterval=0.5,
                dynamic_ncols=True)


__all__ = ["PrepareError", "PrepareResult", "TokenizerError", "expand_inputs", "prepare", "read_units"]
