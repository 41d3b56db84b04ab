"""DeepSpeed's own checkpoint directories (``checkpoint_format='deepspeed'``): files named by data- and
tensor-parallel rank, written and read by the engine; loadable only into the same layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_mgpu.checkpoint.formats import DEEPSPEED_TAG as CHECKPOINT_TAG
from lightning_mgpu.checkpoint.formats import PIPELINE_RANK_DIR
from lightning_mgpu.layout import ParallelLayout


def stage_dir(path: str | Path, layout: ParallelLayout) -> Path:
    """Where this rank's engine writes: DeepSpeed names files by data- and tensor-parallel rank only, so
    each pipeline rank gets its own subdirectory."""
    path = Path(path)
    return path / PIPELINE_RANK_DIR.format(layout.rank("pp")) if layout.size("pp") > 1 else path


def save_engine_checkpoint(engine: Any, layout: ParallelLayout, path: str | Path, client_state: dict) -> None:
    """The engine's weights and ZeRO partitions, with ``client_state`` (Lightning's state) beside them. Collective."""
    engine.save_checkpoint(str(stage_dir(path, layout)), tag=CHECKPOINT_TAG, client_state=client_state)


def load_engine_checkpoint(engine: Any, layout: ParallelLayout, path: str | Path, load_optimizer: bool,
                           strict: bool) -> dict:
    """Load a directory written by ``save_engine_checkpoint`` on the same layout; return its client state."""
    directory = stage_dir(path, layout)
    if not (directory / CHECKPOINT_TAG).is_dir():
        raise FileNotFoundError(f"ckpt_path={str(directory)!r} is not an MGPUStrategy checkpoint directory (expected "
                                f"a '{CHECKPOINT_TAG}' folder inside); pass the directory given to save_checkpoint")
    _, client_state = engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=load_optimizer,
                                             load_lr_scheduler_states=False, load_module_strict=strict)
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {directory}")
    return client_state
