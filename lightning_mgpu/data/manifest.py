"""Prepared token directories: ``tokens.bin`` (a flat token stream) and ``manifest.json`` (what made it).

``mgpu-prepare`` writes them; training reads them and checks, cheaply, that the token file is the one the
manifest describes: its size, and a checksum of 64 evenly spaced 4 KiB blocks (a full checksum of a corpus would read
every byte on every rank at every start). The manifest is written last, so a directory with one is complete. A
token file named directly (``DIR/tokens.bin``) is read through the manifest beside it, never as a bare stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.bin"
FORMAT = "lightning_mgpu.tokens/1"
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int) -> str:
    """The narrowest token dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


@dataclass(frozen=True)
class Source:
    """One input file as it was when it was tokenised (a changed size or time means other inputs); a saved
    ``datasets`` directory is recorded as its Arrow files."""

    path: str
    bytes: int
    mtime_ns: int


@dataclass(frozen=True)
class Manifest:
    tokenizer_path: str
    tokenizer_sha256: str  #: SHA-256 of the tokenizer JSON: the same tokenizer under any path
    vocab_size: int  #: largest id the tokenizer can produce + 1
    eod_token: str
    eod_id: int  #: appended after every document
    dtype: str
    token_count: int
    document_count: int
    text_bytes: int  #: UTF-8 bytes of text tokenised
    text_key: str  #: the JSONL field, or the Parquet / Arrow column, read
    sources: tuple[Source, ...] = field(default_factory=tuple)
    tokens_sha256: str = ""  #: SHA-256 of tokens.bin
    tokens_sample_sha256: str = ""  #: :func:`sampled_sha256` of tokens.bin, checked whenever training opens it
    format: str = FORMAT
    tokens_file: str = TOKENS_FILE
    #: conversations (``mgpu-prepare --chat``): template checksum, mask rule, options, counts, the mask and document
    #: files and their checksums (:mod:`lightning_mgpu.data.chat`); None for a plain token stream
    chat: Optional[dict] = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["sources"] = tuple(Source(**s) for s in data.get("sources", ()))
        return cls(**values)

    @property
    def itemsize(self) -> int:
        return np.dtype(TOKEN_DTYPES[self.dtype]).itemsize


class PreparedDataError(ValueError):
    """A token directory that cannot be read as it is; the message names the path and the fix."""


#: Blocks read by :func:`sampled_sha256`, and their size.
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 4096


def sampled_sha256(path: str | Path) -> str:
    """SHA-256 of the file's size and of ``SAMPLE_BLOCKS`` blocks at evenly spaced offsets (the whole file when it is
    smaller): 256 KiB read whatever the corpus size, and a replaced or overwritten file almost surely differs."""
    size = Path(path).stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            digest.update(f.read())
        else:
            step = (size - SAMPLE_BLOCK_BYTES) // (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                f.seek(i * step)
                digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def _beside_manifest(path: Path) -> bool:
    return path.is_file() and (path.parent / MANIFEST_FILE).is_file()


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a prepared directory (or meant to be one), or the token file inside one, as opposed to a
    flat token file."""
    return Path(path).is_dir() or _beside_manifest(Path(path))


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a prepared directory (or of the directory of its token file), checked against its token file:
    dtype, size and sampled checksum."""
    named = Path(directory)
    directory = named.parent if _beside_manifest(named) else named
    path = directory / MANIFEST_FILE
    fix = "prepare it with mgpu-prepare --tokenizer PATH --out DIR INPUT..."
    if not path.is_file():
        raise PreparedDataError(f"{str(directory)!r} is a directory without {MANIFEST_FILE}: not a prepared token "
                                f"directory (or its preparation did not finish); {fix}")
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as err:
        raise PreparedDataError(f"{path} cannot be read ({err}); {fix}") from None
    if manifest.format != FORMAT:
        raise PreparedDataError(f"{path} has format {manifest.format!r}, this version reads {FORMAT!r}; {fix}")
    if manifest.dtype not in TOKEN_DTYPES:
        raise PreparedDataError(f"{path} names dtype {manifest.dtype!r}; token files are uint16 or uint32; {fix}")
    tokens = directory / manifest.tokens_file
    expected = manifest.token_count * manifest.itemsize
    if not tokens.is_file():
        raise PreparedDataError(f"{tokens} is missing (the manifest lists {manifest.token_count:,} tokens); {fix}")
    if tokens.stat().st_size != expected:
        raise PreparedDataError(f"{tokens} has {tokens.stat().st_size:,} bytes, but the manifest lists "
                                f"{manifest.token_count:,} {manifest.dtype} tokens = {expected:,} bytes: it was "
                                f"changed or cut short; {fix}")
    if named != directory and named.name != manifest.tokens_file:
        raise PreparedDataError(f"{named} is not the token file of the prepared directory it sits in (its manifest "
                                f"names {manifest.tokens_file}); give the directory {directory}")
    if manifest.tokens_sample_sha256 and sampled_sha256(tokens) != manifest.tokens_sample_sha256:
        raise PreparedDataError(f"{tokens} does not match the checksum in {path}: it was changed after preparation; "
                                f"prepare it again (mgpu-prepare ... --overwrite)")
    return manifest


def open_tokens(path: str | Path, dtype: str = "uint16") -> tuple[np.ndarray, Optional[Manifest]]:
    """(memory-mapped tokens, manifest) of a prepared directory, or of a flat token file of ``dtype`` (no manifest)."""
    path = Path(path)
    if is_prepared(path):
        manifest = read_manifest(path)
        directory = path if path.is_dir() else path.parent
        return np.memmap(directory / manifest.tokens_file, dtype=TOKEN_DTYPES[manifest.dtype], mode="r"), manifest
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist; give a directory written by mgpu-prepare or "
                                "a flat token file")
    if path.stat().st_size % np.dtype(TOKEN_DTYPES[dtype]).itemsize:
        raise PreparedDataError(f"{path} has {path.stat().st_size:,} bytes, not a whole number of {dtype} tokens; "
                                "set data.dtype to the dtype it was written with")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r"), None


def tokenizer_match_problems(prepared: Sequence[tuple[str, Manifest]], tokenizer_sha256: Optional[str],
                             tokenizer_name: str) -> list[str]:
    """Prepared sources must share one tokenizer, and be the one training uses (``tokenizer_name``, e.g.
    ``data.tokenizer='/tok'``) when one is given: the same ids must mean the same text."""
    out = []
    first = prepared[0] if prepared else None
    for name, manifest in prepared[1:]:
        if manifest.tokenizer_sha256 != first[1].tokenizer_sha256:
            out.append(f"{name} was prepared with tokenizer {manifest.tokenizer_path} (sha256 "
                       f"{manifest.tokenizer_sha256[:12]}), {first[0]} with {first[1].tokenizer_path} (sha256 "
                       f"{first[1].tokenizer_sha256[:12]}); prepare every source with one tokenizer")
    if tokenizer_sha256 is not None:
        for name, manifest in prepared:
            if manifest.tokenizer_sha256 != tokenizer_sha256:
                out.append(f"{tokenizer_name} (sha256 {tokenizer_sha256[:12]}) is not the tokenizer {name} was "
                           f"prepared with ({manifest.tokenizer_path}, sha256 {manifest.tokenizer_sha256[:12]}); "
                           f"use that tokenizer, or prepare {name} again with mgpu-prepare --tokenizer of this one")
                break
    return out
