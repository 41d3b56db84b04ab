"""Lightning callbacks: throughput and MFU counted per data-parallel replica; every collective counted (``comm/*``);
atomic periodic checkpoints; profiles of chosen steps."""

from lightning_mgpu.callbacks.checkpoint import PeriodicCheckpoint, newest_checkpoint
from lightning_mgpu.callbacks.comm import CommunicationCounter
from lightning_mgpu.resilience.preemption import REQUEUE_EXIT, Preemption  # failure handling's, kept importable here
from lightning_mgpu.callbacks.profile import ProfileSteps
from lightning_mgpu.callbacks.throughput import Throughput, ThroughputCallback, throughput

__all__ = ["CommunicationCounter", "PeriodicCheckpoint", "Preemption", "ProfileSteps", "REQUEUE_EXIT", "Throughput", "ThroughputCallback", "newest_checkpoint", "throughput"]
