"""``mgpu-train data=sft data.path=DIR``: conversations prepared with ``mgpu-prepare --chat`` train with document
masks from the manifest's end-of-document id, packed whole, and print a held-out conversation's prompt with the model's
answer; what keeps them from training is refused before launch."""

import pytest
from chat_helpers import conversations, make_chat_tokenizer, write_jsonl
from cli_helpers import BIN, HF_FAMILIES, composed, read_metric
from forked_cli import run_cli
from helpers import make_tokenizer

from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.cli.run_data import resolve_data
from lightning_mgpu.cli.spec import config_problems


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tok = make_chat_tokenizer(root / "tok")
    data = write_jsonl(root / "chat.jsonl", conversations(60))
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(root / "chat"), str(data), "--workers", "1",
                  "--max-tokens", "97", "--overlong", "truncate", "--no-progress"])
    return root


def test_data_sft_refuses_what_cannot_train_before_launch(chat_dir, tmp_path):
    def problems(*overrides):
        cfg = composed("data=sft", "model.vocab_size=416", *overrides)
        return "\n".join(config_problems(cfg, resolve_data(cfg)))

    assert "data.path is not set: data=sft reads a directory of conversations" in problems()
    assert problems(f"data.path={chat_dir / 'chat'}", "data.seq_len=96") == ""
    short = problems(f"data.path={chat_dir / 'chat'}", "data.seq_len=40")
    assert "data.seq_len=40: " in short and "longer than a packed sequence of seq_len + 1 = 41 tokens (the longest 97)" \
        in short, short
    assert "data.document_mask=false with data=sft" in problems(f"data.path={chat_dir / 'chat'}", "data.seq_len=96",
                                                                "data.document_mask=false")
    # the documents follow the sequence split, for the package's model and for a transformers one
    assert problems(f"data.path={chat_dir / 'chat'}", "data.seq_len=96", "trainer.devices=2",
                    "parallel.context_parallel_size=2") == ""
    hf = composed("data=sft", f"data.path={chat_dir / 'chat'}", "data.seq_len=96", "trainer.devices=2",
                  "parallel.context_parallel_size=2", "model=hf", f"model.path={HF_FAMILIES / 'llama3_8b'}")
    assert config_problems(hf, resolve_data(hf)) == []  # a transformers model's documents follow the split
    plain = tmp_path / "plain"
    (tmp_path / "a.txt").write_text("some text " * 50)
    prepare_main(["--tokenizer", str(make_tokenizer(tmp_path / "tok", 300, 20_000)), "--out", str(plain),
                  str(tmp_path / "a.txt"), "--workers", "1", "--no-progress"])
    assert "holds plain tokens, no answer mask (prepared without --chat)" in problems(f"data.path={plain}")


def test_mgpu_train_data_sft_trains_packed_conversations_with_document_masks(chat_dir):
    run_dir = chat_dir / "run"
    train = run_cli(
        [str(BIN / "mgpu-train"), "data=sft", f"data.path={chat_dir / 'chat'}", "model=tiny", "model.vocab_size=416",
         "trainer.devices=1", "trainer.max_steps=2", "data.seq_len=96", "data.global_batch_size=4",
         "data.micro_batch_size=2", "data.val_batches=1", "data.val_fraction=0.1", "sample.prompt=0",
         "sample.max_new_tokens=2", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         f"hydra.run.dir={run_dir}"], cwd=chat_dir, timeout=240)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-4000:]
    printed = train.stdout + train.stderr
    assert "into" in printed and "sequences of 97 tokens (best-fit decreasing)" in printed, printed[-3000:]
    assert "eod_token_id: 0\n" in (run_dir / "hparams.yaml").read_text()  # <|endoftext|>: the manifest's id
    assert len(read_metric(run_dir / "metrics.csv", "val/loss")) == 1
    # the sample: the first held-out conversation (54 of 60, a prompt/completion pair) up to its answer, rendered by
    # the template (tests/chat_helpers.PLAIN), then the model's 2 tokens
    prompt = f"<|im_start|>user\n{conversations(60)[54]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert f"--- sample after 2 steps ---\n{prompt}" in printed, printed[printed.find("--- sample"):][:600]
