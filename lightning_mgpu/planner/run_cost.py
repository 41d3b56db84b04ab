"""A whole training run from one layout's step: its wall time with the expected failure overhead, its GPU-hours,
energy and cost; the ranking of runs for a deadline; the node counts and the efficiency of a scaling curve.

For a budget of ``D`` tokens, a step of ``B`` tokens taking ``s`` seconds and an expected effective training time
(goodput) ``g`` (:mod:`lightning_mgpu.planner.goodput`), on ``n`` nodes of ``G`` GPUs in all:

- time ``T = D / (B / s) / g`` (failure-free time over goodput: failures, restarts and saves stretch the run);
- GPU-hours ``T x G`` (every GPU is held for the whole wall time, the lost part included);
- energy ``T x (G x P_gpu + n x P_node) x PUE``;
- cost ``GPU-hours x price``.

Pure arithmetic: imports nothing distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RunSettings:
    """What the run's figures are priced and powered at (``plan.*`` settings, not facts)."""

    tokens: float  #: the run's token budget
    price_per_gpu_hour: float  #: currency per GPU-hour
    gpu_power_w: Optional[float]  #: watts one GPU draws; None: unknown (no energy figure)
    node_overhead_w: float  #: watts one node draws besides its GPUs (CPUs, memory, NICs, fans)
    pue: float = 1.0  #: facility energy over the machines' energy


@dataclass(frozen=True)
class RunCost:
    """One layout's whole run."""

    nodes: int
    gpus: int
    failure_free_hours: float  #: the tokens at the planned rate, with no failure
    goodput: float  #: the expected share of the wall time that trains
    hours: float  #: wall time: ``failure_free_hours / goodput`` (inf where goodput is 0)
    gpu_hours: float
    energy_mwh: Optional[float]  #: None where the GPU's power is unknown
    cost: float

    @property
    def days(self) -> float:
        return self.hours / 24

    def within(self, deadline_hours: float) -> bool:
        return self.hours <= deadline_hours


def run_cost(tokens_per_step: float, step_s: float, goodput: float, nodes: int, gpus_per_node: int,
             settings: RunSettings) -> RunCost:
    """The run of ``settings.tokens`` tokens at ``tokens_per_step`` per step of ``step_s`` seconds on ``nodes`` x
    ``gpus_per_node`` GPUs that train ``goodput`` of their wall time."""
    gpus = nodes * gpus_per_node
    failure_free_h = settings.tokens / (tokens_per_step / step_s) / 3600
    hours = failure_free_h / goodput if goodput > 0 else math.inf
    gpu_hours = hours * gpus
    energy = None if settings.gpu_power_w is None else (
        hours * (gpus * settings.gpu_power_w + nodes * settings.node_overhead_w) * settings.pue / 1e6)
    return RunCost(nodes, gpus, failure_free_h, goodput, hours, gpu_hours, energy,
                   gpu_hours * settings.price_per_gpu_hour)


def rank_for_deadline(items: Sequence[T], run_of: Callable[[T], RunCost],
                      deadline_hours: float) -> tuple[list[T], Optional[T]]:
    """(the items whose run finishes within the deadline, cheapest first, the faster first at equal cost; the
    fastest item of all, which is what to say when none does; None when there are no items)."""
    within = sorted((i for i in items if run_of(i).within(deadline_hours)),
                    key=lambda i: (run_of(i).cost, run_of(i).hours))
    fastest = min(items, key=lambda i: run_of(i).hours, default=None)
    return within, fastest


def node_counts(max_nodes: int, configured: int) -> list[int]:
    """A scaling curve's node counts: the powers of two up to ``max_nodes``, ``max_nodes`` itself and the
    configured count (a cluster of 12 nodes is drawn at 1, 2, 4, 8 and 12)."""
    counts = {max_nodes, configured}
    n = 1
    while n < max_nodes:
        counts.add(n)
        n *= 2
    return sorted(counts)


def scaling_efficiency(rates: Sequence[float]) -> list[float]:
    """Each tokens/s per GPU over the first one's (the smallest node count's): 1 at the first point, below 1 where
    communication grows faster than the work per GPU shrinks, above where a small cluster fits the model only with
    recomputation or deeper pipelines."""
    return [r / rates[0] for r in rates] if rates else []
