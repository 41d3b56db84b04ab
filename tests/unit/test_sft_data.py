"""SFTDataModule's batches: answer-only labels, every rank's slice of one global batch, and a resumed run continuing at
the saved global batch."""

import numpy as np
import torch
from chat_helpers import make_chat_tokenizer, short_conversations, write_jsonl

from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.data.batching import BatchPlan
from lightning_mgpu.data.sft import SFTDataModule


def prepared(tmp_path):
    tok = make_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", short_conversations(40))
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / "sft"), str(data), "--workers", "1",
                  "--max-tokens", "65", "--no-progress"])
    return tmp_path / "sft"


def test_labels_are_the_answer_tokens_and_ranks_share_one_global_batch_and_resume_continues(tmp_path):
    """Labels equal the token where mask.bin says answer, -100 elsewhere (read here from the files); two ranks' slices
    are the one-rank batch; a module loaded with next_global_batch=2 yields global batch 2 first. Broken once
    (load_state_dict ignored): the resumed module yielded batch 0."""
    path = prepared(tmp_path)
    one = SFTDataModule(path, seq_len=64, global_batch_size=4, micro_batch_size=2, seed=3, val_fraction=0.1)
    train = one.splits()[0]
    tokens, labels = train.batch(3, 0, 4, 0, 4)
    mask = np.fromfile(path / "mask.bin", np.uint8).astype(bool)
    drawn = np.random.default_rng([3, 0]).permutation(len(train))[:4]  # the first pass's order (module docstring)
    documents = [d for i in drawn for d in train.packing.sequences[i]]
    assert int((labels != -100).sum()) == sum(int(mask[train.starts[d]:train.starts[d + 1]].sum()) for d in documents)
    assert torch.equal(labels[labels != -100], tokens[labels != -100])
    halves = [train.batch(3, 0, 4, lo, lo + 2) for lo in (0, 2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), tokens)
    resumed = SFTDataModule(path, seq_len=64, global_batch_size=4, micro_batch_size=2, seed=3, val_fraction=0.1)
    resumed.load_state_dict({"next_global_batch": 2})
    resumed.batch_plan, resumed._train = BatchPlan(4, 2, 1, 64), resumed.splits()[0]
    first = next(iter(resumed.train_dataloader()))
    assert torch.equal(first[0], train.batch(3, 2, 4, 0, 4)[0])
    assert not torch.equal(first[0], tokens)
