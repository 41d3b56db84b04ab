"""``mgpu-export CKPT --format hf OUT``: a checkpoint's weights as a Hugging Face directory: a Llama, or for a mixture
of experts a Mixtral (or a Qwen3-MoE, with ``qk_norm``); a model none of them can hold is refused before writing. An
adapter run's checkpoint: ``--format peft`` writes its adapters as PEFT does, ``--merge`` its base with them merged
(``lightning_mgpu.hf.adapter_export``).

CKPT is a universal checkpoint written by any layout (read in this one process, one shard's parameters at a time), or
a checkpoint saved with consolidated weights. The weights are written as safetensors shards of at most
``--max-shard-size`` with ``model.safetensors.index.json``, as ``transformers`` writes them (one shard: one
``model.safetensors``). Its checksums are verified first, and nothing in it is unpickled beyond plain data."""

from __future__ import annotations

import argparse
import re
from decimal import Decimal
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

from lightning_mgpu.checkpoint.files import CONFIG, WEIGHTS, read_consolidated
from lightning_mgpu.checkpoint.formats import format_of, is_consolidated
from lightning_mgpu.checkpoint.frozen_weights import ADAPTER_RECORD
from lightning_mgpu.checkpoint.store import verify
from lightning_mgpu.checkpoint.universal import read_model_shapes, read_parameters, read_trainer_state
from lightning_mgpu.cli.errors import ConfigError, exit_on_refusal
from lightning_mgpu.cli.fast_exit import skip_final_garbage_collection
from lightning_mgpu.hf.export import ParameterReader, export_trained_model, save_hf, trained_from
from lightning_mgpu.hf.names import export_problems as hf_export_problems
from lightning_mgpu.models.llama import LlamaConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``--max-shard-size`` units: decimal as ``transformers`` reads "5GB", binary with an ``i``.
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_size(text: str | int) -> Optional[int]:
    """Bytes of a size such as ``5GB``, ``500MB``, ``1.5GiB`` or ``200000`` (case-insensitive); None when ``text`` is
    not one, or is under one byte."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if found is None or found.group(2).upper() not in SIZE_UNITS:
        return None
    size = int(Decimal(found.group(1)) * SIZE_UNITS[found.group(2).upper()])
    return size if size >= 1 else None


def export_problems(checkpoint: Path, out: Path, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """What is wrong with the two paths and the shard size, before anything is read or written."""
    from lightning_mgpu.callbacks import newest_checkpoint

    problems = []
    if not checkpoint.is_dir():
        problems.append(f"checkpoint {str(checkpoint)!r} is not a directory; give a checkpoint directory, e.g. "
                        "outputs/DATE/TIME/checkpoints/step-00000100")
    elif not (format_of(checkpoint) == "universal" or is_consolidated(checkpoint)):
        newest = newest_checkpoint(checkpoint)
        fix = (f"it holds checkpoints: give one, e.g. the newest, {newest}" if newest is not None else
               "give a checkpoint written by mgpu-train (checkpoint.every_n_steps or checkpoint.save_last)")
        problems.append(f"checkpoint {str(checkpoint)!r} is neither a universal checkpoint (.metadata) nor one "
                        f"with consolidated weights ({WEIGHTS}, {CONFIG}); {fix}")
    if out.exists() and not out.is_dir():
        problems.append(f"out {str(out)!r} exists and is not a directory; give a new or existing directory")
    elif checkpoint.is_dir() and out.resolve() == checkpoint.resolve():
        problems.append(f"out {str(out)!r} is the checkpoint itself, whose files the export would replace; give "
                        "another directory")
    if parse_size(max_shard_size) is None:
        problems.append(f"--max-shard-size {max_shard_size!r} is not a size of at least one byte; give a number of "
                        "bytes with an optional unit KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
                        f"of 1024), e.g. --max-shard-size 5GB (the default) or 500MB")
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``mgpu-export``: refused paths print their problems and exit with status 2."""
    skip_final_garbage_collection()
    parser = argparse.ArgumentParser(prog="mgpu-export", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory (universal, or with consolidated weights)")
    parser.add_argument("out", help="output directory (config.json + safetensors shards + their index)")
    parser.add_argument("--format", choices=["hf", "peft"], default="hf",
                        help="hf: the model's weights as from_pretrained loads them; peft: an adapter run's adapters "
                             "(adapter_model.safetensors + adapter_config.json) as PeftModel.from_pretrained loads them")
    parser.add_argument("--merge", action="store_true",
                        help="with --format hf, an adapter run's adapters merged into its base's weights, written "
                             "with the base's own shards and dtype (--dtype and --max-shard-size do not apply)")
    parser.add_argument("--base", default=None,
                        help="an adapter run's base model directory (default: the one its checkpoint records)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest safetensors file, e.g. 5GB (the default), 500MB or a number of bytes; a single "
                             "tensor bigger than it gets a file of its own")
    args = parser.parse_args(argv)
    if args.format == "peft" or args.merge:
        exit_on_refusal(lambda: export_adapters(Path(args.checkpoint), Path(args.out), args.format, args.merge,
                                                None if args.base is None else Path(args.base)))
        return
    exit_on_refusal(lambda: export(Path(args.checkpoint), Path(args.out), DTYPES[args.dtype], args.max_shard_size))


def export_adapters(checkpoint: Path, out: Path, format: str, merge: bool, base: Optional[Path] = None) -> list[Path]:
    """An adapter run's adapters in PEFT's format (``--format peft``) or merged into its base (``--merge``)."""
    from lightning_mgpu.hf.adapter_export import export_merged, export_peft

    problems = export_problems(checkpoint, out)
    if checkpoint.is_dir() and format_of(checkpoint) != "universal":
        problems.append(f"checkpoint {str(checkpoint)!r} is not a universal checkpoint: adapters are exported from one "
                        "(checkpoint.format=universal, the default)")
    if format == "peft" and merge:
        problems.append("--merge writes the merged model's weights (--format hf), --format peft the adapters alone; "
                        "choose one")
    if problems:
        raise ConfigError(problems, what="arguments")
    verify(checkpoint)
    try:
        written = export_merged(checkpoint, out, base) if merge else export_peft(checkpoint, out, base)
    except ValueError as error:
        raise ConfigError([str(error)], what=f"adapter export of {checkpoint}") from error
    print(f"wrote {', '.join(path.name for path in written)} in {out}")
    return written


def export(checkpoint: Path, out: Path, dtype: torch.dtype = torch.float32,
           max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
    """Write ``checkpoint``'s weights to ``out`` as a Hugging Face directory, one shard at a time; return the files
    written (``config.json`` first)."""
    problems = export_problems(checkpoint, out, max_shard_size)
    if problems:
        raise ConfigError(problems, what="arguments")
    verify(checkpoint)
    shard_bytes = parse_size(max_shard_size) or 0  # a size: refused above if not
    state = read_trainer_state(checkpoint) if format_of(checkpoint) == "universal" else {}
    if state.get(ADAPTER_RECORD):
        raise ConfigError([f"{checkpoint} holds a run's adapters, not its frozen base: export them with --format peft, "
                           "or the base with them merged with --merge"], what="arguments")
    source = trained_from(state) if state else None
    if source is not None:  # a transformers model trained as it is (model=hf)
        written = _export_transformers_run(checkpoint, source, out, dtype, shard_bytes)
    else:
        written = _export_package_model(checkpoint, out, dtype, shard_bytes)
    print(f"wrote {', '.join(path.name for path in written)} in {out}")
    return written


def _export_transformers_run(checkpoint: Path, source: Path, out: Path, dtype: torch.dtype,
                             shard_bytes: int) -> list[Path]:
    problems = [f"{source} (the directory this run trained from, model.path) has no config.json; the export "
                "writes the model's own config.json: restore that directory"] if not (source / "config.json").is_file() \
        else []
    if out.resolve() == source.resolve():
        problems.append(f"out {str(out)!r} is the directory this run trained from, whose weights the export would "
                        "replace; give another directory")
    if problems:
        raise ConfigError(problems, what=f"Hugging Face export of {checkpoint}")
    return export_trained_model(checkpoint, source, out, dtype, shard_bytes)


def _export_package_model(checkpoint: Path, out: Path, dtype: torch.dtype, shard_bytes: int) -> list[Path]:
    config, shapes, read = _weights(checkpoint)
    model = LlamaConfig(**config)
    problems = hf_export_problems(model)
    if problems:
        raise ConfigError(problems, what=f"model for a Hugging Face export of {checkpoint}")
    return save_hf(read, shapes, model, out, dtype, shard_bytes)


def _weights(checkpoint: Path) -> tuple[dict, Mapping[str, torch.Size], ParameterReader]:
    """(model config, every parameter's shape, a reader of some parameters) of a checkpoint: a universal one is read
    only when the reader is called, a few parameters at a time; consolidated weights were written whole, and are
    read whole now."""
    if format_of(checkpoint) == "universal":
        config, shapes = read_model_shapes(checkpoint)
        return config, shapes, lambda names: read_parameters(checkpoint, {name: shapes[name] for name in names})
    config, state = read_consolidated(checkpoint)
    return config, {name: value.shape for name, value in state.items()}, lambda names: {n: state[n] for n in names}
