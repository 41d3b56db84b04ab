"""The DeepSpeed engine at run time: its comm layer, its construction over the layout's process groups, and the
few engine calls the strategy, the pipeline and the checkpoints make (ZeRO stage, deferred gradient reduction,
step with the global gradient norm, gathering ZeRO-3 partitions)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional

import torch
from torch import nn

from lightning_mgpu.engine import experts
from lightning_mgpu.engine.config import parameter_dtype
from lightning_mgpu.engine.whole_matrices import bind_engine_optimizer
from lightning_mgpu.optim import tag_state_keys
from lightning_mgpu.layout import ParallelLayout


class LayoutMPU:
    """The model-parallel-unit object DeepSpeed asks for process groups.

    * data-parallel group: ZeRO partitions and reduces only over ranks holding the same model shard: the data x
      context ranks (context-parallel ranks compute gradients of the same weights from other tokens);
    * model-parallel group: the tp x pp ranks of one replica, so that gradient clipping and overflow
      checks see the whole model (a tp-only group would give each pipeline stage its own norm);
      its rank is the tp rank, which is how DeepSpeed names checkpoint files (the pp rank goes into
      the path, see ``engine.checkpoint_dir``);
    * tensor-model-parallel group: shards marked ``tensor_model_parallel`` are counted once per group.
    """

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout

    def get_data_parallel_group(self):
        return self.layout.group("dp_cp")

    def get_data_parallel_rank(self) -> int:
        return self.layout.rank("dp_cp")

    def get_data_parallel_world_size(self) -> int:
        return self.layout.size("dp_cp")

    def get_model_parallel_group(self):
        return self.layout.group("mp")

    def get_model_parallel_rank(self) -> int:
        return self.layout.rank("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.layout.size("tp") * self.layout.size("pp")

    def get_tensor_model_parallel_group(self):
        return self.layout.group("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.layout.rank("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.layout.size("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.layout.global_rank_of(0, self.layout.rank("pp"), self.layout.rank("dp"), self.layout.rank("cp"),
                                          self.layout.rank("rep"))

    def get_pipeline_model_parallel_group(self):
        return self.layout.group("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.layout.rank("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.layout.size("pp")


def _skip_cpu_shared_memory_op() -> None:
    """Stop DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op (30-70 s, inference only).

    ``import deepspeed.comm.torch`` resolves to the torch package (name shadowing), hence sys.modules.
    """
    import deepspeed.comm  # noqa: F401  (loads deepspeed.comm.torch)

    module = sys.modules.get("deepspeed.comm.torch")
    if module is not None and not torch.cuda.is_available():
        module.build_shm_op = lambda: None


def preload() -> None:
    """Import what building an engine imports, ahead of time: DeepSpeed itself, the Muon optimizer module every
    ZeRO engine imports (its kernels are ``torch.compile``-decorated, which loads torch's compiler: 2-3 s of CPU per
    process the first time, measured here) and the expert-parallel config module every engine's config parsing
    imports (0.3 s). The strategy calls it before the rendezvous, so the first rank does this while the others are
    still starting; a parent that forks ranks (or restarts them) calls it once for all of them."""
    import deepspeed  # noqa: F401

    _skip_cpu_shared_memory_op()
    for name in ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_config"):
        try:
            importlib.import_module(name)
        except ImportError:  # a DeepSpeed without it: nothing more to load
            pass


def init_engine_comm(timeout=None) -> None:
    """Let DeepSpeed's comm layer adopt the torch.distributed process group the strategy created."""
    import deepspeed

    _skip_cpu_shared_memory_op()
    kwargs = {"dist_init_required": False, "verbose": False}
    if timeout is not None:
        kwargs["timeout"] = timeout
    deepspeed.init_distributed(**kwargs)


