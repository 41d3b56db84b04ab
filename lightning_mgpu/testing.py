"""Launch a function on N local processes by fork, with torch.distributed's environment set.

Forking from a parent that has already imported torch, Lightning and DeepSpeed costs ~0.1-0.3 s per
launch, against 6-20 s for torchrun or spawn (measured on 2 CPU cores), which is what makes a multi-process test
suite affordable on two cores. Used by the tests and the benchmarks only: nothing under ``lightning_mgpu`` imports
this module (a test checks); the fault injection ``mgpu-train`` ships is ``lightning_mgpu.resilience.faults``.

A forked child deadlocks in its first matmul if the parent had already started an OpenMP thread
pool, so a parent should call ``torch.set_num_threads(1)`` before any tensor work (the test suite's
``conftest.py`` does); each child runs single-threaded as well.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import random
import signal
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


#: Ports :func:`free_port` draws from: below the kernel's ephemeral range (32768-60999 by default), from which it picks
#: the source port of every outgoing connection. A port found free there can be taken by one of the many connections
#: gloo opens between ranks before the server that asked for it binds it (EADDRINUSE, seen with two pytest workers).
PORTS = range(20000, 32000)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 that no outgoing connection will take: drawn at random from :data:`PORTS`, from
    this pytest-xdist worker's share of them (``PYTEST_XDIST_WORKER=gwN``), and checked free by binding it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = len(PORTS) // max(1, workers)
    start = PORTS.start + (int(worker) if worker.isdigit() else 0) % max(1, workers) * share
    for _ in range(100):
        port = random.randrange(start, start + share)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port among 100 tried in [{start}, {start + share})")


def use_free_port_for_lightning() -> None:
    """Lightning picks ``MASTER_PORT`` (when it is not set) from the ephemeral range: make it pick by
    :func:`free_port` in this process and the ones it forks."""
    import lightning.fabric.plugins.environments.lightning as environment

    environment.find_free_network_port = free_port


def _child(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, timeout: float, args: tuple,
           kwargs: dict) -> None:
    # A hung child prints where every thread is, then exits, instead of hanging silently.
    faulthandler.dump_traceback_later(max(1.0, timeout - 5.0), exit=True)
    # A fatal signal's stacks go to a file the parent reads back (stderr holds only their last lines in a long report).
    # enable() alone only changes the file when faulthandler is already on (pytest turns it on), keeping whatever
    # handler a library installed for SIGSEGV since: disable() first, so enable() installs faulthandler's own again.
    # After its dump faulthandler re-raises the signal under the handler it found, which disable() put back: whatever
    # the parent had when faulthandler was last enabled there (a library's Python handler survives a SIGSEGV sent by
    # kill, and the rank goes on). The default disposition first, so a fatal signal always ends the rank.
    faulthandler.disable()
    for name in CRASH_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    faulthandler.enable(open(Path(out_dir, f"{rank}.fatal"), "w"), all_threads=True)
    torch.set_num_threads(1)
    # What the parent made (a test session's heap) stays out of this rank's garbage collections: each full collection
    # would walk all of it, and copy every page it touches out of the memory shared with the parent.
    gc.freeze()
    # What a rank writes relative to its working directory goes into the launch's temporary directory, removed with
    # it: a Trainer's default_root_dir is the working directory, where the survivors of a rank that failed write their
    # hang reports (hang-rank<r>-collectives.json) and a rank that dies leaves its watchdog's stall-rank<r> file.
    os.chdir(out_dir)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "NODE_RANK": "0", "GROUP_RANK": "0", "GLOO_SOCKET_IFNAME": "lo"})
    result = fn(rank, *args, **kwargs)
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


#: Signals a forked rank can die of in a crash of native code, where one more launch is made (see run_distributed).
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL")


class RankCrashed(RuntimeError):
    """A forked rank died of a fatal signal; the message holds its stacks as faulthandler wrote them."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` forked processes; return each rank's result.

    The environment variables of ``torch.distributed``'s env:// rendezvous (and Lightning's "processes
    created externally" mode) are set in each child. A child's exception is re-raised here with its
    traceback; a run longer than ``timeout`` seconds is killed and raises ``TimeoutError``.

    A rank that dies of a fatal signal (:data:`CRASH_SIGNALS`) is reported with its stacks, and the launch is made once
    more, with a warning that carries those stacks: the ranks are forked from a process that has run other work first
    (a test session), whose native state they inherit; a second crash raises :class:`RankCrashed`.
    """
    try:
        return _launch(fn, world_size, args, kwargs, timeout)
    except RankCrashed as crash:
        warnings.warn(f"{crash}\nlaunched {getattr(fn, '__name__', fn)} once more", RuntimeWarning, stacklevel=2)
        return _launch(fn, world_size, args, kwargs, timeout)


def _launch(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_child, args=(fn, world_size, free_port(), out_dir, timeout, args, kwargs),
                                 nprocs=world_size, join=False, start_method="fork")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} processes did not finish "
                                       f"within {timeout:.0f} s")
        except mp.ProcessExitedException as exited:
            if exited.signal_name not in CRASH_SIGNALS:
                raise
            stacks = Path(out_dir, f"{exited.error_index}.fatal").read_text(errors="replace")
            raise RankCrashed(f"rank {exited.error_index} of {getattr(fn, '__name__', fn)} on {world_size} processes "
                              f"died of {exited.signal_name}; its stacks:\n{stacks}") from exited
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]


def saved_tensor_bytes(modules: "list[torch.nn.Module]", run: Callable[[], Any]) -> int:
    """Bytes autograd saves for backward while ``run()`` runs a forward, each storage once, leaving out the given
    modules' parameters and buffers (what activation memory means)."""
    owned = {t.untyped_storage().data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def parallel_saved_bytes(config: Any, layout: Any, dtype: "torch.dtype", batch: "torch.Tensor",
                         depths: tuple[int, ...] = (1, 2)) -> list[int]:
    """Bytes one forward of ``LLMModule``'s loss saves for backward on this rank (:func:`saved_tensor_bytes`), for the
    model ``config`` at each depth of ``depths``, built on the meta device and split by ``parallelize`` over ``layout``
    (its groups initialised) as MGPUStrategy does, with weights and activations in ``dtype``."""
    from dataclasses import replace

    from lightning_mgpu.module import LLMModule
    from lightning_mgpu.parallel.parallelize import parallelize

    out = []
    for n_layers in depths:
        module = LLMModule(replace(config, n_layers=n_layers))
        with torch.device("meta"):
            module.configure_model()
        parallelize(module, layout, torch.device("cpu"))
        module.model.to(dtype).train()
        out.append(saved_tensor_bytes([module.model], lambda: module.loss(batch)))
    return out


def live_tensor_bytes(*modules: "torch.nn.Module") -> int:
    """Bytes of every tensor storage alive in this process, each storage counted once.

    Tensors are found through the garbage collector, plus the ``.grad`` of the given modules' parameters:
    a gradient that only autograd holds has no Python object for the collector to find.
    """
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


def resident_bytes(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or its peak since the last :func:`reset_peak_resident` (``VmHWM``),
    in bytes, from ``/proc/self/status`` (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def reset_peak_resident() -> None:
    """Start a new peak: ``VmHWM`` becomes the current resident memory (Linux ``clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def setup_and_first_step_peaks(rank: int, config: Any, token_file: str, devices: int, layout: dict,
                               seq_len: int = 16, global_batch: int = 4, steps: int = 1) -> dict:
    """Train ``LLMModule(config)`` for ``steps`` steps on ``devices`` CPU processes (``run_distributed``) and report
    this rank's resident memory: its import baseline (after torch, Lightning and DeepSpeed are loaded, before the model
    exists), its peak during setup (the model built, split, materialised and the engine created), its peak during the
    first step and during each step (``"steps"``), with the setup time and where the rank sits in the layout."""
    import lightning as L

    from lightning_mgpu import LLMModule, MGPUStrategy
    from lightning_mgpu.data import TokenFileDataModule
    from lightning_mgpu.engine import preload

    preload()
    baseline = resident_bytes()
    peaks: dict = {}

    class Peaks(L.Callback):
        def on_train_start(self, trainer, module) -> None:
            peaks["setup"], peaks["setup_s"] = resident_bytes("VmHWM"), time.perf_counter() - start
            reset_peak_resident()

        def on_train_batch_end(self, *args) -> None:
            peaks.setdefault("step", resident_bytes("VmHWM"))
            peaks.setdefault("steps", []).append(resident_bytes("VmHWM"))
            reset_peak_resident()

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**layout), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Peaks()])
    data = TokenFileDataModule(token_file, seq_len=seq_len, global_batch_size=global_batch, micro_batch_size=1, seed=0)
    module = LLMModule(config, lr=1e-4, warmup_steps=0, max_steps=steps)
    reset_peak_resident()
    start = time.perf_counter()
    trainer.fit(module, data)
    s = trainer.strategy
    return {"rank": rank, "tp": s.layout.rank("tp"), "pp": s.layout.rank("pp"), "dp": s.layout.rank("dp"),
            "baseline": baseline, "materialized": s.materialized_elements, **peaks}


def rank_memory_bound(config: Any, layout: dict, dp: int, pp_rank: int, baseline: float,
                      precision: str = "32-true") -> dict[str, float]:
    """What one rank of an ``LLMModule(config)`` run under ``layout`` (``MGPUStrategy`` keywords) may hold at its peak:
    1.3 x its steady-state model states (the planner's measured figure) + the model's largest single tensor + the
    process's import baseline; with the bytes of its shard and of the whole model in fp32, to report beside it."""
    import torch

    from lightning_mgpu.models import Llama
    from lightning_mgpu.planner.memory import model_state_bytes
    from lightning_mgpu.planner.model_stats import rank_parameters

    tp, pp = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    shard = rank_parameters(config, tp, pp, 1, pp_rank)
    steady = sum(model_state_bytes(shard, layout.get("zero_stage", 0), dp, precision, pp > 1).values())
    with torch.device("meta"):
        largest = max(p.numel() for p in Llama(config).parameters()) * 4
    return {"shard": shard * 4.0, "steady": steady, "whole": config.num_parameters() * 4.0, "largest": float(largest),
            "bound": 1.3 * steady + largest + baseline}
