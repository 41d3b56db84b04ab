"""``mgpu-export CKPT --format hf OUT``: a checkpoint's weights as a Hugging Face directory: a Llama, or for a mixture
of experts a Mixtral (or a Qwen3-MoE, with ``qk_norm``); a model none of them can hold is refused before writing.

CKPT is a universal checkpoint written by any layout (read in this one process), or a checkpoint saved with
consolidated weights. Its checksums are verified first, and nothing in it is unpickled beyond plain data."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch

from lightning_mgpu.checkpoint.files import CONFIG, WEIGHTS, read_consolidated
from lightning_mgpu.checkpoint.formats import format_of, is_consolidated
from lightning_mgpu.checkpoint.hf import export_problems as hf_export_problems
from lightning_mgpu.checkpoint.hf import save_hf
from lightning_mgpu.checkpoint.store import verify
from lightning_mgpu.checkpoint.universal import read_model_weights
from lightning_mgpu.cli.errors import ConfigError, exit_on_refusal
from lightning_mgpu.cli.fast_exit import skip_final_garbage_collection
from lightning_mgpu.models.llama import LlamaConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_problems(checkpoint: Path, out: Path) -> list[str]:
    """What is wrong with the two paths, before anything is read or written."""
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
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``mgpu-export``: refused paths print their problems and exit with status 2."""
    skip_final_garbage_collection()
    parser = argparse.ArgumentParser(prog="mgpu-export", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory (universal, or with consolidated weights)")
    parser.add_argument("out", help="output directory (config.json + model.safetensors)")
    parser.add_argument("--format", choices=["hf"], default="hf")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    exit_on_refusal(lambda: export(Path(args.checkpoint), Path(args.out), DTYPES[args.dtype]))


def export(checkpoint: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``checkpoint``'s weights to ``out`` as a Hugging Face directory; return ``out``."""
    problems = export_problems(checkpoint, out)
    if problems:
        raise ConfigError(problems, what="arguments")
    verify(checkpoint)
    if format_of(checkpoint) == "universal":
        config, state = read_model_weights(checkpoint)
    else:
        config, state = read_consolidated(checkpoint)
    model = LlamaConfig(**config)
    problems = hf_export_problems(model)
    if problems:
        raise ConfigError(problems, what=f"model for a Hugging Face export of {checkpoint}")
    written = save_hf(state, model, out, dtype)
    print(f"wrote {written / 'config.json'} and {written / 'model.safetensors'}")
    return written
