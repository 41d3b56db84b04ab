"""DeepSpeed's own checkpoint directories (``checkpoint_format='deepspeed'``): files named by data- and
tensor-parallel rank, written and read by the engine; loadable only into the same layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_mgpu.layout import ParallelLayout

#: The folder (DeepSpeed's tag) that DeepSpeed's engine writes its files under, and (with pipeline stages) the
#: folder of each pipeline rank above it. ``lightning_mgpu.checkpoint.formats`` reads them to tell the formats apart.
DEEPSPEED_TAG = "checkpoint"
PIPELINE_RANK_DIR = "pipeline_rank_{:03d}"


def stage_dir(path: str | Path, layout: ParallelLayout) -> Path:
    """Where this rank's engine writes: DeepSpeed names files by data- and tensor-parallel rank only, so
    each pipeline rank gets its own subdirectory."""
    path = Path(path)
    return path / PIPELINE_RANK_DIR.format(layout.rank("pp")) if layout.size("pp") > 1 else path


def save_engine_checkpoint(engine: Any, layout: ParallelLayout, path: str | Path, client_state: dict) -> None:
    """The engine's weights and ZeRO partitions, with ``client_state`` (Lightning's state) beside them. Collective."""
    engine.save_checkpoint(str(stage_dir(path, layout)), tag=DEEPSPEED_TAG, client_state=client_state)


def load_engine_checkpoint(engine: Any, layout: ParallelLayout, path: str | Path, load_optimizer: bool,
                           strict: bool) -> dict:
    """Load a directory written by ``save_engine_checkpoint`` on the same layout; return its client state."""
    directory = stage_dir(path, layout)
    if not (directory / DEEPSPEED_TAG).is_dir():
        raise FileNotFoundError(f"ckpt_path={str(directory)!r} is not an MGPUStrategy checkpoint directory (expected "
                                f"a '{DEEPSPEED_TAG}' folder inside); pass the directory given to save_checkpoint")
    _, client_state = engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG, load_optimizer_states=load_optimizer,
                                             load_lr_scheduler_states=False, load_module_strict=strict)
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {directory}")
    return client_state
