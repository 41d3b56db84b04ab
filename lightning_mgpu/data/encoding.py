"""The tokenising processes of ``mgpu-prepare``: units of raw documents in, their token bytes out, in input order.

The main process reads the inputs into units (:func:`lightning_mgpu.data.prepare.read_units`) and writes the tokens;
a worker decodes, parses and tokenises one unit at a time, with the tokenizer it loaded once. The units, not the
files, are the work shared out, so one large file keeps every process busy.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from collections import deque
from typing import Callable, Iterable, Iterator

import numpy as np

from lightning_mgpu.data.columnar import TextColumn
from lightning_mgpu.data.manifest import TOKEN_DTYPES
from lightning_mgpu.data.tokenizer import Tokenizer

# A unit is (file index, documents, read errors); the documents are [(line number or 0, raw bytes), ...], raw bytes
# being a JSONL line or a whole text file, or a TextColumn: rows of a Parquet / Arrow file's text column. A read
# error travels with the unit, so that problems are reported in input order.
Unit = tuple[int, "list[tuple[int, bytes]] | TextColumn", list[str]]
#: What a worker is started with: (tokenizer path, end-of-document id, token dtype name, text key, input paths).
EncoderSettings = tuple[str, int, str, str, list[str]]
#: (token bytes, documents, UTF-8 text bytes, problems, CPU seconds) of one unit.
EncodedUnit = tuple[bytes, int, int, list[str], float]

_worker: dict = {}


def _init_worker(tokenizer_path: str, eod_id: int, dtype: str, text_key: str, files: list[str]) -> None:
    # One thread per process: the processes are the parallelism, and the MB/s per process is then honest.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker.update(tokenizer=Tokenizer(tokenizer_path), eod_id=eod_id, dtype=TOKEN_DTYPES[dtype],
                   text_key=text_key, files=files)


def _texts(index: int, docs: "list[tuple[int, bytes]] | TextColumn") -> tuple[list[str], list[str]]:
    """(the documents' texts, what is wrong with the others)."""
    path, key = _worker["files"][index], _worker["text_key"]
    if isinstance(docs, TextColumn):
        return docs.texts(path)
    out, problems = [], []
    for line, raw in docs:
        where = f"{path}:{line}" if line else path
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problems.append(f"{where}: not UTF-8 text (byte {err.start} is {raw[err.start]:#04x}); convert it to "
                            "UTF-8")
            continue
        if not line:
            out.append(text)
            continue
        try:
            record = json.loads(text)
        except ValueError as err:
            problems.append(f"{where}: not a JSON line ({err}); fix the line or remove it")
            continue
        if not isinstance(record, dict) or key not in record:
            have = f"its fields: {', '.join(list(record)[:8])}" if isinstance(record, dict) else "it is not an object"
            problems.append(f"{where}: no {key!r} field ({have}); set --text-key to the field with the text")
        elif not isinstance(record[key], str):
            problems.append(f"{where}: field {key!r} is a {type(record[key]).__name__}, not a string")
        else:
            out.append(record[key])
    return out, problems


def _encode_unit(unit: Unit) -> EncodedUnit:
    """(token bytes, documents, UTF-8 text bytes, problems, CPU seconds) of one unit: each document's ids, then the
    end-of-document id."""
    cpu = time.process_time()
    index, docs, read_errors = unit
    texts, problems = _texts(index, docs)
    eod = _worker["eod_id"]
    ids: list[int] = []
    for doc in _worker["tokenizer"].encode_batch(texts):
        ids += doc
        if not doc or doc[-1] != eod:  # a post-processor may already end each document with it
            ids.append(eod)
    data = np.asarray(ids, dtype=_worker["dtype"]).tobytes()
    size = docs.text_bytes if isinstance(docs, TextColumn) else sum(len(r) for _, r in docs)
    return data, len(texts), size, problems + read_errors, time.process_time() - cpu


@contextlib.contextmanager
def unit_encoder(workers: int,
                 settings: EncoderSettings) -> Iterator[Callable[[Iterable[Unit]], Iterator[EncodedUnit]]]:
    """A function from units to their encodings, in input order; with several workers at most ``4 x workers`` units
    are read ahead, so memory stays bounded."""
    if workers == 1:
        _init_worker(*settings)
        yield lambda units: map(_encode_unit, units)
        return
    # fork: the children inherit the imported modules (spawn would import torch and Lightning again in each one)
    with multiprocessing.get_context("fork").Pool(workers, _init_worker, settings) as pool:
        def encoded(units: Iterable[Unit]) -> Iterator[EncodedUnit]:
            pending: deque = deque()
            for unit in units:
                pending.append(pool.apply_async(_encode_unit, (unit,)))
                if len(pending) >= 4 * workers:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()

        yield encoded


__all__ = ["EncodedUnit", "EncoderSettings", "Unit", "unit_encoder"]
