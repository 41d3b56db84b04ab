"""``mgpu-prepare --tokenizer PATH --out DIR INPUT...``: text and JSONL files (gzip too), Parquet files and
Hugging Face datasets saved to disk (Arrow) -> a token directory that ``mgpu-train data=tokens data.path=DIR`` reads.

Every document (a whole text file, one JSONL line's text field, or one Parquet / Arrow row's text column) is
tokenised in parallel processes and followed by the tokenizer's end-of-document token; DIR gets tokens.bin (uint16
when the vocabulary fits, else uint32) and manifest.json (tokenizer, counts, dtype, source files, checksum). Running
it again on the same inputs checks DIR and does nothing more."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from lightning_mgpu.cli.errors import ConfigError, exit_on_refusal
from lightning_mgpu.data.manifest import MANIFEST_FILE
from lightning_mgpu.data.prepare import PrepareError, PrepareResult, prepare
from lightning_mgpu.cli.fast_exit import skip_final_garbage_collection
from lightning_mgpu.data.tokenizer import TokenizerError


def default_workers() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mgpu-prepare", description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  mgpu-prepare --tokenizer /models/llama-3.2-1b --out data/books 'books/**/*.txt'\n"
               "  mgpu-prepare --tokenizer tok.json --out data/web --text-key content web/*.jsonl.gz --workers 16\n"
               "  mgpu-prepare --tokenizer tok.json --out data/fineweb 'fineweb/data/CC-MAIN-2024-10/*.parquet'\n"
               "  mgpu-prepare --tokenizer tok.json --out data/stack --split train saved/the-stack-python\n"
               "  mgpu-train data=tokens data.path=data/books data.tokenizer=/models/llama-3.2-1b ...")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text, JSONL, Parquet (.parquet) or Arrow (.arrow) files, or globs of them (quote them; ** "
                        "recurses), or a directory written by datasets' save_to_disk; .gz is read decompressed; a "
                        ".jsonl/.ndjson line is one document, so is a Parquet/Arrow row, any other file is one "
                        "document; Parquet and Arrow need pyarrow: pip install 'lightning_mgpu[parquet]'")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="a Hugging Face tokenizer directory (with tokenizer.json) or a tokenizers JSON file; nothing "
                        "is downloaded")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (tokens.bin + manifest.json)")
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSONL field, or the Parquet/Arrow column, that holds the text (default: text)")
    p.add_argument("--split", default=None, metavar="NAME",
                   help="the split to read of a DatasetDict directory (one with dataset_dict.json), e.g. train")
    p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                   help=f"tokenizing processes (default: the CPUs available, here {default_workers()})")
    p.add_argument("--eod-token", default=None, metavar="TOKEN",
                   help="the token appended after every document (default: the tokenizer's eos token, or "
                        "<|end_of_text|>, <|endoftext|>, </s> if it has one; with --chat those first, then the eos "
                        "token, which chat templates often write at every turn's end)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what DIR holds when it was prepared from other inputs or with another tokenizer")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    chat = p.add_argument_group("conversations (--chat)")
    chat.add_argument("--chat", action="store_true",
                      help="the inputs are conversations (JSONL / Parquet / Arrow rows with messages: [{role, "
                           "content}, ...] or prompt and completion), rendered with the chat template of --tokenizer "
                           "(a transformers tokenizer directory); writes an answer mask (mask.bin) and document "
                           "boundaries (documents.bin) beside the tokens, for mgpu-train data=sft")
    chat.add_argument("--max-tokens", type=int, default=None, metavar="N",
                      help="longest conversation kept, its end-of-document token included (e.g. data.seq_len + 1); "
                           "default: no limit")
    chat.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                      help="a conversation longer than --max-tokens is dropped (default) or truncated; counted either "
                           "way")
    return p


def report(result: PrepareResult, out: Path) -> str:
    """What was written (or found up to date), with the throughput in MB of text per second per process."""
    m = result.manifest
    what = (f"{m.token_count:,} tokens ({m.dtype}, vocabulary {m.vocab_size:,}, end of document {m.eod_token!r} = "
            f"id {m.eod_id}) from {m.document_count:,} documents in {len(m.sources)} file(s), "
            f"{m.text_bytes / 1e6:.2f} MB of text")
    if result.skipped:
        return (f"{out} is up to date: same inputs, same tokenizer, tokens match the manifest's checksum; nothing to "
                f"do\n  {what}")
    total = m.text_bytes / 1e6 / max(result.seconds, 1e-9)
    return (f"wrote {out / m.tokens_file} and {out / MANIFEST_FILE}\n  {what}\n"
            f"throughput: {m.text_bytes / 1e6:.2f} MB of text in {result.seconds:.2f} s = {total:.2f} MB/s, "
            f"{result.mb_per_second_per_process:.2f} MB/s per process ({result.workers} process"
            f"{'es' if result.workers > 1 else ''}); {result.mb_per_cpu_second:.2f} MB per CPU-second of a process "
            "tokenising")


def run(args: argparse.Namespace) -> PrepareResult:
    """Prepare as ``args`` say and print the report; bad inputs raise :class:`ConfigError` (exit status 2)."""
    if args.chat:
        return run_chat(args)
    try:
        result = prepare(args.inputs, args.tokenizer, args.out, text_key=args.text_key, workers=args.workers,
                         eod_token=args.eod_token, overwrite=args.overwrite, progress=not args.no_progress,
                         split=args.split)
    except PrepareError as err:
        raise ConfigError(err.problems, what="input") from None
    except TokenizerError as err:
        raise ConfigError([str(err)], what="input") from None
    print(report(result, Path(args.out)))
    return result


def run_chat(args: argparse.Namespace) -> PrepareResult:
    """``--chat``: render the conversations and print what was kept, left out and how fast."""
    from lightning_mgpu.data.chat import prepare_chat

    try:
        result = prepare_chat(args.inputs, args.tokenizer, args.out, workers=args.workers, eod_token=args.eod_token,
                              max_tokens=args.max_tokens, overlong=args.overlong, overwrite=args.overwrite)
    except (PrepareError, TokenizerError) as err:
        raise ConfigError(getattr(err, "problems", [str(err)]), what="input") from None
    print(chat_report(result, Path(args.out)))
    return result


def chat_report(result: PrepareResult, out: Path) -> str:
    """Kept and left-out conversations (the first rows of each reason named), the mask rule, the throughput."""
    m, chat = result.manifest, result.manifest.chat
    left = chat["left_out"]
    lines = [f"{chat['conversations']:,} conversations, {m.token_count:,} tokens, {chat['answer_tokens']:,} answer "
             f"tokens ({chat['answer_tokens'] / max(m.token_count, 1):.1%}); mask rule {chat['mask_rule']}; "
             f"{chat['truncated']} truncated; left out: "
             + (", ".join(f"{n} {reason}" for reason, n in left.items()) or "none")]
    lines += [f"  {line}" for examples in chat["left_out_examples"].values() for line in examples]
    if result.skipped:
        return f"{out} is up to date: same inputs, tokenizer, template and options; nothing to do\n" + "\n".join(lines)
    rate = chat["conversations"] / max(result.seconds, 1e-9)
    lines.append(f"throughput: {rate:,.0f} conversations/s, {rate / result.workers:,.0f} per process "
                 f"({result.workers} process{'es' if result.workers > 1 else ''})")
    return f"wrote {out} (tokens.bin, mask.bin, documents.bin, {MANIFEST_FILE})\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``mgpu-prepare``: bad inputs print their problems and exit with status 2."""
    skip_final_garbage_collection()
    args = parser().parse_args(argv)
    exit_on_refusal(lambda: run(args))


if __name__ == "__main__":
    main()
