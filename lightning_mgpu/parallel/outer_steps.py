"""The outer step a fit runs, by ``replica_update``: none for ``sync``, :class:`ReplicaSync` for ``local``,
:class:`AsyncReplicaSync` for ``async``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel.async_replicas import AsyncReplicaSync
from lightning_mgpu.parallel.replicas import OuterOptimizer, ReplicaSync
from lightning_mgpu.split_rules import steps_apart


def replica_sync(engine: Any, layout: ParallelLayout, outer: OuterOptimizer, fitting: bool,
                 timeout: Optional[timedelta] = None) -> Optional[Union[ReplicaSync, AsyncReplicaSync]]:
    """The outer step of a fit (None for ``sync``, or when not training); ``timeout``: how long a pull waits for
    another replica's server to answer."""
    if not fitting or not steps_apart(layout.replica_update):
        return None
    if layout.replica_update == "async":
        return AsyncReplicaSync(engine, layout, outer, timeout)
    return ReplicaSync(engine, layout, outer)
