"""Data: layout-independent global batches, batch arithmetic, the built-in corpus, text files."""

import json

import numpy as np
import pytest
import torch

from lightning_mgpu.data import BatchPlan, StdlibCorpusDataModule, TextFilesDataModule, TokenFileDataModule
from lightning_mgpu.data.corpus import decode_bytes, encode_bytes, stdlib_source_files
from lightning_mgpu.data.tokens import _WindowBatches


def global_batches(tokens, dp_size, steps=3, first_step=0):
    """The global batches seen by dp_size ranks, reassembled in rank order."""
    plan = BatchPlan(8, 2, dp_size)
    per_rank = [list(_WindowBatches(tokens, 16, 3, plan, r, lambda: first_step, steps)) for r in range(dp_size)]
    return [torch.cat([per_rank[r][s] for r in range(dp_size)]) for s in range(steps)]


def test_global_batches_do_not_depend_on_data_parallel_size():
    tokens = np.arange(5000, dtype=np.uint16)
    one = global_batches(tokens, 1)
    for dp in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(one, global_batches(tokens, dp)))
    assert not torch.equal(one[0], one[1])  # different steps draw different windows


def test_stream_restarts_at_saved_position():
    tokens = np.arange(5000, dtype=np.uint16)
    full = global_batches(tokens, 2, steps=4)
    resumed = global_batches(tokens, 2, steps=2, first_step=2)
    assert torch.equal(full[2], resumed[0]) and torch.equal(full[3], resumed[1])


def test_batch_plan_arithmetic_and_description():
    plan = BatchPlan(32, 4, 2, seq_len=128)
    assert (plan.per_rank, plan.num_microbatches) == (16, 4)
    assert plan.describe() == ("global batch 32 = 4 per micro-batch x 4 micro-batches x 2 data-parallel replicas = "
                               "4,096 tokens per step; 4 gradient-accumulation steps per optimizer step")
    assert plan.describe(pipeline_parallel_size=2).endswith(
        "; the 4 micro-batches flow through 2 pipeline ranks, one optimizer step per schedule")


def test_batch_plan_refuses_non_dividing_sizes_with_nearest_values():
    with pytest.raises(ValueError) as err:
        BatchPlan(30, 4, 2)
    assert "use data.global_batch_size=24 or 32" in str(err.value)
    with pytest.raises(ValueError, match="data.micro_batch_size=0 must be a positive integer"):
        BatchPlan(8, 0, 2)


def test_builtin_corpus_is_python_source(tmp_path):
    files = stdlib_source_files()
    assert any(f.name == "os.py" for f in files)
    dm = StdlibCorpusDataModule(seq_len=32, global_batch_size=4, micro_batch_size=2, cache=str(tmp_path))
    path = dm.token_file()
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    assert len(tokens) > 1_000_000 and tokens.max() < 256
    assert "def " in decode_bytes(tokens[:20000])
    assert dm.token_file() == path  # cached


def test_text_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 200)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(100)))
    dm = TextFilesDataModule([str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl")], seq_len=8, global_batch_size=2,
                             micro_batch_size=1, cache=str(tmp_path / "cache"))
    tokens = np.memmap(dm.token_file(), dtype=np.uint16, mode="r")
    text = decode_bytes(tokens)
    assert text.startswith("hello world") and "line 99" in text


def test_missing_inputs_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="matched no files"):
        TextFilesDataModule(str(tmp_path / "*.none")).token_file()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenFileDataModule(tmp_path / "missing.bin").token_file()
    with pytest.raises(ValueError, match="data.dtype='int8'"):
        TokenFileDataModule(tmp_path / "x.bin", dtype="int8")


def test_byte_tokens_round_trip():
    assert decode_bytes(encode_bytes("héllo")) == "héllo"
