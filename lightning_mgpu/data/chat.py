"""``mgpu-prepare --chat``: conversations -> a token directory with an answer mask and document boundaries.

Each row of the inputs (:mod:`lightning_mgpu.data.chat_rows`) is rendered with the tokenizer directory's own chat
template in parallel processes (:mod:`lightning_mgpu.data.chat_encoding`), in input order whatever the number of
processes, and written as three files beside one manifest:

- ``tokens.bin``: every kept conversation's ids, each followed by the end-of-document token (as ``mgpu-prepare``
  writes documents), so the package's document masks keep attention within a conversation;
- ``mask.bin``: one byte per token, 1 where the token belongs to an assistant answer (the loss counts it as a target);
- ``documents.bin``: ``uint64`` offsets, where each conversation starts, and the end.

The manifest's ``chat`` entry records the template's checksum, the mask rule, the options, the counts (kept,
truncated, left out by reason, answer tokens) and the checksums of the two new files. Rows left out are counted and
the first of each reason named; an input whose every conversation is left out is refused. Running again on the same
inputs, tokenizer, template and options checks the directory and does nothing more.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from lightning_mgpu.data.chat_encoding import OVERLONG, REASONS, ChatSettings, Rendered, render_rows, start_worker
from lightning_mgpu.data.chat_rows import read_rows
from lightning_mgpu.data.manifest import MANIFEST_FILE, TOKEN_DTYPES, TOKENS_FILE, Manifest, dtype_for, sampled_sha256
from lightning_mgpu.data.prepare import PrepareError, PrepareResult, _existing, _expand, _publish, describe_sources
from lightning_mgpu.data.tokenizer import EOD_CANDIDATES, Tokenizer, file_sha256

MASK_FILE, DOCUMENTS_FILE = "mask.bin", "documents.bin"
#: Rows sent to a process at a time.
UNIT_ROWS = 64
#: Rows named per reason (the rest are counted).
NAMED_PER_REASON = 5


@dataclass
class _Tally:
    kept: int = 0
    tokens: int = 0
    answer_tokens: int = 0
    truncated: int = 0
    left_out: Counter = field(default_factory=Counter)
    named: dict = field(default_factory=dict)  #: reason -> the first rows left out for it

    def add(self, r: Rendered) -> None:
        if r.reason is not None:
            self.left_out[r.reason] += 1
            self.named.setdefault(r.reason, [])
            if len(self.named[r.reason]) < NAMED_PER_REASON:
                self.named[r.reason].append(f"{r.place}: {r.why}")
            return
        self.kept += 1
        self.tokens += len(r.tokens)
        self.answer_tokens += int(r.mask.sum())
        self.truncated += r.truncated


def prepare_chat(inputs: Sequence[str | Path], tokenizer: str | Path, out: str | Path, workers: int = 1,
                 eod_token: Optional[str] = None, max_tokens: Optional[int] = None, overlong: str = "drop",
                 overwrite: bool = False) -> PrepareResult:
    """Render the conversations of ``inputs`` with ``tokenizer``'s chat template into the directory ``out``."""
    problems = _option_problems(workers, max_tokens, overlong)
    files, found = _expand(inputs, None)
    if problems + found:
        raise PrepareError(problems + found)
    from lightning_mgpu.hf.chat_template import ChatTemplate, ChatTemplateError

    try:
        template = ChatTemplate(tokenizer)
    except ChatTemplateError as err:
        raise PrepareError([str(err)]) from None
    tok = Tokenizer(tokenizer)
    eod_name, eod_id = tok.eod_token(eod_token or _end_of_text(tok))
    settings = ChatSettings(str(Path(tokenizer).resolve()), eod_id, max_tokens, overlong)
    chat = {"template_sha256": template.sha256, "mask_rule": template.rule, "max_tokens": max_tokens,
            "overlong": overlong}
    sources = describe_sources(files)
    existing = _existing(Path(out), tok, eod_id, "messages", sources, overwrite)
    if existing is not None and _same_chat(Path(out), existing, chat):
        return PrepareResult(existing, True, 0.0, workers)
    return _write(Path(out), files, settings, workers, tok, eod_name, sources, chat)


def _end_of_text(tok: Tokenizer) -> Optional[str]:
    """The first of the usual end-of-text tokens the vocabulary has: a chat model's ``eos_token`` is often its end of
    turn (Qwen's ``<|im_end|>``, Llama 3's ``<|eot_id|>``), which the template writes inside every conversation."""
    return next((t for t in EOD_CANDIDATES if tok.token_id(t) is not None), None)


def _option_problems(workers: int, max_tokens: Optional[int], overlong: str) -> list[str]:
    out = []
    if workers < 1:
        out.append(f"--workers={workers} must be >= 1")
    if max_tokens is not None and max_tokens < 2:
        out.append(f"--max-tokens={max_tokens} must be >= 2 (a token and the end-of-document token)")
    if overlong not in OVERLONG:
        out.append(f"--overlong={overlong!r} is not one of {', '.join(OVERLONG)}")
    return out


