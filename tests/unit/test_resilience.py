"""The arithmetic of failure handling: any single flipped bit changes a parameter's fingerprint, the ranks outside a
parameter's majority are the ones named (all holders when there is none), the batches a step drew, and the spike
rule."""

from collections import deque

import torch

from lightning_mgpu.resilience.fingerprint import Corruption, fingerprints, host_verdict, odd_ranks
from lightning_mgpu.resilience.rollback import batches_of_step
from lightning_mgpu.resilience.step_guard import SpikeRule


def test_every_single_bit_flip_changes_the_fingerprint():
    for dtype, width in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        weight = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
        clean = fingerprints([weight])
        bits = 8 * weight.element_size()
        for element in (0, 7, 14):
            for bit in range(bits):
                flipped = weight.clone()
                view = flipped.view(width).view(-1)
                view[element] ^= (1 << bit) if bit < bits - 1 else -(1 << bit)  # the sign bit, as a signed int
                assert not torch.equal(fingerprints([flipped]), clean), (dtype, element, bit)


def test_the_ranks_outside_the_majority_are_named():
    # ranks 4, 5, 6 hold three parameters; rank 5's second differs
    assert odd_ranks([[1, 2, 3], [1, 9, 3], [1, 2, 3]], [4, 5, 6]) == ([5], [1])
    assert odd_ranks([[1, 2], [1, 2]], [0, 1]) == ([], [])
    # two copies: no majority, both named
    assert odd_ranks([[1, 2], [1, 7]], [0, 1]) == ([0, 1], [1])
    # three different copies of one parameter: no majority
    assert odd_ranks([[1], [2], [3]], [0, 1, 2]) == ([0, 1, 2], [0])


def test_a_named_rank_is_told_apart_from_its_host():
    """One device when the named rank's host also runs ranks that agree; the device or its node when it runs alone."""
    two_nodes = ["a", "a", "b", "b"]  # ranks 0-1 on host a, 2-3 on host b
    assert host_verdict([3], two_nodes) == ("rank 3 shares host b with ranks [2], whose copies agree: one device "
                                            "(rank 3's), not the node")
    assert host_verdict([2], ["a", "a", "b"]) == ("rank 2 is the only rank on host b: its device and the rest of "
                                                   "that node cannot be told apart here")
    assert host_verdict([2, 3], two_nodes) == "the ranks named all run on host b, which runs no other rank"
    assert host_verdict([1, 2], ["a", "a", "a", "b"]) == ("the ranks named all run on host a, beside ranks [0] whose "
                                                          "copies agree")
    assert host_verdict([1, 2], two_nodes) == ("the ranks named run on different hosts (a, b): no one node is common "
                                               "to them")
    assert host_verdict([1], []) == ""
    # said in the line every rank logs and kept in the record (sdc-suspect.json, faulty-device.json)
    found = Corruption(4, 2, [3], ["w"], [], two_nodes, persistent=True)
    assert "rank 3 shares host b with ranks [2]" in found.describe() and found.record()["where"].startswith("rank 3 ")


def test_the_batches_a_step_drew():
    # the batches not skipped are 0, 2, 3, 4, 5, 6, ...; two a step: step 0 drew 0 and 2, step 2 the 5th and 6th
    assert batches_of_step(0, 2, frozenset({1})) == [0, 2]
    assert batches_of_step(2, 2, frozenset({1})) == [5, 6]
    assert batches_of_step(3, 1, frozenset()) == [3]
    assert batches_of_step(3, 1, frozenset({0, 3})) == [5]


def test_the_spike_rule_needs_both_sigmas_and_the_rise():
    rule = SpikeRule(window=4, sigmas=6.0, min_history=3, min_rise=0.5)
    flat = deque([2.0, 2.0, 2.0, 2.0])  # std 0: any rise is infinitely many sigmas, but 2.9 is less than 50 % more
    assert rule.spikes(2.9, flat) is None and rule.spikes(3.1, flat) is not None
    noisy = deque([1.0, 3.0, 1.0, 3.0])  # mean 2, std 1: 8.1 is 6.1 sigmas and 305 % above
    assert rule.spikes(7.9, noisy) is None and rule.spikes(8.1, noisy) is not None
    assert rule.spikes(100.0, deque([2.0, 2.0])) is None  # fewer than min_history steps
    assert SpikeRule(window=4, min_history=8).problems() and SpikeRule(sigmas=0).problems()


