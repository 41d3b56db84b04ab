"""``mgpu-export CKPT --format hf OUT``: a checkpoint's weights as a Hugging Face Llama directory.

CKPT is a universal checkpoint written by any layout (read in this one process), or a checkpoint saved with
consolidated weights."""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from lightning_mgpu.checkpoint.files import read_consolidated
from lightning_mgpu.checkpoint.hf import save_hf
from lightning_mgpu.checkpoint.universal import is_universal, read_model_weights
from lightning_mgpu.models.llama import LlamaConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mgpu-export", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory (universal, or with consolidated weights)")
    parser.add_argument("out", help="output directory (config.json + model.safetensors)")
    parser.add_argument("--format", choices=["hf"], default="hf")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    if is_universal(args.checkpoint):
        config, state = read_model_weights(args.checkpoint)
    else:
        config, state = read_consolidated(args.checkpoint)
    out = save_hf(state, LlamaConfig(**config), args.out, DTYPES[args.dtype])
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")


if __name__ == "__main__":
    main()
