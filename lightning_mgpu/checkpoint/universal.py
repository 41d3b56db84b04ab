"""Layout-independent checkpoints: every trained parameter's fp32 value and Adam moments (a frozen one's value alone,
or under adapters nothing: ``checkpoint.frozen_weights``), saved as sharded tensors with
``torch.distributed.checkpoint`` so that any other layout loads its own slice.

Each rank contributes, per parameter it holds, the fp32 master weight and the two Adam moments of its
tensor-parallel shard, gathered out of the ZeRO partitions (``lightning_mgpu.engine.ParameterState``). A tensor
shard becomes a ``DTensor`` sharded over the tensor-parallel group along ``partition_dim`` (vocabulary
padding dropped, so the saved tensor has the model's true shape); replicated parameters are plain tensors,
which the checkpoint planner writes once. Pipeline stages own distinct names. Keys are the model's own
parameter names, so a checkpoint of ``tp2 x pp2`` loads into ``dp4`` and back. Loading fills tensors of
the new layout (DCP reads the overlapping slices), then writes the values into the engine: weights, fp32
master partitions and Adam state (created if the engine has not stepped yet).

The trainer state (step, LR schedule and the optimizer's current per-group LR, data position, RNG, the module's
counters) goes to ``trainer_state.pt`` as plain containers of tensors and numbers, loaded with
``torch.load(weights_only=True)``. DCP's ``.metadata`` is read by the restricted unpickler of
``lightning_mgpu.checkpoint.safe_reader`` and its tensor files by DCP with ``weights_only=True``: reading a universal
checkpoint runs no code from it, whoever wrote it.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh

from lightning_mgpu.checkpoint import replica_state
from lightning_mgpu.checkpoint.formats import TRAINER_STATE
from lightning_mgpu.checkpoint.safe_reader import SafeFileSystemReader, UnsafeCheckpointError, read_dcp_metadata
from lightning_mgpu.checkpoint.saved_tensors import as_saved, expert_mesh, from_saved
from lightning_mgpu.engine import ParameterState, moments_of
from lightning_mgpu.engine.experts import schedules_by_origin, schedules_for_groups
from lightning_mgpu.engine.pieces import Piece, assemble, own_piece
from lightning_mgpu.layout import ParallelLayout, canonical_name, container_prefix
from lightning_mgpu.checkpoint.frozen_weights import (FROZEN, check_trained_now, frozen_value, keeps_frozen,
                                                      left_out_names, saved_parameters, set_frozen)


def _tensor_state(engine: Any, layout: ParallelLayout, fill: bool, prefix: str = "", defer: bool = False,
                  keep_frozen: bool = True) -> tuple[dict, list]:
    """``prefix``: this replica's keys, when replicas that step apart each save their own weights and moments.
    ``defer``: under ZeRO 1-2, this rank's pieces (:class:`Deferred`), assembled later, instead of whole tensors.
    ``keep_frozen``: frozen parameters' values too (``checkpoint.frozen_weights``)."""
    access = ParameterState(engine)
    mesh = DeviceMesh.from_group(layout.group("tp"), "cpu")
    experts = expert_mesh(layout) if layout.size("ep") > 1 else None
    state: dict[str, Any] = {}
    params = []
    stages = container_prefix(engine.module)
    for name, param in saved_parameters(engine.module, keep_frozen):
        fqn = canonical_name(name, layout, stages)
        params.append((fqn, param))
        if not param.requires_grad:  # frozen: its value, nothing else to save
            state[f"{prefix}param/{fqn}"] = as_saved(frozen_value(param) if fill else access.like(param), param,
                                                     layout, mesh, experts)
            continue
        for key in (None, *moments_of(param)) if access.trains else (None,):  # an engine that evaluates: weights
            # an expert's pieces lie over its own data-parallel ranks, not the ones ``assemble`` reads: copied now
            expert = getattr(param, "expert_partition", None) is not None
            piece = own_piece(access, param, key) if fill and defer and not expert else None
            if piece is not None:
                state[f"{prefix}{key or 'param'}/{fqn}"] = Deferred(piece, param, layout, mesh)
                continue
            value = access.get(param, key) if fill else access.like(param)
            state[f"{prefix}{key or 'param'}/{fqn}"] = as_saved(value, param, layout, mesh, experts)
    for fqn, buffer in persistent_buffers(engine.module, layout):  # e.g. a router's balancing bias: learned state too
        state[f"{prefix}buffer/{fqn}"] = buffer.detach().float().clone() if fill else torch.zeros_like(buffer).float()
    state["step"] = torch.tensor(float(access.step()))
    return state, params


def persistent_buffers(module: torch.nn.Module, layout: ParallelLayout) -> list[tuple[str, torch.Tensor]]:
    """(layout-independent name, buffer) of every buffer ``module`` saves in its state dict."""
    out, stages = [], container_prefix(module)
    for prefix, owner in module.named_modules():
        for key, buffer in owner._buffers.items():
            if buffer is not None and key not in owner._non_persistent_buffers_set:
                out.append((canonical_name(f"{prefix}.{key}" if prefix else key, layout, stages), buffer))
    return out


