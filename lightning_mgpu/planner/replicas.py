"""What replicas that synchronise every ``H`` steps (``replica_update`` other than ``"sync"``) cost, per GPU.

* memory: the outer step keeps two fp32 copies of the rank's share of the master weights, the weights of the last
  outer step and the outer optimizer's momentum, 8 bytes per parameter of that share (4 without momentum: torch's SGD
  then keeps no momentum buffer);
* bytes: every outer step all-reduces the rank's fp32 share over the ``R`` ranks at the same place of every replica,
  as a ring: ``2 (R-1)/R x 4 x share`` bytes sent per GPU. Under ``"sync"`` the gradients of the same share would
  cross the replicas every step: ``2 (R-1)/R x w x share`` (``w``: 2 bytes in bf16, 4 in ``32-true``, as the step time
  of :mod:`lightning_mgpu.planner.time` counts gradients), so ``H`` inner steps send ``4 / (w H)`` of what ``H``
  synchronised steps would;
* bandwidth: the outer step's bytes sent in the time of ``H`` inner steps, ``bytes / (H x step seconds)``: what an
  outer step overlapped with the next round would need to stay hidden. This version's outer step waits for its
  all-reduce, so at a link of bandwidth ``B`` it adds ``bytes / B`` seconds every ``H`` steps.

The share is the fullest rank's (pipeline ranks holding the embedding or the head hold more); without pipeline
parallelism every rank's share is the same. Imports nothing distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_mgpu.models.llama import LlamaConfig
from lightning_mgpu.planner.hardware import ClusterSpec
from lightning_mgpu.planner.model_stats import max_rank_parameters
from lightning_mgpu.planner.time import _ring
from lightning_mgpu.problems import Problem, raise_problems

#: Bytes of an fp32 master weight, of its copy at the last outer step and of its outer momentum.
FP32 = 4


def master_share(cfg: LlamaConfig, tp: int, pp: int, stages_per_rank: int, zero_ranks: int, zero_stage: int) -> float:
    """Parameters of the fp32 master weights the fullest rank holds: its tensor/pipeline shard, split over the
    ``zero_ranks`` (data x context ranks of one replica) from ZeRO-1 on; at ZeRO-0 every rank holds its whole shard."""
    held = max_rank_parameters(cfg, tp, pp, stages_per_rank)
    return held / zero_ranks if zero_stage >= 1 else float(held)


def outer_copy_bytes(share: float, momentum: float, replica_update: str = "local", replicas: int = 1,
                     max_staleness: int = 0) -> float:
    """The outer step's extra fp32 copies of a rank's ``share`` (parameters): the weights of the last outer step, and
    the outer momentum when ``momentum > 0`` (torch's SGD allocates no buffer without momentum). Under ``async`` the
    rank keeps the weights its round started from whole and a whole copy of its masters while a round ends, and owns
    one slice of ``replicas``: its global weights, its momentum, and the sums of the rounds pushed ahead of its
    version (at most ``max_staleness + 1``; ``lightning_mgpu.parallel.replica_server``)."""
    with_momentum = 1 if momentum > 0 else 0
    if replica_update == "async":
        return FP32 * share * (2 + (1 + with_momentum + max_staleness + 1) / replicas)
    return FP32 * share * (1 + with_momentum)


def gradient_bytes(precision: str) -> int:
    """Bytes per gradient element as the planner counts them (``planner.memory`` and ``planner.time``)."""
    return 4 if precision == "32-true" else 2


@dataclass(frozen=True)
class ReplicaTraffic:
    """One GPU's cost of ``replicas`` replicas with an outer step every ``sync_every`` inner steps."""

    replicas: int
    sync_every: int
    gpus_per_replica: int
    share: float  #: parameters of the fullest rank's fp32 master share
    extra_memory: float  #: bytes per GPU of the outer step's fp32 copies
    outer_bytes: float  #: bytes one GPU sends to the other replicas per outer step
    sync_bytes: float  #: bytes one GPU would send over the replica axis per step under "sync"
    step_seconds: Optional[float] = None  #: the estimated inner step (None: no estimate)

    @property
    def site_outer_bytes(self) -> float:
        """Bytes one replica's GPUs send together per outer step: what leaves its site."""
        return self.outer_bytes * self.gpus_per_replica

    @property
    def job_outer_bytes(self) -> float:
        return self.site_outer_bytes * self.replicas

    @property
    def bandwidth_per_gpu(self) -> Optional[float]:
        """Bytes/s per GPU that send an outer step's bytes in the time of ``sync_every`` inner steps."""
        if self.step_seconds is None:
            return None
        return self.outer_bytes / (self.sync_every * self.step_seconds)

    @property
    def bandwidth_per_site(self) -> Optional[float]:
        """The same for one replica's link to the others: every GPU of the replica sends through it."""
        per_gpu = self.bandwidth_per_gpu
        return None if per_gpu is None else per_gpu * self.gpus_per_replica


def replica_traffic(share: float, replicas: int, sync_every: int, gpus_per_replica: int, momentum: float,
                    precision: str = "bf16-mixed", step_seconds: Optional[float] = None,
                    replica_update: str = "local", max_staleness: int = 0) -> ReplicaTraffic:
    """The memory, bytes and bandwidth of a rank holding ``share`` master parameters (see the module's formulas)."""
    problems = _traffic_problems(share, replicas, sync_every, gpus_per_replica, step_seconds)
    raise_problems("replica plan", problems)
    return ReplicaTraffic(replicas, sync_every, gpus_per_replica, share,
                          outer_copy_bytes(share, momentum, replica_update, replicas, max_staleness),
                          _ring(FP32 * share, replicas, 1.0),  # a ring's seconds at 1 byte/s are its bytes
                          _ring(gradient_bytes(precision) * share, replicas, 1.0), step_seconds)


def _traffic_problems(share: float, replicas: int, sync_every: int, gpus: int,
                      step_seconds: Optional[float]) -> list[Problem]:
    out = [Problem(name, value, "must be an integer >= 1", "use 1 or more")
           for name, value in (("replicas", replicas), ("sync_every", sync_every), ("gpus_per_replica", gpus))
           if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if share < 0:
        out.append(Problem("share", share, "must be >= 0 (parameters of a rank's master weights)"))
    if step_seconds is not None and not step_seconds > 0:
        out.append(Problem("step_seconds", step_seconds, "must be > 0", "pass None where there is no estimate"))
    return out


def replica_cluster_problems(cluster: ClusterSpec, replicas: int) -> list[Problem]:
    """The rule of the planner's model of a replica: ``replicas`` splits the GPUs into whole nodes each, or into
    parts of one node (replicas are the outermost axis: replica ``r`` is the ranks ``r G .. (r+1) G - 1``)."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        return [Problem("replicas", replicas, "must be an integer >= 1", "use 1 or more")]
    gpus = world // replicas
    if world % replicas or (gpus % per_node and per_node % gpus):
        fits = [r for r in range(1, world + 1) if world % r == 0 and (world // r % per_node == 0
                                                                     or per_node % (world // r) == 0)]
        return [Problem("replicas", replicas, f"does not split {cluster.nodes} node(s) x {per_node} GPUs into "
                        "equal groups of whole nodes or of parts of one node (the planner's model of a replica)", f"choose {', '.join(map(str, fits))}")]
    return []


def replica_cluster(cluster: ClusterSpec, replicas: int) -> ClusterSpec:
    """The GPUs of one replica, as a cluster of their own (its inner steps run on them alone)."""
    raise_problems("replica plan", replica_cluster_problems(cluster, replicas))
    gpus = cluster.world_size // replicas
    if gpus >= cluster.gpus_per_node:
        return ClusterSpec(gpus // cluster.gpus_per_node, cluster.gpus_per_node, cluster.gpu)
    return ClusterSpec(1, gpus, cluster.gpu)
