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
