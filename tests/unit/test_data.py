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


def test_skipped_global_batches_are_never_drawn_and_the_position_counts_drawn_ones():
    tokens = np.arange(5000, dtype=np.uint16)
    plan = BatchPlan(8, 2, 1)
    full = list(_WindowBatches(tokens, 16, 3, plan, 0, lambda: 0, 7))
    skipping = list(_WindowBatches(tokens, 16, 3, plan, 0, lambda: 0, 5, frozenset({1, 4})))
    assert [b.tolist() for b in skipping] == [full[i].tolist() for i in (0, 2, 3, 5, 6)]
    # resumed after 2 drawn batches (0 and 2): batches 3, 5, 6 follow
    resumed = list(_WindowBatches(tokens, 16, 3, plan, 0, lambda: 2, 3, frozenset({1, 4})))
    assert [b.tolist() for b in resumed] == [full[i].tolist() for i in (3, 5, 6)]


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


# ------------------------------------------------------------------------------------------------------- blends
def two_sources(directory=None):
    """Source A holds ids 0..999, source B ids 1000..1999: a window's first token says where it was drawn."""
    a = (np.arange(30_000) % 1000).astype(np.uint16)
    b = (1000 + np.arange(20_000) % 1000).astype(np.uint16)
    if directory is None:
        return a, b
    a.tofile(directory / "a.u16")
    b.tofile(directory / "b.u16")
    return directory / "a.u16", directory / "b.u16"


def test_blend_realises_its_weights():
    """Over 2,000 global batches of 8 (n = 16,000 samples) the count drawn from B (weight 0.3) is binomial(n, 0.3):
    mean 4,800, standard deviation sqrt(n x 0.3 x 0.7) = 58. 4.5 standard deviations (261 samples, 1.6 points of
    share) fail a correct sampler with probability 7e-6, and the draw is fixed by the seed, so it cannot flake; a
    sampler that ignored the weights (8,000) or swapped them (11,200) is 55 standard deviations away."""
    from lightning_mgpu.data.blend import Blend

    a, b = two_sources()
    blend = Blend.of([a, b], [0.7, 0.3])
    n, from_b = 0, 0
    for step in range(2000):
        windows = blend.windows(seed=11, step=step, global_batch_size=8, seq_len=16, lo=0, hi=8)
        in_b = windows >= 1000
        assert (in_b.all(axis=1) | ~in_b.any(axis=1)).all()  # every sample lies within one source
        n, from_b = n + len(windows), from_b + int(in_b[:, 0].sum())
    sd = (n * 0.3 * 0.7) ** 0.5
    assert abs(from_b - 0.3 * n) < 4.5 * sd, (from_b, n)
    same = Blend.of([a, b], [7, 3])  # weights are relative
    assert np.array_equal(same.windows(11, 5, 8, 16, 0, 8), blend.windows(11, 5, 8, 16, 0, 8))


def test_blended_global_batches_do_not_depend_on_data_parallel_size():
    from lightning_mgpu.data.blend import Blend

    blend = Blend.of(two_sources(), [0.5, 0.5])
    one = global_batches(blend, 1)
    assert any(bool((g >= 1000).any() and (g < 1000).any()) for g in one)  # batches mix the sources sample by sample
    for dp in (2, 4):
        assert all(torch.equal(x, y) for x, y in zip(one, global_batches(blend, dp)))


def test_blend_resumes_exactly_at_its_saved_position(tmp_path):
    sources = list(zip(two_sources(tmp_path), (0.7, 0.3)))

    def batches(state=None, n=5):
        dm = TokenFileDataModule(sources=sources, seq_len=16, global_batch_size=8, micro_batch_size=2, seed=5)
        if state is not None:
            dm.load_state_dict(state)
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        return dm, [next(it) for _ in range(n)]

    full_dm, full = batches()
    assert full_dm.state_dict()["next_global_batch"] == 0
    resumed_dm, resumed = batches({"next_global_batch": 3, "seed": 5, "global_batch_size": 8}, n=2)
    assert resumed_dm.state_dict()["next_global_batch"] == 3
    assert torch.equal(full[3], resumed[0]) and torch.equal(full[4], resumed[1])
    assert not torch.equal(full[0], resumed[0])
    saved = full_dm.state_dict()
    with pytest.warns(UserWarning, match=r"other data settings than the checkpoint's \(sources: .*0.7.* -> .*0.5"):
        TokenFileDataModule(sources=[(p, 0.5) for p, _ in sources], seq_len=16, global_batch_size=8,
                            seed=5).load_state_dict(saved)
    val = next(iter(full_dm.val_dataloader()))  # validation draws from the held-out last 1% of each source
    assert val.shape == (8, 17) and bool((((val >= 700) & (val < 1000)) | (val >= 1800)).all())


def test_blend_refuses_bad_weights_and_short_sources(tmp_path):
    a, b = two_sources(tmp_path)
    np.arange(15, dtype=np.uint16).tofile(tmp_path / "short.u16")
    with pytest.raises(ValueError, match=r"b.u16: weight=0.0 must be a number > 0"):
        TokenFileDataModule(sources=[(a, 1), (b, 0)], seq_len=16).setup("fit")
    with pytest.raises(ValueError, match="the training split of .*short.u16 has 14 tokens, fewer than data.seq_len"):
        TokenFileDataModule(sources=[(a, 1), (tmp_path / "short.u16", 1)], seq_len=16).setup("fit")
    with pytest.raises(ValueError, match="give data.path .* or data.sources .*, not both"):
        TokenFileDataModule(a, sources=[(b, 1)])
