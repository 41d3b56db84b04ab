"""Bring your data: a tokenizer, ``mgpu-prepare``, then ``mgpu-train data=tokens`` through the command lines, and
the checks ``mgpu-train`` makes of tokenizers, prepared directories and blends before launch."""

import gzip
import json

import pytest
import torch
from helpers import TEST_EOD, corpus_text, make_tokenizer
from cli_helpers import BIN, composed, read_losses, read_metric
from forked_cli import run_cli

from lightning_mgpu.cli.build import build_datamodule, build_tokenizer
from lightning_mgpu.cli.run_data import resolve_data
from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.cli.spec import config_problems, run_spec
from lightning_mgpu.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of two text files and a gzipped JSONL file (80 documents): 300 kB of the built-in corpus."""
    folder = tmp_path_factory.mktemp("corpus")
    text = corpus_text(300_000)
    (folder / "a.txt").write_text(text[:100_000])
    (folder / "b.txt").write_text(text[100_000:180_000])
    with gzip.open(folder / "c.jsonl.gz", "wt") as f:
        for i in range(80):
            f.write(json.dumps({"text": text[180_000 + i * 1500:180_000 + (i + 1) * 1500]}) + "\n")
    return folder


def prepared(tmp_path, tokenizer_dir, corpus, name="data", *inputs):
    prepare_main(["--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / name), "--workers", "1",
                  "--no-progress", *(inputs or [str(corpus / "*")])])
    return tmp_path / name


def test_prepare_then_train_through_the_command_lines(tmp_path, tokenizer_dir, corpus):
    """Two processes tokenise; one mgpu-train process trains with the document mask (from the manifest's
    end-of-document id), validates and prints a sample decoded by the tokenizer (a byte decoder yields at most one
    character per generated token; BPE tokens yield more)."""
    out = tmp_path / "tokens"
    prep = run_cli([str(BIN / "mgpu-prepare"), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                    "--workers", "2", str(corpus / "*.txt"), str(corpus / "*.jsonl.gz")], timeout=120)
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert "tokens (uint16, vocabulary 512" in prep.stdout and "MB/s per process (2 processes)" in prep.stdout
    assert "tokenizing" in prep.stderr  # the progress bar
    run_dir, prompt, new_tokens = tmp_path / "run", "def ", 40
    train = run_cli(
        [str(BIN / "mgpu-train"), "data=tokens", f"data.path={out}", f"data.tokenizer={tokenizer_dir}", "model=tiny",
         "model.vocab_size=512", "data.document_mask=true", "trainer.devices=1", "trainer.max_steps=4",
         "data.seq_len=32", "data.global_batch_size=4", "data.micro_batch_size=2", "data.val_batches=2",
         f"sample.prompt='{prompt}'",
         f"sample.max_new_tokens={new_tokens}", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, timeout=240)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-4000:]
    assert len(read_losses(run_dir / "metrics.csv")) == 4 and len(read_metric(run_dir / "metrics.csv", "val/loss")) == 1
    sample = train.stdout.split("--- sample after 4 steps ---\n", 1)[1].rsplit("\n---", 1)[0]
    assert sample.startswith(prompt) and len(sample) > len(prompt) + new_tokens, sample
    eod = json.loads((out / "manifest.json").read_text())["eod_id"]
    assert f"eod_token_id: {eod}\n" in (run_dir / "hparams.yaml").read_text()  # the model that trained masked


def test_prepare_command_line_refusals_exit_2_and_a_rerun_does_nothing(tmp_path, tokenizer_dir, corpus, capsys):
    out = prepared(tmp_path, tokenizer_dir, corpus)
    assert "throughput:" in capsys.readouterr().out
    prepared(tmp_path, tokenizer_dir, corpus)
    assert "is up to date: same inputs, same tokenizer" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    other = make_tokenizer(tmp_path / "other", vocab_size=300)
    for argv, fragment in (
            (["--out", str(tmp_path / "new"), str(bad)], f"{bad}:2: no 'text' field (its fields: content); set "
                                                          "--text-key"),
            (["--tokenizer", str(other), str(corpus / "*")], f"{out} was prepared with another tokenizer"),
            ([str(tmp_path / "none*.txt")], "input '" + str(tmp_path / "none*.txt") + "' matches no file"),
            (["--eod-token", "<s>", str(corpus / "*")], "end-of-document token '<s>' is not in the vocabulary")):
        tok = [] if "--tokenizer" in argv else ["--tokenizer", str(tokenizer_dir)]
        with pytest.raises(SystemExit) as exit_:
            prepare_main([*tok, "--out", str(out), "--no-progress", *argv])  # a later --out wins
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("Invalid input:\n  - ") and fragment in err, err
        assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        prepare_main(["--help"])
    assert exit_.value.code == 0 and "--text-key" in capsys.readouterr().out


def test_vocabulary_is_checked_against_the_tokenizer_before_launch(tmp_path, tokenizer_dir, corpus):
    """One rule, bytes and tokenizers alike: the data's largest id must fit model.vocab_size."""
    problems = config_problems(composed(f"data.tokenizer={tokenizer_dir}"))
    assert f"model.vocab_size=256 is smaller than the 512 token ids of data.tokenizer='{tokenizer_dir}': ids up to " \
           "511 have no embedding row; set model.vocab_size>=512" in problems
    assert config_problems(composed(f"data.tokenizer={tokenizer_dir}", "model.vocab_size=512")) == []
    assert any("model.vocab_size=64 is smaller than the 256 byte tokens of data.source=corpus" in p
               for p in config_problems(composed("model.vocab_size=64")))
    out = prepared(tmp_path, tokenizer_dir, corpus)  # the manifest's tokenizer, with no data.tokenizer given
    problems = config_problems(composed("data=tokens", f"data.path={out}"))
    assert any("model.vocab_size=256 is smaller than the 512 token ids of the tokenizer" in p for p in problems)
    other = make_tokenizer(tmp_path / "other", vocab_size=300)
    problems = config_problems(composed("data=tokens", f"data.path={out}", f"data.tokenizer={other}",
                                        "model.vocab_size=512"))
    assert any(f"data.tokenizer='{other}' (sha256 " in p and f"is not the tokenizer {out} was prepared with" in p
               for p in problems), problems


