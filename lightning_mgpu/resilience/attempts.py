"""One name for one attempt of a torchrun job, agreed by all its ranks through the agent's store.

torchrun (from torch 2.4) keeps one store across restarts and lets the ranks use it (``TORCHELASTIC_USE_AGENT_STORE``),
so a restarted rank can read the addresses the failed attempt's ranks left there and hang connecting to them (3 of 4
restarts tried here with torch 2.13 failed so: ``connectFullMesh ... Connection refused``). Each attempt needs keys of
its own. ``TORCHELASTIC_RESTART_COUNT`` cannot name it: on a job of several nodes, the agent whose rank failed counts a
restart, but an agent whose ranks were still healthy restarts them for the new rendezvous round as a membership change,
which torch does not count, so the two nodes' ranks read different counts (seen here with two torchrun "nodes": rank 1
restarted with count 1, rank 0 with 0, and the job hung). Nothing the agent hands its ranks names the round, so rank 0
makes a fresh name, with the attempt's number (how many attempts of the job reached this point before it, counted in
the store), and hands both to every other rank of its own attempt:

1. every other rank appends a fresh nonce to ``mgpu/hellos`` and waits for the key ``mgpu/attempt_for/<nonce>``, which
   only rank 0 of the same attempt can write (the nonce did not exist before);
2. rank 0 answers every nonce in that list with its attempt's name (a failed attempt's nonces too: nobody waits for
   those), until as many ranks as the world has, less itself, have counted themselves in under that name, then empties
   the list.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

HELLOS, ATTEMPTS = "mgpu/hellos", "mgpu/attempts"
#: How often rank 0 reads the list of nonces (one request to the store each time).
POLL_S = 0.01


def agree_on_attempt(store: Any, rank: int, world_size: int, timeout: timedelta) -> tuple[int, str]:
    """(this attempt's number, 0 first; its name): the same on every rank of it, the name new for each attempt.
    ``store``: the agent's store, shared by every attempt of the job."""
    if rank != 0:
        number, _, name = _ask(store, timeout).partition(":")
        return int(number), name
    answer = f"{store.add(ATTEMPTS, 1) - 1}:{uuid.uuid4().hex}"
    if world_size > 1:
        _answer(store, answer, world_size, timeout)
    number, _, name = answer.partition(":")
    return int(number), name


def _ask(store: Any, timeout: timedelta) -> str:
    nonce = uuid.uuid4().hex
    store.append(HELLOS, f"{nonce},")
    key = f"mgpu/attempt_for/{nonce}"
    store.wait([key], timeout)
    attempt = store.get(key).decode()
    store.add(f"mgpu/attempt/{attempt}/joined", 1)
    return attempt


def _answer(store: Any, attempt: str, world_size: int, timeout: timedelta) -> None:
    answered: set[str] = set()
    joined = f"mgpu/attempt/{attempt}/joined"
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(joined, 0) < world_size - 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add(joined, 0)} of the {world_size - 1} other ranks of this attempt asked "
                               f"for its name within {timeout}: a rank did not start, or does not reach the store")
        nonces = store.get(HELLOS).decode().split(",") if store.check([HELLOS]) else []
        for nonce in set(nonces) - answered - {""}:
            store.set(f"mgpu/attempt_for/{nonce}", attempt)
            answered.add(nonce)
        time.sleep(POLL_S)
    # every rank of this attempt has its answer: what is left in the list is a failed attempt's
    store.delete_key(HELLOS)
