"""Layout-independent checkpoints: every parameter's fp32 value and Adam moments, saved as sharded tensors with
``torch.distributed.checkpoint`` so that any other layout loads its own slice.

Each rank contributes, per parameter it holds, the fp32 master weight and the two Adam moments of its
tensor-parallel shard, gathered out of the ZeRO partitions (DeepSpeed's ``safe_get_full_*``). A tensor
shard becomes a ``DTensor`` sharded over the tensor-parallel group along ``partition_dim`` (vocabulary
padding dropped, so the saved tensor has the model's true shape); replicated parameters are plain tensors,
which the checkpoint planner writes once. Pipeline stages own distinct names. Keys are the model's own
parameter names, so a checkpoint of ``tp2 x pp2`` loads into ``dp4`` and back. Loading fills tensors of
the new layout (DCP reads the overlapping slices), then writes the values into the engine: weights, fp32
master partitions and Adam state (created if the engine has not stepped yet).

The trainer state (step, LR schedule and the optimizer's current per-group LR, data position, RNG, the module's
counters) goes to ``trainer_state.pt`` as plain containers of tensors and numbers, loaded with
``torch.load(weights_only=True)``: nothing else is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_mgpu.layout import ParallelLayout

TRAINER_STATE = "trainer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


def is_universal(path: str | Path) -> bool:
    return (Path(path) / TRAINER_STATE).is_file() and (Path(path) / ".metadata").is_file()


def canonical_name(name: str, layout: ParallelLayout, prefix: str = "model.") -> str:
    """A parameter's name independent of layout: the pipeline container's stage key becomes ``prefix``."""
    return prefix + name.split(".", 1)[1] if layout.size("pp") > 1 else name


def _unpadded(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout) -> torch.Tensor:
    dim, per_rank = param.partition_dim, local.shape[param.partition_dim]
    real = max(0, min(per_rank, param.full_size - layout.rank("tp") * per_rank))
    return local.narrow(dim, 0, real)


def _as_saved(local: torch.Tensor, param: torch.nn.Parameter, layout: ParallelLayout, mesh: DeviceMesh):
    if not getattr(param, "tensor_model_parallel", False) or layout.size("tp") == 1:
        return local
    dim = param.partition_dim
    shape = list(local.shape)
    shape[dim] = param.full_size
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(_unpadded(local, param, layout).contiguous(), mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _from_saved(value, param: torch.nn.Parameter, layout: ParallelLayout, like: torch.Tensor) -> torch.Tensor:
    """The full local (tensor-parallel shard, padded) tensor for ``param`` from a loaded value."""
    local = value.to_local() if isinstance(value, DTensor) else value
    if local.shape == like.shape:
        return local
    out = torch.zeros_like(like)
    out.narrow(param.partition_dim, 0, local.shape[param.partition_dim]).copy_(local)
    return out


class _Engine:
    """Read and write one parameter's fp32 value and Adam moments, whatever the ZeRO stage."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = engine.zero_optimization_stage()
        self.optimizer = engine.optimizer
        if self.stage == 0 and engine.bfloat16_enabled():
            raise NotImplementedError("layout-independent checkpoints of bf16 ZeRO-0 engines are not supported (its "
                                      "optimizer wrapper exposes no per-parameter state); use zero_stage >= 1, "
                                      "precision='32-true', or checkpoint_format='deepspeed'")
        self.inner = getattr(self.optimizer, "optimizer", self.optimizer)
        #: False for an engine built to evaluate (validate/test/predict): it has no optimizer, and ZeRO-3 keeps only
        #: its parameter partitions (no fp32 master), so a load sets the weights alone.
        self.trains = self.optimizer is not None and hasattr(self.optimizer, "param_groups")
        if self.stage in (1, 2) and self.step():  # point each parameter's fragment at the current Adam state
            self._relink()

    def _relink(self) -> None:
        self.optimizer._hp_optimizer_states_linked = False
        self.optimizer._lazy_init_hp_params_optimizer_state()

    def step(self) -> int:
        for state in getattr(self.inner, "state", {}).values():
            if "step" in state:
                return int(state["step"])
        return 0

    def get(self, param: torch.nn.Parameter, key: Optional[str]) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.stage == 0:
            if key is None:
                return param.detach().float().clone()
            state = self.optimizer.state.get(param, {})
            return state[key].detach().clone() if key in state else torch.zeros_like(param, dtype=torch.float32)
        if key is None:
            return safe_get_full_fp32_param(param).detach().clone().reshape(self._shape(param))
        if self.step() == 0:
            return torch.zeros(self._shape(param))
        return safe_get_full_optimizer_state(param, key).detach().clone().reshape(self._shape(param))

    def _shape(self, param: torch.nn.Parameter) -> torch.Size:
        return param.ds_shape if hasattr(param, "ds_shape") else param.shape

    def like(self, param: torch.nn.Parameter) -> torch.Tensor:
        return torch.zeros(self._shape(param), dtype=torch.float32)

    def prepare_state(self, step: int) -> None:
        """Create Adam state (so that moments can be written) on an engine that has not stepped yet."""
        if step == 0:
            return
        flats = ([] if self.stage == 0 else
                 self.optimizer.fp32_partitioned_groups_flat if self.stage == 3 else
                 self.optimizer.single_partition_of_fp32_groups)
        for flat in flats:
            state = self.inner.state.setdefault(flat, {})
            for key in MOMENTS:
                state.setdefault(key, torch.zeros_like(flat))
            state["step"] = torch.tensor(float(step))
        if self.stage in (1, 2):
            self._relink()

    def set(self, param: torch.nn.Parameter, value: torch.Tensor, moments: dict[str, torch.Tensor], step: int) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if not self.trains and self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value.to(param.dtype))
            return
        if self.stage == 0 or not self.trains:
            param.data.copy_(value.to(param.dtype))
            if step:
                self.optimizer.state[param] = {"step": torch.tensor(float(step)),
                                               **{k: v.clone() for k, v in moments.items()}}
            return
        safe_set_full_fp32_param(param, value)
        if step:
            for key, moment in moments.items():
                safe_set_full_optimizer_state(param, moment, key)
        if self.stage == 3:  # the bf16/fp32 working partition, from the same full value on every dp rank
            import deepspeed

            # modifier_rank is a rank *inside* the parameter's ZeRO group (the data-parallel group), which DeepSpeed
            # maps to a global rank itself: its first member, whatever this rank's tp/pp coordinates. A global rank
            # here fails as soon as dp == 1 and this rank is not global rank 0 ("Group rank 1 is not part of group").
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value.to(param.dtype))

    def finish(self) -> None:
        if self.stage in (1, 2) and self.trains:
            self.optimizer.update_lp_params()


