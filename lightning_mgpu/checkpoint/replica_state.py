"""What a universal checkpoint adds for replicas that step apart (``replica_update="local"``), so that a run stopped
in the middle of a round resumes where it was.

Mid-round, each replica holds its own weights and Adam moments: replica 0 saves them under the usual keys (so that
``mgpu-export`` and evaluation read replica 0's model, which after the last outer step is every replica's), replica
``r > 0`` under ``replica{r}/``. The outer step's state is the same on every replica and is saved once: the weights
of the last outer step (``outer/param/``) and the outer optimizer's momentum (``outer/momentum/``), both per
parameter like the weights, so that they reshard with them into another layout inside each replica. The counters
(inner steps, the step of the last outer step, outer steps) and the replica settings go into the trainer state.

The outer tensors live in the shape of the engine's fp32 masters (``lightning_mgpu.engine.master_weights``: flat ZeRO
partitions). To save or load them per parameter they pass through the masters: the masters are set aside, the outer
tensor is put in their place and read (or written) per parameter by the same access as the weights, and the masters
are put back.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_mgpu.checkpoint.formats import CheckpointRefusedError
from lightning_mgpu.checkpoint.saved_tensors import as_saved, from_saved
from lightning_mgpu.engine import ParameterState
from lightning_mgpu.layout import ParallelLayout

#: The trainer state's entry of the replica settings and counters.
KEY = "mgpu_replicas"
OUTER = ("param", "momentum")


def prefix(layout: ParallelLayout, replica_sync: Any) -> str:
    """This replica's prefix of the weight and moment keys: none for replica 0 (or without replicas stepping apart)."""
    replica = layout.rank("rep") if replica_sync is not None else 0
    return f"replica{replica}/" if replica else ""


def counters(layout: ParallelLayout, replica_sync: Any) -> dict:
    return {"replicas": layout.size("rep"), "replica_update": layout.replica_update, "sync_every": layout.sync_every,
            "inner_steps": replica_sync.inner_steps, "synced_at": replica_sync.synced_at,
            "outer_steps": replica_sync.outer_steps}


def check_resumable(path: str | Path, saved: Optional[dict], layout: ParallelLayout, fitting: bool) -> None:
    """Refuse, naming both, to continue training with other replicas or another update rule than the checkpoint's
    (``saved``: its :data:`KEY` entry): each replica's weights, and the round they are in, belong to the replicas that
    wrote them. Evaluating from it is fine (replica 0's weights)."""
    saved = saved or {"replicas": 1, "replica_update": "sync"}
    now = {"replicas": layout.size("rep"), "replica_update": layout.replica_update}
    if fitting and any(saved[k] != now[k] for k in now):
        raise CheckpointRefusedError(
            f"{path} was written by replicas={saved['replicas']}, replica_update={saved['replica_update']!r} and this "
            f"run trains with replicas={now['replicas']}, replica_update={now['replica_update']!r}: each replica's "
            "weights and the round in progress belong to the replicas that wrote them. Resume with the checkpoint's "
            "replica settings, or start afresh from its weights (mgpu-export, then model.init_from)")


@contextlib.contextmanager
def _in_masters(masters: list[torch.Tensor], tensors: list[torch.Tensor]) -> Iterator[None]:
    """The engine's masters hold ``tensors`` inside the block, their own values again after it."""
    kept = [m.detach().clone() for m in masters]
    with torch.no_grad():
        for master, tensor in zip(masters, tensors):
            master.copy_(tensor)
        try:
            yield
        finally:
            for master, own in zip(masters, kept):
                master.copy_(own)


def _master_shaped(replica_sync: Any) -> dict[str, list[torch.Tensor]]:
    state = replica_sync.optimizer.state
    momenta = [state.get(a, {}).get("momentum_buffer") for a in replica_sync.anchors]
    return {"param": list(replica_sync.anchors),
            "momentum": [torch.zeros_like(a) if m is None else m for a, m in zip(replica_sync.anchors, momenta)]}


def outer_tensors(engine: Any, layout: ParallelLayout, replica_sync: Any, params: list, fill: bool) -> dict:
    """``outer/param/<name>`` and ``outer/momentum/<name>`` for every parameter: filled from the outer step
    (``fill``), or empty tensors of the saved shapes for a load to fill."""
    access, mesh = ParameterState(engine), DeviceMesh.from_group(layout.group("tp"), "cpu")
    out = {}
    for kind, tensors in _master_shaped(replica_sync).items():
        context = _in_masters(replica_sync.masters, tensors) if fill else contextlib.nullcontext()
        with context:
            for fqn, param in params:
                value = access.get(param, None) if fill else access.like(param)
                out[f"outer/{kind}/{fqn}"] = as_saved(value, param, layout, mesh)
    return out


@torch.no_grad()
def restore_outer(engine: Any, layout: ParallelLayout, replica_sync: Any, params: list, loaded: dict,
                  saved_counters: dict) -> None:
    """Write the loaded outer weights and momentum into the outer step (through the masters), and its counters."""
    access = ParameterState(engine)
    for kind, targets in _master_shaped(replica_sync).items():
        for fqn, param in params:
            access.set(param, from_saved(loaded[f"outer/{kind}/{fqn}"], param, layout, access.like(param)), {}, 0)
        for target, master in zip(targets, replica_sync.masters):
            target.copy_(master)
        if kind == "momentum" and replica_sync.optimizer.defaults.get("momentum", 0):
            for anchor, target in zip(replica_sync.anchors, targets):
                replica_sync.optimizer.state[anchor]["momentum_buffer"] = target
    for name in ("inner_steps", "synced_at", "outer_steps"):
        setattr(replica_sync, name, int(saved_counters[name]))
