"""Every collective this process issues, counted by axis, operation, bytes and calls, at the dispatcher.

``torch.distributed``'s functions, a process group's own methods and the functional collectives
(``torch.distributed._functional_collectives``, what expert parallelism's all-to-all uses) all reach the dispatcher
as one ``c10d`` or ``_c10d_functional`` operator per collective, whoever calls them: this package's tensor, context,
pipeline and expert layers, DeepSpeed's ZeRO (``deepspeed.comm`` calls ``torch.distributed``), torch's pipelining
sends and receives, Lightning's metric reductions. A ``TorchDispatchMode`` sees each of them with its tensors and its
process group, which is what is counted here. It is written by hand because the closest library tool,
``torch.distributed.tensor.debug.CommDebugMode``, counts calls per operator but not bytes nor groups, and the Flight
Recorder (``lightning_mgpu.resilience.collective_trace``) records no point-to-point operation on gloo and names a
gloo reduce-scatter an all-reduce.

**Bytes** are those of the whole tensor the operation is about, per rank: an all-reduce's tensor, an all-gather's
output, a reduce-scatter's input, an all-to-all's input, a send's or receive's tensor. What crosses the links
follows from it and the group size (``lightning_mgpu.planner.communication``). Groups of one rank move nothing and
are not counted. Collectives of at most :data:`SCALAR_ELEMENTS` elements (a gradient norm, a loss, an overflow
flag) are kept apart as well as in the totals: the planner has no term for them.

**Cost.** The mode is a Python call per dispatched operator while it is on (measured in the docs' planning page);
off, nothing is installed and nothing is paid. It is per thread: collectives another thread issues (a background
checkpoint writer) are not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

#: Operator name (``c10d`` and ``_c10d_functional`` namespaces) -> (operation, index of the argument whose tensors
#: are the operation's whole tensor, whether that argument is the local shard of an all-gather: times the group size).
OPERATORS = {
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "all_reduce": ("all_reduce", 0, False), "all_reduce_": ("all_reduce", 0, False),
    "all_reduce_coalesced": ("all_reduce", 0, False), "all_reduce_coalesced_": ("all_reduce", 0, False),
    "allgather_": ("all_gather", 0, False), "_allgather_base_": ("all_gather", 0, False),
    "allgather_coalesced_": ("all_gather", 0, False), "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True), "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "all_gather_into_tensor_out": ("all_gather", 0, True),
    "reduce_scatter_": ("reduce_scatter", 1, False), "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "alltoall_": ("all_to_all", 1, False), "alltoall_base_": ("all_to_all", 1, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast_": ("broadcast", 0, False), "broadcast": ("broadcast", 0, False), "reduce_": ("reduce", 0, False),
    "send": ("send", 0, False), "recv_": ("recv", 0, False), "recv_any_source_": ("recv", 0, False),
    "gather_": ("gather", 1, False), "scatter_": ("scatter", 0, False),
    "barrier": ("barrier", None, False), "monitored_barrier_": ("barrier", None, False),
}
NAMESPACES = ("c10d", "_c10d_functional")
#: Process group descriptions that name no axis of the layout.
WORLD = {"default_pg": "world"}
#: Collectives of at most this many elements are scalars: norms, losses, flags, counts of a few values.
SCALAR_ELEMENTS = 8


@dataclass
class Traffic:
    """Bytes and calls of one (axis, operation); of them, those of scalars (:data:`SCALAR_ELEMENTS`)."""

    bytes: int = 0
    calls: int = 0
    scalar_bytes: int = 0


@dataclass
class CommCount:
    """What one stretch of this process's work sent, by (axis, operation)."""

    traffic: dict = field(default_factory=lambda: defaultdict(Traffic))

    def add(self, axis: str, op: str, nbytes: int, elements: int) -> None:
        entry = self.traffic[(axis, op)]
        entry.bytes += nbytes
        entry.calls += 1
        entry.scalar_bytes += nbytes if elements <= SCALAR_ELEMENTS else 0

    def bytes(self, axis: Optional[str] = None, op: Optional[str] = None) -> int:
        """Bytes of every entry on ``axis`` (all axes: None) and ``op`` (all operations: None)."""
        return sum(t.bytes for (a, o), t in self.traffic.items() if axis in (None, a) and op in (None, o))

    def calls(self, axis: Optional[str] = None, op: Optional[str] = None) -> int:
        return sum(t.calls for (a, o), t in self.traffic.items() if axis in (None, a) and op in (None, o))

    def table(self) -> dict[str, dict[str, int]]:
        """``{"axis/op": {"bytes": n, "calls": n, "scalar_bytes": n}}``, sorted: a plain dict for tests and pickles."""
        return {f"{a}/{o}": {"bytes": t.bytes, "calls": t.calls, "scalar_bytes": t.scalar_bytes}
                for (a, o), t in sorted(self.traffic.items())}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group(func: Any, args: tuple) -> Optional[Any]:
    """The process group of a dispatched collective: a boxed group (``c10d``) or a group name (functional)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return dist.ProcessGroup.unbox(arg)
    if func.namespace == "_c10d_functional":
        name = next((a for a in reversed(args) if isinstance(a, str)), None)
        return dist.distributed_c10d._resolve_process_group(name) if name else None
    return None


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as counter:`` counts every collective dispatched on this thread into ``counter.count``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = CommCount()
        self._axes: dict[str, tuple[str, int]] = {}

    def _axis(self, group: Any) -> tuple[str, int]:
        key = group.group_name
        if key not in self._axes:
            desc = group.group_desc
            self._axes[key] = (WORLD.get(desc, desc), group.size())
        return self._axes[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func.namespace in NAMESPACES:
            self._record(func, args)
        return func(*args, **(kwargs or {}))

    def _record(self, func: Any, args: tuple) -> None:
        known = OPERATORS.get(func._opname)
        group = None if known is None else _group(func, args)
        if group is None:
            return  # wait_tensor, _wrap_tensor_autograd: not collectives
        axis, size = self._axis(group)
        if size <= 1:
            return
        op, index, shard = known
        tensors = [] if index is None else list(_tensors(args[index]))
        factor = size if shard else 1
        elements = sum(t.numel() for t in tensors)  # a rank's own share, for an all-gather
        self.count.add(axis, op, factor * sum(t.numel() * t.element_size() for t in tensors),
                       elements // size if op == "all_gather" and not shard else elements)
