"""``mgpu-prepare --chat``: conversations through the tokenizer directory's own chat template, an answer mask by the
template's generation markers or by prefix rendering, rows left out counted and named, a re-run that does nothing."""

import json

import numpy as np
import pytest
from chat_helpers import MARKED, PLAIN, REWRITING, conversations, make_chat_tokenizer, write_jsonl

from lightning_mgpu.cli.prepare import main as prepare_main
from lightning_mgpu.hf.chat_template import ChatTemplate

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello you"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "four"}]


def answers(template: ChatTemplate, conversation: list) -> str:
    ids, mask = template.render(conversation)
    assert len(ids) == len(mask)
    return template.tokenizer.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("source, rule, expected", [
    (MARKED, "generation-markers", "hello you<|im_end|>four<|im_end|>"),
    (PLAIN, "prefix-diff", "hello you<|im_end|>\nfour<|im_end|>\n")])
def test_the_answer_mask_covers_exactly_the_assistant_turns(tmp_path, source, rule, expected):
    """Both rules mark each assistant turn's text and its end-of-turn token, nothing of the prompts (the prefix rule
    also the newline the template writes after a turn). Broken once: with the prefix rule's span starting at the
    rendering without the generation prompt, '<|im_start|>assistant' was marked too: the prefix-diff case failed (and the two tests below)."""
    template = ChatTemplate(make_chat_tokenizer(tmp_path / "tok", source))
    assert template.rule == rule
    assert answers(template, CONVERSATION) == expected


def test_a_template_that_rewrites_earlier_turns_is_named_not_guessed(tmp_path):
    from lightning_mgpu.hf.chat_template import ChatTemplateError

    template = ChatTemplate(make_chat_tokenizer(tmp_path / "tok", REWRITING))
    with pytest.raises(ChatTemplateError, match="turn 2 \\(assistant\\): the template renders"):
        template.render(CONVERSATION)
    assert answers(template, CONVERSATION[:3]) == "hello you<|im_end|>\n"  # one answer: nothing rewritten


def test_prepare_chat_writes_mask_and_boundaries_counts_what_it_leaves_out_and_reruns_as_a_check(tmp_path, capsys):
    tok = make_chat_tokenizer(tmp_path / "tok")
    rows = conversations(40) + [{"text": "no conversation"}, "not json",
                                {"messages": [{"role": "user", "content": "a question only"}]},
                                {"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    argv = ["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / "out"), str(data), "--workers", "2",
            "--no-progress"]
    prepare_main(argv)
    printed = capsys.readouterr().out
    assert "40 conversations" in printed and "left out: 4 no-conversation" in printed, printed
    assert f"{data}:42: is not JSON" in printed and f"{data}:44: turn 1 has role 'wizard'" in printed, printed
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    tokens, mask = np.fromfile(out / "tokens.bin", np.uint16), np.fromfile(out / "mask.bin", np.uint8)
    starts = np.fromfile(out / "documents.bin", np.uint64)
    assert manifest["chat"]["mask_rule"] == "prefix-diff" and manifest["document_count"] == 40
    assert len(starts) == 41 and starts[-1] == len(tokens) == len(mask) == manifest["token_count"]
    eod = manifest["eod_id"]
    assert list(np.flatnonzero(tokens == eod) + 1) == list(starts[1:])  # every conversation ends with its eod
    template = ChatTemplate(tok)
    first = [t for t in conversations(1)[0]["completion"].split()]
    assert template.tokenizer.decode(tokens[starts[0]:starts[1]][mask[starts[0]:starts[1]] == 1]) == \
        " ".join(first) + "<|im_end|>\n"
    assert int(mask.sum()) == manifest["chat"]["answer_tokens"]
    prepare_main(argv)
    assert "is up to date" in capsys.readouterr().out


