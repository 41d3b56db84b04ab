"""The arithmetic of ``replica_update="async"``'s sharded global weights, in one process: an owner's outer steps,
staleness scaling, finished replicas and what a waiting pull names."""

import torch

from lightning_mgpu.parallel.replica_server import FINAL, SliceOwner, staleness
from lightning_mgpu.parallel.replicas import OuterOptimizer

AVERAGING = OuterOptimizer("sgd", 1.0, 0.0)


def test_an_owner_steps_once_every_replica_pushed_and_scales_stale_pushes():
    w0 = torch.tensor([1.0, 2.0, 3.0])
    owner = SliceOwner(w0.clone(), AVERAGING, replicas=2)
    d_a, d_b, e_a, e_b = (torch.tensor(v) for v in ([0.5, 0.5, 0.5], [0.25, 0.0, 1.0], [1.0, 1.0, 1.0],
                                                      [2.0, 0.0, 4.0]))
    owner.push(1, 0, d_a, replica=0)
    assert owner.version == 0 and owner.pull(1) is None and owner.missing(1) == [1]
    owner.push(1, 0, d_b, replica=1)
    w1 = w0 - (d_a + d_b) / 2
    assert owner.version == 1 and torch.equal(owner.pull(1)[1], w1)
    # round 2: replica 0 started it from version 1 (fresh), replica 1 from version 0 (one outer step stale: halved)
    assert staleness(2, 1) == 0 and staleness(2, 0) == 1
    owner.push(2, 1, e_a, replica=0)
    owner.push(2, 0, e_b, replica=1)
    assert torch.allclose(owner.pull(2)[1], w1 - (e_a + e_b / 2) / 2, atol=0, rtol=1e-7)


def test_a_finished_replica_is_not_waited_for_and_the_final_pull_waits_for_everyone():
    owner = SliceOwner(torch.zeros(2), AVERAGING, replicas=2)
    owner.push(1, 0, torch.ones(2), replica=0)
    owner.push(1, 0, torch.ones(2), replica=1)
    owner.finish(1, last_round=1)  # replica 1 stopped after round 1 (max_time, epochs)
    owner.push(2, 1, torch.full((2,), 3.0), replica=0)  # round 2 has replica 0 alone: its push, not halved
    assert owner.version == 2 and torch.equal(owner.pull(2)[1], torch.full((2,), -4.0))
    assert owner.pull(FINAL) is None and owner.missing(FINAL) == [0]
    owner.finish(0, last_round=2)
    assert owner.pull(FINAL)[0] == 2


class _Done:
    def wait(self) -> None:
        return None


class Loopback:
    """Point-to-point messages inside one process, in order: what a client sends, the server side receives (the
    transport alone stands in for gloo; the client's pushes and the server's answers are the package's own)."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, torch.Tensor]] = []

    def send(self, tensors, dst, tag) -> _Done:
        self.queue.append((tag, tensors[0].clone()))
        return _Done()

    def recv(self, tensors, src, tag) -> _Done:
        sent_tag, tensor = self.queue.pop(0)
        assert sent_tag == tag, (sent_tag, tag)
        tensors[0].copy_(tensor)
        return _Done()


def test_a_clients_stale_push_is_discounted_by_the_owners_it_reaches():
    """The fast replica 0 of 2 pushed round 1, pulled version 0 (a staleness bound of 1 lets it go on) and now pushes
    round 2 from that base: each owner, its own slice's and replica 1's (reached by message), halves that push. Worked
    by hand with averaging (SGD, lr 1): w - (d0 + d1) / 2 after round 1, then - (e0 / 2 + e1) / 2 after round 2."""
    from types import SimpleNamespace

    from lightning_mgpu.parallel.async_replicas import AsyncReplicaSync
    from lightning_mgpu.parallel.replica_server import REQUEST_TAG, _answer

    owners = [SliceOwner(torch.tensor([1.0, 2.0]), AVERAGING, replicas=2) for _ in range(2)]
    link = Loopback()
    client = AsyncReplicaSync.__new__(AsyncReplicaSync)  # replica 0's client side, without an engine or a world
    client.replica, client.owner, client.groups, client.sent_elements = 0, owners[0], SimpleNamespace(requests=link), 0
    d0, d1, e0, e1 = (torch.tensor(v) for v in ([0.5, 1.0], [0.25, 0.0], [2.0, 4.0], [1.0, 3.0]))
    for owner in owners:
        owner.push(1, 0, d0, replica=0)  # replica 0's round 1, from version 0: fresh
    client.rounds, client.base = 2, [0, 0]  # round 2 started from version 0 of both slices: one outer step stale
    for j in range(2):
        client._push(j, e0)
        while link.queue:  # the owner of slice 1 answers the request and takes the payload
            tag, header = link.queue.pop(0)
            assert tag == REQUEST_TAG
            _answer(owners[j], SimpleNamespace(requests=link), 0, header.tolist())
    for owner in owners:  # replica 1 in lockstep: round 1 from version 0, round 2 from version 1
        owner.push(1, 0, d1, replica=1)
        owner.push(2, 1, e1, replica=1)
    expected = torch.tensor([1.0, 2.0]) - (d0 + d1) / 2 - (e0 / 2 + e1) / 2  # [-0.375, -1.0]
    for owner in owners:
        assert owner.version == 2 and torch.allclose(owner.pull(2)[1], expected, atol=0, rtol=1e-7), owner.weights
    assert client.sent_elements == 2  # slice 1 travelled as a message
