"""The ``bad_steps`` and ``sdc`` groups of ``mgpu-train``'s config: failure handling while training
(:mod:`lightning_mgpu.resilience`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SpikeRuleConfig:
    """:class:`lightning_mgpu.resilience.SpikeRule`: a step's loss spikes when one rank's own loss is more than
    ``rank_ratio`` times the median of the other ranks' (from the first step), or when the mean loss is more than
    ``sigmas`` standard deviations AND ``min_rise`` above the mean of the last ``window`` accepted steps (once
    ``min_history`` are there)."""

    window: int = 128
    sigmas: float = 6.0
    min_history: int = 16
    min_rise: float = 0.5  #: a fraction of the mean loss
    rank_ratio: Optional[float] = 10.0  #: a rank's loss against the median of the others'; null: that rule off


@dataclass
class BadStepsConfig:
    """``MGPUStrategy(skip_bad_steps=skip, loss_spike=loss_spike)``: a step whose loss or gradients are not finite on
    some rank, or whose loss spikes, is skipped on every rank (docs: concepts, "When things fail")."""

    skip: bool = True  #: the ranks agree on every optimizer step (one small all-gather); false: never skip
    #: the spike rule; null: skip only non-finite steps
    loss_spike: Optional[SpikeRuleConfig] = field(default_factory=SpikeRuleConfig)
    #: this many skipped steps within rollback_window roll the run back to the checkpoint before the first of them,
    #: leaving their batches out (an exit with 75 for a restart: cluster.max_restarts or SLURM); null = never
    rollback_after: Optional[int] = None
    rollback_window: int = 100  #: steps (see rollback_after)


@dataclass
class SilentCorruptionConfig:
    """:class:`lightning_mgpu.resilience.SilentCorruptionCheck`: the ranks' copies of the weights compared every N
    steps; on a mismatch the rank is named, the checkpoints since the copies last agreed are set aside and the run
    exits with 75 for a restart, whose rerun of those steps tells a transient fault from a persistent one (exit 77)
    (docs: concepts, "When things fail")."""

    every_n_steps: Optional[int] = None  #: null = off; needs parallel.zero_stage 0-2 and more than one copy
    #: cluster=torchrun started by `python -m lightning_mgpu.cli.node` on each node: a node whose host the run's
    #: faulty-device.json names (a persistent fault) does not join (exit 78); the others start torchrun with
    #: --nnodes=MIN:MAX and the run resumes on the smaller world (docs: concepts, "When things fail")
    exclude_faulty_hosts: bool = False
    #: sdc.exclude_faulty_hosts: the nodes a job may leave out (MIN = the nodes asked for less these)
    max_excluded_nodes: int = 1
