"""Preparation throughput of ``mgpu-prepare --chat`` and packing efficiency of ``data=sft``.

Conversations like the tests' (tests/chat_helpers.py: a third prompt/completion pairs, the rest a system turn and 1-3
user/assistant exchanges of 1-10 words) rendered with the tests' 400-token BPE chat tokenizer, once with a template
that has ``{% generation %}`` markers and once with one that has none (the prefix-diff rule renders each conversation
once per assistant turn more), with 1 and 2 processes. Prints conversations per second in all and per process, then
the packing (best-fit decreasing) of the prepared conversations at several sequence lengths: the share of each
sequence's tokens that are conversations' (the rest is padding) and that are answers', beside padding each
conversation to a sequence of its own (as many sequences as conversations). Last, the step time of the same
conversations trained both ways by the package's model in one process (fp32, AdamW): packed sequences of seq_len + 1
with the document mask, against batches of as many conversations each padded to the batch's longest (the padding
collator of most SFT trainers), each step ``BATCH`` rows; the time of a pass over all of them is the step time times
the steps each way needs (one thread).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chat_helpers import MARKED, PLAIN, conversations, make_chat_tokenizer, write_jsonl  # noqa: E402
from record import recorded  # noqa: E402
from smoke import sized  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_mgpu.data.chat import prepare_chat  # noqa: E402
from lightning_mgpu.data.sft import IGNORE_INDEX, PackedConversations, SFTDataModule  # noqa: E402
from lightning_mgpu.models import LlamaConfig  # noqa: E402
from lightning_mgpu.models.llama import Llama  # noqa: E402

ROWS = sized(20_000, 60)
SEQ_LENS = (128, 256, 512, 1024)
#: The step-time comparison: rows per step, timed steps (after one not timed), the packed length, model width and depth.
BATCH, STEPS, STEP_SEQ = sized(8, 2), sized(10, 2), sized(256, 128)
DIM, LAYERS = sized(128, 32), sized(4, 1)


def main() -> Path:
    """Preparation and packing; the directory of the prefix-diff conversations prepared by one process."""
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
    return out


def padded_batch(train: PackedConversations, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations ``first ... first + rows - 1``, one a row, padded to the longest with the end-of-document id and
    labelled -100 there: (token ids, labels)."""
    parts = [(int(train.starts[d]), int(train.starts[d + 1])) for d in range(first, first + rows)]
    longest = max(hi - lo for lo, hi in parts)
    ids = np.full((rows, longest), train.pad_id, dtype=np.int64)
    labels = np.full((rows, longest), IGNORE_INDEX, dtype=np.int64)
    for row, (lo, hi) in enumerate(parts):
        ids[row, :hi - lo] = train.tokens[lo:hi]
        labels[row, :hi - lo] = np.where(train.mask[lo:hi] != 0, train.tokens[lo:hi].astype(np.int64), IGNORE_INDEX)
    return torch.from_numpy(ids), torch.from_numpy(labels)


def timed_steps(model: Llama, batches: list, eod: int) -> float:
    """Seconds per optimizer step (forward, backward, AdamW) over ``batches`` after one untimed step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> None:
        inputs, targets = tokens[:, :-1], labels[:, 1:].masked_fill(tokens[:, :-1] == eod, IGNORE_INDEX)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(*batches[0])
    start = time.perf_counter()
    for batch in batches[1:]:
        step(*batch)
    return (time.perf_counter() - start) / (len(batches) - 1)


def step_times(out: Path) -> None:
    """Packed against padded batches of the same conversations: step time, steps a pass, time a pass."""
    train = SFTDataModule(out, seq_len=STEP_SEQ, val_fraction=0.01).splits()[0]
    conversations, eod = len(train.starts) - 1, train.pad_id
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: two on these 2 shared cores made steps 3-14x slower and erratic
    config = LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=4, n_kv_heads=2, ffn_hidden=3 * DIM, vocab_size=416,
                         max_seq_len=STEP_SEQ + 1, eod_token_id=eod)
    packed = [train.batch(0, k, BATCH, 0, BATCH) for k in range(STEPS + 1)]
    padded = [padded_batch(train, k * BATCH, BATCH) for k in range(STEPS + 1)]
    print(f"the package's Llama: dim {DIM}, {LAYERS} layers, 4 heads, 2 key/value heads, FFN {3 * DIM}, vocabulary 416, fp32, AdamW, one "
          f"process, one thread; packed rows of seq_len {STEP_SEQ} + 1; the mean of {STEPS} steps after one untimed")
    results = {}
    for name, batches in (("packed", packed), ("padded", padded)):
        torch.manual_seed(0)
        seconds = timed_steps(Llama(config), batches, eod)
        steps = -(-(len(train) if name == "packed" else conversations) // BATCH)
        width = float(np.mean([b[0].shape[1] for b in batches]))
        results[name] = seconds * steps
        print(f"{name:<6} {BATCH} rows of {width:.0f} tokens a step: {seconds * 1e3:.1f} ms a step, {steps:,} steps "
              f"a pass over the {conversations:,} conversations = {seconds * steps:.1f} s")
    print(f"ratio padded / packed, time of a pass: {results['padded'] / results['packed']:.2f}")


if __name__ == "__main__":
    with recorded(__file__, "Conversations: preparation and packing", about=__doc__.split(" Last, ")[0]):
        prepared = main()
    with recorded(__file__, "Conversations: packed against padded step time", about="The" + __doc__.split(" Last, the")[1],
                  name="sft_step_time"):
        step_times(prepared)
