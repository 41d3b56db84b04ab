"""ZeRO through DeepSpeed: the generated config, the ``mpu`` that confines ZeRO to the data-parallel
group, and engine construction."""

from __future__ import annotations

import copy
import sys
from typing import Any, Optional

import torch
from torch import nn

from lightning_mgpu.layout import ParallelLayout

#: DeepSpeed's default bucket size; buckets are never larger than this.
MAX_BUCKET_ELEMENTS = 500_000_000
MIN_BUCKET_ELEMENTS = 1 << 17


class LayoutMPU:
    """The model-parallel-unit object DeepSpeed asks for process groups.

    * data-parallel group: ZeRO partitions and reduces only over replicas of the same model shard;
    * model-parallel group: the tp x pp ranks of one replica, so that gradient clipping and overflow
      checks see the whole model (a tp-only group would give each pipeline stage its own norm);
      its rank is the tp rank, which is how DeepSpeed names checkpoint files (the pp rank goes into
      the path, see the strategy);
    * tensor-model-parallel group: shards marked ``tensor_model_parallel`` are counted once per group.
    """

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout

    def get_data_parallel_group(self):
        return self.layout.group("dp")

    def get_data_parallel_rank(self) -> int:
        return self.layout.rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.layout.size("dp")

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
        return self.layout.global_rank_of(0, self.layout.rank("pp"), self.layout.rank("dp"))

    def get_pipeline_model_parallel_group(self):
        return self.layout.group("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.layout.rank("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.layout.size("pp")


def bucket_elements(model: nn.Module) -> int:
    """Communication bucket size sized from the model: a quarter of it (at least 2**17 elements), at most DeepSpeed's
    default. DeepSpeed's fixed 5e8-element buckets cost GBs and tens of seconds
    on a tiny CPU model (FIELD-NOTES)."""
    total = sum(p.numel() for p in model.parameters())
    return int(min(MAX_BUCKET_ELEMENTS, max(MIN_BUCKET_ELEMENTS, total // 4)))


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` merged into a copy of ``base``, recursing into nested dicts."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def zero_config(layout: ParallelLayout, model: nn.Module, micro_batch_size: int, num_microbatches: int,
                gradient_clipping: Optional[float], precision: dict, nvme_path: Optional[str] = None,
                overrides: Optional[dict] = None) -> dict:
    """The DeepSpeed config of one run.

    Without pipeline parallelism gradient accumulation is unmanaged: the strategy runs every micro-batch's
    backward through the engine and then calls ``engine.step()`` once, which is the accumulation boundary
    (one optimizer step per global batch). With it, the schedule runs all micro-batches inside
    ``engine.coalesce_grad_reduction()``, which DeepSpeed supports (ZeRO 1-3) only with managed
    accumulation: then the whole schedule counts as one micro-step of ``micro_batch_size * num_microbatches``.
    ``overrides`` (the user's ``deepspeed_config``) is merged over the result.
    """
    coalesced = layout.pipeline_parallel_size > 1 and layout.zero_stage >= 1
    bucket = bucket_elements(model)
    zero: dict[str, Any] = {
        "stage": layout.zero_stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "overlap_comm": False,
        "contiguous_gradients": True,
    }
    if layout.zero_stage == 3:
        largest = max((p.numel() for p in model.parameters()), default=0)
        zero.update({
            "stage3_prefetch_bucket_size": bucket,
            # Parameters below this stay whole on every rank; DeepSpeed's 1e5 would keep a small model unsharded.
            "stage3_param_persistence_threshold": int(min(100_000, max(1, largest // 8))),
            "stage3_max_live_parameters": max(bucket, 1_000_000),
            "stage3_max_reuse_distance": max(bucket, 1_000_000),
        })
    for key, device in (("offload_optimizer", layout.offload_optimizer), ("offload_param", layout.offload_params)):
        if device:
            zero[key] = {"device": device, "pin_memory": torch.cuda.is_available()}
            if device == "nvme":
                zero[key]["nvme_path"] = nvme_path or "/local_nvme"
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size * num_microbatches if coalesced else micro_batch_size,
        "gradient_accumulation_steps": 1 if coalesced else num_microbatches,
        "managed_gradient_accumulation": coalesced,
        "gradient_clipping": float(gradient_clipping or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # Torch's AdamW needs no compiled op, also when the optimizer state is offloaded.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    config.update(precision)
    return deep_merge(config, overrides or {})


def skip_cpu_shared_memory_op() -> None:
    """Stop DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op (30-70 s, inference only).

    ``import deepspeed.comm.torch`` resolves to the torch package (name shadowing), hence sys.modules.
    """
    import deepspeed.comm  # noqa: F401  (loads deepspeed.comm.torch)

    module = sys.modules.get("deepspeed.comm.torch")
    if module is not None and not torch.cuda.is_available():
        module.build_shm_op = lambda: None


def init_deepspeed_comm(timeout=None) -> None:
    """Let DeepSpeed's comm layer adopt the torch.distributed process group the strategy created."""
    import deepspeed

    skip_cpu_shared_memory_op()
    kwargs = {"dist_init_required": False, "verbose": False}
    if timeout is not None:
        kwargs["timeout"] = timeout
    deepspeed.init_distributed(**kwargs)


def initialize_engine(module: nn.Module, optimizer: torch.optim.Optimizer, config: dict, layout: ParallelLayout):
    """``deepspeed.initialize`` over an already-parallelised module with ZeRO confined to the dp group."""
    import deepspeed

    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, mpu=LayoutMPU(layout), dist_init_required=False)
    # DeepSpeed names and counts checkpoint files per model-parallel rank, which the mpu makes the tp rank: one
    # pipeline stage's directory holds tp files, not tp x pp (the grad norm reads the mpu, not this number).
    engine.mp_world_size = layout.size("tp")
    return engine, ds_optimizer


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


def keep_zero0_grad_norm(engine) -> None:
    """Make a ZeRO-0 fp32 engine remember the global grad norm it clips with.

    DeepSpeed's fp32 ZeRO-0 path computes the norm inside ``clip_fp32_gradients`` and drops it, so
    ``get_global_grad_norm()`` would stay ``None``; every other path keeps it. This wraps that one call.
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep() -> None:
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                               mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_and_keep
