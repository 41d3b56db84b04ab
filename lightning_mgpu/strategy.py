"""MGPUStrategy: thin Lightning glue over the layout, the parallel transforms and the DeepSpeed engine."""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from typing import Any, Callable, Generator, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_mgpu.checkpoint.hooks import EngineCheckpointHooks
from lightning_mgpu.checkpoint.formats import CheckpointSettings, format_name_problems
from lightning_mgpu import allocator, engine as engines
from lightning_mgpu.engine_hooks import EngineHooks
from lightning_mgpu.contract import ParallelContext, builds_on_meta
from lightning_mgpu.hf import adopt as adopt_hf_model
from lightning_mgpu.launcher import choose_launcher
from lightning_mgpu.layout import LayoutRequest, ParallelLayout
from lightning_mgpu.parallel.collectives import WorldCollectives
from lightning_mgpu.parallel.evaluation import EvaluationSteps
from lightning_mgpu.parallel.frozen import user_optimizers
from lightning_mgpu.resilience.liveness import Heartbeat, name_lost_ranks
from lightning_mgpu.parallel.pipeline import Pipeline
from lightning_mgpu.parallel.process_group import start_process_group
from lightning_mgpu.parallel.outer_steps import replica_sync
from lightning_mgpu.parallel.replicas import OuterOptimizer
from lightning_mgpu.resilience.stragglers import StepClock, slow_rank_problems
from lightning_mgpu.parallel.plan import TensorParallelPlan
from lightning_mgpu.parallel.split_once import SplitOnce
from lightning_mgpu.parallel.step import layout_step
from lightning_mgpu.parallel.timeline import PipelineTimeline
from lightning_mgpu.problems import raise_problems
from lightning_mgpu.refusals import check_module, check_optimizers, check_trainer
from lightning_mgpu.resilience.step_guard import SpikeRule


#: The names registered in Lightning's ``StrategyRegistry`` on import, with the ``MGPUStrategy`` arguments of each.
REGISTERED_NAMES = {"mgpu": {}, "mgpu_zero1": {"zero_stage": 1}, "mgpu_zero2": {"zero_stage": 2},
                    "mgpu_zero3": {"zero_stage": 3},
                    "mgpu_zero3_offload": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}}


