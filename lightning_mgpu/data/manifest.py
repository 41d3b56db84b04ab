"""Prepared token directories: ``tokens.bin`` (a flat token stream) and ``manifest.json`` (what made it).

``mgpu-prepare`` writes them; training reads them and checks, cheaply, that the token file is the one the
manifest describes (its dtype and size). The manifest is written last, so a directory with one is complete.
"""

from __future__ import annotations

import dataclasses
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
    """One input file as it was when it was tokenised (a changed size or time means other inputs)."""

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
    text_key: str  #: the JSONL field read
    sources: tuple[Source, ...] = field(default_factory=tuple)
    tokens_sha256: str = ""  #: SHA-256 of tokens.bin
    format: str = FORMAT
    tokens_file: str = TOKENS_FILE

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


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a directory (prepared, or meant to be), as opposed to a flat token file."""
    return Path(path).is_dir()


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a prepared directory, checked against its token file (dtype and size)."""
    directory = Path(directory)
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
    return manifest


def open_tokens(path: str | Path, dtype: str = "uint16") -> tuple[np.ndarray, Optional[Manifest]]:
    """(memory-mapped tokens, manifest) of a prepared directory, or of a flat token file of ``dtype`` (no manifest)."""
    path = Path(path)
    if is_prepared(path):
        manifest = read_manifest(path)
        return np.memmap(path / manifest.tokens_file, dtype=TOKEN_DTYPES[manifest.dtype], mode="r"), manifest
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