def _tensor_state(engine: Any, layout: ParallelLayout, fill: bool) -> tuple[dict, list]:
    access = _Engine(engine)
    mesh = DeviceMesh.from_group(layout.group("tp"), "cpu")
    state: dict[str, Any] = {}
    params = []
    for name, param in engine.module.named_parameters():
        fqn = canonical_name(name, layout)
        params.append((fqn, param))
        for key in (None, *MOMENTS):
            value = access.get(param, key) if fill else access.like(param)
            state[f"{key or 'param'}/{fqn}"] = _as_saved(value, param, layout, mesh)
    state["step"] = torch.tensor(float(access.step()))
    return state, params


def _plain(obj: Any) -> Any:
    """Containers of tensors and numbers only (what ``torch.load(weights_only=True)`` accepts)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj) if type(obj) in (list, tuple) else [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    return None  # e.g. functions in an LR scheduler's state: not needed to resume


def save_universal(engine: Any, layout: ParallelLayout, path: str | Path, trainer_state: dict) -> None:
    """Write a layout-independent checkpoint into ``path`` (collective over all ranks)."""
    state, _ = _tensor_state(engine, layout, fill=True)
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in getattr(engine.optimizer, "param_groups", [])]
        trainer_state = dict(trainer_state, rng_state=torch.get_rng_state(), optimizer_param_groups=groups)
        torch.save(_plain(trainer_state), Path(path) / TRAINER_STATE)
    dist.barrier()


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state of a universal checkpoint. ``weights_only=True`` unpickles only containers, tensors and
    numbers: a file holding any other object (which plain unpickling would construct, running its code) is refused
    with ``pickle.UnpicklingError``. Explicit, because torch only defaults to it from 2.6 and an environment
    variable (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``) turns the default off."""
    return torch.load(Path(path) / TRAINER_STATE, weights_only=True)


def load_universal(engine: Any, layout: ParallelLayout, path: str | Path) -> dict:
    """Load a checkpoint written by any layout into this rank's engine; return the trainer state."""
    trainer_state = read_trainer_state(path)  # first: a refused file leaves the engine untouched
    state, params = _tensor_state(engine, layout, fill=False)
    dcp.load(state, checkpoint_id=str(path))
    access = _Engine(engine)
    step = int(state["step"]) if access.trains else 0
    access.prepare_state(step)
    for fqn, param in params:
        like = access.like(param)
        value = _from_saved(state[f"param/{fqn}"], param, layout, like)
        moments = {k: _from_saved(state[f"{k}/{fqn}"], param, layout, like) for k in MOMENTS}
        access.set(param, value, moments, step)
    access.finish()
    torch.set_rng_state(trainer_state.pop("rng_state"))
    # The LR (and any other per-group setting) where the schedule left it; the scheduler only sets it on its next step.
    for group, saved in zip(getattr(engine.optimizer, "param_groups", []), trainer_state.pop("optimizer_param_groups")):
        group.update({k: v for k, v in saved.items() if v is not None})
    return trainer_state


def read_model_weights(path: str | Path, prefix: str = "model.") -> tuple[dict, dict[str, torch.Tensor]]:
    """(the model config saved with an ``LLMModule``, the whole model's fp32 weights under the model's own names),
    read from a universal checkpoint in one process, whatever layout wrote it."""
    from lightning_mgpu.models.llama import Llama, LlamaConfig

    trainer_state = read_trainer_state(path)
    config = (trainer_state.get("hyper_parameters") or {}).get("model")
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no model config (hyper_parameters['model']): it was not written by LLMModule")
    with torch.device("meta"):  # built on meta, not moved there: ``.to("meta")`` unties tied embeddings
        shapes = {name: p.shape for name, p in Llama(LlamaConfig(**config)).named_parameters()}
    targets = {f"param/{prefix}{name}": torch.zeros(shape) for name, shape in shapes.items()}
    dcp.load(targets, checkpoint_id=str(path), no_dist=True)
    return config, {k[len("param/") + len(prefix):]: v for k, v in targets.items()}
