"""Starting this process's part of a job: the world process group, the layout's groups over it, the engine's
communication, and the heartbeat that names lost ranks. The strategy calls it once, in ``setup_environment``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

from lightning_mgpu import engine as engines
from lightning_mgpu.layout import LayoutRequest, ParallelLayout
from lightning_mgpu.parallel.liveness import Heartbeat

def start_process_group(cluster_environment: Any, root_device: torch.device, backend: Optional[str],
                        timeout: Optional[timedelta], request: LayoutRequest, devices_per_node: int,
                        global_rank: int) -> tuple[str, ParallelLayout, Optional[Heartbeat]]:
    """(the backend used, the one layout of this process with its groups created, the heartbeat or None alone)."""
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    engines.preload()  # while the other ranks start: the rendezvous below waits for them anyway
    _init_dist_connection(cluster_environment, backend, timeout=timeout)
    layout = request.build(cluster_environment.world_size(), devices_per_node=devices_per_node)
    layout.init_groups(global_rank, timeout=timeout)
    engines.init_engine_comm(timeout)
    return backend, layout, Heartbeat.for_default_group() if layout.world_size > 1 else None