def initialize_engine(module: nn.Module, optimizer: Optional[torch.optim.Optimizer], config: dict,
                      layout: ParallelLayout, schedulers: Iterable = ()):
    """(engine, engine optimizer): ``deepspeed.initialize`` over an already-parallelised module with ZeRO confined to
    the data-parallel group, and the global gradient norm kept on every path (see ``_keep_zero0_grad_norm``). Expert
    parameters go to optimizer groups of their own (``schedulers`` follow: ``experts.split_expert_groups``)."""
    import deepspeed

    if optimizer is not None and layout.size("ep") > 1:
        experts.split_expert_groups(optimizer, list(schedulers), layout)

    if optimizer is not None:
        tag_state_keys(optimizer)
    with experts.shown_to_engine(module, layout, config.get("zero_optimization", {}).get("stage", 0)):
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=config, mpu=LayoutMPU(layout), dist_init_required=False)
    # DeepSpeed names and counts checkpoint files per model-parallel rank, which the mpu makes the tp rank: one
    # pipeline stage's directory holds tp files, not tp x pp (the grad norm reads the mpu, not this number).
    engine.mp_world_size = layout.size("tp")
    _keep_zero0_grad_norm(engine, layout)
    if zero_stage(engine) == 3 and layout.size("ep") > 1 and hasattr(ds_optimizer, "_grad_norm_counts_every_rank"):
        experts.count_experts_once_at_zero3(ds_optimizer)
    if layout.size("dp_cp") == 1 and zero_stage(engine) == 0:
        engine.enable_backward_allreduce = False  # one replica: nothing to average, skip flatten + copy
    bind_engine_optimizer(optimizer, ds_optimizer, module, layout, zero_stage(engine))
    return engine, ds_optimizer


def zero3_partitioner(config: dict, layout: ParallelLayout) -> Callable[[list[nn.Parameter]], None]:
    """What partitions freshly filled parameters over the data-parallel (x context) ranks in place, exactly as
    ``deepspeed.initialize`` would have partitioned them later under ``config`` (same group, dtype and offload
    device), so that the engine, seeing them partitioned already, keeps them. A rank then never holds its whole
    tensor/pipeline shard: :func:`lightning_mgpu.parallel.materialize.materialize` hands over each module's
    parameters as soon as they are filled."""
    import deepspeed

    dtype, mpu = parameter_dtype(config), LayoutMPU(layout)
    #: per group: a parameter converted by the one Init of that group, which converts all later ones
    first: dict[str, nn.Parameter] = {}

    def partition(params: list[nn.Parameter]) -> None:
        for param in params:
            param.data = param.data.to(dtype)  # the engine would cast before partitioning; cast one tensor at a time
        split = layout.size("ep") > 1
        expert = [split and getattr(p, "expert_partition", None) is not None for p in params]
        for group in ("dp_cp", "edp"):  # experts over the ranks holding the same experts, the rest over dp x cp
            mine = [p for p, e in zip(params, expert) if e == (group == "edp")]
            if mine:
                _partition_over(mine, group)

    def _partition_over(params: list[nn.Parameter], group: str) -> None:
        if group in first:  # as the engine converts parameters added later: through the Init that converted the first
            first[group].convert_to_zero_parameters(param_list=params)
            return
        # One Init for the whole model, as the engine would make: each Init makes its own NVMe swapper (clearing the
        # swap folder) and its own hierarchical-partition group. It converts the parameters of the module it is
        # given; a container of exactly these parameters keeps their identity (the model and its ties keep them).
        deepspeed.zero.Init(module=nn.ParameterList(params), data_parallel_group=layout.group(group),
                            config_dict_or_path=config, mpu=mpu)
        first[group] = params[0]

    return partition


