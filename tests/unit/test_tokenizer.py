"""Tokenizers by path and the preparation of token directories, in this process (the CLI: tests/configs)."""

import gzip
import json

import numpy as np
import pytest
import torch
from helpers import TEST_EOD, corpus_text, make_tokenizer

from lightning_mgpu.data import TokenFileDataModule
from lightning_mgpu.data.manifest import PreparedDataError, dtype_for, read_manifest
from lightning_mgpu.data.prepare import PrepareError, prepare
from lightning_mgpu.data.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def inputs(tmp_path):
    """Two text files (one document each) and a gzipped JSONL file of 40 documents, from the built-in corpus."""
    text = corpus_text(120_000)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text[:30_000])
    (tmp_path / "in" / "b.txt").write_text(text[30_000:50_000])
    with gzip.open(tmp_path / "in" / "c.jsonl.gz", "wt") as f:
        for i in range(40):
            f.write(json.dumps({"id": i, "text": text[50_000 + i * 1500:50_000 + (i + 1) * 1500]}) + "\n")
    docs = [text[:30_000], text[30_000:50_000]] + [text[50_000 + i * 1500:50_000 + (i + 1) * 1500] for i in range(40)]
    return tmp_path / "in", docs


def test_tokenizer_by_directory_or_file(tokenizer_dir):
    by_dir, by_file = Tokenizer(tokenizer_dir), Tokenizer(tokenizer_dir / "tokenizer.json")
    assert by_dir.sha256 == by_file.sha256 and by_dir.vocab_size == 512
    assert by_dir.eod_token() == (TEST_EOD, by_dir.token_id(TEST_EOD))
    text = "def __init__(self, x):\n    return {'é': x}\n"
    ids = by_dir.encode(text)
    assert len(ids) < 0.6 * len(text.encode()) and by_dir.decode(ids) == text  # BPE merges, exact round trip


def test_bad_tokenizer_paths_are_named(tmp_path, tokenizer_dir):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="is a directory without tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="cannot be read by the tokenizers package"):
        Tokenizer(tmp_path / "bad.json")
    with pytest.raises(TokenizerError, match="'<eos>' is not in the vocabulary"):
        Tokenizer(tokenizer_dir).eod_token("<eos>")


def test_end_of_document_token_from_tokenizer_config_then_by_name(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    vocab = {"<unk>": 0, "a": 1, "</s>": 2, "<|end_of_text|>": 3}
    HFTokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer(tmp_path).eod_token() == ("<|end_of_text|>", 3)  # the first of the known names
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert Tokenizer(tmp_path).eod_token() == ("</s>", 2)  # what the tokenizer's own configuration says
    HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "none.json"))
    with pytest.raises(TokenizerError, match="has no end-of-document token .* name one of its tokens with --eod-token"):
        Tokenizer(tmp_path / "none.json").eod_token()


def test_prepare_writes_each_document_then_the_end_of_document_token(tmp_path, tokenizer_dir, inputs):
    folder, docs = inputs
    result = prepare([str(folder / "*.txt"), str(folder / "*.jsonl.gz")], tokenizer_dir, tmp_path / "out",
                     progress=False)
    tok, m = Tokenizer(tokenizer_dir), result.manifest
    tokens = np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16)
    expected = [i for d in docs for i in tok.encode(d) + [m.eod_id]]
    assert tokens.tolist() == expected
    assert read_manifest(tmp_path / "out") == m
    assert (m.token_count, m.document_count, m.dtype, m.vocab_size, m.eod_token) == (len(expected), 42, "uint16", 512,
                                                                                     TEST_EOD)
    assert m.text_bytes == sum(len(d.encode()) for d in docs[:2]) + sum(
        len(json.dumps({"id": i, "text": d}).encode()) + 1 for i, d in enumerate(docs[2:]))
    assert [s.path.rsplit("/", 1)[1] for s in m.sources] == ["a.txt", "b.txt", "c.jsonl.gz"]
    assert m.tokenizer_sha256 == tok.sha256 and len(m.tokens_sha256) == 64 and result.mb_per_second_per_process > 0