@dataclass
class Deferred:
    """A tensor of the checkpoint still in pieces over the data-parallel group: :meth:`assemble` it (collective)."""

    piece: Piece
    param: torch.nn.Parameter
    layout: ParallelLayout
    mesh: DeviceMesh

    def assemble(self, group: Any) -> Any:
        return as_saved(assemble(self.piece, group), self.param, self.layout, self.mesh)


def _plain(obj: Any) -> Any:
    """Containers of tensors and numbers only (what ``torch.load(weights_only=True)`` accepts)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj) if type(obj) in (list, tuple) else [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    return None  # e.g. functions in an LR scheduler's state: not needed to resume


def universal_state(engine: Any, layout: ParallelLayout, trainer_state: dict, replica_sync: Any = None,
                    defer: bool = False) -> tuple[dict, Optional[dict]]:
    """(this rank's tensors for DCP, the trainer state rank 0 writes; None elsewhere): a snapshot, since every tensor is
    a fresh fp32 copy out of the engine (``ParameterState.get`` clones), which training may change at once. With
    ``replica_sync`` (a ``ReplicaSync``), each replica's own weights and moments and the outer step's
    (``checkpoint.replica_state``). ``defer``: ZeRO 1-2 tensors as this rank's pieces (:class:`Deferred`)."""
    keep = keeps_frozen(trainer_state)
    state, params = _tensor_state(engine, layout, fill=True, prefix=replica_state.prefix(layout, replica_sync),
                                  defer=defer, keep_frozen=keep)
    trainer_state = dict(trainer_state, **{FROZEN: [] if keep else left_out_names(engine.module, layout)})
    params = [(fqn, p) for fqn, p in params if p.requires_grad]
    if replica_sync is not None:
        state.update(replica_state.outer_tensors(engine, layout, replica_sync, params, fill=True))
        trainer_state = dict(trainer_state, **{replica_state.KEY: replica_state.counters(layout, replica_sync)})
    if dist.get_rank() != 0:
        return state, None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ParameterState(engine).param_groups()]
    if "lr_schedulers" in trainer_state:
        trainer_state = dict(trainer_state, lr_schedulers=schedules_by_origin(trainer_state["lr_schedulers"], groups))
    return state, _plain(dict(trainer_state, rng_state=torch.get_rng_state(), optimizer_param_groups=groups))


def write_trainer_state(path: str | Path, trainer_state: Optional[dict]) -> None:
    """Rank 0's part of a universal checkpoint beside the tensors (``trainer_state``: from :func:`universal_state`)."""
    if trainer_state is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(trainer_state, Path(path) / TRAINER_STATE)


