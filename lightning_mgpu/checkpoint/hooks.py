"""Lightning's checkpoint hooks for a strategy whose engine writes and reads its own state.

Mixed into :class:`~lightning_mgpu.MGPUStrategy` (which provides ``model``, the engine; ``layout``; ``checkpoints``,
the :class:`~lightning_mgpu.checkpoint.formats.CheckpointSettings`; ``save_consolidated_weights``; ``broadcast``):
Lightning's own state goes into the checkpoint as client state beside the engine's, and both are written and read
by :mod:`lightning_mgpu.checkpoint.store` (formats, checksums, the trust rule, the fallback of a directory). Lightning
restores after ``setup``, once the engine exists, and never restores the optimizer itself.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu.checkpoint import store as checkpoints
from lightning_mgpu.contract import hook
from lightning_mgpu.checkpoint.background import InBackground
from lightning_mgpu.checkpoint.formats import LOADED_FROM, expert_checkpoint_problems, replica_checkpoint_problems
from lightning_mgpu.checkpoint.frozen_weights import ADAPTER_RECORD, check_same_base
from lightning_mgpu.checkpoint.loader_state import take_own_loader_state, with_every_loader_state
from lightning_mgpu.resilience.liveness import name_lost_ranks
from lightning_mgpu.resilience.watchdog import paused
from lightning_mgpu.problems import raise_problems


class EngineCheckpointHooks:
    """The checkpoint half of ``MGPUStrategy``'s Lightning hooks."""

    #: the checkpoint this fit resumed from (one of a directory's), for the line at the start of training
    _resumed_from: Optional[str] = None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # DeepSpeed writes the (possibly partitioned) weights itself

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # DeepSpeed writes the ZeRO partitions itself

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a checkpoint directory: the engine's state in the run's format plus Lightning's as client state.
        ``storage_options``: an :class:`~lightning_mgpu.checkpoint.background.InBackground` to write it in the
        background (the started save is left in it), else None."""
        if storage_options is not None and not isinstance(storage_options, InBackground):
            raise TypeError(f"storage_options={storage_options!r}: MGPUStrategy takes None or InBackground (the engine "
                            "writes the checkpoint)")
        raise_problems("Cannot save a checkpoint", replica_checkpoint_problems(
            self.layout.replica_update, self.checkpoints.format) + expert_checkpoint_problems(
            self.layout.expert_parallel_size, self.checkpoints.format))
        filepath = self.broadcast(str(filepath))
        record = hook(self.lightning_module, "checkpoint_record")
        client_state = with_every_loader_state(
            {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}, self.layout)
        client_state.update(record() if record is not None else {})
        with name_lost_ranks(self._heartbeat), paused(self._heartbeat):  # a save is not a step
            extra = functools.partial(checkpoints.write_consolidated_weights, self.model, self.layout,
                                      self.lightning_module) if self.save_consolidated_weights else None
            if storage_options is None:
                checkpoints.save(self.model, self.layout, filepath, client_state, self.checkpoints, extra,
                                 self._replica_sync)
            else:
                storage_options.started = checkpoints.save_in_background(
                    self.model, self.layout, filepath, client_state, self.checkpoints, storage_options, extra,
                    self._replica_sync)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read ``checkpoint_path`` (one checkpoint, or a directory of periodic ones: the newest this run may read
        and that is intact) into the engine; see ``lightning_mgpu.checkpoint.store``."""
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting:
            raise_problems("Cannot resume", replica_checkpoint_problems(self.layout.replica_update,
                                                                        self.checkpoints.format)
                           + expert_checkpoint_problems(self.layout.expert_parallel_size, self.checkpoints.format))
        state = checkpoints.load(self.model, self.layout, checkpoint_path, self.checkpoints, fitting,
                                 strict=self.lightning_module.strict_loading, replica_sync=self._replica_sync)
        record = hook(self.lightning_module, "checkpoint_record")
        check_same_base(checkpoint_path, state.get(ADAPTER_RECORD), (record() if record else {}).get(ADAPTER_RECORD))
        self._resumed_from = state.get(LOADED_FROM, str(checkpoint_path)) if fitting else None
        return take_own_loader_state(state, self.layout)

    @override
    def on_train_start(self) -> None:
        """Say which checkpoint a resumed run continues from, and at which step, on every resume (a directory of
        periodic checkpoints resolves to one of them only here, so Lightning's own line names the directory)."""
        super().on_train_start()
        if self._resumed_from is not None:
            rank_zero_info(f"Resumed at step {self.lightning_module.trainer.global_step} from {self._resumed_from}")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Weights were loaded by DeepSpeed in ``load_checkpoint``."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """ZeRO partitions were loaded by DeepSpeed in ``load_checkpoint``."""