class MGPUStrategy(EngineHooks, EngineCheckpointHooks, EvaluationSteps, WorldCollectives, ParallelStrategy):
    """Tensor, pipeline and ZeRO data parallelism for ``lightning.Trainer``.

    Every process holds one DeepSpeed engine whose ZeRO stage partitions over the ranks holding the same model shard
    (data x context parallel). One Lightning batch is this rank's share of one global batch: ``training_step`` runs
    its micro-batches (forward and backward through the engine); the optimizer step is one ``engine.step()``, with
    gradient clipping (``Trainer(gradient_clip_val=...)``) by the global norm. The class is Lightning's hooks, each
    delegating: the engine's (``engine_hooks``), checkpoints (``checkpoint.hooks``), evaluation
    (``parallel.evaluation``) and collectives (``parallel.collectives``).

    Args:
        zero_stage: ZeRO stage 0-3 over the data-parallel group.
        tensor_parallel_size: ranks that split each layer's matmuls (innermost axis).
        pipeline_parallel_size: ranks that split the stack of layers into stages.
        context_parallel_size: ranks that split each sequence (long context, ``lightning_mgpu.parallel.context``):
            each holds two of ``2 x context_parallel_size`` chunks; needs a replaceable attention (``LLMModule``).
        expert_parallel_size: data x context ranks splitting each layer's experts (``lightning_mgpu.parallel.experts``).
        sequence_parallel: norms on sequence shards, all-gather / reduce-scatter in place of all-reduce inside
            tensor-parallel groups (needs ``tensor_parallel_size > 1``).
        tensor_parallel_plan: ``{module name pattern: style}`` that splits the module's layers
            (``lightning_mgpu.parallel.plan``); default: the module's ``tensor_parallel_plan()``.
        pipeline_boundaries: ``stages + 1`` block indices from 0 to ``n_layers``; default: balanced by blocks.
        pipeline_timeline: record when each pipeline action ran on this rank (``strategy.pipeline.timeline``).
        save_consolidated_weights: every checkpoint also holds the whole model's weights (``model.safetensors``, any
            layout) for ``mgpu-export``; rank 0 holds the whole model in CPU memory while saving.
        checkpoint_format: ``"universal"`` (any layout, ZeRO stage or schedule can resume from it) or
            ``"deepspeed"`` (DeepSpeed's own directories: the same layout only).
        trust_deepspeed_checkpoints: allow loading DeepSpeed-format directories, which DeepSpeed unpickles (code in
            them runs); universal checkpoints are always read without running code. ``ckpt_path`` may be a directory
            of periodic checkpoints: the newest intact one this run may read is loaded.
        pipeline_schedule: pipeline schedule name (see ``lightning_mgpu.layout.SCHEDULES``).
        virtual_pipeline_size: stage chunks per pipeline rank (interleaved schedules).
        num_microbatches: micro-batches per global batch; ``None`` derives it from the data module.
        offload_optimizer: ``None``, ``"cpu"`` or ``"nvme"``: where ZeRO keeps optimizer state.
        offload_params: ``None``, ``"cpu"`` or ``"nvme"``: where ZeRO-3 keeps parameters.
        nvme_path: directory for NVMe offload.
        deepspeed_config: a dict merged over the generated DeepSpeed config (escape hatch).
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: collective timeout, a ``timedelta`` or seconds (``parallel.timeout``).
        return_freed_memory: CPU processes hand the memory a step frees back to the OS (``lightning_mgpu.allocator``):
            a lower host-memory peak for 10-25% more step time; the memory check counts either.
        replicas: groups of data-parallel ranks (the outermost axis) that synchronise by ``replica_update``.
        replica_update: ``"sync"`` (gradients over every data-parallel rank, every step), ``"local"`` (each replica
            steps alone; every ``sync_every`` steps an outer step over their averaged change in weights: DiLoCo,
            local SGD; ``parallel.replicas``) or ``"async"`` (push the change, continue from the newest global
            weights, at most ``max_staleness`` rounds ahead of them; ``parallel.async_replicas``).
        sync_every: inner steps between outer steps. outer_optimizer: ``OuterOptimizer`` or a dict of its fields;
            default Nesterov SGD, lr 0.7, momentum 0.9.
        slow_ranks: chaos, ``{global rank: factor}``: ranks made that much slower (``resilience.stragglers``).
        skip_bad_steps: skip, on every rank, a step whose loss or gradients are not finite on a rank or whose loss
            spikes (``lightning_mgpu.resilience.step_guard``; ``strategy.skipped_steps`` lists them).
        loss_spike: the spike rule (``SpikeRule`` or a dict of its fields); ``None``: non-finite steps only.
    """

    strategy_name = "mgpu"

    def __init__(self, zero_stage: int = 0, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 sequence_parallel: bool = False, pipeline_schedule: str = "1f1b", virtual_pipeline_size: int = 1,
                 num_microbatches: Optional[int] = None, offload_optimizer: Optional[str] = None,
                 offload_params: Optional[str] = None, nvme_path: Optional[str] = None,
                 deepspeed_config: Optional[dict] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
                 tensor_parallel_plan: Optional[TensorParallelPlan] = None,
                 pipeline_boundaries: Optional[list[int]] = None, pipeline_timeline: bool = False,
                 save_consolidated_weights: bool = False, checkpoint_format: str = "universal",
                 context_parallel_size: int = 1, trust_deepspeed_checkpoints: bool = False,
                 return_freed_memory: bool = False, replicas: int = 1, replica_update: str = "sync",
                 sync_every: int = 1, outer_optimizer: Optional[Union[OuterOptimizer, dict]] = None,
                 max_staleness: int = 2, slow_ranks: Optional[dict[int, float]] = None, expert_parallel_size: int = 1,
                 skip_bad_steps: bool = True, loss_spike: Optional[Union[SpikeRule, dict]] = SpikeRule(),
                 **kwargs: Any) -> None:
        arguments = locals()
        super().__init__(**kwargs)
        self.layout_request = LayoutRequest(**{name: arguments[name] for name in LayoutRequest.__dataclass_fields__})
        self.outer_optimizer, self.slow_ranks = OuterOptimizer.of(outer_optimizer), dict(slow_ranks or {})
        self.skip_bad_steps, self.loss_spike = skip_bad_steps, SpikeRule.of(loss_spike)
        # Everything that does not depend on the world size is checked now, before any process exists.
        raise_problems("Invalid parallel layout", self.layout_request.problems_with() + self.outer_optimizer.problems()
                       + slow_rank_problems(self.slow_ranks) + (self.loss_spike.problems() if self.loss_spike else []))
        self.pipeline_boundaries = None if pipeline_boundaries is None else list(pipeline_boundaries)
        self.pipeline_timeline, self.save_consolidated_weights = pipeline_timeline, save_consolidated_weights
        if problems := format_name_problems(checkpoint_format):
            raise ValueError(problems[0])
        self.checkpoints = CheckpointSettings(checkpoint_format, trust_deepspeed_checkpoints)
        self.pipeline: Optional[Pipeline] = None
        #: When set, local ranks 1..N-1 run ``worker_command`` instead of re-running the script, or a CPU job forks them
        #: from this process to run ``fork_entry``, inheriting torch, Lightning and DeepSpeed imported (launcher.py).
        self.worker_command: Optional[list[str]] = None
        self.fork_entry: Optional[Callable[[], object]] = None
        self.tensor_parallel_plan, self.tensor_parallel_notes = tensor_parallel_plan, []
        self.nvme_path, self.return_freed_memory = nvme_path, return_freed_memory
        self.deepspeed_config_overrides = dict(deepspeed_config or {})
        self._process_group_backend = process_group_backend
        self._timeout = timeout if timeout is None or isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.layout: Optional[ParallelLayout] = None
        self._heartbeat: Optional[Heartbeat] = None
        self.num_nodes = 1
        self.context: Optional[ParallelContext] = None
        self._split = SplitOnce()
        #: Parameter elements this rank gave storage to after building on the meta device (0: built for real).
        self.materialized_elements = 0
        self._replica_sync, self._clock = None, StepClock()

    # ------------------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, kwargs in REGISTERED_NAMES.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"MGPUStrategy {kwargs or '(ZeRO-0)'}", **kwargs)

    # ------------------------------------------------------------------------------- environment
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.size("data"), "rank": self.layout.rank("data")}

    @property
    def is_distributed(self) -> bool:
        """Always: Lightning then shards a user's DataLoaders over the data-parallel group (``distributed_sampler_kwargs``),
        as it does under DDP. It reads this attribute for strategies that are not its own."""
        return True

    @override
    def _configure_launcher(self) -> None:
        # The last moment before processes start: the world size is known, so check the layout now.
        world_size = self.num_nodes * self.num_processes
        raise_problems("Invalid parallel layout", self.layout_request.problems_with(world_size))
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = choose_launcher(self.cluster_environment, self.num_processes, self.num_nodes,
                                             self.worker_command, self.fork_entry,
                                             isinstance(self.accelerator, CPUAccelerator))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.root_device.type == "cpu" and self.return_freed_memory:  # hand what a step frees back to the OS
            allocator.return_freed_memory()
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self._process_group_backend, self.layout, self._heartbeat = start_process_group(
            self.cluster_environment, self.root_device, self._process_group_backend, self._timeout,
            self.layout_request, self.num_processes, self.global_rank, self.lightning_module.trainer.default_root_dir)

    # ---------------------------------------------------------------------------------- model setup
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.accelerator.setup(trainer)
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        plan = getattr(trainer.datamodule, "batch_plan", None) if trainer.datamodule is not None else None
        micro_batches = self.layout_request.num_microbatches or (plan.num_microbatches if plan else 1)
        if plan:
            rank_zero_info(plan.describe(self.layout.size("pp")))
        check_trainer(trainer, module, self.layout, micro_batches)
        if self._split.module is not module:  # a transformers model inside: the hooks its config implies
            adopt_hf_model(module, self.layout)
        check_module(module, self.layout_request, self.world_size, micro_batches, self.precision_plugin.precision)
        accumulate = trainer.accumulate_grad_batches if module.automatic_optimization else 1
        engine_config = functools.partial(
            engines.run_config, self.layout, micro_batch_size=plan.micro_batch_size if plan else 1,
            num_microbatches=micro_batches * accumulate, gradient_clipping=trainer.gradient_clip_val,
            precision=self.precision_plugin.precision, nvme_path=self.nvme_path,
            overrides=self.deepspeed_config_overrides, overlap=self.root_device.type == "cuda", fitting=fitting)
        wrapped = self._split(self.lightning_module, self.layout, self.root_device, self.tensor_parallel_plan,
                              self.pipeline_boundaries, self._partitioner(engine_config))
        self.tensor_parallel_notes, self.materialized_elements = self._split.notes, self._split.materialized
        self.model = self._convert_precision(self.model)
        self.model_to_device()
        wrapped = self.model if self.layout.size("pp") == 1 else wrapped
        optimizer = None
        if fitting:
            self.optimizers, self.lr_scheduler_configs = user_optimizers(module, wrapped, self.layout, self.root_device)
            optimizer = check_optimizers(self.optimizers, module, self.layout)
        config = engine_config(wrapped)
        if optimizer is not None and engines.drifts_from_fp32(config):
            rank_zero_warn(engines.drifts_from_fp32(config))
        self.num_microbatches, self.deepspeed_config = micro_batches, config
        self.model, engine_optimizer = engines.initialize_engine(wrapped, optimizer, config, self.layout,
                                                                 [c.scheduler for c in self.lr_scheduler_configs])
        self._replica_sync = replica_sync(self.model, self.layout, self.outer_optimizer, optimizer is not None,
                                          self._timeout)
        self._clock = StepClock(self.slow_ranks.get(self.global_rank, 1.0))
        if optimizer is not None:
            self.optimizers = [engines.EngineOwnedOptimizer(engine_optimizer, optimizer)]
            self._guard_steps(module, optimizer)
        self._step, self.pipeline = layout_step(self.model, module, self.layout, self.root_device, micro_batches,
                                                PipelineTimeline() if self.pipeline_timeline else None,
                                                self.precision_plugin.train_step_context, self._forward_redirection)
        module.parallel_context = self.context = ParallelContext(self.layout, micro_batches, self.engine_step,
                                                                 self.pipeline)
        self._announce_setup(trainer)

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device when the module can give each rank its share of the initial
        values (``initial_value``): then each rank materialises only its own tensor/pipeline shard (``parallelize``)."""
        if builds_on_meta(self.lightning_module):
            with torch.device("meta"):
                yield
        else:
            yield

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch of this rank's share of the global batch.

        Returns the loss averaged over the whole global batch (all micro-batches of all data-parallel
        ranks), detached: the backward has already run.
        """
        self.context.last_grad_norm = None  # set again only by a batch that ends with an optimizer step
        with name_lost_ranks(self._heartbeat):
            return self._step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Record this rank's own failure in the rendezvous store (Lightning calls this on every exception that
        ends fit), so that the ranks left waiting on it name it with its exception instead of reporting it as
        unresponsive."""
        if self._heartbeat is not None:
            self._heartbeat.record_failure(exception)


MGPUStrategy.register_strategies(StrategyRegistry)
