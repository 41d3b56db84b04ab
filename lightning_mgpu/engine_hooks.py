"""The Lightning hooks of the strategy that hand work to the engine: precision, backward, the optimizer step and
gradient accumulation are the engine's (DeepSpeed's), not torch's or Lightning's. Strategy glue, beside the strategy:
it calls the engine and the parallel layers, so it sits in neither package (the engine imports no parallel layer)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Generator, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.engine import zero3_partitioner
from lightning_mgpu.engine.runtime import backward, step
from lightning_mgpu.parallel.replicas import keep_sigterm_check_inside_replicas
from lightning_mgpu.resilience.stragglers import log_round, report_stragglers
from lightning_mgpu.parallel.experts import balance_experts, forget_skipped_step
from lightning_mgpu.resilience.liveness import name_lost_ranks
from lightning_mgpu.resilience.watchdog import StepWatchdog
from lightning_mgpu.precision import MGPUPrecision, as_mgpu_precision, fp8_layout_problems
from lightning_mgpu.problems import raise_problems
from lightning_mgpu.resilience.step_guard import SkippedStep, StepGuard, describe
from lightning_mgpu.callbacks.console import use_layout_console
from lightning_mgpu.parallel.applied import applied_layout, parameter_counts


class EngineHooks:
    """For a strategy whose ``model`` is the engine after ``setup``, with ``context`` (the module's parallel context),
    ``_heartbeat`` (which names a lost rank), ``_replica_sync`` (the outer step of replicas that step apart),
    ``_clock`` (this rank's time per step, ``lightning_mgpu.resilience.stragglers``) and ``skip_bad_steps`` /
    ``loss_spike`` (the step guard's settings)."""

    _guard: Optional[StepGuard] = None

    def _partitioner(self, engine_config: Callable[[torch.nn.Module], dict]) -> Optional[Callable]:
        """Under ZeRO-3, each module's parameters are partitioned as they are filled."""
        if self.layout.zero_stage != 3:
            return None
        return lambda kept: zero3_partitioner(engine_config(kept), self.layout)

    def _convert_precision(self, module: torch.nn.Module) -> torch.nn.Module:
        """The precision plugin's conversion, then fp8 (``MGPUPrecision(fp8=...)``) on every linear layer of this
        rank's split model, its scales reduced over the tensor- and context-parallel groups; on CUDA a layer whose
        local sizes the fp8 kernels refuse is named (all at once)."""
        module = self.precision_plugin.convert_module(module)
        if self.precision_plugin.fp8 is not None:
            from lightning_mgpu import fp8  # torchao, imported by runs that use it only

            raise_problems("Invalid parallel layout", fp8_layout_problems(
                self.precision_plugin.fp8, self.layout.size("cp"), self.layout.size("ep")))
            converted = fp8.convert_to_fp8(module, self.precision_plugin.fp8, self.layout.group("tp") if
                                           self.layout.size("tp") > 1 else None,
                                           self.layout.group("cp") if self.layout.size("cp") > 1 else None)
            rank_zero_info(f"fp8 ({self.precision_plugin.fp8}): {len(converted)} layers")
            if self.root_device.type == "cuda":
                raise_problems("fp8 cannot run these layers", fp8.kernel_size_problems(fp8.local_sizes(module)))
        return module

    def _guard_steps(self, module: Any, optimizer: torch.optim.Optimizer) -> None:
        """With ``skip_bad_steps``: the guard that skips bad steps on every rank of a replica (they step together),
        holding back the module's LR schedules on a skipped step."""
        if self.skip_bad_steps:
            self._guard = StepGuard(optimizer, self.layout.group("replica"), self.root_device, self.loss_spike)
            self._guard.hold_schedules_of(module)

    def _announce_setup(self, trainer: Any) -> None:
        """What ``setup`` built, said on rank 0: the applied layout; the whole model's parameters, counted over the
        ranks (one all-reduce), for the model summary, which with the progress bar becomes the package's own."""
        rank_zero_info(applied_layout(self.model, self.layout, self.pipeline, self.global_rank, self._replica_sync))
        self.parameter_counts = parameter_counts(self.model.module, self.layout, self.root_device)
        use_layout_console(trainer, trainer.state.stage.value if trainer.state.stage else "fit")

    @property
    def engine(self):
        """The DeepSpeed engine (available after ``setup``)."""
        return self.model

    @property
    def precision_plugin(self) -> MGPUPrecision:
        return self._precision_plugin if self._precision_plugin is not None else MGPUPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning picks a torch-autocast plugin for strategies it does not know; DeepSpeed owns precision here.
        self._precision_plugin = None if plugin is None else as_mgpu_precision(plugin)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: on the batches ``accumulate_grad_batches`` accumulates over, the engine's backward keeps
        accumulating (it is scaled by 1 / (micro-batches x N), its boundary is ``engine.step()``, called by Lightning's
        optimizer step only at the end of each group of N batches or of the epoch, as under DDP). Lightning's
        default would enter DeepSpeed's ``no_sync``, which ZeRO 2 and 3 refuse."""
        yield

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Automatic optimization: nothing to do, ``training_step`` already ran each micro-batch's backward through
        the engine. Manual optimization (``self.manual_backward(loss)``): the engine's backward."""
        if not self.lightning_module.automatic_optimization:
            with name_lost_ranks(self._heartbeat):
                backward(self.model, closure_loss, *args, **kwargs)
        return closure_loss

    def engine_step(self) -> None:
        """One optimizer step of the engine (reduce, clip by the global norm, update, zero grads); the step guard
        (``skip_bad_steps``) checks this rank's own losses of the step's batches with the gradients."""
        losses, self._step.local_losses[:] = list(self._step.local_losses), []
        with name_lost_ranks(self._heartbeat):
            self._clock.before_step()
            if self._guard is not None:
                self._guard.arm(torch.stack(losses) if losses else None)
            self.context.last_grad_norm = step(self.model)
            if self._guard is None or not self._settle_guard():
                balance_experts(self.model.module, self.layout)
            else:  # skipped: the router biases stay, and the skipped batches' token counts are dropped
                forget_skipped_step(self.model.module)
            if self._replica_sync is not None:  # replicas that step apart: every sync_every steps, the outer step
                trainer = self.lightning_module.trainer
                if self._replica_sync.after_inner_step(last=0 < trainer.max_steps <= trainer.global_step + 1):
                    log_round(trainer, self._replica_sync)
            self._clock.after_step()
        if self._heartbeat is not None and self._heartbeat.watchdog is not None:
            self._heartbeat.watchdog.beat()

    def _settle_guard(self) -> bool:
        """Whether the step just taken was skipped (the guard's verdict); a skipped step is reported and holds back
        the LR schedules stepped once per optimizer step."""
        trainer = self.lightning_module.trainer
        schedulers = [c.scheduler for c in self.lr_scheduler_configs if c.interval == "step" and c.frequency == 1]
        verdict = self._guard.settle(trainer.global_step, schedulers)
        if verdict.skip:
            rank_zero_info(describe(self._guard.skipped[-1]))
        return verdict.skip

    @property
    def skipped_steps(self) -> list[SkippedStep]:
        """The optimizer steps skipped so far (``skip_bad_steps``)."""
        return list(self._guard.skipped) if self._guard is not None else []

    def on_train_start(self) -> None:
        if self._heartbeat is not None:  # a hang report writes this rank's collective trace and stacks there
            self._heartbeat.report_dir = Path(self.lightning_module.trainer.default_root_dir)
            stall = self._timeout.total_seconds() if self._timeout is not None else default_pg_timeout.total_seconds()
            if self._heartbeat.watchdog is None:
                self._heartbeat.watchdog = StepWatchdog(self._heartbeat.store, self._heartbeat.rank, stall,
                                                        self._heartbeat.report_dir)
        if self._replica_sync is not None:
            keep_sigterm_check_inside_replicas(self.lightning_module.trainer, self.layout)
        self._clock.start()
        super().on_train_start()

    def on_validation_start(self) -> None:
        """Validation is not a step: the step-progress watchdog waits for training to go on."""
        if self._heartbeat is not None and self._heartbeat.watchdog is not None:
            self._heartbeat.watchdog.pause()
        super().on_validation_start()

    def on_validation_end(self) -> None:
        if self._heartbeat is not None and self._heartbeat.watchdog is not None:
            self._heartbeat.watchdog.resume()
        super().on_validation_end()

    def on_train_end(self) -> None:
        """Replicas that step apart: a round cut short ends with its outer step (every replica, the same weights).
        Then every rank's time per step, and the straggler report (``self.straggler_report``)."""
        with name_lost_ranks(self._heartbeat):
            if self._replica_sync is not None:
                self._replica_sync.finish()
            self.straggler_report = report_stragglers(self._clock, self._replica_sync)
        rank_zero_info(self.straggler_report)
        if self._heartbeat is not None and self._heartbeat.watchdog is not None:
            self._heartbeat.watchdog.stop()
            self._heartbeat.watchdog = None
        super().on_train_end()

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm (before clipping) of the last optimizer step, ``None`` after a batch without one."""
        return self.context.last_grad_norm if self.context is not None else None
