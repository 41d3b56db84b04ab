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

The restart reruns the steps since the copies last agreed, on the same ranks: that rerun tells a transient fault from
a persistent one, as Megatron's rerun state machine does for a step, but over the whole interval and without a job
restart (torch elastic restarts the workers in place). What was found is kept in the checkpoint directory
(``sdc-suspect.json``: the step, the ranks and their hosts). If the copies agree when the rerun reaches that step, the
fault was transient: said, the record removed, training goes on. If the same rank on the same host is named again, its
device corrupts what it holds: the run stops with :data:`EXIT_FAULTY_DEVICE`, which neither the agent nor a requeue
script should restart on that host.

What it covers is said as training starts (:func:`coverage`): the parameter tensors compared and over how many copies;
never the optimizer state (moments, and ZeRO 1-2's fp32 master weights: one partition a rank, no second copy inside a
replica to compare). At one data-parallel copy of every parameter it compares nothing: warned, not refused (a run on
too few ranks to have copies, a debugging run, is legitimate, and the check then costs nothing), so the warning says
what would make it compare.

What it sees: a copy that changed at rest between two steps. Under ZeRO-0 every rank keeps its whole copy, and a flip
stays until caught; under ZeRO 1-2 the engine rebuilds each rank's copy from the partitions after every step, so a
flip lasts at most one step and is caught only when a check falls in it; ZeRO-3 holds no copies to compare (refused).
Written here because neither torch, DeepSpeed nor Lightning compares replicas (Megatron's rerun state machine reruns a
step instead, and needs a job restart to run it elsewhere).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mgpu.resilience.faulty_hosts import host_name
from lightning_mgpu.resilience.restarts import EXIT_FAULTY_DEVICE
from lightning_mgpu.resilience.rollback import complete_checkpoints, set_aside

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


#: what a check found, kept in the checkpoint directory until a rerun of the same steps tells what it was
SUSPECT = "sdc-suspect.json"