def test_the_cross_rank_rule_names_a_rank_far_above_the_others_from_the_first_step():
    rule = SpikeRule()  # rank_ratio 10: a rank's loss against the median of the other ranks' losses of the step
    far, why = rule.outliers({0: 2.0, 1: 2000.0})
    assert far == (1,) and "rank(s) [1]" in why and "2000 on rank 1 against 2" in why, why
    assert rule.outliers({0: 2.0, 1: 19.9}) == ((), "")  # 9.95x: inside the rule
    assert rule.outliers({0: 2.0, 1: 2.5, 2: 3.0, 3: 2.2}) == ((), "")
    # tensor-parallel pairs report one loss each: both ranks of the bad pair are named, the median of the others holds
    assert rule.outliers({0: 2.0, 1: 2.0, 2: 2000.0, 3: 2000.0})[0] == (2, 3)
    assert rule.outliers({0: -1.0, 1: 5.0}) == ((), "")  # the others' median is not positive: no ratio
    assert rule.outliers({0: 2.0}) == ((), "")  # one rank has no others
    assert SpikeRule(rank_ratio=None).outliers({0: 2.0, 1: 2000.0}) == ((), "")
    assert SpikeRule(rank_ratio=1.0).problems() and not SpikeRule(rank_ratio=None).problems()


def test_the_fault_matrix_spec_acts_in_the_right_attempt_and_names_every_bad_entry():
    import pytest

    from lightning_mgpu.resilience.faults import fault_callbacks
    from lightning_mgpu.resilience.strikes import planned

    env = {"MGPU_FAULT": "SIGKILL@collective:1:3,raise@restore:0:2"}
    assert planned(env, 0) == {("collective", 1, 3): "SIGKILL"}  # a restore fault waits for the first restart
    assert planned(env, 1) == {("restore", 0, 2): "raise"}
    assert planned(env, 2) == {}
    assert planned({**env, "MGPU_FAULT_ATTEMPTS": "every"}, 2) == {("collective", 1, 3): "SIGKILL",
                                                                    ("restore", 0, 2): "raise"}
    assert len(fault_callbacks(env, attempt=1)) == 1  # the restore fault's callback, in the restarted attempt
    with pytest.raises(ValueError) as refused:
        fault_callbacks({"MGPU_FAULT": "SIGKILL@lunch:1:3,boom@backward:0:1,raise@save:x:1"})
    said = str(refused.value)
    assert all(f"MGPU_FAULT={bad!r}" in said for bad in ("SIGKILL@lunch:1:3", "boom@backward:0:1", "raise@save:x:1"))
    assert "e.g. MGPU_FAULT=SIGKILL@collective:1:3" in said


def test_gradients_are_finite_exactly_when_every_element_is():
    """The step guard's check sums each gradient first: finite elements whose sum overflows fp32 (2 x 3e38) are
    finite, and a NaN or an infinity anywhere, or infinities of both signs whose sum is NaN, are not."""
    from lightning_mgpu.resilience.step_guard import _gradients_finite

    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p, q], lr=0.1)
    p.grad, q.grad = torch.tensor([3e38, 3e38, -1.0, 0.0]), torch.ones(3)
    assert _gradients_finite(optimizer)
    for bad in (float("nan"), float("inf"), -float("inf")):
        q.grad = torch.tensor([1.0, bad, 1.0])
        assert not _gradients_finite(optimizer), bad
    p.grad, q.grad = torch.tensor([float("inf"), -float("inf"), 0.0, 0.0]), torch.ones(3)
    assert not _gradients_finite(optimizer)
