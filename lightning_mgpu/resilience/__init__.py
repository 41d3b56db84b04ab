"""Failure handling: what keeps a long run going through what long runs meet (so far: a step whose loss or gradients
are not finite, or whose loss spikes, skipped on every rank; a rank's copy of the weights corrupted silently)."""

from lightning_mgpu.resilience.fingerprint import Corruption, SilentCorruptionCheck
from lightning_mgpu.resilience.step_guard import SkippedStep, SpikeRule, StepGuard

__all__ = ["Corruption", "SilentCorruptionCheck", "SkippedStep", "SpikeRule", "StepGuard"]