def _keep_zero0_grad_norm(engine, layout: ParallelLayout) -> None:
    """Make a ZeRO-0 fp32 engine remember the global grad norm it clips with.

    DeepSpeed's fp32 ZeRO-0 path computes the norm inside ``clip_fp32_gradients`` and drops it, so
    ``get_global_grad_norm()`` would stay ``None``; every other path keeps it. This wraps that one call. With expert
    parallelism DeepSpeed's norm is wrong (it averages the ranks' norms over data parallelism, though they hold
    different experts): :func:`lightning_mgpu.engine.experts.global_grad_norm` counts every expert once instead.
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep() -> None:
        if layout.size("ep") > 1 and experts.expert_parameters(engine.module):
            norm = experts.clip_by_global_norm(engine.module, layout, engine.gradient_clipping())
        else:
            norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                                   mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_and_keep


def zero_stage(engine: Any) -> int:
    """The ZeRO stage the engine runs (it may be lower than asked: an engine built without optimizer runs 0 or 3)."""
    return int(engine.zero_optimization_stage())


def data_parallel_size(engine: Any) -> int:
    """The number of replicas the engine averages gradients over."""
    return int(engine.dp_world_size)


@contextlib.contextmanager
def deferred_grad_reduction(engine: Any) -> Iterator[None]:
    """Inside it, backward passes accumulate gradients without reducing them over data-parallel replicas; the
    reduction happens once, at the step. A pipeline schedule runs all its micro-batches' backward inside it (ZeRO
    1-3; ZeRO-0 reduces at the step anyway).

    Under ZeRO-3 the parameters a schedule leaves gathered are partitioned again before the reduction, so that they are
    not whole next to the whole gradients while those are reduced. DeepSpeed releases each module's parameters after its
    backward, but not on the first pipeline stage: measured after a 1F1B schedule of a 200M-parameter Llama (tp2 x pp2 x
    dp2), all 49.9M parameters of pp rank 0 were still whole, none of pp rank 1's; releasing them took that rank's peak
    during the reduction from 2.06 to 1.86 GB at 401M parameters. (The optimizer's call, not the engine's, which also
    collects garbage and empties the device cache: not something to do every step.)"""
    if zero_stage(engine) < 1:
        yield
        return
    with engine.coalesce_grad_reduction():
        yield
        if zero_stage(engine) == 3:
            engine.optimizer.empty_partition_cache()


def backward(engine: Any, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Backward of one micro-batch's loss through the engine (scaled by its accumulation, loss-scaled under fp16)."""
    engine.backward(loss, *args, **kwargs)


def loss_scale(engine: Any) -> float:
    """The factor the engine multiplies each loss by before backward (fp16's dynamic loss scale; 1 otherwise)."""
    if not engine.fp16_enabled():
        return 1.0
    optimizer = engine.optimizer
    return float(getattr(optimizer, "loss_scale", None) or getattr(optimizer, "cur_scale", 1.0))


def accumulation_steps(engine: Any) -> int:
    """The micro-batches whose losses the engine averages into one step (it divides each loss by this)."""
    return int(engine.gradient_accumulation_steps())


def step(engine: Any) -> Optional[float]:
    """One optimizer step (reduce, clip by the global norm, update, zero gradients); the global gradient norm before
    clipping, or None when the engine computed none."""
    engine.step()
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def gathered(params: Iterable[nn.Parameter], modifier_rank: Optional[int] = None) -> ContextManager:
    """Inside it, ZeRO-3 partitioned ``params`` are whole on every rank (a no-op for parameters that are not
    partitioned). With ``modifier_rank`` (a rank *inside* the parameters' data-parallel group), that rank's writes
    to them are partitioned back on exit."""
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


class EngineOwnedOptimizer(torch.optim.Optimizer):
    """The optimizer Lightning sees: the user's torch optimizer as DeepSpeed drives it, minus ``zero_grad`` and ``step``.

    Lightning's automatic optimisation calls ``zero_grad`` after ``training_step`` and before its
    backward. Here the micro-batches' backward already ran inside ``training_step`` (through the engine),
    so zeroing then would erase the accumulated gradients; ``engine.step()`` zeroes them itself after
    the update. ``optimizer`` is the user's own optimizer (the one its LR scheduler holds, which DeepSpeed wraps and
    steps), because Lightning and its callbacks (LearningRateMonitor) unwrap to ``.optimizer`` and read its
    ``defaults`` and ``param_groups``; ``engine_optimizer`` is DeepSpeed's wrapper, whose state checkpoints hold.
    """

    def __init__(self, engine_optimizer: Any, optimizer: torch.optim.Optimizer) -> None:
        # no super().__init__: nothing of its own
        self.engine_optimizer, self.optimizer = engine_optimizer, optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.engine_optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are zeroed by ``engine.step()``."""

    def step(self, closure=None):
        raise RuntimeError("step the DeepSpeed engine (MGPUStrategy does), not the optimizer directly")

    def state_dict(self):
        return self.engine_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.engine_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"EngineOwnedOptimizer({type(self.optimizer).__name__} in {type(self.engine_optimizer).__name__})"
