"""Saving and loading a run's checkpoints in either format, with checksums, the trust rule and the fallback.

``save`` writes the engine's state in the run's format, optionally the consolidated weights, then the checksums of
every file (``lightning_mgpu.checkpoint.integrity``). ``load`` takes either one checkpoint or a directory of periodic
checkpoints (what ``checkpoint.resume=auto`` passes): there it tries the newest first and skips, saying why, any of
another format (``lightning_mgpu.checkpoint.formats``) or with a damaged file, so the run continues from the newest
intact checkpoint it may read. Every decision is taken on the same evidence on every rank (the checksums are
verified in shares and gathered), so ranks never disagree on what they load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mgpu.checkpoint.formats import (
    CheckpointRefusedError,
    LOADED_FROM,
    CheckpointSettings,
    background_save_problems,
    complete_checkpoints,
    format_of,
    read_refusal,
)
from lightning_mgpu.checkpoint.integrity import checksum_problems, has_checksums, record_checksums
from lightning_mgpu.checkpoint.universal import load_universal, save_universal
from lightning_mgpu.engine.checkpoint_dir import load_engine_checkpoint, save_engine_checkpoint
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.collectives import gather_objects
from lightning_mgpu.problems import format_problems


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def record(path: str | Path) -> None:
    """Checksum every file of the checkpoint ``path`` once all ranks have written theirs (collective)."""
    record_checksums(path, *_rank_world(), gather=gather_objects)


def verify(path: str | Path) -> None:
    """Refuse a checkpoint with a damaged or missing file, naming each (collective: each rank checks a share; warns
    when nothing was recorded: a checkpoint written before checksums existed is loaded unverified)."""
    problems = checksum_problems(path, *_rank_world(), gather=gather_objects)
    if problems:
        raise CheckpointRefusedError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    if not has_checksums(path):
        rank_zero_warn(f"checkpoint {path} records no checksums (written by an older lightning_mgpu): its files "
                       "are loaded unverified")


def save(engine: Any, layout: ParallelLayout, path: str | Path, client_state: dict, settings: CheckpointSettings,
         write_extra: Optional[Callable[[Path], None]] = None, replica_sync: Any = None) -> None:
    """Write the checkpoint ``path`` in the run's format, then ``write_extra(path)`` (collective), then the
    checksums of every file. ``replica_sync``: the outer step of replicas that step apart, saved with them."""
    if settings.format == "universal":
        save_universal(engine, layout, path, client_state, replica_sync)
    else:
        save_engine_checkpoint(engine, layout, path, client_state)
    if write_extra is not None:
        write_extra(Path(path))
    record(path)


def save_in_background(engine: Any, layout: ParallelLayout, path: str | Path, client_state: dict,
                       settings: CheckpointSettings, options: Any, write_extra: Optional[Callable[[Path], None]] = None,
                       replica_sync: Any = None) -> Any:
    """Start writing the universal checkpoint ``path`` in the background (collective) and return its
    :class:`~lightning_mgpu.checkpoint.background.BackgroundSave`; ``options``: the periodic checkpoint's
    :class:`~lightning_mgpu.checkpoint.background.InBackground`; ``write_extra`` (the consolidated weights) is written
    first, blocking, so that the background checksums cover it."""
    from lightning_mgpu.checkpoint.background import start_background_save

    problems = background_save_problems(settings.format)
    if problems:
        raise ValueError(problems[0])
    if write_extra is not None:
        write_extra(Path(path))
    return start_background_save(engine, layout, path, client_state, options, replica_sync)


def write_consolidated_weights(engine: Any, layout: ParallelLayout, module: Any, directory: Path) -> None:
    """The whole model's weights, gathered to rank 0, beside the checkpoint (``model.safetensors`` and, for a module
    with a ``config`` that has ``to_dict()``, ``model_config.json``). Collective."""
    from lightning_mgpu.checkpoint.consolidate import consolidated_state_dict
    from lightning_mgpu.checkpoint.files import write_consolidated

    state = consolidated_state_dict(engine, layout)
    if state is not None:
        config = getattr(module, "config", None)
        write_consolidated(directory, state, config.to_dict() if hasattr(config, "to_dict") else None)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _load_one(engine: Any, layout: ParallelLayout, path: Path, fitting: bool, strict: bool,
              replica_sync: Any = None) -> dict:
    verify(path)  # before anything is read: 6% of a 100M-parameter resume on one CPU process (docs: measurements)
    if format_of(path) == "universal":
        return load_universal(engine, layout, path, replica_sync, fitting)
    return load_engine_checkpoint(engine, layout, path, load_optimizer=fitting, strict=strict)


def load(engine: Any, layout: ParallelLayout, path: str | Path, settings: CheckpointSettings, fitting: bool,
         strict: bool = True, replica_sync: Any = None) -> dict:
    """Load the checkpoint ``path`` into ``engine``, or the newest one this run may read of a directory of
    periodic checkpoints; return the client (trainer) state, with the path loaded under ``LOADED_FROM``."""
    path = Path(path)
    candidates = complete_checkpoints(path)
    if not candidates:
        refusal = read_refusal(path, settings)
        if refusal is not None:
            raise CheckpointRefusedError(refusal)
        return dict(_load_one(engine, layout, path, fitting, strict, replica_sync), **{LOADED_FROM: str(path)})
    skipped: list[str] = []
    for candidate in candidates:
        refusal = read_refusal(candidate, settings, searching=True)
        if refusal is None:
            try:
                state = _load_one(engine, layout, candidate, fitting, strict, replica_sync)
            except CheckpointRefusedError as error:  # raised on every rank alike: all move on together
                refusal = str(error)
            else:
                for line in skipped:
                    rank_zero_warn(f"Skipped: {line}")
                rank_zero_info(f"Loaded the checkpoint of step {state.get('global_step')}: {candidate}")
                return dict(state, **{LOADED_FROM: str(candidate)})
        skipped.append(refusal)
    raise CheckpointRefusedError(format_problems(f"no checkpoint in {path} can be resumed", skipped)
                                 + "\nfix or remove them, or start afresh (checkpoint.resume=null)")
