"""What a rule returns when a value breaks it, and the one way a list of them becomes a message.

A rule lives beside the object whose field it constrains (the layout, the model shape, the precision, the checkpoint
formats, the data) and returns :class:`Problem` objects: the field, the value, the rule it breaks and the fix. The
strategy, the CLI, the planner's search and the dry run ask the same rule; the CLI names a problem by its config
key through one table (:meth:`Problem.keyed`) instead of parsing the text, and :func:`format_problems` writes every
message. Plain strings are accepted wherever a problem is, for rules whose message is already a whole sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Union


#: A setting's name inside a problem's text: a word not already part of a dotted key.
_SETTING = re.compile(r"(?<![\w.*])[a-z_][a-z0-9_]*(?![\w.(])")


@dataclass(frozen=True)
class Problem:
    """``field=value`` breaks ``rule``; ``fix`` says what to set instead (may be empty)."""

    field: str
    value: Any
    rule: str
    fix: str = ""

    def __str__(self) -> str:
        line = f"{self.field}={self.value!r} {self.rule}"
        return f"{line}; {self.fix}" if self.fix else line

    def keyed(self, keys: Mapping[str, str]) -> "Problem":
        """The same problem named by config keys: ``field`` and every setting its rule and fix mention, through
        the table ``keys`` (setting name -> config key); names the table does not hold stay as they are."""
        def rename(text: str) -> str:
            return _SETTING.sub(lambda m: keys.get(m.group(0), m.group(0)), text)

        return replace(self, field=rename(self.field), rule=rename(self.rule), fix=rename(self.fix))


#: A rule's result: a structured problem or a whole sentence.
AnyProblem = Union[Problem, str]


def format_problems(title: str, problems: Iterable[AnyProblem]) -> str:
    """``title:`` and one indented line per problem: the message of every refusal in the package."""
    return f"{title}:\n" + "\n".join(f"  - {p}" for p in problems)


def raise_problems(title: str, problems: Iterable[AnyProblem], error: type[Exception] = ValueError) -> None:
    """Raise ``error`` listing every problem at once; nothing when there is none."""
    problems = list(problems)
    if problems:
        raise error(format_problems(title, problems))
