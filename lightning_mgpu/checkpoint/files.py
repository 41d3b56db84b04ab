"""The consolidated-weights files inside a checkpoint directory: ``model.safetensors`` and ``model_config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import torch

WEIGHTS, CONFIG = "model.safetensors", "model_config.json"


def write_consolidated(directory: Path, state: Mapping[str, torch.Tensor], model_config: Optional[dict]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / WEIGHTS))
    if model_config is not None:
        (directory / CONFIG).write_text(json.dumps(model_config, indent=2) + "\n")


def read_consolidated(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(model config dict, weights) of a checkpoint saved with consolidated weights."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / WEIGHTS).is_file() or not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no consolidated weights ({WEIGHTS}, {CONFIG}): save the checkpoint "
                                "with MGPUStrategy(save_consolidated_weights=True) (mgpu-train: "
                                "checkpoint.save_consolidated_weights=true)")
    return json.loads((directory / CONFIG).read_text()), load_file(str(directory / WEIGHTS))
