"""The rules of the ``data`` group: sources, paths, token files, document masks and vocabularies against the model.
They read the run's data as resolved once (:class:`~lightning_mgpu.cli.run_data.RunData`: manifests read, the tokenizer
loaded) and the file system for data paths."""

from __future__ import annotations

import glob
import shlex
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.cli.run_data import RunData
from lightning_mgpu.cli.rule_base import DATA_SOURCES, TOKEN_DTYPES, _positive
from lightning_mgpu.data import BYTE_VOCAB_SIZE
from lightning_mgpu.models import LlamaConfig


#: (vocabulary size, where it comes from) of one data source
Vocabulary = tuple[int, str]


def data_problems(cfg: DictConfig, data: RunData, model: Optional[LlamaConfig]) -> list[str]:
    d = cfg.data
    out = _positive("data.seq_len", d.seq_len) + _positive("data.val_batches", d.val_batches)
    if d.source not in DATA_SOURCES:
        out.append(f"data.source={d.source!r} is unknown; choose one of {', '.join(DATA_SOURCES)} (or data=NAME)")
    elif d.source == "tokens":
        out += token_source_problems(cfg, data)
    elif d.source == "text":
        out += text_file_problems(list(d.files), has_tokenizer=data.tokenizer is not None)
    elif d.source == "sft":
        from lightning_mgpu.cli.sft_rules import sft_problems

        out += sft_problems(cfg, data)
    if d.get("sources") and d.source != "tokens":
        out.append(f"data.sources is set but data.source={d.source}: blends are of token sources; use data=tokens")
    if not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.01")
    vocabularies, problems = data_vocabularies(data)
    out += problems + document_mask_problems(cfg, data)
    if model is not None:
        if vocabularies:  # the largest one: every id of the data must have an embedding row
            out += vocabulary_problems(cfg, model, *max(vocabularies))
        out += seq_len_problems(cfg, model)
    return out


def seq_len_problems(cfg: DictConfig, model: LlamaConfig) -> list[str]:
    """The rule: a sample is at most the model's ``max_seq_len`` tokens (asked by ``mgpu-train`` and ``mgpu-plan``);
    the fix is the model source's."""
    seq_len = cfg.data.seq_len
    if isinstance(seq_len, int) and seq_len > model.max_seq_len:
        return [f"data.seq_len={seq_len} exceeds the model's max_seq_len={model.max_seq_len}; "
                + model_source(cfg).sequence_fix(seq_len, model.max_seq_len)]
    return []


def text_file_problems(patterns: Sequence[str], has_tokenizer: bool) -> list[str]:
    """``data=text``: every pattern matches something, and nothing that ``data=text`` would read wrongly. Without a
    tokenizer it reads each file's bytes as text, so a Parquet or Arrow file would be trained on as its encoded bytes;
    and it reads files only, so a dataset saved by ``datasets``' ``save_to_disk`` (a directory) would be left out.
    ``mgpu-prepare`` reads both."""
    from lightning_mgpu.data.columnar import is_columnar, is_saved_dataset

    out = [] if patterns else ["data.files is empty; give glob patterns of .txt/.jsonl files, e.g. "
                               "'data.files=[books/*.txt]'"]
    for pattern in patterns:
        matches = [Path(m) for m in sorted(glob.glob(pattern, recursive=True))]
        if not matches:
            out.append(f"data.files pattern {pattern!r} matches no file")
        columnar = [] if has_tokenizer else [m for m in matches if is_columnar(m) and m.is_file()]
        if columnar:
            out.append(f"data.files pattern {pattern!r} matches the Parquet/Arrow file(s) {_listed(columnar)}, which "
                       "data=text without a tokenizer would read as raw bytes, not as rows of text; tokenise them "
                       f"with `mgpu-prepare --tokenizer PATH --out DIR {shlex.quote(pattern)}` and train with "
                       "data=tokens data.path=DIR (or give data.tokenizer=PATH)")
        for directory in (m for m in matches if is_saved_dataset(m)):
            out.append(f"data.files pattern {pattern!r} matches {str(directory)!r}, a dataset written by "
                       "save_to_disk, which data=text does not read (it reads files); tokenise it with "
                       f"`mgpu-prepare --tokenizer PATH --out DIR {shlex.quote(str(directory))}` (with --split NAME "
                       "for a DatasetDict) and train with data=tokens data.path=DIR")
    return out


