"""Launch a function on N local processes by fork, with torch.distributed's environment set.

Forking from a parent that has already imported torch, Lightning and DeepSpeed costs ~0.1-0.3 s per
launch, against 6-20 s for torchrun or spawn (FIELD-NOTES), which is what makes a multi-process test
suite affordable on two cores. Used by the tests and the benchmarks.

A forked child deadlocks in its first matmul if the parent had already started an OpenMP thread
pool, so a parent should call ``torch.set_num_threads(1)`` before any tensor work (the test suite's
``conftest.py`` does); each child runs single-threaded as well.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, timeout: float, args: tuple,
           kwargs: dict) -> None:
    # A hung child prints where every thread is, then exits, instead of hanging silently.
    faulthandler.dump_traceback_later(max(1.0, timeout - 5.0), exit=True)
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "NODE_RANK": "0", "GROUP_RANK": "0", "GLOO_SOCKET_IFNAME": "lo"})
    result = fn(rank, *args, **kwargs)
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` forked processes; return each rank's result.

    The environment variables of ``torch.distributed``'s env:// rendezvous (and Lightning's "processes
    created externally" mode) are set in each child. A child's exception is re-raised here with its
    traceback; a run longer than ``timeout`` seconds is killed and raises ``TimeoutError``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_child, args=(fn, world_size, free_port(), out_dir, timeout, args, kwargs),
                                 nprocs=world_size, join=False, start_method="fork")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} processes did not finish "
                                       f"within {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]


def live_tensor_bytes(*modules: "torch.nn.Module") -> int:
    """Bytes of every tensor storage alive in this process, each storage counted once.

    Tensors are found through the garbage collector, plus the ``.grad`` of the given modules' parameters:
    a gradient that only autograd holds has no Python object for the collector to find.
    """
    import gc

    gc.collect()
    tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    tensors += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    seen, total = set(), 0
    for tensor in tensors:
        try:
            if tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
        except Exception:  # tensor subclasses without a storage
            continue
        if storage.data_ptr() not in seen and storage.nbytes() > 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class KillRankAt:
    """Fault injection (``MGPU_KILL_RANK_AT=<rank>:<step>``): that rank SIGKILLs itself as optimizer step ``step``
    begins, so its peers meet a lost rank mid-step. A Lightning callback; mgpu-train adds it when the variable is set."""

    def __new__(cls, spec: str):
        import signal

        import lightning as L

        rank, step = (int(x) for x in spec.split(":"))

        class _KillRankAt(L.Callback):
            def on_train_batch_start(self, trainer, *args) -> None:
                if trainer.global_rank == rank and trainer.global_step == step:
                    os.kill(os.getpid(), signal.SIGKILL)

        return _KillRankAt()
