"""Replicas that synchronise every ``sync_every`` steps (``replica_update="local"``: local SGD, DiLoCo), and the
outer optimizer both ``local`` and ``async`` (``lightning_mgpu.parallel.async_replicas``) step with.

Each replica (a group of data-parallel ranks, the outermost axis of the layout) trains alone: its gradients reduce
and its ZeRO partitions split over its own ranks, with its own inner optimizer. After every ``sync_every`` inner
steps, every rank takes the change of its share of the fp32 master weights since the last outer step (the
pseudo-gradient: weights before minus after), averages it over the ranks at the same place of every replica (one
all-reduce of this rank's share, group ``"rep"``), and an outer optimizer updates the weights of the last outer step
with it; every replica continues from the result. DiLoCo (arXiv 2311.08105) uses Nesterov SGD with lr 0.7 and
momentum 0.9 (the default); plain SGD with lr 1 and no momentum is model averaging (local SGD). The inner optimizers'
states stay each replica's own.

Written by hand: torch's model averagers (``torch.distributed.algorithms.model_averaging``) act on module parameters,
which the next ZeRO step would overwrite from the fp32 masters, and torchft's DiLoCo wraps FSDP; this acts on the
engine's masters (``lightning_mgpu.engine.master_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch
import torch.distributed as dist

from lightning_mgpu import engine as engines
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.problems import Problem

#: Outer optimizers by name.
OUTER_OPTIMIZERS = ("nesterov", "sgd")


@dataclass(frozen=True)
class OuterOptimizer:
    """The optimizer of the outer step: SGD over the averaged pseudo-gradient, with Nesterov momentum by default."""

    name: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9

    @classmethod
    def of(cls, value: Union["OuterOptimizer", Mapping[str, Any], None]) -> "OuterOptimizer":
        """From an ``OuterOptimizer``, a mapping of its fields (Hydra's ``parallel.outer_optimizer``) or None."""
        if value is None or isinstance(value, OuterOptimizer):
            return value or cls()
        unknown = set(value) - {"name", "lr", "momentum"}
        if unknown:
            raise ValueError(f"outer_optimizer has no setting {', '.join(sorted(unknown))}; give name, lr, momentum")
        return cls(**value)

    def problems(self) -> list[Problem]:
        out = []
        if self.name not in OUTER_OPTIMIZERS:
            out.append(Problem("outer_optimizer", self.name, "is unknown", f"choose {' or '.join(OUTER_OPTIMIZERS)}"))
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            out.append(Problem("outer_optimizer", f"lr={self.lr}", "must be > 0", "DiLoCo uses 0.7"))
        if not isinstance(self.momentum, (int, float)) or not 0 <= self.momentum < 1:
            out.append(Problem("outer_optimizer", f"momentum={self.momentum}", "must be in [0, 1)", "DiLoCo uses 0.9"))
        elif self.name == "nesterov" and self.momentum == 0:
            out.append(Problem("outer_optimizer", "momentum=0", "gives Nesterov nothing to look ahead with",
                               "use name='sgd', or momentum > 0"))
        return out

    def is_averaging(self) -> bool:
        """SGD with lr 1 and no momentum: the outer step sets the weights to the replicas' mean."""
        return self.name == "sgd" and self.lr == 1 and self.momentum == 0

    def build(self, params: list[torch.Tensor]) -> torch.optim.SGD:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.name == "nesterov")


@torch.no_grad()
def start_together(engine: Any, layout: ParallelLayout, masters: list[torch.Tensor]) -> None:
    """Every replica starts from replica 0's weights: the engine's start-up broadcast reaches one replica only,
    and replicas that started apart would stay apart (each outer step moves them by the same average)."""
    if layout.size("rep") == 1:
        return
    coords = layout.coords(dist.get_rank())
    source = layout.global_rank_of(coords["tp"], coords["pp"], coords["dp"], coords["cp"], rep=0)
    for master in masters:
        dist.broadcast(master, src=source, group=layout.group("rep"))
    engines.refresh_working_weights(engine)


class ReplicaSync:
    """The outer step of one rank: call :meth:`after_inner_step` after every inner optimizer step."""

    def __init__(self, engine: Any, layout: ParallelLayout, outer: OuterOptimizer) -> None:
        self.engine, self.layout, self.every = engine, layout, layout.sync_every
        self.masters = engines.master_weights(engine)
        start_together(engine, layout, self.masters)
        #: the weights of the last outer step (this rank's share), which the outer optimizer updates
        self.anchors = [torch.nn.Parameter(m.detach().clone(), requires_grad=False) for m in self.masters]
        self.optimizer = outer.build(self.anchors)
        #: one replica averaged with itself: the outer step is the identity, so it is not computed (its rounding
        #: would be the only difference from plain training)
        self.identity = layout.size("rep") == 1 and outer.is_averaging()
        self.inner_steps = 0
        self.outer_steps = 0
        self.synced_at = 0  #: the inner step of the last outer step

    def describe(self) -> str:
        return (f"{self.layout.size('rep')} replicas stepping alone, an outer step over {len(self.masters)} master "
                f"tensors every {self.every} steps ({type(self.optimizer).__name__})")

    def after_inner_step(self, last: bool = False) -> bool:
        """Count an inner step; every ``sync_every``-th, and at the ``last`` step of training (so that validation and
        everything after training see the replicas' common weights), take the outer step. Returns whether it did."""
        self.inner_steps += 1
        if self.inner_steps % self.every and not last:
            return False
        self.outer_step()
        return True

    def finish(self) -> None:
        """At the end of training: a round cut short (by ``max_time`` or epochs, which the last inner step cannot
        see coming) ends with its outer step, so that every replica ends with the same weights."""
        if self.inner_steps != self.synced_at:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the pseudo-gradients over the replicas, step the outer optimizer, continue every replica from it."""
        replicas, group = self.layout.size("rep"), self.layout.group("rep") if self.layout.size("rep") > 1 else None
        if self.identity:
            for anchor, master in zip(self.anchors, self.masters):
                anchor.copy_(master)
            self.outer_steps, self.synced_at = self.outer_steps + 1, self.inner_steps
            return
        for anchor, master in zip(self.anchors, self.masters):
            delta = anchor - master
            if group is not None:
                dist.all_reduce(delta, group=group)
                delta /= replicas
            anchor.grad = delta
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for anchor, master in zip(self.anchors, self.masters):
            master.copy_(anchor)
        engines.refresh_working_weights(self.engine)
        self.outer_steps += 1
        self.synced_at = self.inner_steps


def keep_sigterm_check_inside_replicas(trainer: Any, layout: ParallelLayout) -> None:
    """Lightning broadcasts rank 0's SIGTERM flag over every rank before each training batch, which would make
    replicas that step apart meet at every inner step (and, under ``async``, wait for the slowest). Here each replica
    broadcasts its first rank's flag over its own ranks instead (group ``"replica"``): a SIGTERM stops the replica
    that received it as Lightning stops a job. Set on this trainer's loop only (an instance attribute over the
    private method, the one place Lightning issues that collective)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    loop = trainer.fit_loop.epoch_loop
    first = layout.global_rank_of(rep=layout.coords(dist.get_rank())["rep"])

    def replica_sigterm_check() -> None:
        flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
        dist.broadcast(flag, src=first, group=layout.group("replica"))
        if flag.item() == 1:
            dist.barrier(group=layout.group("replica"))
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = replica_sigterm_check
