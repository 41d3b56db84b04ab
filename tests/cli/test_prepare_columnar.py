"""``mgpu-prepare`` on Parquet files and on Hugging Face ``datasets`` saved to disk (Arrow), through its ``main`` in
this process: the tokens must be those of the same documents given as JSONL (the JSONL reader is the expected
value), and every bad input is named before anything is tokenised.

The saved datasets are written here with pyarrow the way ``datasets.Dataset.save_to_disk`` (5.2.0) writes them: one
Arrow IPC *stream* per shard, ``data-0000K-of-0000N.arrow``, its schema carrying ``datasets``' features under the
``huggingface`` key, record batches of at most ``writer_batch_size`` rows; ``state.json`` listing the shards in order;
``dataset_info.json``; and, for a ``DatasetDict``, ``dataset_dict.json`` naming the split subdirectories.
``datasets`` itself is not a test dependency (it brings pandas and a hub client with it)."""

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import corpus_text, make_tokenizer

import lightning_mgpu.data.columnar as columnar
import lightning_mgpu.data.prepare as prep
from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.data.columnar import TextColumn, read_columnar
from lightning_mgpu.data.manifest import read_manifest


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"), n_bytes=100_000)


@pytest.fixture(scope="module")
def documents():
    """90 documents of 200-1,400 characters of the built-in corpus, one of them empty, one not ASCII."""
    text = corpus_text(80_000)
    lengths = [200 + (i * 373) % 1200 for i in range(90)]
    starts = np.cumsum([0] + lengths[:-1])
    docs = [text[s:s + n] for s, n in zip(starts, lengths)]
    docs[7], docs[40] = "", "naïve café — ☕ " + docs[40]
    return docs


def save_to_disk(directory, columns: dict, shards: int = 1, batch_rows: int = 7):
    """A ``Dataset`` directory as ``save_to_disk`` writes one (see the module's docstring); returns it."""
    directory.mkdir(parents=True)
    table = pa.table(columns)
    features = {name: {"dtype": "string" if pa.types.is_string(t) else str(t), "_type": "Value"}
                for name, t in zip(table.schema.names, table.schema.types)}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    per_shard = -(-table.num_rows // shards)
    names = []
    for k in range(shards):
        names.append(f"data-{k:05d}-of-{shards:05d}.arrow")
        with pa.OSFile(str(directory / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.slice(k * per_shard, per_shard).to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    (directory / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}, indent=2))
    (directory / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": features,
                                                             "homepage": "", "license": ""}, indent=2))
    return directory


def prepare_cli(tokenizer_dir, out, *argv, workers=2):
    prepare_main(["--tokenizer", str(tokenizer_dir), "--out", str(out), "--workers", str(workers), "--no-progress",
                  *map(str, argv)])
    return out


def ours(err: str) -> list[str]:
    """The problem lines of a refusal, each "not a readable ..." and "cannot be read ..." cut before pyarrow's own
    words, which other versions may change."""
    return [re.sub(r"(not a readable \w+ file|cannot be read from row \d+ on) \(.*\)$", r"\1 (...)", line)
            for line in err.splitlines()[1:]]


