"""Tokenizers given by path: a Hugging Face tokenizer directory (``tokenizer.json``) or a ``tokenizers`` JSON file.

Nothing is downloaded: the ``tokenizers`` package reads the file that is there. Byte tokens
(:mod:`lightning_mgpu.data.corpus`) stay the default when no tokenizer is given.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence

#: The file a Hugging Face tokenizer directory holds (Llama models ship one).
TOKENIZER_FILE = "tokenizer.json"
#: End-of-document tokens looked for, in order, when the tokenizer's own configuration names none.
EOD_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")


class TokenizerError(ValueError):
    """A tokenizer path that cannot be used; the message names the path and the fix."""


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer JSON file of ``path`` (the file itself, or ``tokenizer.json`` inside a directory)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / TOKENIZER_FILE).is_file():
            raise TokenizerError(f"tokenizer {str(path)!r} is a directory without {TOKENIZER_FILE}; give a Hugging "
                                 f"Face tokenizer directory (with {TOKENIZER_FILE}) or a tokenizers JSON file")
        return p / TOKENIZER_FILE
    if not p.is_file():
        raise TokenizerError(f"tokenizer {str(path)!r} does not exist; give a Hugging Face tokenizer directory "
                             f"(with {TOKENIZER_FILE}) or a tokenizers JSON file")
    return p


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (what manifests record to recognise the same tokenizer under another path)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a path, with what training needs: the vocabulary size (largest id + 1),
    the end-of-document token, a hash of its JSON, and encoding of documents and prompts with the tokenizer's own
    special tokens (e.g. Llama's ``<|begin_of_text|>``)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self.path = tokenizer_file(path).resolve()
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust parser's message says what is wrong in the file
            raise TokenizerError(f"tokenizer {str(self.path)!r} cannot be read by the tokenizers package: {err}; "
                                 "give a tokenizer.json saved by tokenizers or transformers") from None

    @cached_property
    def sha256(self) -> str:
        return file_sha256(self.path)

    @cached_property
    def vocab_size(self) -> int:
        """Largest token id + 1: the embedding rows a model needs for every id this tokenizer can produce."""
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def eod_token(self, name: Optional[str] = None) -> tuple[str, int]:
        """(token, id) that ends a document: ``name`` when given; else the ``eos_token`` of a ``tokenizer_config.json``
        beside the tokenizer; else the first of :data:`EOD_CANDIDATES` in the vocabulary."""
        if name is not None:
            found = self.token_id(name)
            if found is None:
                raise TokenizerError(f"end-of-document token {name!r} is not in the vocabulary of tokenizer "
                                     f"{str(self.path)!r}; name one of its tokens (e.g. {self._specials()})")
            return name, found
        for token in [self._configured_eos()] + list(EOD_CANDIDATES):
            if token is not None and self.token_id(token) is not None:
                return token, self.token_id(token)
        raise TokenizerError(f"tokenizer {str(self.path)!r} has no end-of-document token (looked for "
                             f"{', '.join(EOD_CANDIDATES)} and the eos_token of tokenizer_config.json); name one of "
                             f"its tokens with --eod-token (its special tokens: {self._specials()})")

    def _configured_eos(self) -> Optional[str]:
        config = self.path.parent / "tokenizer_config.json"
        if not config.is_file():
            return None
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError):
            return None
        return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None

    def _specials(self) -> str:
        names = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        return ", ".join(names[:8]) or "none"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's own special tokens (its post-processor, e.g. a BOS)."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept, so document boundaries show."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