def save_universal(engine: Any, layout: ParallelLayout, path: str | Path, trainer_state: dict,
                   replica_sync: Any = None) -> None:
    """Write a layout-independent checkpoint into ``path`` (collective over all ranks); ``replica_sync``: see
    :func:`universal_state`."""
    state, plain = universal_state(engine, layout, trainer_state, replica_sync)
    dcp.save(state, checkpoint_id=str(path))
    write_trainer_state(path, plain)
    dist.barrier()


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state of a universal checkpoint. ``weights_only=True`` unpickles only containers, tensors and
    numbers: a file holding any other object (which plain unpickling would construct, running its code) is refused
    with ``pickle.UnpicklingError``. Explicit, because torch only defaults to it from 2.6 and an environment
    variable (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``) turns the default off."""
    file = Path(path) / TRAINER_STATE
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as error:  # torch's message names the type, not the file, and suggests unsafe loading
        found = re.search(r"unsupported GLOBAL (\S+)|Unsupported global: GLOBAL (\S+)", str(error))
        if found is None:  # not a pickle of plain data at all: garbage or a torn write
            raise UnsafeCheckpointError(f"{file} is not a readable trainer state ({str(error).splitlines()[-1][:200]}"
                                        "): the checkpoint is damaged") from error
        raise UnsafeCheckpointError(f"{file} names {found.group(1) or found.group(2)}, which only unrestricted "
                                    "unpickling would build: refused. The file was not written by lightning_mgpu's "
                                    "universal format or has been altered; do not load it") from error


def _check_optimizer_state(path: str | Path, wanted: dict, saved: dict) -> None:
    """The rule: a run resumes the optimizer state it keeps itself. Adam's moments and Muon's momentum are different
    state; resuming one from the other is refused by name (DCP's own error names only a missing key)."""
    missing = sorted(k for k in wanted if "/" in k and k.split("/")[-2] not in ("param", "buffer") and k not in saved)
    if missing:
        raise ValueError(f"{path} holds no optimizer state '{missing[0].split('/')[-2]}' for {len(missing)} "
                         f"tensor(s) (first: {missing[0]}): it was saved by a run with another optimizer (Adam keeps "
                         "exp_avg and exp_avg_sq, Muon momentum_buffer). Resume with the optimizer that saved it, or "
                         "start from its weights alone (mgpu-export it, then model.init_from=hf:DIR)")


def load_universal(engine: Any, layout: ParallelLayout, path: str | Path, replica_sync: Any = None,
                   fitting: bool = True) -> dict:
    """Load a checkpoint written by any layout into this rank's engine; return the trainer state. With
    ``replica_sync``, this replica's own weights and moments and the outer step's state."""
    trainer_state = read_trainer_state(path)  # first: a refused file leaves the engine untouched
    saved_replicas = trainer_state.pop(replica_state.KEY, None)
    replica_state.check_resumable(path, saved_replicas, layout, fitting)
    metadata = read_dcp_metadata(path)  # refused here with its own message, not wrapped in DCP's
    prefix = replica_state.prefix(layout, replica_sync)
    state, params = _tensor_state(engine, layout, fill=False, prefix=prefix)
    saved = metadata.state_dict_metadata
    left_out = {f"{prefix}param/{fqn}" for fqn, p in params if not p.requires_grad} - set(saved)  # a base, by record
    state = {k: v for k, v in state.items() if k not in left_out}
    trainer_state.pop(FROZEN, None)
    check_trained_now(path, params, saved, prefix)
    _check_optimizer_state(path, state, saved)
    frozen, params = [(f, p) for f, p in params if not p.requires_grad], [(f, p) for f, p in params if p.requires_grad]
    if replica_sync is not None:
        state.update(replica_state.outer_tensors(engine, layout, replica_sync, params, fill=False))
    dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata))
    access = ParameterState(engine)
    step = int(state["step"]) if access.trains else 0
    access.prepare_state(step)
    if replica_sync is not None:  # through the masters, before this replica's own weights are written into them
        replica_state.restore_outer(engine, layout, replica_sync, params, state, saved_replicas)
    for fqn, param in params:
        like = access.like(param)
        value = from_saved(state[f"{prefix}param/{fqn}"], param, layout, like)
        moments = {k: from_saved(state[f"{prefix}{k}/{fqn}"], param, layout, like) for k in moments_of(param)
                   if f"{prefix}{k}/{fqn}" in state}
        access.set(param, value, moments, step)
    access.finish()
    for fqn, param in frozen:
        if f"{prefix}param/{fqn}" in state:
            set_frozen(param, from_saved(state[f"{prefix}param/{fqn}"], param, layout, access.like(param)))
    for fqn, buffer in persistent_buffers(engine.module, layout):
        with torch.no_grad():
            buffer.copy_(state[f"{prefix}buffer/{fqn}"])
    torch.set_rng_state(trainer_state.pop("rng_state"))
    # The LR (and any other per-group setting) where the schedule left it; the scheduler only sets it on its next step.
    saved = trainer_state.pop("optimizer_param_groups")
    if "lr_schedulers" in trainer_state:
        trainer_state["lr_schedulers"] = schedules_for_groups(trainer_state["lr_schedulers"], access.param_groups())
    by_origin = {g.get("origin", i): g for i, g in reversed(list(enumerate(saved)))}
    for i, group in enumerate(access.param_groups()):  # a group split off for experts takes its origin's settings
        settings = by_origin.get(group.get("origin", i), {})
        group.update({k: v for k, v in settings.items() if v is not None and k not in ("origin", "moe", "name")})
    return trainer_state


def read_model_shapes(path: str | Path) -> tuple[dict, dict[str, torch.Size]]:
    """(the model config saved with an ``LLMModule``, the shape of each of the model's parameters under its own name),
    from a universal checkpoint's trainer state, before any tensor is read: what :func:`read_parameters` needs to read
    a few parameters at a time. A tied head is left out (the model has one tensor, named as the embedding)."""
    from lightning_mgpu.models.llama import Llama, LlamaConfig

    trainer_state = read_trainer_state(path)
    read_dcp_metadata(path)  # refused here with its own message, not wrapped in DCP's
    config = (trainer_state.get("hyper_parameters") or {}).get("model")
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no model config (hyper_parameters['model']): it was not written by LLMModule")
    with torch.device("meta"):  # built on meta, not moved there: ``.to("meta")`` unties tied embeddings
        return config, {name: p.shape for name, p in Llama(LlamaConfig(**config)).named_parameters()}


def read_parameters(path: str | Path, shapes: Mapping[str, torch.Size], prefix: str = "model."
                    ) -> dict[str, torch.Tensor]:
    """The fp32 weights of only the parameters named in ``shapes`` (name -> shape, from :func:`read_model_shapes`),
    read from a universal checkpoint in one process, whatever layout wrote it: DCP reads only the keys it is given,
    so a caller can hold a part of a model too big for one process's memory."""
    targets = {f"param/{prefix}{name}": torch.zeros(shape) for name, shape in shapes.items()}
    dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return {k[len("param/") + len(prefix):]: v for k, v in targets.items()}


def read_model_weights(path: str | Path, prefix: str = "model.") -> tuple[dict, dict[str, torch.Tensor]]:
    """(the model config saved with an ``LLMModule``, the whole model's fp32 weights under the model's own names),
    read from a universal checkpoint in one process, whatever layout wrote it."""
    config, shapes = read_model_shapes(path)
    return config, read_parameters(path, shapes, prefix)
