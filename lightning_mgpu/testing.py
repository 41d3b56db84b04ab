"""Launch a function on N local processes by fork, with torch.distributed's environment set.

Forking from a parent that has already imported torch, Lightning and DeepSpeed costs ~0.1-0.3 s per
launch, against 6-20 s for torchrun or spawn (FIELD-NOTES), which is what makes a multi-process test
suite affordable on two cores. Used by the tests and the benchmarks. Also the fault injection that ``mgpu-train``
adds when its environment variables are set (killed, hung and failing ranks, a job killed at chosen moments).

A forked child deadlocks in its first matmul if the parent had already started an OpenMP thread
pool, so a parent should call ``torch.set_num_threads(1)`` before any tensor work (the test suite's
``conftest.py`` does); each child runs single-threaded as well.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

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
                               seq_len: int = 16, global_batch: int = 4) -> dict:
    """Train ``LLMModule(config)`` for one step on ``devices`` CPU processes (``run_distributed``) and report this
    rank's resident memory: its import baseline (after torch, Lightning and DeepSpeed are loaded, before the model
    exists), its peak during setup (the model built, split, materialised and the engine created) and its peak during the
    first step, with the setup time and where the rank sits in the layout."""
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

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**layout), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Peaks()])
    data = TokenFileDataModule(token_file, seq_len=seq_len, global_batch_size=global_batch, micro_batch_size=1, seed=0)
    module = LLMModule(config, lr=1e-4, warmup_steps=0, max_steps=1)
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


#: Fault injection for tests, read by ``mgpu-train`` (see :func:`fault_callbacks`). ``<rank>:<step>``: that rank, as
#: optimizer step ``step`` begins, SIGKILLs itself (``kill``: its sockets close at once), SIGSTOPs itself (``stop``: it
#: hangs with its sockets open), or raises :class:`InjectedFault` inside that step's backward pass (``raise``); the
#: last two first print ``MGPU fault: ... at time <unix time>`` on stderr.
RANK_FAULTS = {"MGPU_KILL_RANK_AT": "kill", "MGPU_STOP_RANK_AT": "stop", "MGPU_RAISE_RANK_AT": "raise"}
#: ``MGPU_KILL_AT=<point>:<step>``: rank 0 SIGKILLs the whole job (its process group) at that point of that step.
KILL_JOB_VARIABLE = "MGPU_KILL_AT"
#: The points of ``MGPU_KILL_AT``, each with the step it counts (``trainer.global_step`` there).
KILL_POINTS = {
    "backward": "inside the backward pass of the step that starts at step",
    "step": "after the optimizer step that ends at step",
    "trained": "after a step that ends at a checkpoint step, before its save",
    "torn": "while writing the checkpoint of step: rank 0's first whole file half written",
    "saving": "checkpoint of step written by every rank, not yet published",
    "published": "checkpoint of step published, older ones not yet deleted",
    "resume": "while restoring the checkpoint of step (read, not yet applied to the trainer)",
}


class InjectedFault(RuntimeError):
    """The exception ``MGPU_RAISE_RANK_AT`` raises."""


def _spec(name: str, value: str, first: str, example: str, problems: list[str]) -> Optional[tuple[str, int]]:
    parts = value.split(":")
    if len(parts) != 2 or not parts[1].isdigit() or (first == "rank" and not parts[0].isdigit()):
        problems.append(f"{name}={value!r} must be <{first}>:<step>, e.g. {name}={example}")
        return None
    return parts[0], int(parts[1])


def _say(message: str) -> None:
    print(f"MGPU fault: {message}", file=sys.stderr, flush=True)


def kill_job_at(point: str, step: int, rank: int) -> None:
    """A fault point: SIGKILL the whole job when ``MGPU_KILL_AT`` is ``<point>:<step>`` and this is rank 0."""
    if rank == 0 and os.environ.get(KILL_JOB_VARIABLE) == f"{point}:{step}":
        _kill_job(f"{point}:{step}")


def _kill_job(where: str) -> None:
    _say(f"rank 0 kills the job (SIGKILL to its process group) at {where}")
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _in_backward(model: torch.nn.Module, action: Callable[[], None]) -> None:
    """Run ``action`` once, inside the next backward pass: from the gradient hook of the first trainable parameter
    (the embedding's gradient comes last, so most of the backward pass has run by then)."""
    param = next(p for p in model.parameters() if p.requires_grad)
    handles = []

    def hook(grad: torch.Tensor) -> None:
        handles[0].remove()
        action()

    handles.append(param.register_hook(hook))


def _tear_next_file(where: str) -> None:
    """Make this process's next ``torch.save`` to a path write half of its bytes, then kill the job."""
    import io

    save = torch.save

    def torn_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(f, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.fsync(out.fileno())
        _kill_job(f"{where} ({Path(f).name}: {len(data) // 2} of {len(data)} bytes written)")

    torch.save = torn_save


def fault_callbacks(environ: Optional[Mapping[str, str]] = None) -> list:
    """The Lightning callbacks that inject the faults the environment asks for (none when no variable is set)."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    rank_faults = {}
    for name, action in RANK_FAULTS.items():
        if name in environ and (spec := _spec(name, environ[name], "rank", "1:3", problems)):
            rank_faults[(int(spec[0]), spec[1])] = action
    kill_job = None
    if KILL_JOB_VARIABLE in environ:
        kill_job = _spec(KILL_JOB_VARIABLE, environ[KILL_JOB_VARIABLE], "point", "torn:4", problems)
        if kill_job and kill_job[0] not in KILL_POINTS:
            problems.append(f"{KILL_JOB_VARIABLE}={environ[KILL_JOB_VARIABLE]!r}: point {kill_job[0]!r} is unknown; "
                            f"choose one of {', '.join(KILL_POINTS)}")
    if problems:
        raise ValueError("Invalid fault injection:\n" + "\n".join(f"  - {p}" for p in problems))
    if not rank_faults and kill_job is None:
        return []
    return [_fault_injection(rank_faults, kill_job)]


def _fault_injection(rank_faults: dict[tuple[int, int], str], kill_job: Optional[tuple[str, int]]):
    import lightning as L

    class FaultInjection(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            rank, step = trainer.global_rank, trainer.global_step
            action = rank_faults.get((rank, step))
            if action == "kill":
                _say(f"rank {rank} kills itself (SIGKILL) at step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "stop":
                _say(f"rank {rank} stops (SIGSTOP) at step {step} at time {time.time():.3f}")
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action == "raise":
                def fail() -> None:
                    where = f"in the backward pass of step {step}"
                    _say(f"rank {rank} raises InjectedFault {where} at time {time.time():.3f}")
                    raise InjectedFault(f"injected on rank {rank} {where}")

                _in_backward(trainer.strategy.model, fail)
            if kill_job == ("backward", step) and rank == 0:
                _in_backward(trainer.strategy.model, lambda: _kill_job(f"backward:{step} (inside the backward pass)"))

        def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
            if kill_job == ("torn", trainer.global_step) and trainer.global_rank == 0:
                _tear_next_file(f"torn:{trainer.global_step}")

        def on_load_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
            kill_job_at("resume", checkpoint["global_step"], trainer.global_rank)

    return FaultInjection()