def test_prepare_is_the_same_with_two_processes_and_idempotent(tmp_path, tokenizer_dir, inputs, monkeypatch):
    import lightning_mgpu.data.prepare as prep

    monkeypatch.setattr(prep, "UNIT_BYTES", 8_000)  # several units per file, so both processes work
    folder, _ = inputs
    one = prepare([str(folder / "*")], tokenizer_dir, tmp_path / "one", workers=1, progress=False).manifest
    two = prepare([str(folder / "*")], tokenizer_dir, tmp_path / "two", workers=2, progress=False)
    assert not two.skipped and two.workers == 2
    assert two.manifest.tokens_sha256 == one.tokens_sha256 and two.manifest.token_count == one.token_count
    again = prepare([str(folder / "*")], tokenizer_dir, tmp_path / "two", workers=2, progress=False)
    assert again.skipped and again.manifest == two.manifest


def test_prepare_refuses_what_would_mix_up_a_directory(tmp_path, tokenizer_dir, inputs):
    folder, _ = inputs
    out = tmp_path / "out"
    prepare([str(folder / "a.txt")], tokenizer_dir, out, progress=False)
    other = make_tokenizer(tmp_path / "other", vocab_size=400)
    with pytest.raises(PrepareError, match="was prepared with another tokenizer .* or pass --overwrite"):
        prepare([str(folder / "a.txt")], other, out, progress=False)
    with pytest.raises(PrepareError, match=r"other inputs \(1 input file\(s\) new: .*b.txt"):
        prepare([str(folder / "a.txt"), str(folder / "b.txt")], tokenizer_dir, out, progress=False)
    replaced = prepare([str(folder / "a.txt")], other, out, overwrite=True, progress=False)
    assert not replaced.skipped and read_manifest(out).vocab_size == 400
    (folder / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(PrepareError, match="bad.jsonl:2"):  # an overwrite that fails keeps what was there
        prepare([str(folder / "bad.jsonl")], tokenizer_dir, out, overwrite=True, progress=False)
    assert read_manifest(out) == replaced.manifest
    with open(out / "tokens.bin", "ab") as f:  # a token file changed after preparation
        f.write(b"\0\0")
    with pytest.raises(PreparedDataError, match="has .* bytes, but the manifest lists"):
        read_manifest(out)


def test_a_changed_input_or_token_file_is_noticed(tmp_path, tokenizer_dir, inputs):
    """A re-run after an input changed is refused (not "up to date"); a token file overwritten in place after
    preparation, size unchanged, is refused by the re-run and by training (sampled checksum)."""
    folder, _ = inputs
    out = tmp_path / "out"
    prepare([str(folder / "a.txt")], tokenizer_dir, out, progress=False)
    (folder / "a.txt").write_text((folder / "a.txt").read_text()[:-10] + "# changed\n")
    with pytest.raises(PrepareError, match=r"other inputs .*changed since: .*a.txt"):
        prepare([str(folder / "a.txt")], tokenizer_dir, out, progress=False)
    prepare([str(folder / "a.txt")], tokenizer_dir, out, overwrite=True, progress=False)
    size = (out / "tokens.bin").stat().st_size
    with open(out / "tokens.bin", "r+b") as f:  # the middle of the file, where no other check looks
        f.seek(size // 2 - (size // 2) % 4)
        f.write(b"\x07\x00" * 2000)
    assert (out / "tokens.bin").stat().st_size == size
    with pytest.raises(PreparedDataError, match="does not match the checksum"):
        read_manifest(out)
    with pytest.raises(PrepareError, match="checksum"):
        prepare([str(folder / "a.txt")], tokenizer_dir, out, progress=False)


def test_naming_the_token_file_of_a_prepared_directory_reads_it_through_its_manifest(tmp_path, tokenizer_dir, inputs):
    """data.path=DIR/tokens.bin must not read the file as a bare stream of data.dtype (a uint32 directory read as
    uint16 would give two garbage ids per token, past every vocabulary check)."""
    folder, _ = inputs
    out = tmp_path / "out"
    prepare([str(folder / "*")], tokenizer_dir, out, progress=False)
    by_dir, by_file = (TokenFileDataModule(p, seq_len=16, global_batch_size=4, micro_batch_size=2, dtype="uint32")
                       for p in (out, out / "tokens.bin"))
    for dm in (by_dir, by_file):
        dm.setup("fit")
    assert torch.equal(next(iter(by_dir.train_dataloader())), next(iter(by_file.train_dataloader())))
    assert read_manifest(out / "tokens.bin") == read_manifest(out)


def test_bad_inputs_name_file_and_line_all_at_once(tmp_path, tokenizer_dir, monkeypatch):
    import lightning_mgpu.data.prepare as prep

    monkeypatch.setattr(prep, "MAX_PROBLEMS", 4)
    good, bad, corrupt = tmp_path / "good.jsonl", tmp_path / "bad.jsonl", tmp_path / "x.jsonl.gz"
    good.write_text('{"text": "a"}\n')
    bad.write_text('{"text": "a"}\n\n{"text": 3}\n{"body": "b"}\n{oops\n[1]\n"s"\n')
    corrupt.write_bytes(b"not gzip")
    with pytest.raises(PrepareError) as err:
        prepare([str(good), str(bad), str(corrupt)], tokenizer_dir, tmp_path / "out", progress=False, workers=2)
    assert err.value.problems == [
        f"{bad}:3: field 'text' is a int, not a string",
        f"{bad}:4: no 'text' field (its fields: body); set --text-key to the field with the text",
        f"{bad}:5: not a JSON line (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); fix "
        "the line or remove it",
        f"{bad}:6: no 'text' field (it is not an object); set --text-key to the field with the text",
        "... and 2 more"]  # line 7, and the file that is not gzip
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("*"))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    for inputs, fragment in (([str(tmp_path / "*.none")], "matches no file"),
                             ([str(tmp_path / "missing.txt")], "does not exist"),
                             ([str(tmp_path)], "is a directory, but not a dataset written by save_to_disk"),
                             ([str(corrupt)], f"{corrupt}:1: cannot be read (Not a gzipped file"),
                             ([str(tmp_path / "latin1.txt")], "latin1.txt: not UTF-8 text (byte 3 is 0xe9)")):
        with pytest.raises(PrepareError) as err:
            prepare(inputs, tokenizer_dir, tmp_path / "out", progress=False)
        assert fragment in str(err.value)


def test_uint32_tokens_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    assert (dtype_for(65_536), dtype_for(65_537)) == ("uint16", "uint32")
    tok = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 70_000, "</s>": 70_001}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "t.txt").write_text("a b b a")
    m = prepare([str(tmp_path / "t.txt")], tmp_path / "big.json", tmp_path / "out", progress=False).manifest
    assert (m.dtype, m.vocab_size) == ("uint32", 70_002)
    assert np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint32).tolist() == [1, 70_000, 70_000, 1, 70_001]