def test_overlong_conversations_are_dropped_or_truncated_and_an_input_with_no_answer_is_refused(tmp_path, capsys):
    tok = make_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(12))
    base = ["--chat", "--tokenizer", str(tok), str(data), "--workers", "1", "--max-tokens"]
    prepare_main(base + ["60", "--out", str(tmp_path / "drop")])
    dropped = json.loads((tmp_path / "drop" / "manifest.json").read_text())["chat"]
    prepare_main(base + ["60", "--overlong", "truncate", "--out", str(tmp_path / "cut")])
    cut = json.loads((tmp_path / "cut" / "manifest.json").read_text())["chat"]
    assert dropped["left_out"]["overlong"] > 0 and cut["truncated"] == dropped["left_out"]["overlong"] - \
        cut["left_out"].get("empty-mask", 0)
    assert cut["conversations"] + sum(cut["left_out"].values()) == 12
    with pytest.raises(SystemExit) as exit_:
        prepare_main(base + ["8", "--overlong", "truncate", "--out", str(tmp_path / "none")])
    assert exit_.value.code == 2
    assert "no conversation has an answer token to train on (12 left out)" in capsys.readouterr().err


def test_parquet_rows_give_the_tokens_and_mask_of_the_same_jsonl_rows(tmp_path):
    """Parquet's messages column (a list of structs; rows with prompt/completion have it null) reads as the JSONL
    does. Broken once (Arrow's null messages taken as a conversation): every prompt/completion row was left out."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    tok = make_chat_tokenizer(tmp_path / "tok")
    rows = conversations(12)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    full = [{"messages": r.get("messages"), "prompt": r.get("prompt"), "completion": r.get("completion")} for r in rows]
    pq.write_table(pa.Table.from_pylist(full), tmp_path / "chat.parquet")
    for name in ("chat.jsonl", "chat.parquet"):
        prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / name.replace(".", "-")),
                      str(tmp_path / name), "--workers", "1", "--no-progress"])
    for file in ("tokens.bin", "mask.bin", "documents.bin"):
        assert (tmp_path / "chat-jsonl" / file).read_bytes() == (tmp_path / "chat-parquet" / file).read_bytes(), file
    assert json.loads((tmp_path / "chat-parquet" / "manifest.json").read_text())["document_count"] == 12


def test_a_failing_template_is_counted_per_conversation_and_a_directory_without_one_refused(tmp_path, capsys):
    """With a template that rewrites earlier turns, the conversations with two or more answers are left out as
    template-failed (counted by hand from the rows), the others kept; a tokenizer without a chat template is refused
    by name. Broken once (the ChatTemplateError not caught per row): the whole preparation stopped."""
    rows = conversations(30)
    multi = sum(1 for r in rows if sum(t["role"] == "assistant" for t in r.get("messages", [])) > 1)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = make_chat_tokenizer(tmp_path / "tok", REWRITING)
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / "out"), str(data), "--workers", "1"])
    chat = json.loads((tmp_path / "out" / "manifest.json").read_text())["chat"]
    assert 0 < multi < 30 and chat["left_out"] == {"template-failed": multi} and chat["conversations"] == 30 - multi
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    with pytest.raises(SystemExit):
        prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / "none"), str(data)])
    assert f"--tokenizer '{tok}' has no chat template" in capsys.readouterr().err


def test_an_end_of_document_token_the_template_writes_is_refused_and_tool_turns_are_not_answers(tmp_path, capsys):
    """A tokenizer whose eos is the template's end of turn (as Qwen's <|im_end|>): by default the end-of-text token
    <|endoftext|> ends conversations instead; --eod-token <|im_end|> would cut every conversation at its first turn:
    refused, naming --eod-token. A tool turn's content is not marked (the answers are the assistant's only). Broken
    once each: without the eod-inside check nothing was refused; with the eos as default, the default run failed."""
    tok = make_chat_tokenizer(tmp_path / "tok")
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token": "<|im_end|>"}))
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(6))
    with pytest.raises(SystemExit):
        prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / "a"), str(data), "--workers", "1",
                      "--eod-token", "<|im_end|>"])
    err = capsys.readouterr().err
    assert "occurs inside 6 rendered conversation(s)" in err and "choose with --eod-token" in err, err
    prepare_main(["--chat", "--tokenizer", str(tok), "--out", str(tmp_path / "b"), str(data), "--workers", "1"])
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["document_count"] == 6 and manifest["eod_token"] == "<|endoftext|>"
    tool = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "asking"},
            {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "it rains"}]
    assert answers(ChatTemplate(tok), tool) == "asking<|im_end|>\nit rains<|im_end|>\n"