@dataclass(frozen=True)
class Corruption:
    """What a check found: the step it ran at, the last step whose fingerprints agreed, the ranks named (with every
    rank's host), the parameters that differ and the checkpoints set aside; ``persistent``: found again on a rerun,
    the same rank on the same host."""

    step: int
    last_good_step: int
    ranks: list[int]
    parameters: list[str]
    set_aside: list[Path]
    hosts: list[str] = field(default_factory=list)
    persistent: bool = False

    def describe(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"one of ranks {self.ranks} (no majority of copies)"
        shown = ", ".join(self.parameters[:3]) + (f" and {len(self.parameters) - 3} more" if len(self.parameters) > 3
                                                  else "")
        aside = ", ".join(p.name for p in self.set_aside) or "none"
        where = host_verdict(self.ranks, self.hosts)
        found = (f"silent data corruption: {who} holds a copy of {shown} that differs from its data-parallel peers at "
                 f"step {self.step} (the copies agreed at step {self.last_good_step}); checkpoints set aside: {aside}."
                 + (f" {where}." if where else ""))
        if not self.persistent:
            return f"{found} Every rank stops; resume with checkpoint.resume=auto from the newest checkpoint before it"
        hosts = sorted({self.hosts[r] for r in self.ranks}) if self.hosts else []
        return (f"{found} Found again on the rerun of these steps, on the same host(s) {hosts}: a persistent fault of "
                f"that device. Every rank stops with exit status {EXIT_FAULTY_DEVICE}; do not restart on "
                f"{', '.join(hosts)} (e.g. sbatch --exclude={','.join(hosts)})")

    def record(self) -> dict:
        """What the rerun compares against: the step, the ranks named and their hosts."""
        return {"step": self.step, "last_good_step": self.last_good_step,
                "ranks": {str(r): self.hosts[r] if self.hosts else "" for r in self.ranks},
                "where": host_verdict(self.ranks, self.hosts)}


def host_verdict(ranks: list[int], hosts: list[str]) -> str:
    """Whether the ranks named share their host with ranks whose copies agree (one device to replace) or have a host to
    themselves (that device and its node cannot be told apart), from ``hosts`` (every rank's, by rank); "" without
    hosts."""
    if not hosts or not ranks:
        return ""
    named_hosts = sorted({hosts[r] for r in ranks})
    beside = {h: [r for r, host in enumerate(hosts) if host == h and r not in ranks] for h in named_hosts}
    if len(ranks) > 1:
        if len(named_hosts) > 1:
            return f"the ranks named run on different hosts ({', '.join(named_hosts)}): no one node is common to them"
        host = named_hosts[0]
        return f"the ranks named all run on host {host}, " + (
            f"beside ranks {beside[host]} whose copies agree" if beside[host] else "which runs no other rank")
    rank, host = ranks[0], named_hosts[0]
    if beside[host]:
        return (f"rank {rank} shares host {host} with ranks {beside[host]}, whose copies agree: one device (rank "
                f"{rank}'s), not the node")
    return (f"rank {rank} is the only rank on host {host}: its device and the rest of that node cannot be told apart "
            "here")


class SilentCorruptionCheck(L.Callback):
    """Compare the ranks' copies of the weights every ``every_n_steps`` steps (under ``MGPUStrategy``); on a
    mismatch, set aside the checkpoints of ``checkpoint_dir`` written since the copies last agreed and stop.
    :attr:`corruption` says what was found (None: nothing); :attr:`transient` the record of a corruption that a
    rerun of its steps did not meet again (None: none)."""

    def __init__(self, every_n_steps: int, checkpoint_dir: Optional[str | Path] = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
        self.every_n_steps = every_n_steps
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.corruption: Optional[Corruption] = None
        self.transient: Optional[dict] = None
        self.last_good_step = 0
        self._suspect: Optional[dict] = None  # a corruption an earlier attempt found, until its step is rerun
        self._found: Optional[tuple[int, list[int], list[str], list[str]]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if getattr(getattr(trainer.strategy, "layout", None), "zero_stage", 0) == 3:
            raise ValueError("SilentCorruptionCheck compares the ranks' copies of the weights, and ZeRO-3 keeps none "
                             "(each rank holds a different partition): use zero_stage 0-2, or leave the check out")

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.last_good_step = trainer.global_step  # a resumed checkpoint's copies were checksummed when read
        line, compared = coverage(trainer.strategy.layout, trainer.strategy.model.module, self.every_n_steps)
        (rank_zero_info if compared else rank_zero_warn)(line)
        path = self._suspect_path()
        self._suspect = json.loads(path.read_text()) if path is not None and path.is_file() else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or self._found is not None:
            return
        ranks, names, hosts = self._compare(trainer)
        if ranks:
            self._found = (step, ranks, names, hosts)
            trainer.should_stop = True  # after this step, on every rank: they compared the same fingerprints
            return
        self.last_good_step = step
        if self._suspect is not None and step >= self._suspect["step"]:
            self.transient, self._suspect = self._suspect, None
            rank_zero_info(f"silent data corruption: the rerun of steps {self.transient['last_good_step'] + 1}-"
                           f"{self.transient['step']} left every copy equal at step {step}: the fault found there on "
                           f"rank(s) {sorted(int(r) for r in self.transient['ranks'])} was transient; training goes on")
            if trainer.is_global_zero:
                self._suspect_path().unlink(missing_ok=True)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        """Set the suspect checkpoints aside once the periodic checkpoint (before this callback in the list) has
        published every save in flight, and keep what was found for the rerun."""
        if self._found is None:
            return
        step, ranks, names, hosts = self._found
        again = self._suspect is not None and any(self._suspect["ranks"].get(str(r)) == hosts[r] for r in ranks)
        aside = self._set_aside() if trainer.is_global_zero else []
        self.corruption = Corruption(step, self.last_good_step, ranks, names, aside, hosts, persistent=again)
        path = self._suspect_path()
        if trainer.is_global_zero and path is not None:
            path.with_suffix(".tmp").write_text(json.dumps(self.corruption.record()))
            os.replace(path.with_suffix(".tmp"), path)
        rank_zero_info(self.corruption.describe())

    def _suspect_path(self) -> Optional[Path]:
        return None if self.checkpoint_dir is None else self.checkpoint_dir / SUSPECT

    def _compare(self, trainer: L.Trainer) -> tuple[list[int], list[str], list[str]]:
        """(the ranks named, the parameters that differ, every rank's host) over this rank's groups of copies; the
        same on every rank."""
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
                moved.append(set_aside(path, ".corrupt"))
        return moved


def coverage(layout: Any, module: torch.nn.Module, every_n_steps: int) -> tuple[str, bool]:
    """(the line said at startup, whether anything is compared): this rank's parameter tensors that are compared and
    over how many copies (dense ones over the data x context ranks, experts' over their data-parallel ranks), and what
    is never compared; at one copy of everything, the line says why nothing is and what would change that."""
    split = {"dense": 0, "expert": 0}
    for p in module.parameters():
        split["expert" if getattr(p, "expert_partition", None) else "dense"] += 1
    copies = {"dense": layout.size("dp_cp"),
              "expert": layout.size("edp") if layout.size("ep") > 1 else layout.size("dp_cp")}
    said = [f"{split[k]} {k} parameter tensors over {copies[k]} copies" + ("" if copies[k] > 1 else " (not compared)")
            for k in ("dense", "expert") if split[k]]
    unchecked = "optimizer state (moments" + (f"; ZeRO-{layout.zero_stage}'s fp32 master weights, one partition a rank "
                                              "with no copy to compare" if layout.zero_stage in (1, 2) else "") + ")"
    compared = any(split[k] and copies[k] > 1 for k in split)
    if not compared:
        return (f"silent data corruption check (every {every_n_steps} steps): every parameter of this run has one "
                f"data-parallel copy (data x context ranks: {layout.size('dp_cp')}), so the check compares nothing; it "
                "needs two copies or more of a parameter: train on more data-parallel ranks, or leave the check out "
                "(sdc.every_n_steps=null)"), False
    return (f"silent data corruption check every {every_n_steps} steps: this rank's {'; '.join(said)}; never "
            f"compared: {unchecked}"), True


def _agreed(ranks: list[int], names: list[str]) -> tuple[list[int], list[str], list[str]]:
    """Each rank compared within its own groups: the union over every rank, so that all stop together, with every
    rank's host (a persistent fault is a device's, named by its host)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ranks, names, host_name()))
    return (sorted({r for rs, _, _ in gathered for r in rs}), sorted({n for _, ns, _ in gathered for n in ns}),
            [host for _, _, host in gathered])
