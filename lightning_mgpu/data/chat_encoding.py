"""One conversation row -> its token ids and answer mask, in a tokenizing process (the template is loaded once per
process): the worker side of :mod:`lightning_mgpu.data.chat`.

Every row ends as a :class:`Rendered`: its tokens and mask (each conversation followed by the end-of-document token,
which no loss counts), or the reason it was left out -- one of :data:`REASONS` -- and a line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from lightning_mgpu.data.chat_rows import conversation, parse

#: Why a row was left out: no usable conversation in it, a template that cannot render it, no answer token, longer
#: than ``--max-tokens`` (with ``--overlong drop``), the end-of-document token rendered inside it.
REASONS = ("no-conversation", "template-failed", "empty-mask", "overlong", "eod-inside")
OVERLONG = ("drop", "truncate")


@dataclass(frozen=True)
class ChatSettings:
    tokenizer: str  #: the tokenizer directory
    eod_id: int
    max_tokens: Optional[int]  #: longest document kept (its end-of-document token included)
    overlong: str  #: one of :data:`OVERLONG`


@dataclass(frozen=True)
class Rendered:
    place: str
    tokens: Optional[np.ndarray] = None  #: int64 ids, the end-of-document token last
    mask: Optional[np.ndarray] = None  #: uint8, 1 where the token is an answer's
    reason: Optional[str] = None  #: one of :data:`REASONS` when the row was left out
    why: str = ""
    truncated: bool = False


_TEMPLATE: Any = None
_SETTINGS: Optional[ChatSettings] = None


def start_worker(settings: ChatSettings) -> None:
    """Load the template once in this process (the initializer of the tokenizing pool)."""
    global _TEMPLATE, _SETTINGS
    from lightning_mgpu.hf.chat_template import ChatTemplate

    _TEMPLATE, _SETTINGS = ChatTemplate(settings.tokenizer), settings


def render_rows(rows: Sequence[tuple[str, Any]]) -> list[Rendered]:
    """Each (place, raw row) of a unit of work rendered in this process."""
    return [render_row(place, raw, _TEMPLATE, _SETTINGS) for place, raw in rows]


def render_row(place: str, raw: Any, template: Any, settings: ChatSettings) -> Rendered:
    from lightning_mgpu.hf.chat_template import ChatTemplateError

    row, unreadable = parse(raw)
    turns = unreadable or conversation(row)
    if isinstance(turns, str):
        return Rendered(place, reason=REASONS[0], why=turns)
    try:
        ids, mask = template.render(turns)
    except ChatTemplateError as err:
        return Rendered(place, reason=REASONS[1], why=str(err))
    except Exception as err:  # a jinja2 error of the template, or one it raises itself (raise_exception)
        return Rendered(place, reason=REASONS[1], why=f"the chat template does not render it: {type(err).__name__}: "
                                                     f"{str(err).splitlines()[0] if str(err) else ''}")
    if settings.eod_id in ids:
        return Rendered(place, reason=REASONS[4], why=f"the end-of-document id {settings.eod_id} occurs inside it")
    tokens = np.asarray(list(ids) + [settings.eod_id], dtype=np.int64)
    answer = np.asarray(list(mask) + [0], dtype=np.uint8)
    truncated = False
    if settings.max_tokens is not None and len(tokens) > settings.max_tokens:
        if settings.overlong == "drop":
            return Rendered(place, reason=REASONS[3], why=f"{len(tokens)} tokens > --max-tokens {settings.max_tokens}")
        tokens = np.append(tokens[: settings.max_tokens - 1], settings.eod_id)
        answer, truncated = np.append(answer[: settings.max_tokens - 1], 0).astype(np.uint8), True
    if not answer.any():
        return Rendered(place, reason=REASONS[2], why="no token of it is an answer's" +
                        (" after truncation to --max-tokens" if truncated else ""))
    return Rendered(place, tokens, answer, truncated=truncated)


__all__ = ["OVERLONG", "REASONS", "ChatSettings", "Rendered", "render_row", "render_rows", "start_worker"]