def test_training_reads_a_prepared_directory_and_checks_its_tokenizer(tmp_path, tokenizer_dir, inputs):
    folder, _ = inputs
    out = tmp_path / "out"
    prepare([str(folder / "*")], tokenizer_dir, out, progress=False)
    dm = TokenFileDataModule(out, seq_len=16, global_batch_size=4, micro_batch_size=2, dtype="uint32",
                             tokenizer=tokenizer_dir)  # the manifest's dtype, not data.dtype, reads a directory
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 17) and int(batch.max()) < 512 and int(batch.max()) > 255
    other = make_tokenizer(tmp_path / "other", vocab_size=400)
    with pytest.raises(ValueError, match=r"data.tokenizer=.* is not the tokenizer .* was prepared with"):
        TokenFileDataModule(out, seq_len=16, global_batch_size=4, micro_batch_size=2, tokenizer=other).setup("fit")


def test_text_files_with_a_tokenizer_are_prepared_into_the_cache(tmp_path, tokenizer_dir, inputs):
    from lightning_mgpu.data import TextFilesDataModule

    folder, docs = inputs
    dm = TextFilesDataModule([str(folder / "*.txt")], seq_len=16, global_batch_size=4, micro_batch_size=2,
                             cache=str(tmp_path / "cache"), tokenizer=tokenizer_dir)
    path = dm.token_file()
    assert path.parent == tmp_path / "cache" and read_manifest(path).document_count == 2
    tok = Tokenizer(tokenizer_dir)
    assert tok.decode(np.fromfile(path / "tokens.bin", dtype=np.uint16)) == docs[0] + TEST_EOD + docs[1] + TEST_EOD
    assert dm.token_file() == path  # cached
