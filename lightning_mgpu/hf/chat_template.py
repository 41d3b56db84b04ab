"""A tokenizer directory's own chat template, rendered through ``transformers`` (its sandboxed jinja2 renderer), with
the mask of the tokens a conversation's assistant turns contribute.

Nothing is downloaded (``local_files_only``) and nothing of the directory runs but the template (no remote code). Two
rules give the answer mask, and :attr:`ChatTemplate.rule` says which one a template gets:

- ``generation-markers``: the template wraps assistant text in ``{% generation %}`` ... ``{% endgeneration %}``;
  transformers' ``return_assistant_tokens_mask=True`` marks the tokens inside.
- ``prefix-diff``: any other template (Llama 3.1, Qwen3, Gemma 3 ... have no markers, and transformers then returns an
  all-zero mask with only a warning). Each assistant turn ``i`` is what rendering ``messages[:i + 1]`` adds to rendering
  ``messages[:i]`` with the generation prompt; the conversation's text must begin with both renderings (a template that
  rewrites earlier turns, e.g. one that drops earlier reasoning, is refused for that conversation, by name).

Marks are made on characters and carried to tokens by the tokenizer's offsets: a token counts when its first
character lies in an answer.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Sequence

#: A chat template that carries generation markers.
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
RULES = ("generation-markers", "prefix-diff")


class ChatTemplateError(ValueError):
    """A conversation (or a tokenizer directory) the template cannot render as asked; the message says why."""


class ChatTemplate:
    """The chat template and tokenizer of a Hugging Face tokenizer directory."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True,
                                                           trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise ChatTemplateError(f"--tokenizer {str(directory)!r} cannot be loaded by transformers' AutoTokenizer "
                                    f"({_first_line(err)}); give a tokenizer directory saved by transformers "
                                    "(tokenizer.json and tokenizer_config.json)") from None
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        if not template:
            raise ChatTemplateError(f"--tokenizer {str(directory)!r} has no chat template (no chat_template in "
                                    "tokenizer_config.json, no chat_template.jinja); give a chat model's tokenizer "
                                    "directory or add its template")
        self.template: str = template
        self.rule: str = RULES[0] if _GENERATION.search(template) else RULES[1]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def render(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(token ids, answer mask: 1 on each token an assistant turn contributes) of one conversation."""
        if self.rule == RULES[0]:
            out = self.tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        text = self._text(messages, False)
        spans = [self._answer_span(messages, i, text) for i, m in enumerate(messages) if m.get("role") == "assistant"]
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in encoded["offset_mapping"]]
        mask = [int(any(lo <= s < hi for lo, hi in spans)) for s in starts]
        return list(encoded["input_ids"]), mask

    def _text(self, messages: Sequence[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _answer_span(self, messages: Sequence[dict[str, Any]], i: int, text: str) -> tuple[int, int]:
        """Characters of ``text`` that assistant turn ``i`` adds to the conversation before it."""
        before = self._text(messages[:i], True) if i else ""
        through = self._text(messages[: i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ChatTemplateError(f"turn {i} (assistant): the template renders the conversation up to it differently "
                                    "from the start of the whole conversation (it rewrites earlier turns), so the "
                                    "prefix-diff rule cannot find its answer; add {% generation %} markers to the "
                                    "template, or split such conversations at that turn")
        return len(before), len(through)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


__all__ = ["RULES", "ChatTemplate", "ChatTemplateError"]
