"""Starting this process's part of a job: the world process group, the layout's groups over it, the engine's
communication, and the heartbeat that names lost ranks. The strategy calls it once, in ``setup_environment``."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

from lightning_mgpu import engine as engines
from lightning_mgpu.harmless_warnings import quiet_library_warnings
from lightning_mgpu.layout import LayoutRequest, ParallelLayout
from lightning_mgpu.resilience import collective_trace
from lightning_mgpu.resilience.attempts import agree_on_attempt
from lightning_mgpu.resilience.liveness import Heartbeat
from lightning_mgpu.resilience.nccl import apply_nccl_settings
from lightning_mgpu.resilience.restarts import RESTART_COUNT


def attempt_store(timeout: Optional[timedelta]) -> Optional[Any]:
    """Under torchrun, the agent's store seen through a prefix that names this attempt alone: torchrun keeps that
    store across restarts, where a restarted rank could read the failed attempt's gloo addresses, heartbeats and
    failure records (``lightning_mgpu.resilience.attempts`` says how the ranks agree on the name). The attempt's
    number the ranks agreed on replaces ``TORCHELASTIC_RESTART_COUNT`` in this process, which on a job of several
    nodes can differ from node to node (a node whose ranks were healthy restarts them uncounted)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    timeout = timeout or timedelta(minutes=30)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                           is_master=False, timeout=timeout)
    number, name = agree_on_attempt(client, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout)
    os.environ[RESTART_COUNT] = str(number)
    return dist.PrefixStore(f"mgpu/attempt/{name}/", client)


def start_process_group(cluster_environment: Any, root_device: torch.device, backend: Optional[str],
                        timeout: Optional[timedelta], request: LayoutRequest, devices_per_node: int,
                        global_rank: int, report_dir: Optional[str] = None
                        ) -> tuple[str, ParallelLayout, Optional[Heartbeat]]:
    """(the backend used, the one layout of this process with its groups created, the heartbeat or None alone).
    ``report_dir``: where failure reports go (NCCL's Flight Recorder dumps too)."""
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    quiet_library_warnings()  # each rank, before the engine, the loaders and the loop print what it filters
    engines.preload()  # while the other ranks start: the rendezvous below waits for them anyway
    collective_trace.enable()  # before the first group: a hang report names the collective where ranks part
    apply_nccl_settings(backend, Path(report_dir) if report_dir else None)  # survivors name a lost rank on NCCL
    store = attempt_store(timeout)
    _init_dist_connection(cluster_environment, backend, timeout=timeout, **({"store": store} if store else {}))
    layout = request.build(cluster_environment.world_size(), devices_per_node=devices_per_node)
    layout.init_groups(global_rank, timeout=timeout)
    engines.init_engine_comm(timeout)
    return backend, layout, Heartbeat.for_default_group() if layout.world_size > 1 else None
