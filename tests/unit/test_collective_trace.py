"""Where ranks part in their collectives, from their Flight Recorder places, without processes; and the report of
a rank that is alive but has not entered the collective the others wait in."""

import json
import time

import pytest

from lightning_mgpu.resilience import collective_trace
from lightning_mgpu.resilience.collective_trace import divergence
from lightning_mgpu.resilience.liveness import Heartbeat, LostRankError, name_lost_ranks

MINE = {"groups": {"0": [22, "gloo:all_reduce"], "8": [36, "gloo:all_reduce"]}, "waiting": "8"}


def test_the_rank_behind_and_the_rank_with_another_op_are_named():
    behind = {"groups": {"0": [22, "gloo:all_reduce"], "8": [35, "gloo:all_gather"]}}
    other_op = {"groups": {"8": [36, "gloo:broadcast"]}}
    text, lagging = divergence(0, MINE, {1: behind, 2: other_op, 3: {"groups": {}}, 4: MINE})
    assert lagging == [1, 3]
    assert ("rank 1 has not entered collective #36 (gloo:all_reduce) of process group 8, which rank 0 waits in (its "
            "heartbeat, every 0.5 s, last saw it at #35 (gloo:all_gather) there)") in text
    assert "ranks 0 and 2 diverged at collective #36 of process group 8: gloo:all_reduce on rank 0, gloo:broadcast " \
           "on rank 2" in text
    assert "rank 3 has not entered collective #36" in text and "saw no collective of that group yet" in text
    assert "rank 4" not in text  # at the same place: not named
    assert divergence(0, MINE, {1: MINE}) == (None, [])
    assert divergence(0, {"groups": {}, "waiting": None}, {1: MINE}) == (None, [])


def test_a_live_rank_that_did_not_enter_the_collective_is_named(monkeypatch, tmp_path, tcp_store):
    """Both heartbeats fresh (a rank spinning outside collectives, or one that skipped a collective): the failed
    collective is still reported, naming the rank behind and pointing to this rank's trace and stacks."""
    store = tcp_store
    monkeypatch.setattr(collective_trace, "place", lambda: MINE)
    monkeypatch.setattr(collective_trace, "_dump", lambda: {"entries": []})
    survivor, peer = Heartbeat(store, 0, 2).start(), Heartbeat(store, 1, 2).start()
    survivor.report_dir = tmp_path
    timed_out = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms")
    try:
        peer.stop()
        store.set("mgpu/at/1", json.dumps({"groups": {"8": [35, "gloo:all_reduce"]}, "waiting": "8"}))
        store.set("mgpu/heartbeat/1", repr(time.time() + 60))  # fresh for the whole check
        with pytest.raises(LostRankError, match=r"^every rank is alive \(fresh heartbeats\), while rank 0 waited: "
                                                r"the job cannot continue\. Where: rank 1 has not entered collective "
                                                r"#36 \(gloo:all_reduce\) of process group 8"), name_lost_ranks(survivor):
            raise timed_out
        stacks = (tmp_path / "hang-rank0-stacks.txt").read_text()  # every thread: this one and the heartbeat's
        assert "Current thread 0x" in stacks and "Thread 0x" in stacks and "_run" in stacks
    finally:
        survivor.stop()


def test_the_watchdog_of_a_rank_without_progress_writes_its_stacks_and_is_quoted(monkeypatch, tmp_path,
                                                                                    tcp_store):
    """Rank 1 makes no step for longer than its stall time while its heartbeat is fresh (it spins): its watchdog
    writes rank 1's trace and stacks and says so in the store; rank 0's error names rank 1 as behind, quotes the
    watchdog and points to rank 1's files. A step after it withdraws the word; a paused watchdog says nothing."""
    from lightning_mgpu.resilience.watchdog import StepWatchdog, stalled_ranks

    store = tcp_store
    monkeypatch.setattr(collective_trace, "place", lambda: MINE)
    monkeypatch.setattr(collective_trace, "_dump", lambda: {"entries": []})
    survivor = Heartbeat(store, 0, 2).start()
    quiet = StepWatchdog(store, 0, 0.2, tmp_path)
    quiet.pause()  # rank 0 is "validating": nothing said however long it takes
    spinning = StepWatchdog(store, 1, 0.2, tmp_path)
    try:
        store.set("mgpu/at/1", json.dumps({"groups": {"8": [35, "gloo:all_reduce"]}, "waiting": "8"}))
        store.set("mgpu/heartbeat/1", repr(time.time() + 60))
        time.sleep(1.2)
        assert (tmp_path / "stall-rank1-stacks.txt").is_file() and not (tmp_path / "stall-rank0-stacks.txt").exists()
        with pytest.raises(LostRankError, match=r"Rank 1 has made no training progress for \d+ s while its heartbeat "
                                                r"went on: it is busy outside any collective .* its stacks show "
                                                r"where: .*stall-rank1-stacks\.txt"):
            with name_lost_ranks(survivor):
                raise RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting")
        assert list(stalled_ranks(store, [0, 1])) == [1]
        spinning.beat()
        assert stalled_ranks(store, [1]) == {}
    finally:
        quiet.stop(), spinning.stop(), survivor.stop()