def _same_chat(out: Path, manifest: Manifest, chat: dict) -> bool:
    """Whether ``out`` was prepared with this template and these options, its mask and boundaries intact."""
    old = manifest.chat or {}
    changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in chat.items() if old.get(k) != v]
    if changed:
        raise PrepareError([f"{out} was prepared with other chat settings ({'; '.join(changed)}); give another --out, "
                            "or pass --overwrite to replace it"])
    for name, key in ((MASK_FILE, "mask_sha256"), (DOCUMENTS_FILE, "documents_sha256")):
        if not (out / name).is_file() or file_sha256(out / name) != old.get(key):
            raise PrepareError([f"{out / name} is missing or does not match the checksum in its manifest; pass "
                                "--overwrite to prepare it again"])
    return True


def _units(files: Sequence[Path]) -> Iterator[list[tuple[str, Any]]]:
    for path in files:
        rows = read_rows(path)
        while unit := list(islice(rows, UNIT_ROWS)):
            yield unit


def _rendered(files: Sequence[Path], settings: ChatSettings, workers: int) -> Iterator[Rendered]:
    """Every row rendered, in input order."""
    if workers == 1:
        start_worker(settings)
        for unit in _units(files):
            yield from render_rows(unit)
        return
    with multiprocessing.get_context("fork").Pool(workers, start_worker, (settings,)) as pool:
        for rendered in pool.imap(render_rows, _units(files)):
            yield from rendered


def _write(out: Path, files: Sequence[Path], settings: ChatSettings, workers: int, tok: Tokenizer, eod_name: str,
           sources: tuple, chat: dict) -> PrepareResult:
    dtype = dtype_for(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    names = (TOKENS_FILE, MASK_FILE, DOCUMENTS_FILE)
    tmp = {n: out / f"{n}.{os.getpid()}.tmp" for n in names}
    start, cpu = time.perf_counter(), time.process_time()
    tally, offsets = _Tally(), [0]
    try:
        with open(tmp[TOKENS_FILE], "wb") as t, open(tmp[MASK_FILE], "wb") as m:
            for r in _rendered(files, settings, workers):
                tally.add(r)
                if r.reason is None:
                    t.write(r.tokens.astype(TOKEN_DTYPES[dtype]).tobytes())
                    m.write(r.mask.tobytes())
                    offsets.append(offsets[-1] + len(r.tokens))
        np.asarray(offsets, dtype=np.uint64).tofile(tmp[DOCUMENTS_FILE])
        _refuse_unusable(tally, settings)
        (out / MANIFEST_FILE).unlink(missing_ok=True)
        for n in names:
            os.replace(tmp[n], out / n)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    chat.update(_recorded(out, tally))
    manifest = Manifest(tokenizer_path=str(tok.path), tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size,
                        eod_token=eod_name, eod_id=settings.eod_id, dtype=dtype, token_count=tally.tokens,
                        document_count=tally.kept, text_bytes=sum(s.bytes for s in sources), text_key="messages",
                        sources=sources, tokens_sha256=file_sha256(out / TOKENS_FILE),
                        tokens_sample_sha256=sampled_sha256(out / TOKENS_FILE), chat=chat)
    _publish(out, manifest)
    return PrepareResult(manifest, False, seconds, workers, time.process_time() - cpu)


def _recorded(out: Path, tally: _Tally) -> dict:
    return {"conversations": tally.kept, "answer_tokens": tally.answer_tokens, "truncated": tally.truncated,
            "left_out": {reason: tally.left_out[reason] for reason in REASONS if tally.left_out[reason]},
            "left_out_examples": tally.named, "mask_file": MASK_FILE, "documents_file": DOCUMENTS_FILE,
            "mask_sha256": file_sha256(out / MASK_FILE), "documents_sha256": file_sha256(out / DOCUMENTS_FILE)}


def _refuse_unusable(tally: _Tally, settings: ChatSettings) -> None:
    """No conversation kept, or the end-of-document token inside conversations: every reason named."""
    problems = []
    if tally.left_out["eod-inside"]:
        problems.append(f"the end-of-document id {settings.eod_id} occurs inside {tally.left_out['eod-inside']} "
                        "rendered conversation(s): it would cut them into documents; choose with --eod-token a token "
                        "the chat template never writes (e.g. <|endoftext|> where the template ends turns with "
                        "another)")
    if not tally.kept:
        problems.append(f"no conversation has an answer token to train on ({sum(tally.left_out.values())} left "
                        "out); every row's reason:")
    if problems:
        raise PrepareError(problems + [line for lines in tally.named.values() for line in lines])


__all__ = ["DOCUMENTS_FILE", "MASK_FILE", "prepare_chat"]
