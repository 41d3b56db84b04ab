"""Tiny chat tokenizers and conversations, built in the test (no download): a byte-level BPE tokenizer with
``<|im_start|>`` / ``<|im_end|>`` turns, saved as a transformers tokenizer directory with a chat template with or
without ``{% generation %}`` markers."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import TEST_EOD, make_tokenizer

PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: Renders only the last assistant answer in full, earlier ones shortened: the prefix-diff rule cannot apply.
REWRITING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
             "...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the cat sat on a mat while dogs ran far away from home and then came back for dinner".split()


def make_chat_tokenizer(directory: Path, template: str = PLAIN) -> Path:
    from tokenizers import Tokenizer

    directory = make_tokenizer(Path(directory), vocab_size=400, n_bytes=30_000)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TEST_EOD, "chat_template": template}))
    return directory


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows, every third a prompt/completion pair, the others multi-turn ``messages`` of unequal lengths."""
    import random

    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        if i % 3 == 0:
            rows.append({"prompt": say(rng.randint(2, 8)), "completion": say(rng.randint(1, 10))})
            continue
        turns = [{"role": "system", "content": say(3)}]
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": say(rng.randint(2, 6))},
                      {"role": "assistant", "content": say(rng.randint(1, 8))}]
        rows.append({"messages": turns})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def short_conversations(n: int) -> list[dict]:
    """Conversations of one or two short exchanges (unequal answers): 10 to about 70 tokens with the test tokenizer."""
    import numpy as np

    rng = np.random.default_rng(1)
    words = "cat sat mat dog ran far home back".split()
    say = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    rows = []
    for i in range(n):
        turns = []
        for _ in range(1 + i % 2):
            turns += [{"role": "user", "content": say(rng.integers(1, 3))},
                      {"role": "assistant", "content": say(rng.integers(1, 6))}]
        rows.append({"messages": turns})
    return rows
