"""Failure handling: what keeps a long run going through what long runs meet (today: a step whose loss or gradients
are not finite, or whose loss spikes, skipped on every rank)."""

from lightning_mgpu.resilience.step_guard import SkippedStep, SpikeRule, StepGuard

__all__ = ["SkippedStep", "SpikeRule", "StepGuard"]
