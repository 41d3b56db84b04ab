"""Silent data corruption: a bit flipped in one rank's copy of the weights, caught by comparing fingerprints of the
copies that must be equal, the rank named, and the run rolled back past it.

Every ``every_n_steps`` optimizer steps, as the step begins (before its forward), each rank fingerprints its
parameters: per parameter, the sum of its elements' bit patterns as integers, so that any one flipped bit changes it.
The data x context ranks that hold the same shard of a dense parameter (the experts' data-parallel ranks, for an
expert's) all-gather their fingerprints and compare. A parameter whose fingerprints differ is held wrongly by the
ranks outside its majority; with two copies no majority exists and both ranks are named.

On a mismatch every rank stops after the step (the ranks agree: they compared the same fingerprints). The periodic
checkpoints written after the last step whose fingerprints agreed may hold the corruption: they are set aside (renamed
``<name>.corrupt``), and the run exits with the requeue status, so that a restart with ``checkpoint.resume=auto``
resumes from the newest checkpoint that predates it (a torch elastic or SLURM restart does it by itself).

What it sees: a copy that changed at rest between two steps. Under ZeRO-0 every rank keeps its whole copy, and a flip
stays until caught; under ZeRO 1-2 the engine rebuilds each rank's copy from the partitions after every step, so a
flip lasts at most one step and is caught only when a check falls in it; ZeRO-3 holds no copies to compare (refused).
Written here because neither torch, DeepSpeed nor Lightning compares replicas (Megatron's rerun state machine reruns a
step instead, and needs a job restart to run it elsewhere).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.resilience.rollback import complete_checkpoints

#: integer views of the same width as each float dtype, whose bit patterns are summed
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}


def fingerprints(params: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per parameter: the sum of its elements' bit patterns (a single flipped bit changes it)."""
    sums = [p.detach().contiguous().view(_BITS.get(p.dtype, torch.uint8)).sum(dtype=torch.int64) for p in params]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def odd_ranks(rows: list[list[int]], ranks: list[int]) -> tuple[list[int], list[int]]:
    """(the ranks whose fingerprint of some parameter is outside its majority, the parameters that differ), from
    ``rows`` (one list of fingerprints per rank of ``ranks``); with no majority every holder of a parameter is named."""
    odd: set[int] = set()
    differing = []
    for index, values in enumerate(zip(*rows)):
        if len(set(values)) == 1:
            continue
        differing.append(index)
        (common, count), *rest = Counter(values).most_common()
        majority = count > len(values) / 2
        odd.update(r for r, v in zip(ranks, values) if not majority or v != common)
    return sorted(odd), differing


@dataclass(frozen=True)
class Corruption:
    """What a check found: the step it ran at, the last step whose fingerprints agreed, the ranks named, the
    parameters that differ and the checkpoints set aside."""

    step: int
    last_good_step: int
    ranks: list[int]
    parameters: list[str]
    set_aside: list[Path]

    def describe(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"one of ranks {self.ranks} (no majority of copies)"
        shown = ", ".join(self.parameters[:3]) + (f" and {len(self.parameters) - 3} more" if len(self.parameters) > 3
                                                  else "")
        aside = ", ".join(p.name for p in self.set_aside) or "none"
        return (f"silent data corruption: {who} holds a copy of {shown} that differs from its data-parallel peers at "
                f"step {self.step} (the copies agreed at step {self.last_good_step}); checkpoints set aside: {aside}. "
                "Every rank stops; resume with checkpoint.resume=auto from the newest checkpoint before it")


class SilentCorruptionCheck(L.Callback):
    """Compare the ranks' copies of the weights every ``every_n_steps`` steps (under ``MGPUStrategy``); on a
    mismatch, set aside the checkpoints of ``checkpoint_dir`` written since the copies last agreed and stop.
    :attr:`corruption` says what was found (None: nothing)."""

    def __init__(self, every_n_steps: int, checkpoint_dir: Optional[str | Path] = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
        self.every_n_steps = every_n_steps
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.corruption: Optional[Corruption] = None
        self.last_good_step = 0
        self._found: Optional[tuple[int, list[int], list[str]]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if getattr(getattr(trainer.strategy, "layout", None), "zero_stage", 0) == 3:
            raise ValueError("SilentCorruptionCheck compares the ranks' copies of the weights, and ZeRO-3 keeps none "
                             "(each rank holds a different partition): use zero_stage 0-2, or leave the check out")

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.last_good_step = trainer.global_step  # a resumed checkpoint's copies were checksummed when read

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or self._found is not None:
            return
        ranks, names = self._compare(trainer)
        if not ranks:
            self.last_good_step = step
            return
        self._found = (step, ranks, names)
        trainer.should_stop = True  # after this step, on every rank: they compared the same fingerprints

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        """Set the suspect checkpoints aside once the periodic checkpoint (before this callback in the list) has
        published every save in flight."""
        if self._found is None:
            return
        step, ranks, names = self._found
        set_aside = self._set_aside() if trainer.is_global_zero else []
        self.corruption = Corruption(step, self.last_good_step, ranks, names, set_aside)
        rank_zero_info(self.corruption.describe())

    def _compare(self, trainer: L.Trainer) -> tuple[list[int], list[str]]:
        """(the ranks named, the parameters that differ) over this rank's groups of copies; the same on every rank."""
        layout, module = trainer.strategy.layout, trainer.strategy.model.module
        named = list(module.named_parameters())
        odd: set[int] = set()
        differing: list[str] = []
        for axis, experts in (("dp_cp", False), ("edp", True)):
            chosen = [(n, p) for n, p in named if bool(getattr(p, "expert_partition", None)) == experts]
            group = layout.group(axis)
            ranks = dist.get_process_group_ranks(group)
            if len(ranks) < 2 or not chosen:
                continue
            mine = fingerprints([p for _, p in chosen]).to(trainer.strategy.root_device)
            rows = [torch.empty_like(mine) for _ in ranks]
            dist.all_gather(rows, mine, group=group)
            found, indices = odd_ranks([r.tolist() for r in rows], ranks)
            odd.update(found)
            differing += [chosen[i][0] for i in indices]
        return _agreed(sorted(odd), differing)

    def _set_aside(self) -> list[Path]:
        """Rename the checkpoints written after :attr:`last_good_step` (rank 0)."""
        if self.checkpoint_dir is None:
            return []
        moved = []
        for path in complete_checkpoints(self.checkpoint_dir):
            if int(path.name.split("-")[1]) > self.last_good_step:
                target = path.with_name(path.name + ".corrupt")
                path.rename(target)
                moved.append(target)
        return moved


def _agreed(ranks: list[int], names: list[str]) -> tuple[list[int], list[str]]:
    """Each rank compared within its own groups: the union over every rank, so that all stop together."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ranks, names))
    return sorted({r for rs, _ in gathered for r in rs}), sorted({n for _, ns in gathered for n in ns})
