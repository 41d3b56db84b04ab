"""Where each rank is in its collectives, from PyTorch's Flight Recorder: what a hang report names.

The Flight Recorder keeps the last entries of every process group's collectives (``TORCH_FR_BUFFER_SIZE`` of them,
set here before the first group exists); each entry has the group, its sequence number in that group and the op
(``gloo:all_reduce``). On gloo its entries stay ``scheduled`` (no completion is recorded), so a rank's place is the
newest sequence number it has entered. Each rank's heartbeat stamps that place per group in the rendezvous store;
when a collective fails, the surviving rank compares its own place with the others': the rank that has not entered
the collective it waits in (stopped, busy outside collectives, or one that skipped a collective), or that entered
another op under the same number. It also writes its trace and every thread's stack into the run directory.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
from pathlib import Path
from typing import Optional

import torch

#: Entries the Flight Recorder keeps per rank (only the newest of each group are read).
BUFFER_VARIABLE, BUFFER_ENTRIES = "TORCH_FR_BUFFER_SIZE", "64"
#: How often a rank's place is stamped (with its heartbeat, ``lightning_mgpu.resilience.liveness.INTERVAL_S``).
STAMP_S = 0.5


def enable() -> None:
    """Turn the Flight Recorder on for the process groups created after this (a user's own setting wins)."""
    os.environ.setdefault(BUFFER_VARIABLE, BUFFER_ENTRIES)


def _dump() -> dict:
    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True))


def recorded() -> list[dict]:
    """Every operation the Flight Recorder holds for this process, oldest first: its process group's name, op
    (``all_reduce``), elements of its inputs, when it was issued (``time.time_ns()``) and by which thread
    (``threading.get_ident()``). Recorded by the process group itself: whether ``torch.distributed``'s functions, a
    functional collective or the group's own methods issued it."""
    out = [{"group": str(e["process_group"][0]), "op": e["profiling_name"].split(":", 1)[-1],
            "elements": sum(math.prod(size) for size in e.get("input_sizes") or []),
            "created_ns": e["time_created_ns"], "thread": int(e["thread_id"])} for e in _dump().get("entries", [])]
    return sorted(out, key=lambda entry: entry["created_ns"])


def place() -> dict:
    """``{"groups": {group: [sequence number, op]}, "waiting": the group of the newest entry}`` of this rank."""
    groups: dict[str, list] = {}
    newest, waiting = -1, None
    for entry in _dump().get("entries", []):
        group = str(entry["process_group"][0])
        if entry["collective_seq_id"] >= groups.get(group, [-1])[0]:
            groups[group] = [entry["collective_seq_id"], entry["profiling_name"]]
        if entry["time_created_ns"] > newest:
            newest, waiting = entry["time_created_ns"], group
    return {"groups": groups, "waiting": waiting}


def divergence(rank: int, mine: dict, theirs: dict[int, dict]) -> tuple[Optional[str], list[int]]:
    """Where ``rank`` and the others part, in the group ``rank`` waits in: who has not entered its collective, or
    entered another op under the same number (None when nobody is behind or different), and the ranks behind."""
    group = mine.get("waiting")
    if group is None:
        return None, []
    seq, op = mine["groups"][group]
    parts, behind = [], []
    for other, where in sorted(theirs.items()):
        at = where.get("groups", {}).get(group, [0, None])
        if at[0] < seq:
            behind.append(other)
            seen = f"last saw it at #{at[0]} ({at[1]}) there" if at[1] else "saw no collective of that group yet"
            parts.append(f"rank {other} has not entered collective #{seq} ({op}) of process group {group}, which rank "
                         f"{rank} waits in (its heartbeat, every {STAMP_S:g} s, {seen})")
        elif at[0] == seq and at[1] != op:
            parts.append(f"ranks {rank} and {other} diverged at collective #{seq} of process group {group}: {op} on "
                         f"rank {rank}, {at[1]} on rank {other}")
    return "; ".join(parts) or None, behind


def write_report(directory: Path, rank: int, kind: str = "hang") -> list[Path]:
    """This rank's Flight Recorder trace and every thread's stack, into ``directory`` (``kind``: the files' first
    word: ``hang`` from a failed collective, ``stall`` from the step-progress watchdog, which may write at once)."""
    directory.mkdir(parents=True, exist_ok=True)
    trace, stacks = directory / f"{kind}-rank{rank}-collectives.json", directory / f"{kind}-rank{rank}-stacks.txt"
    trace.write_text(json.dumps(_dump(), indent=1, default=str))
    with stacks.open("w") as out:
        faulthandler.dump_traceback(out, all_threads=True)
    return [trace, stacks]
