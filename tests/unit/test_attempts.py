"""The ranks of one torchrun attempt agree on its number and a name of its own through the store torchrun keeps across
attempts (``lightning_mgpu.resilience.attempts``), whatever the previous attempts left there and in whichever order
the ranks arrive; ``tests/cli/test_launch.py`` restarts two torchrun "nodes" whose restart counts differ."""

import time
from datetime import timedelta

import torch.distributed as dist

from lightning_mgpu.resilience.attempts import HELLOS, agree_on_attempt
from lightning_mgpu.testing import free_port, run_distributed

#: The rank that arrives last at each attempt (after the others asked, or answered).
LATE = [0, 2, 1]
#: A failed attempt whose rank 0 died before it emptied the list: two questions nobody will ask again.
STALE = "0123456789abcdef0123456789abcdef,fedcba9876543210fedcba9876543210,"


def _all_here(store: dist.Store, name: str) -> None:
    if store.add(name, 1) == 4:
        store.set(f"{name}/all", "1")
    store.wait([f"{name}/all"])


def _three_attempts(rank: int, port: int) -> object:
    """Ranks 0-2 are a job's ranks, started three times; rank 3 serves the store, as torchrun's agent does (created
    after the fork, in the process that serves it: nothing forks while it serves)."""
    store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 3, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    agreed = []
    for attempt, late in enumerate(LATE):
        if rank < 3:
            if rank == late:
                time.sleep(0.3)
            agreed.append(agree_on_attempt(store, rank, 3, timedelta(seconds=60)))
        _all_here(store, f"after{attempt}")
        if attempt == 0 and rank == 3:
            store.append(HELLOS, STALE)
        _all_here(store, f"ready{attempt}")
    if rank < 3:
        store.add("gone", 1)  # this rank's last word to the store
        return agreed
    # The store dies with this process: it serves until every job rank has stopped asking (the last of them may still
    # be waiting on "ready2/all" when this rank's own wait returns).
    while store.add("gone", 0) < 3:
        time.sleep(0.01)
    return store.check([HELLOS])


def test_every_attempt_gets_one_number_and_a_new_name_whatever_the_last_one_left():
    *ranks, list_left = run_distributed(_three_attempts, 4, free_port(), timeout=120)
    for number in range(3):
        assert [agreed[number][0] for agreed in ranks] == [number] * 3
        assert len({agreed[number][1] for agreed in ranks}) == 1
    assert len({agreed[1] for agreed in ranks[0]}) == 3  # a new name each attempt
    assert list_left is False  # each attempt's rank 0 emptied the list once every rank had its answer


def test_a_restarted_attempt_skips_the_sanity_check_its_first_attempt_ran(monkeypatch, tmp_path):
    """Decided when fit starts, after the ranks agreed on the attempt's number (it replaced the node's restart count),
    not when the Trainer was built."""
    from types import SimpleNamespace

    from lightning_mgpu.resilience.restarts import RESTART_COUNT, RestartRecord

    for count, steps in (("0", 2), ("1", 0), ("3", 0)):
        trainer = SimpleNamespace(num_sanity_val_steps=2)
        monkeypatch.setenv(RESTART_COUNT, count)
        RestartRecord(tmp_path).on_fit_start(trainer, None)
        assert trainer.num_sanity_val_steps == steps, count
