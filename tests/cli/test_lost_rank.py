"""A lost rank is reported by the survivor for what it is, through ``mgpu-train`` on two processes: a rank that
raised is named with its exception type and message, at once; a rank that hangs with its sockets open (SIGSTOP)
is named as unresponsive once the collective timeout (``parallel.timeout``) has passed, not before and not much
after. Times are measured from the moment the faulty rank prints (the chaos hook ``lightning_mgpu.resilience.faults``)
to the moment the report reaches this process, so start-up time does not blur them."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import TINY_ARGS
from forked_cli import popen_cli

from lightning_mgpu.resilience.liveness import STALE_S, Heartbeat, LostRankError, name_lost_ranks

BIN = Path(sys.executable).parent
#: The collective timeout of the hung-rank runs. torch.distributed's rendezvous waits for the other rank under the same
#: timeout: 5 s once failed there on two busy cores, when each rank started its own interpreter; the local ranks are
#: now forked from rank 0 with everything imported, and 10 s leaves room for a healthy rank that three test workers'
#: ranks keep off the two cores (the wait costs no CPU).
TIMEOUT_S = 10
#: The latest a report may come after its fault: well inside the 90 s a job is given (a report that waits for that has
#: missed its trigger) and loose enough for cores shared with other tests' ranks, which only delay a report.
REPORT_WITHIN_S = 45


def launch(token_file, tmp_path, name, env, timeout_s):
    """Run a 2-process job with the fault ``env`` asks for; return its exit status (None: still running after 90 s)
    and its output lines (stdout and stderr), each with the time it arrived. The job's whole process group is
    SIGKILLed at the end: a stopped rank would outlive it."""
    proc = popen_cli(
        [str(BIN / "mgpu-train"), "trainer.devices=2", "data=tokens", f"data.path={token_file}", "trainer.max_steps=4",
         f"parallel.timeout={timeout_s}", "throughput.enabled=false", *TINY_ARGS,
         f"hydra.run.dir={tmp_path / name}"],
        cwd=tmp_path, env=dict(os.environ, **env), start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read(stream):
        for line in stream:
            lines.append((time.time(), line))

    readers = [threading.Thread(target=read, args=(stream,), daemon=True) for stream in (proc.stdout, proc.stderr)]
    for reader in readers:
        reader.start()
    try:
        returncode = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        returncode = None  # rank 0 hung: reported by the caller with the output so far
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank, which holds the pipes open
        except ProcessLookupError:
            pass
        for reader in readers:
            reader.join(timeout=10)
    return returncode, sorted(lines, key=lambda x: x[0])


def fault_time(lines, action):
    """The time the faulty rank printed just before its fault."""
    for _, line in lines:
        if m := re.match(rf"MGPU fault: rank 1 {action} .* at time ([\d.]+)", line):
            return float(m.group(1))
    raise AssertionError(f"rank 1 did not report its fault '{action}':\n" + "".join(l for _, l in lines)[-3000:])


def report(lines, text):
    """The time the first line containing ``text`` arrived, and the line."""
    found = [(t, line) for t, line in lines if text in line]
    assert found, f"no line with {text!r} in the output:\n" + "".join(l for _, l in lines)[-3000:]
    return found[0]


def test_hung_rank_is_named_as_unresponsive_after_the_timeout(token_file, tmp_path):
    returncode, lines = launch(token_file, tmp_path, "stopped", {"MGPU_STOP_RANK_AT": "1:2"}, TIMEOUT_S)
    assert returncode is not None, "rank 0 still waited on the stopped rank after 90 s (do the layout's process " \
        "groups have the collective timeout?):\n" + "".join(line for _, line in lines)[-3000:]
    assert returncode != 0
    stopped = fault_time(lines, "stops")
    reported, line = report(lines, "LostRankError: rank 1 of 2 stopped responding")
    # the collective timeout fired, the configured one: the stopped rank's sockets stayed open
    assert "Timed out" in line and f"{TIMEOUT_S * 1000}ms" in line, line
    print(line)
    # the collective it waits in, and the stopped rank's last one, with rank 0's trace and stacks in the run directory
    assert re.search(r"Where: rank 1 has not entered collective #\d+ \(gloo:\w+\) of process group \S+, which rank 0 "
                     r"waits in \(its heartbeat, every 0.5 s, ", line), line
    for name in ("hang-rank0-collectives.json", "hang-rank0-stacks.txt"):
        assert str(tmp_path / "stopped" / name) in line and (tmp_path / "stopped" / name).stat().st_size > 0
    elapsed = reported - stopped
    print(f"stopped at {stopped:.3f}, reported {elapsed:.2f} s later (timeout {TIMEOUT_S} s)")
    # Not before the timeout (a busy machine only delays the report; 1 s for rank 0 having entered the collective just
    # before rank 1 printed), and from the timeout, not from the 90 s the job is given.
    assert TIMEOUT_S - 1 <= elapsed <= REPORT_WITHIN_S, elapsed


def test_rank_that_raised_is_named_with_its_exception(token_file, tmp_path):
    # A long timeout: the report must come from the failed rank's record, not from a collective timing out.
    returncode, lines = launch(token_file, tmp_path, "raised", {"MGPU_RAISE_RANK_AT": "1:2"}, 60)
    assert returncode is not None and returncode != 0
    raised = fault_time(lines, "raises")
    reported, line = report(lines, "LostRankError: rank 1 of 2 failed with")
    assert "failed with InjectedFault: injected on rank 1 in the backward pass of step 2" in line, line
    assert "stopped responding" not in line
    print(f"raised at {raised:.3f}, reported {reported - raised:.2f} s later")
    assert reported - raised < REPORT_WITHIN_S  # inside the 60 s timeout: from the failed rank's record


@pytest.mark.parametrize("fault, action", [("MGPU_SPIN_RANK_AT", "spins"), ("MGPU_SKIP_RANK_AT", "skips")])
def test_a_live_rank_that_spins_or_skipped_a_collective_is_named_where_the_ranks_diverged(token_file, tmp_path,
                                                                                        fault, action):
    """Rank 1 stays alive, its heartbeat fresh: it spins in Python from step 2 on, or it skipped one all-reduce of
    the default group after step 1. After the timeout (well before the job's 90 s), rank 0's error names rank 1, the
    collective and its sequence number where they diverged, and points to rank 0's trace and stacks; a spinning rank's
    own step-progress watchdog writes its stacks, which show the spin, and the error points to them."""
    returncode, lines = launch(token_file, tmp_path, action, {fault: "1:2" if action == "spins" else "1:1"},
                               TIMEOUT_S)
    assert returncode is not None and returncode != 0, "".join(line for _, line in lines)[-3000:]
    faulted = fault_time(lines, action)
    reported, line = report(lines, "LostRankError: every rank is alive (fresh heartbeats), while rank 0 waited")
    assert re.search(r"Where: rank 1 has not entered collective #\d+ \(gloo:\w+\) of process group \S+, which rank 0 "
                     r"waits in", line), line
    run_dir = tmp_path / action
    assert str(run_dir / "hang-rank0-stacks.txt") in line and (run_dir / "hang-rank0-collectives.json").is_file()
    if action == "spins":
        assert "Rank 1 has made no training progress for" in line and str(run_dir / "stall-rank1-stacks.txt") in line
        assert "_spin_forever" in (run_dir / "stall-rank1-stacks.txt").read_text()
    print(f"{action} at {faulted:.3f}, reported {reported - faulted:.2f} s later (timeout {TIMEOUT_S} s)")
    assert reported - faulted <= REPORT_WITHIN_S


def test_only_a_ranks_own_failure_is_recorded_and_a_stopped_stamp_goes_stale(tcp_store):
    """In one process on a real TCPStore: what a survivor reads for each kind of peer loss."""
    store = tcp_store
    survivor, peer = Heartbeat(store, 0, 2).start(), Heartbeat(store, 1, 2).start()
    closed = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    try:
        peer.record_failure(closed)  # a consequence of someone else's failure: not the peer's own
        assert not survivor.lost_peers(wait_s=0)
        asked, lost_peers = [], survivor.lost_peers
        survivor.lost_peers = lambda *a, **kw: asked.append(a) or lost_peers(*a, **kw)  # type: ignore[method-assign]
        with pytest.raises(ValueError, match="bad batch"), name_lost_ranks(survivor):
            raise ValueError("bad batch")  # this rank's own error passes through at once
        # at once: without asking after the peers (which waits up to STALE_S + 1 s for their records to appear)
        assert asked == []
        survivor.lost_peers = lost_peers  # type: ignore[method-assign]
        peer.record_failure(ValueError("bad batch"))
        with pytest.raises(LostRankError, match="^rank 1 of 2 failed with ValueError: bad batch, while rank 0"), \
                name_lost_ranks(survivor):
            raise closed
        store.delete_key("mgpu/failed/1")
        peer.stop()
        time.sleep(STALE_S + 1)
        with pytest.raises(LostRankError, match=r"^rank 1 of 2 stopped responding \(no heartbeat"), \
                name_lost_ranks(survivor):
            raise closed
    finally:
        survivor.stop()
        peer.stop()


def test_a_rank_holding_the_gil_is_named_with_the_stacks_it_wrote_without_it(token_file, tmp_path):
    """Rank 1 sleeps in C code holding the GIL from step 2: its heartbeat and watchdog threads stop with it, so it
    looks dead; faulthandler's timer (a native thread) writes its stacks at half the timeout, and rank 0's error names
    rank 1 and points to them, which show the call that holds the GIL."""
    returncode, lines = launch(token_file, tmp_path, "gil", {"MGPU_GIL_RANK_AT": "1:2"}, TIMEOUT_S)
    assert returncode is not None and returncode != 0, "".join(line for _, line in lines)[-3000:]
    held = fault_time(lines, "holds the GIL")
    reported, line = report(lines, "LostRankError: rank 1 of 2 stopped responding")
    stacks = tmp_path / "gil" / "stall-rank1-native-stacks.txt"
    assert f"Their stacks, written without the GIL when their steps stopped: {stacks}" in line, line
    assert "in hold_the_gil" in stacks.read_text()  # resilience/strikes.py, the call that holds the GIL
    # rank 0's steps stopped too (it waited in the collective for the whole timeout): its stacks show the wait
    assert "hold_the_gil" not in (tmp_path / "gil" / "stall-rank0-native-stacks.txt").read_text()
    print(f"held at {held:.3f}, reported {reported - held:.2f} s later (timeout {TIMEOUT_S} s)")
