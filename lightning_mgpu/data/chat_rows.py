"""Conversations as rows of JSONL, Parquet or Arrow files: ``messages`` (a list of ``{role, content}`` turns: system,
user, assistant, tool) or ``prompt`` / ``completion`` (strings, or lists of turns as TRL's conversational format
holds them). A row is data only: it is read as JSON or Arrow values, never run.

:func:`conversation` turns one row into its turns or says, in one line, why it cannot (no column, a turn without a
role, a role the rule does not know, no assistant turn).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterator, Union

from lightning_mgpu.data.columnar import INSTALL_HINT, is_arrow, is_parquet

ROLES = ("system", "user", "assistant", "tool")
#: The columns a row may carry its conversation in.
COLUMNS = ("messages", "prompt", "completion")
Turns = list[dict[str, Any]]


def conversation(row: Any) -> Union[Turns, str]:
    """The turns of ``row``, or why it has none usable (a sentence without the row's place)."""
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not an object with messages or prompt/completion"
    if row.get("messages") is not None:
        turns = row["messages"]
    elif row.get("prompt") is not None and row.get("completion") is not None:
        turns = _as_turns(row["prompt"], "user") + _as_turns(row["completion"], "assistant")
    else:
        return (f"has no messages column and no prompt/completion pair (its keys: {sorted(row)[:8]}); give rows "
                "with messages: [{role, content}, ...] or prompt and completion")
    return _checked(turns)


def _as_turns(value: Any, role: str) -> Turns:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return list(value) if isinstance(value, list) else [value]


def _checked(turns: Any) -> Union[Turns, str]:
    if not isinstance(turns, list) or not turns:
        return "has messages that are not a non-empty list of turns"
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            role = turn.get("role") if isinstance(turn, dict) else type(turn).__name__
            return f"turn {i} has role {role!r}; roles are {', '.join(ROLES)}"
        out.append({k: v for k, v in turn.items() if v is not None})  # Arrow structs fill absent fields with None
    if not any(t["role"] == "assistant" for t in out):
        return "has no assistant turn: nothing to learn from it"
    return out


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(place, row) of every row of ``path`` in order: ``file:line`` of JSONL, ``file:row N`` of Parquet / Arrow. A
    JSONL line that is not JSON yields its error message as the row (a string), which :func:`conversation` names."""
    if is_parquet(path) or is_arrow(path):
        yield from _columnar_rows(path)
        return
    with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")) as f:
        for line, raw in enumerate(f, start=1):
            if raw.strip():
                yield f"{path}:{line}", raw


def parse(raw: Any) -> tuple[Any, str]:
    """(a JSONL line's value, ""), a row read from Parquet / Arrow being one already; (None, why) for a line that is
    not JSON."""
    if not isinstance(raw, str):
        return raw, ""
    try:
        return json.loads(raw), ""
    except ValueError as err:
        return None, f"is not JSON ({err})"


def _columnar_rows(path: Path) -> Iterator[tuple[str, Any]]:
    from lightning_mgpu.data.columnar import _open_arrow, _pyarrow

    pa = _pyarrow()
    if pa is None:
        yield f"{path}", f"cannot be read without pyarrow: {INSTALL_HINT}"
        return
    source = None
    if is_parquet(path):
        import pyarrow.parquet as pq

        handle = pq.ParquetFile(path)
        wanted = [c for c in COLUMNS if c in handle.schema_arrow.names]
        batches: Any = handle.iter_batches(columns=wanted or None)
    else:
        _, source, batches = _open_arrow(pa, path)
    row = 0
    try:
        for batch in batches:
            for value in batch.to_pylist():
                yield f"{path}:row {row}", value
                row += 1
    finally:
        if source is not None:
            source.close()


__all__ = ["COLUMNS", "ROLES", "conversation", "parse", "read_rows"]
