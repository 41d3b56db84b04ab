"""Lightning callbacks: throughput and MFU counted per data-parallel replica."""

from lightning_mgpu.callbacks.throughput import Throughput, ThroughputCallback, throughput

__all__ = ["Throughput", "ThroughputCallback", "throughput"]