def refusal(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        prepare_main([*map(str, argv), "--no-progress"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("Invalid input:\n  - ") and "Traceback" not in err, err
    return err


def test_parquet_and_saved_datasets_give_the_tokens_of_the_same_jsonl(tmp_path, tokenizer_dir, documents,
                                                                      monkeypatch, capsys):
    """A Parquet file of 4 row groups, a saved Dataset of 3 shards and a DatasetDict's split, each tokenised by two
    processes in units that cut row groups and batches, give byte for byte the tokens of the same documents as JSONL;
    a re-run does nothing, a changed shard or another split is caught."""
    monkeypatch.setattr(prep, "UNIT_BYTES", 5_000)  # several units per file and per row group: both processes work
    ids = list(range(len(documents)))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in zip(ids, documents)))
    expected = prepare_cli(tokenizer_dir, tmp_path / "jsonl", "--text-key", "content", jsonl, workers=1)
    expected_tokens = (expected / "tokens.bin").read_bytes()

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ids, "content": documents, "n": [len(d) for d in documents]}), parquet,
                   row_group_size=25)
    assert pq.ParquetFile(parquet).num_row_groups == 4
    dataset = save_to_disk(tmp_path / "saved", {"content": documents, "id": ids}, shards=3)
    save_to_disk(tmp_path / "dict" / "train", {"content": documents[:50]})
    save_to_disk(tmp_path / "dict" / "test", {"content": documents[50:]})
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    capsys.readouterr()
    # the DatasetDict's train split, then its test split's own directory (a Dataset directory): every document
    for name, inputs in (("parquet", [parquet]), ("saved", [dataset]),
                         ("split", ["--split", "train", tmp_path / "dict", tmp_path / "dict" / "test"])):
        out = prepare_cli(tokenizer_dir, tmp_path / name, "--text-key", "content", *inputs)
        manifest = read_manifest(out)
        assert (out / "tokens.bin").read_bytes() == expected_tokens, name
        assert manifest.document_count == len(documents) and manifest.text_key == "content"
        assert manifest.text_bytes == sum(len(d.encode()) for d in documents)
        assert "throughput:" in capsys.readouterr().out
    assert [os.path.basename(s.path) for s in read_manifest(tmp_path / "saved").sources] == [
        "data-00000-of-00003.arrow", "data-00001-of-00003.arrow", "data-00002-of-00003.arrow"]
    assert [s.path.split("/")[-2] for s in read_manifest(tmp_path / "split").sources] == ["train", "test"]

    prepare_cli(tokenizer_dir, tmp_path / "saved", "--text-key", "content", dataset)
    assert "is up to date: same inputs, same tokenizer" in capsys.readouterr().out
    fix = "give another --out, or pass --overwrite to replace it"
    err = refusal(capsys, "--tokenizer", tokenizer_dir, "--out", tmp_path / "saved", "--text-key", "id", dataset)
    assert "column 'id' is of type int64, not text (string)" in err  # the schema, before the directory
    err = refusal(capsys, "--tokenizer", tokenizer_dir, "--out", tmp_path / "split", "--text-key", "content",
                  "--split", "test", tmp_path / "dict")
    assert "already holds tokens of other inputs (1 input file(s) missing: " in err and fix in err
    save_to_disk(tmp_path / "again", {"content": documents[::-1], "id": ids}, shards=3)
    shard = dataset / "data-00001-of-00003.arrow"
    os.replace(tmp_path / "again" / shard.name, shard)  # the dataset saved anew, one shard different
    err = refusal(capsys, "--tokenizer", tokenizer_dir, "--out", tmp_path / "saved", "--text-key", "content", dataset)
    assert f"1 input file(s) changed since: {shard}" in err and fix in err


def test_bad_parquet_and_arrow_inputs_are_all_named_before_tokenising(tmp_path, tokenizer_dir, capsys, monkeypatch):
    text = tmp_path / "notes.parquet"
    text.write_text("this is not a Parquet file\n" * 10)
    pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), tmp_path / "other.parquet")
    pq.write_table(pa.table({"text": [b"\x00\x01", b"x"]}), tmp_path / "bytes.parquet")
    save_to_disk(tmp_path / "saved", {"title": ["t"], "url": ["u"]})
    (tmp_path / "empty.arrow").write_bytes(b"")
    (tmp_path / "dict" / "train").mkdir(parents=True)
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    (tmp_path / "plain").mkdir()
    called = []
    monkeypatch.setattr(prep, "_tokenise", lambda *a, **k: called.append(a))
    out = tmp_path / "out"
    err = refusal(capsys, "--tokenizer", tokenizer_dir, "--out", out, text, tmp_path / "other.parquet",
                  tmp_path / "bytes.parquet", tmp_path / "saved", tmp_path / "empty.arrow", tmp_path / "dict",
                  tmp_path / "plain")
    assert ours(err) == [f"  - {p}" for p in (
        f"{tmp_path / 'dict'} is a DatasetDict with the splits train, validation; choose one with --split (e.g. "
        "--split train)",
        f"input '{tmp_path / 'plain'}' is a directory, but not a dataset written by save_to_disk (no state.json or "
        f"dataset_dict.json); give its files or a glob, e.g. '{tmp_path / 'plain'}/**/*.txt' or "
        f"'{tmp_path / 'plain'}/*.parquet'",
        f"{text}: not a readable Parquet file (...)",
        f"{tmp_path / 'other.parquet'}: no column 'text' (its columns: id, body); set --text-key to the column with "
        "the text",
        f"{tmp_path / 'bytes.parquet'}: column 'text' is of type binary, not text (string); set --text-key to the "
        "column with the text",
        f"{tmp_path / 'saved' / 'data-00000-of-00001.arrow'}: no column 'text' (its columns: title, url); set "
        "--text-key to the column with the text",
        f"{tmp_path / 'empty.arrow'}: not a readable Arrow file (...)")]
    assert "Parquet magic bytes not found in footer" in err  # pyarrow's words in 26.0.1
    assert not called and not out.exists()
    for argv, fragment in (
            (["--split", "test", tmp_path / "dict"], f"{tmp_path / 'dict'} has no split 'test' (its splits: train, "
                                                      "validation); set --split to one of them"),
            (["--split", "train", tmp_path / "dict"], f"{tmp_path / 'dict' / 'train'} has no state.json"),
            (["--split", "train", tmp_path / "other.parquet"], "--split train: no input is a DatasetDict directory")):
        assert fragment in refusal(capsys, "--tokenizer", tokenizer_dir, "--out", out, *argv)
    (tmp_path / "saved" / "data-00000-of-00001.arrow").unlink()
    assert f"{tmp_path / 'saved' / 'state.json'} lists data-00000-of-00001.arrow, missing from" in refusal(
        capsys, "--tokenizer", tokenizer_dir, "--out", out, tmp_path / "saved")
    monkeypatch.setattr(columnar, "_pyarrow", lambda: None)  # an install without the extra
    assert (f"{tmp_path / 'other.parquet'} and 1 more Parquet/Arrow file(s): reading Parquet and Arrow needs pyarrow, "
            "which is not installed; pip install 'lightning_mgpu[parquet]' (pyarrow)") in refusal(
        capsys, "--tokenizer", tokenizer_dir, "--out", out, tmp_path / "other.parquet", tmp_path / "bytes.parquet")


