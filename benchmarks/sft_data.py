"""Preparation throughput of ``mgpu-prepare --chat`` and packing efficiency of ``data=sft``.

Conversations like the tests' (tests/chat_helpers.py: a third prompt/completion pairs, the rest a system turn and 1-3
user/assistant exchanges of 1-10 words) rendered with the tests' 400-token BPE chat tokenizer, once with a template
that has ``{% generation %}`` markers and once with one that has none (the prefix-diff rule renders each conversation
once per assistant turn more), with 1 and 2 processes. Prints conversations per second in all and per process, then
the packing (best-fit decreasing) of the prepared conversations at several sequence lengths: the share of each
sequence's tokens that are conversations' (the rest is padding) and that are answers', beside padding each
conversation to a sequence of its own (as many sequences as conversations; at one sequence length a step with the document mask took the time of one
without it in benchmarks/document_mask.py, so the ratio of the sequence counts estimates that of the steps an epoch
takes; step times of the two are not measured here).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chat_helpers import MARKED, PLAIN, conversations, make_chat_tokenizer, write_jsonl  # noqa: E402
from smoke import sized  # noqa: E402

from lightning_mgpu.data.chat import prepare_chat  # noqa: E402
from lightning_mgpu.data.sft import SFTDataModule  # noqa: E402

ROWS = sized(20_000, 60)
SEQ_LENS = (128, 256, 512, 1024)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="sft-bench-"))
    data = write_jsonl(root / "chat.jsonl", conversations(ROWS))
    for name, template in (("generation-markers", MARKED), ("prefix-diff", PLAIN)):
        tok = make_chat_tokenizer(root / name, template)
        for workers in (1, 2):
            start = time.perf_counter()
            result = prepare_chat([data], tok, root / f"{name}-{workers}", workers=workers, max_tokens=129,
                                  overlong="truncate")
            seconds = time.perf_counter() - start
            kept = result.manifest.chat["conversations"]
            print(f"{name:<18} {workers} process(es): {kept:,} conversations in {seconds:.2f} s = "
                  f"{kept / seconds:,.0f}/s, {kept / seconds / workers:,.0f}/s per process")
    out = root / "prefix-diff-1"
    for seq_len in SEQ_LENS:
        module = SFTDataModule(out, seq_len=seq_len, val_fraction=0.01)
        train = module.splits()[0]
        p = train.packing
        per = p.capacity * len(p.sequences)
        print(f"seq_len {seq_len:>5}: {len(p.sequences):,} sequences, {p.efficiency:.1%} conversation tokens "
              f"({p.used_tokens / len(p.sequences):.1f} per sequence), {train.answer_tokens() / per:.1%} answer tokens "
              f"({train.answer_tokens() / len(p.sequences):.1f} per sequence); padded, one conversation a sequence: "
              f"{len(train.starts) - 1:,} sequences, {p.used_tokens / ((len(train.starts) - 1) * p.capacity):.1%} "
              f"conversation tokens")


if __name__ == "__main__":
    main()