def test_prepared_tokens_whose_tokenizer_moved_are_not_decoded_as_bytes(tmp_path, tokenizer_dir, corpus):
    """The tokenizer a prepared directory records is the run's tokenizer; once moved, the run has none, and the
    sample says why instead of decoding BPE ids as bytes."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    out = prepared(tmp_path, tok, corpus, "data", str(corpus / "a.txt"))
    cfg = composed("data=tokens", f"data.path={out}")
    assert resolve_data(cfg).tokenizer_path == tok / "tokenizer.json" and resolve_data(cfg).lost_tokenizer is None
    shutil.rmtree(tok)
    assert resolve_data(cfg).tokenizer is None and resolve_data(cfg).lost_tokenizer == str(tok / "tokenizer.json")
    assert resolve_data(composed("data=tokens", f"data.path={out}", f"data.tokenizer={tokenizer_dir}")).lost_tokenizer is None


def test_a_hugging_face_directory_brings_its_tokenizer(tmp_path, tokenizer_dir):
    from lightning_mgpu.hf.names import to_hf_config
    from lightning_mgpu.models import LlamaConfig

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(to_hf_config(LlamaConfig(vocab_size=256))))
    assert resolve_data(composed(f"model.init_from=hf:{hf}")).tokenizer is None  # no tokenizer.json: bytes
    (hf / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    cfg = composed(f"model.init_from=hf:{hf}")
    assert resolve_data(cfg).tokenizer_path == hf / "tokenizer.json"
    assert any(f"the vocab_size=256 of model.init_from='hf:{hf}' (its config.json) is smaller than the 512 token ids"
               f" of the tokenizer of model.init_from" in p and "use the tokenizer that came with the checkpoint" in p
               for p in config_problems(cfg))
    assert resolve_data(composed(f"model.init_from=hf:{hf}", f"data.tokenizer={tokenizer_dir}")).tokenizer_path == tokenizer_dir


def test_generated_sample_is_encoded_and_decoded_with_the_tokenizer(tokenizer_dir):
    from lightning_mgpu.cli.build import build_module
    from lightning_mgpu.cli.train import generate_sample

    cfg = composed(f"data.tokenizer={tokenizer_dir}", "model.vocab_size=512", "sample.max_new_tokens=12",
                   "sample.prompt='def __init__(self'")
    spec = run_spec(cfg)
    module = build_module(spec)
    module.configure_model()
    tok = Tokenizer(tokenizer_dir)
    prompt = torch.tensor([tok.encode(cfg.sample.prompt)])
    ids = module.generate(prompt, 12, temperature=cfg.sample.temperature,
                          generator=torch.Generator().manual_seed(cfg.seed))[0].tolist()
    assert generate_sample(module, spec) == tok.decode(ids) and tok.decode(ids).startswith("def __init__(self")
    assert len(ids) == len(prompt[0]) + 12 and len(prompt[0]) < len("def __init__(self")
    assert build_tokenizer(run_spec(composed())) is None  # bytes by default


def test_blend_from_the_command_line(tmp_path, tokenizer_dir, corpus):
    one = prepared(tmp_path, tokenizer_dir, corpus, "one", str(corpus / "a.txt"))
    two = prepared(tmp_path, tokenizer_dir, corpus, "two", str(corpus / "c.jsonl.gz"))
    cfg = composed("data=tokens", f"data.sources=[{{path: {one}, weight: 0.7}}, {{path: {two}, weight: 0.3}}]",
                   "model.vocab_size=512")
    assert config_problems(cfg) == []
    dm = build_datamodule(run_spec(cfg))
    assert dm.sources == [(one, 0.7), (two, 0.3)] and dm.tokenizer == tokenizer_dir / "tokenizer.json"
    assert json.loads((one / "manifest.json").read_text())["eod_token"] == TEST_EOD
    problems = config_problems(composed("data=tokens", f"data.sources=[{{path: {one}, weight: 0}}, {{weight: 1}}]"))
    assert any("data.sources[0] (" in p and "weight=0.0 must be a number > 0" in p for p in problems), problems
    assert "data.sources[1] has no path; give each source as {path: DIR, weight: W}" in problems


def test_a_run_reads_each_manifest_and_its_tokenizer_once(tmp_path, tokenizer_dir, corpus, monkeypatch):
    """Validation, the model's end-of-document id, the data module and the memory check's fixes all read the one
    resolved ``RunData``: one manifest read per source and one tokenizer load for a whole ``check_run``."""
    from lightning_mgpu.cli import run_data
    from lightning_mgpu.cli.validate import check_run
    from lightning_mgpu.data import tokenizer as tokenizer_module

    one = prepared(tmp_path, tokenizer_dir, corpus, "one", str(corpus / "a.txt"))
    two = prepared(tmp_path, tokenizer_dir, corpus, "two", str(corpus / "b.txt"))
    counts = {"manifests": 0, "tokenizers": 0}
    read, load = run_data.read_manifest, tokenizer_module.Tokenizer.__init__

    def counted_read(path):
        counts["manifests"] += 1
        return read(path)

    def counted_load(self, path):
        counts["tokenizers"] += 1
        load(self, path)

    monkeypatch.setattr(run_data, "read_manifest", counted_read)
    monkeypatch.setattr(tokenizer_module.Tokenizer, "__init__", counted_load)
    spec = check_run(composed("data=tokens", f"data.sources=[{{path: {one}}}, {{path: {two}}}]",
                              "data.document_mask=true", "model.vocab_size=512"))
    assert counts == {"manifests": 2, "tokenizers": 1}
    assert spec.model.eod_token_id == Tokenizer(tokenizer_dir).token_id(TEST_EOD)
    changed = spec.replaced({"parallel.zero_stage": 3, "data.micro_batch_size": 1})
    assert changed.data is spec.data and changed.layout.zero_stage == 3 and changed.config.data.micro_batch_size == 1
    assert spec.replaced({"parallel.tensor_parallel_size": 3}) is None  # 3 does not divide the heads: a broken rule


def test_document_mask_needs_an_end_of_document_id(tmp_path, tokenizer_dir, corpus):
    """One rule: the mask needs tokens with an end-of-document id (a manifest's, or a tokenizer's), not bytes; the
    model then carries that id."""
    problems = config_problems(composed("data.document_mask=true"))
    assert ["data.document_mask=true needs tokens that end every document with an end-of-document id, but "
            "data.source=corpus without a tokenizer gives byte tokens, which mark no document ends; prepare the data "
            "with mgpu-prepare (data=tokens data.path=DIR), or give data.tokenizer=PATH of a tokenizer with an "
            "end-of-document token, or set data.document_mask=false"] == problems
    eod = Tokenizer(tokenizer_dir).token_id(TEST_EOD)
    with_tokenizer = composed("data.document_mask=true", f"data.tokenizer={tokenizer_dir}", "model.vocab_size=512")
    assert config_problems(with_tokenizer) == [] and run_spec(with_tokenizer).model.eod_token_id == eod
    out = prepared(tmp_path, tokenizer_dir, corpus, "data", str(corpus / "a.txt"))
    from_manifest = composed("data=tokens", f"data.path={out}", "data.document_mask=true", "model.vocab_size=512")
    assert config_problems(from_manifest) == [] and run_spec(from_manifest).model.eod_token_id == eod
    assert run_spec(composed("data=tokens", f"data.path={out}", "model.vocab_size=512")).model.eod_token_id is None
    other = prepared(tmp_path, tokenizer_dir, corpus, "other", "--eod-token", "e", str(corpus / "b.txt"))
    blend = composed("data=tokens", f"data.sources=[{{path: {out}}}, {{path: {other}}}]", "data.document_mask=true",
                     "model.vocab_size=512")
    assert [f"data.document_mask=true: {other} ends documents with id {Tokenizer(tokenizer_dir).token_id('e')} ('e'), "
            f"but the manifest of {out} ('{TEST_EOD}') says {eod}; prepare every source with the same --eod-token"] \
        == config_problems(blend)
