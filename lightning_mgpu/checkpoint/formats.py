"""Which format a checkpoint directory is in, and whether a run may read it: the rules, stated once.

``universal`` checkpoints are read without running anything from them (restricted unpickling of DCP's metadata,
``weights_only`` for the rest). ``deepspeed`` directories are read by DeepSpeed itself with unrestricted unpickling,
so anything in them runs: they are read only when the run says it trusts them (``trust_deepspeed_checkpoints``). A
directory of periodic checkpoints (``step-NNNNNNNN`` folders) is searched newest first, and there a checkpoint of a
format other than the run's own is skipped unless the run trusts DeepSpeed checkpoints, and so is one that records no
checksums (named explicitly, it loads with a warning that it is unverified).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning_mgpu.checkpoint.files import CONFIG, WEIGHTS
from lightning_mgpu.checkpoint.integrity import CHECKSUMS
from lightning_mgpu.engine.checkpoint_dir import DEEPSPEED_TAG, PIPELINE_RANK_DIR
from lightning_mgpu.resilience.rollback import complete_checkpoints  # noqa: F401  (what a restart may resume from)

FORMATS = ("universal", "deepspeed")
#: The trainer state written beside DCP's ``.metadata`` (``lightning_mgpu.checkpoint.universal``).
TRAINER_STATE = "trainer_state.pt"
UNIVERSAL_FILES = (".metadata", TRAINER_STATE)
TRUST_SETTING = ("MGPUStrategy(trust_deepspeed_checkpoints=True) (mgpu-train: "
                 "checkpoint.trust_deepspeed_checkpoints=true)")
#: The key of the loaded checkpoint's path in the state a load returns (Lightning hands it to ``on_load_checkpoint``).
LOADED_FROM = "mgpu_loaded_from"


class CheckpointRefusedError(ValueError):
    """A checkpoint this run may not, or cannot safely, load; the message names each file and the reason."""


@dataclass(frozen=True)
class CheckpointSettings:
    """How a run writes checkpoints and which it agrees to read."""

    format: str = "universal"
    trust_deepspeed_checkpoints: bool = False


def replica_checkpoint_problems(replica_update: str, checkpoint_format: str) -> list[str]:
    """The rule: a round of ``replica_update="local"`` (each replica's own weights, the weights of the last outer
    step, the outer momentum) is saved in universal checkpoints only (``checkpoint.replica_state``); an ``async``
    run's state depends on when each replica's messages arrived, so no resume could continue it as it would have
    gone on: it neither saves nor resumes."""
    if replica_update == "async":
        return ["replica_update='async' cannot save or resume checkpoints (where it is depends on when each "
                "replica's pushes arrived, which a resume cannot repeat); train without checkpoint.every_n_steps, "
                "checkpoint.save_last and checkpoint.resume, or with replica_update='local'"]
    if replica_update == "local" and checkpoint_format != "universal":
        return [f"replica_update='local' saves each replica's round in universal checkpoints only, not "
                f"the {checkpoint_format} format; use the universal format (checkpoint.format=universal)"]
    return []


def expert_checkpoint_problems(expert_parallel_size: int, checkpoint_format: str) -> list[str]:
    """The rule: experts split over ranks are saved in universal checkpoints only. DeepSpeed's own format writes the
    model's weights from data-parallel rank 0 (ZeRO 0-2), which holds only its own experts."""
    if isinstance(expert_parallel_size, int) and expert_parallel_size > 1 and checkpoint_format != "universal":
        return [f"expert_parallel_size={expert_parallel_size} saves its experts in universal checkpoints only, not "
                f"the {checkpoint_format} format (its model file would hold one rank's experts); use the universal "
                "format (checkpoint.format=universal, MGPUStrategy(checkpoint_format='universal'))"]
    return []


def background_save_problems(checkpoint_format: str, key: str = "checkpoint.async_save") -> list[str]:
    """The rule: only universal checkpoints are written in the background (DCP's ``async_save``); DeepSpeed's own
    format is written by the engine, blocking."""
    if checkpoint_format != "universal":
        return [f"{key}=true writes universal checkpoints in the background, and the checkpoint format is "
                f"{checkpoint_format!r} (DeepSpeed writes its own format, blocking): use checkpoint.format=universal "
                f"(MGPUStrategy(checkpoint_format='universal')) or {key}=false"]
    return []


def format_name_problems(value: object, key: str = "checkpoint_format") -> list[str]:
    """The format-name rule: one of :data:`FORMATS`."""
    if value in FORMATS:
        return []
    return [f"{key}={value!r} is unknown; choose {' or '.join(FORMATS)}"]


def is_deepspeed(path: str | Path) -> bool:
    path = Path(path)
    return (path / DEEPSPEED_TAG).is_dir() or (path / PIPELINE_RANK_DIR.format(0) / DEEPSPEED_TAG).is_dir()


def is_consolidated(path: str | Path) -> bool:
    return (Path(path) / WEIGHTS).is_file() and (Path(path) / CONFIG).is_file()


def format_of(path: str | Path) -> Optional[str]:
    """``"universal"``, ``"deepspeed"`` or ``None`` (not a checkpoint this package can resume from)."""
    if all((Path(path) / name).is_file() for name in UNIVERSAL_FILES):
        return "universal"
    return "deepspeed" if is_deepspeed(path) else None


def read_refusal(path: str | Path, settings: CheckpointSettings, searching: bool = False) -> Optional[str]:
    """Why a run with ``settings`` may not read the checkpoint ``path`` (``None``: it may). ``searching``: ``path``
    was found in a directory of checkpoints, not named by the user, so it must also be of the run's own format."""
    found = format_of(path)
    if found is None:
        return (f"{path} is not a checkpoint (neither {' + '.join(UNIVERSAL_FILES)} nor a DeepSpeed "
                f"'{DEEPSPEED_TAG}' folder); pass a directory given to save_checkpoint")
    if found == "deepspeed" and not settings.trust_deepspeed_checkpoints:
        return (f"{path} is in DeepSpeed's format, which DeepSpeed reads by unrestricted unpickling: code inside its "
                f"files would run. Load it only if you trust whoever wrote it, with {TRUST_SETTING}")
    if searching and not (Path(path) / CHECKSUMS).is_file():
        return (f"{path} records no checksums, so its files cannot be verified (every checkpoint this version publishes "
                "records them); name it explicitly to load it unverified")
    if searching and found != settings.format and not settings.trust_deepspeed_checkpoints:
        return (f"{path} is in the {found} format and this run writes {settings.format}; name it explicitly, or "
                f"accept either format with {TRUST_SETTING}")
    return None
