"""Frozen parameters in layout-independent checkpoints: saved by value (no master copy, no optimizer state: they have
none), except under adapters, where the frozen base is the directory the run loaded it from and only what trains is
saved.

A frozen parameter (``requires_grad=False``) never changes, so a checkpoint needs its value only to be complete: a
partial fine-tune of the package's own model must export and resume like any run. A fine-tune through adapters records
its base instead (``checkpoint_record``: the PEFT configuration and the base's directory, under
:data:`ADAPTER_RECORD`); its checkpoints then cost what trains, and the base comes from the module on resume, as when
the run started. The names of the frozen parameters left out are recorded (:data:`FROZEN`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping

import torch
import torch.distributed as dist

from lightning_mgpu.engine import gathered
from lightning_mgpu.layout import ParallelLayout, canonical_name, container_prefix
from lightning_mgpu.parallel.frozen import is_placeholder

#: The trainer-state key under which a run through adapters records its base (``lightning_mgpu.hf.adapters``).
ADAPTER_RECORD = "adapters"
#: The trainer-state key of the frozen parameters a checkpoint leaves out.
FROZEN = "frozen_parameters"


def keeps_frozen(trainer_state: Mapping[str, Any]) -> bool:
    """Whether a checkpoint of this trainer state saves its frozen parameters (every run but one through adapters)."""
    return not trainer_state.get(ADAPTER_RECORD)


def saved_parameters(module: torch.nn.Module, keep_frozen: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a checkpoint holds: every one that trains, and the frozen ones when ``keep_frozen``; never a
    frozen pipeline stage's placeholder."""
    return [(name, p) for name, p in module.named_parameters()
            if not is_placeholder(name) and (p.requires_grad or keep_frozen)]


def frozen_value(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 value of this rank's shard of a frozen parameter (gathered from its ZeRO-3 partitions)."""
    with gathered([param]):
        return param.detach().float().clone()


def set_frozen(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's shard of a frozen parameter (through its ZeRO-3 partitions; the data-parallel group's first
    rank writes, every rank holds the same value)."""
    with gathered([param], modifier_rank=0), torch.no_grad():
        param.data.copy_(value.to(param.dtype))


def left_out_names(module: torch.nn.Module, layout: ParallelLayout) -> list[str]:
    """The layout-independent names of every frozen parameter of the model, from every rank (collective): what a
    checkpoint through adapters leaves out."""
    stages = container_prefix(module)
    mine = [canonical_name(name, layout, stages) for name, p in module.named_parameters()
            if not p.requires_grad and not is_placeholder(name)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted({name for names in everyone for name in names})


def check_same_base(path: str | Path, saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> None:
    """The rule: adapters resume over the base they were trained on. A checkpoint through adapters holds no base: over
    other weights they would train on without a word. Compared by the bases' fingerprints (their records'
    ``fingerprint``: :func:`lightning_mgpu.hf.adapters.base_fingerprint`), where both have one."""
    was, is_now = (saved or {}).get("fingerprint"), (now or {}).get("fingerprint")
    if was and is_now and was != is_now:
        raise ValueError(f"{path} holds adapters trained over the base {saved['base']!r} (its weights' fingerprint "
                         f"{was[:12]}); this run's base {now['base']!r} holds other weights ({is_now[:12]}). Resume "
                         "over the base they were trained on, or start a new run over this one (export the adapters "
                         "with mgpu-export --format peft to keep them)")


def check_trained_now(path: str | Path, params: list[tuple[str, torch.nn.Parameter]], saved: Collection[str],
                      prefix: str = "") -> None:
    """The rule: a parameter that trains now must be in the checkpoint; one left out (frozen under adapters when it
    was saved) would start from the module's value while the run believes it resumed."""
    missing = sorted(fqn for fqn, p in params if p.requires_grad and f"{prefix}param/{fqn}" not in saved)
    if missing:
        raise ValueError(f"{path} holds no value of {len(missing)} parameter(s) that train now (first: {missing[0]}): "
                         "they were frozen, and left out, when it was saved. Freeze the same parameters as the run "
                         "that saved it, or start a new run from its exported weights (mgpu-export)")