def _listed(paths: Sequence[Path]) -> str:
    """The first three of ``paths``, then how many more."""
    return ", ".join(repr(str(p)) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def token_source_problems(cfg: DictConfig, data: RunData) -> list[str]:
    """``data=tokens``: one ``data.path`` or ``data.sources`` (each a prepared directory or a flat token file, with a
    weight > 0)."""
    from lightning_mgpu.data.blend import weight_problems

    d, out = cfg.data, []
    unreadable = {s.path: s.error for s in data.prepared if s.error is not None}
    if d.dtype not in TOKEN_DTYPES:
        out.append(f"data.dtype={d.dtype!r} is not a token dtype; choose {' or '.join(TOKEN_DTYPES)}")
    if data.sources and d.path:
        return out + [f"data.path={d.path!r} and data.sources are both set; give one: data.path for one source, "
                      "data.sources for a blend"]
    if not data.sources:
        if not d.path:
            return out + ["data.path is not set: data=tokens reads a flat token file or a directory written by "
                          "mgpu-prepare; give data.path=DIR, or a blend: 'data.sources=[{path: DIR1, weight: 0.7}, "
                          "{path: DIR2, weight: 0.3}]'"]
        return out + _token_path_problems("data.path", d.path, unreadable)
    for i, (path, weight) in enumerate(data.sources):
        key = f"data.sources[{i}]"
        if not path or path == "???":
            out.append(f"{key} has no path; give each source as {{path: DIR, weight: W}}")
            continue
        out += _token_path_problems(f"{key}.path", path, unreadable)
        out += weight_problems([weight], [f"{key} ({path})"])
    return out


def document_mask_problems(cfg: DictConfig, data: RunData) -> list[str]:
    """``data.document_mask=true`` needs tokens with an end-of-document id (a prepared directory's manifest, or a
    tokenizer that has one; not bytes), the same in every prepared source."""
    if not cfg.data.get("document_mask"):
        return []
    eod, origin = data.eod_token_id()
    if eod is None:
        return [f"data.document_mask=true needs tokens that end every document with an end-of-document id, but "
                f"{origin}; prepare the data with mgpu-prepare (data=tokens data.path=DIR), or give "
                "data.tokenizer=PATH of a tokenizer with an end-of-document token, or set data.document_mask=false"]
    return [f"data.document_mask=true: {path} ends documents with id {manifest.eod_id} ({manifest.eod_token!r}), but "
            f"{origin} says {eod}; prepare every source with the same --eod-token"
            for path, manifest in data.readable_manifests() if manifest.eod_id != eod]


def _token_path_problems(key: str, path: str, unreadable: dict[str, str]) -> list[str]:
    """A token source that does not exist, or a prepared one whose manifest cannot be read (``unreadable``)."""
    if path in unreadable:
        return [f"{key}: {unreadable[path]}"]
    if not (Path(path).is_dir() or Path(path).is_file()):  # a device or a pipe is no token file either
        return [f"{key}={path!r} does not exist; give a directory written by mgpu-prepare or a token file "
                "(data=tokens)"]
    return []


def data_vocabularies(data: RunData) -> tuple[list[Vocabulary], list[str]]:
    """(the vocabularies the data's token ids come from, problems with the tokenizer and the prepared tokens).

    Byte tokens when no tokenizer is given (corpus, text); the run's tokenizer; every prepared directory's manifest,
    whose tokenizer must be the run's. A flat token file says nothing about its ids.
    """
    from lightning_mgpu.data.manifest import tokenizer_match_problems

    out: list[Vocabulary] = []
    problems: list[str] = []
    tok = data.tokenizer
    if tok is not None and tok.error is not None:
        problems.append(f"{tok.name}: {tok.error}")
    elif tok is not None:
        out.append((tok.vocab_size, f"the {tok.vocab_size:,} token ids of {tok.name}"))
    elif data.source in ("corpus", "text"):
        out.append((BYTE_VOCAB_SIZE, f"the {BYTE_VOCAB_SIZE} byte tokens of data.source={data.source}"))
    prepared = data.readable_manifests()
    out += [(m.vocab_size, f"the {m.vocab_size:,} token ids of the tokenizer {path} was prepared with")
            for path, m in prepared]
    sha = None if tok is None else tok.sha256
    return out, problems + tokenizer_match_problems(prepared, sha, "" if tok is None else tok.name)


def vocabulary_problems(cfg: DictConfig, model: LlamaConfig, size: int, what: str) -> list[str]:
    """The rule for bytes and tokenizers alike: the data's largest token id (``size - 1``) must fit
    ``model.vocab_size``; the fix is the model source's."""
    if model.vocab_size >= size:
        return []
    return [model_source(cfg).vocabulary_problem(model.vocab_size, size, what)]
