"""Failure handling, in one package that imports nothing above it (only :mod:`lightning_mgpu.problems`): what keeps a
long run going through what long runs meet.

- detection: a lost rank (``liveness``: heartbeats), a stalled or GIL-holding one (``watchdog``), the collective
  each rank is in (``collective_trace``), slow ranks (``stragglers``), a step whose loss or gradients are not finite
  or whose loss spikes (``step_guard``), a rank's copy of the weights corrupted silently (``fingerprint``);
- agreement: every rank decides the same at a step boundary (``agreement``);
- preemption: a signal becomes an emergency checkpoint and the requeue status (``preemption``);
- recovery: a rollback past bad steps (``rollback``), restarts on torch's elastic agent and crash loops
  (``restarts``, ``elastic``);
- rehearsal: the chaos hooks ``mgpu-train`` ships (``faults``).

The code above it (the strategy, the checkpoint callbacks, the CLI) wires these in; what they need from there is passed
in (the emergency save of :class:`Preemption`, the refusal handling of the elastic ranks).
"""

from lightning_mgpu.resilience.fingerprint import Corruption, SilentCorruptionCheck
from lightning_mgpu.resilience.preemption import REQUEUE_EXIT, Preemption
from lightning_mgpu.resilience.step_guard import SkippedStep, SpikeRule, StepGuard

__all__ = ["Corruption", "Preemption", "REQUEUE_EXIT", "SilentCorruptionCheck", "SkippedStep", "SpikeRule",
           "StepGuard"]
