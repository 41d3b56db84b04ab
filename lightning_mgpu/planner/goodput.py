"""The share of a job's wall time that trains (its goodput, "effective training time"), given how often it fails,
how often it checkpoints, and what a save and a restart cost; and the checkpoint interval that maximises it.

A job of ``G`` GPUs fails every ``M = M_gpu / G`` hours on average (``M_gpu``: the mean time between failures of one
GPU with its share of host, network and software; Llama 3's 466 interruptions in 54 days on 16,384 H100s give
``M_gpu`` of about 45,000 hours). Checkpointing every ``tau`` seconds of training with a blocking save of ``C`` seconds
costs ``C / tau`` of the time; each failure costs the restart ``R`` and, on average, half an interval of lost work.
To first order (Young, 1974; Daly, 2006) the goodput is ``1 - C / tau - (R + tau / 2) / M``, largest at
``tau* = sqrt(2 C M)``. Imports nothing distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: One GPU's mean time between job interruptions, in hours, from Llama 3's report (466 in 54 days on 16,384 GPUs).
LLAMA3_GPU_MTBF_HOURS = 54 * 24 * 16384 / 466

#: A universal checkpoint's bytes per parameter: the fp32 weight and Adam's two moments.
CHECKPOINT_BYTES_PER_PARAMETER = 12


@dataclass(frozen=True)
class Goodput:
    """A layout's expected effective training time at a checkpoint interval, and the interval that is best."""

    gpus: int
    job_mtbf_s: float  #: mean seconds between failures of the whole job
    interval_s: float  #: seconds of training between checkpoints
    save_s: float  #: seconds training is blocked by one save
    restart_s: float  #: seconds from a failure to training again (scheduling, start-up, loading)
    fraction: float  #: expected share of wall time spent training
    best_interval_s: float  #: Young/Daly: sqrt(2 x save x job MTBF)
    best_fraction: float


def goodput_fraction(interval_s: float, save_s: float, restart_s: float, job_mtbf_s: float) -> float:
    """``1 - C/tau - (R + tau/2)/M``, at least 0 (a job that fails faster than it can save never progresses)."""
    return max(0.0, 1.0 - save_s / interval_s - (restart_s + interval_s / 2) / job_mtbf_s)


def plan_goodput(gpus: int, gpu_mtbf_hours: float, every_n_steps: int, step_s: float, save_s: float,
                 restart_s: float, background_write_s: float = 0.0) -> Goodput:
    """The goodput of a job of ``gpus`` GPUs checkpointing every ``every_n_steps`` steps of ``step_s`` seconds.
    ``background_write_s``: the write of a checkpoint saved in the background, which overlaps training, unless the
    next save comes before it ends (that save waits for the rest: ``C = save + max(0, write - tau)``); the best
    interval is then at least the write."""
    job_mtbf = gpu_mtbf_hours * 3600 / gpus
    interval = every_n_steps * step_s

    def blocked(tau: float) -> float:
        return save_s + max(0.0, background_write_s - tau)

    best = max(math.sqrt(2 * save_s * job_mtbf), background_write_s)
    return Goodput(gpus, job_mtbf, interval, blocked(interval), restart_s,
                   goodput_fraction(interval, blocked(interval), restart_s, job_mtbf), best,
                   goodput_fraction(best, blocked(best), restart_s, job_mtbf))


def save_seconds(checkpoint_bytes: float, nodes: int, write_bytes_per_s_per_node: float) -> float:
    """A blocking universal checkpoint's time: its bytes written by every node at once at the given rate."""
    return checkpoint_bytes / (nodes * write_bytes_per_s_per_node)


def snapshot_seconds(checkpoint_bytes: float, gpus: int, copies: int, copy_bytes_per_s_per_gpu: float) -> float:
    """A background checkpoint's blocking part: every GPU copies its share to host memory, ``copies`` x 1/G of the
    checkpoint (1 under ZeRO 1-2, where each rank copies its own pieces; the data-parallel size under ZeRO 0 and 3,
    where each rank holds or gathers its whole tensor-parallel and pipeline shard)."""
    return checkpoint_bytes * copies / (gpus * copy_bytes_per_s_per_gpu)