def test_null_rows_text_that_is_not_utf8_and_corrupt_pages_are_named(tmp_path, tokenizer_dir, capsys):
    """Arrow IPC does not check that strings are UTF-8: a row that is not is named, as are null rows and a Parquet
    file whose pages are damaged (its footer intact), with the other files' problems, and nothing is published."""
    pq.write_table(pa.table({"text": ["a", None, "b", None]}), tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"text": [f"document {i} " * 50 for i in range(300)]}), tmp_path / "damaged.parquet",
                   compression="snappy")
    damaged = bytearray((tmp_path / "damaged.parquet").read_bytes())
    damaged[len(damaged) // 2:len(damaged) // 2 + 200] = b"Z" * 200
    (tmp_path / "damaged.parquet").write_bytes(bytes(damaged))
    bad = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(np.array([0, 2, 4, 6], np.int32).tobytes()),
                                                 pa.py_buffer(b"okok\xe9!")])
    batch = pa.record_batch([bad], names=["text"])
    with pa.OSFile(str(tmp_path / "latin1.arrow"), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    err = refusal(capsys, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out", tmp_path / "nulls.parquet",
                  tmp_path / "latin1.arrow", tmp_path / "damaged.parquet", "--workers", "2")
    assert ours(err) == [
        f"  - {tmp_path / 'nulls.parquet'}: row 1: column 'text' is null (in 2 row(s) of this file); drop or fill "
        "those rows",
        f"  - {tmp_path / 'latin1.arrow'}: row 2: not UTF-8 text (byte 0 is 0xe9); convert it to UTF-8",
        f"  - {tmp_path / 'damaged.parquet'}: cannot be read from row 0 on (...)"]
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_units_cut_a_column_by_its_bytes_of_text_whatever_its_layout(tmp_path):
    """A Parquet file of one row group, an Arrow IPC *file* (not stream) of large_string, string_view and
    dictionary-encoded batches: units of at least ``unit_bytes`` (the file's last excepted), rows numbered through
    the file, the texts those written."""
    texts = [("x" * (i % 13)) + f"row {i}" for i in range(500)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "one.parquet")  # one row group
    assert pq.ParquetFile(tmp_path / "one.parquet").num_row_groups == 1
    schema = pa.schema([("text", pa.large_string())])
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, 500, 60):
            writer.write_batch(pa.record_batch([pa.array(texts[start:start + 60], pa.large_string())], schema=schema))
    views = pa.table({"text": pa.array(texts, pa.string_view())})
    dictionary = pa.table({"text": pa.array(texts).dictionary_encode()})
    for name, table in (("views.arrow", views), ("dictionary.arrow", dictionary)):
        with pa.OSFile(str(tmp_path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=45):
                writer.write_batch(batch)
    assert columnar.schema_problems([tmp_path / n for n in ("one.parquet", "file.arrow", "views.arrow",
                                                            "dictionary.arrow")], "text") == []
    for name in ("one.parquet", "file.arrow", "views.arrow", "dictionary.arrow"):
        units = list(read_columnar(tmp_path / name, "text", unit_bytes=700))
        assert all(errors == [] and isinstance(u, TextColumn) for u, errors in units), name
        assert all(u.text_bytes >= 700 for u, _ in units[:-1]) and 1 < len(units) < 12, name
        assert [u.first_row for u, _ in units] == list(np.cumsum([0] + [len(u.offsets) - 1 for u, _ in units[:-1]]))
        assert [t for u, _ in units for t in u.texts(name)[0]] == texts, name
