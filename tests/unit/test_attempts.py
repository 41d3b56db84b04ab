"""The ranks of one torchrun attempt agree on its number and a name of its own through the store torchrun keeps across
attempts (``lightning_mgpu.resilience.attempts``), whatever the previous attempts left there and in whichever order
the ranks arrive; ``tests/cli/test_launch.py`` restarts two torchrun "nodes" whose restart counts differ."""

import time
from datetime import timedelta

import torch.distributed as dist

from lightning_mgpu.resilience.attempts import HELLOS, agree_on_attempt
from lightning_mgpu.testing import run_distributed


def _agree(rank: int, port: int, late_rank: int) -> tuple[int, str]:
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
    if rank == late_rank:
        time.sleep(0.3)  # the others asked (or answered) before this rank came
    return agree_on_attempt(store, rank, 3, timedelta(seconds=30))


def test_every_attempt_gets_one_number_and_a_new_name_whatever_the_last_one_left(tcp_store):
    port = tcp_store.port
    first = run_distributed(_agree, 3, port, 0)  # rank 0 last: the others' questions wait for it
    # a failed attempt whose rank 0 died before it emptied the list: two questions nobody will ask again
    tcp_store.append(HELLOS, "0123456789abcdef0123456789abcdef,fedcba9876543210fedcba9876543210,")
    second = run_distributed(_agree, 3, port, 2)  # rank 0 first: it answers what it finds, then the late rank
    third = run_distributed(_agree, 3, port, 1)
    for number, results in ((0, first), (1, second), (2, third)):
        assert [n for n, _ in results] == [number] * 3
        assert len({name for _, name in results}) == 1
    assert len({first[0][1], second[0][1], third[0][1]}) == 3
    assert not tcp_store.check([HELLOS])  # each attempt's rank 0 emptied the list once every rank had its answer
