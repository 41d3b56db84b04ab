"""The lost time of a restarted job split from its records (``lightning_mgpu.resilience.lost_time``), on records written
here by hand, each bucket worked out by hand below, without processes."""

import json

import pytest

from lightning_mgpu.resilience.lost_time import Job, gaps, lost_time
from lightning_mgpu.resilience.restarts import read_step_log

EVERY = 4  # a periodic checkpoint after steps 4, 8, ...: its blocking part lands in steps 5, 9, ...


def reference() -> Job:
    """Uninterrupted: set-up until step 1 ends at 10 s; steps of 1 s but step 5 (after step 4's save) of 1.5 s; the
    last save and exit 2.5 s after step 8. Median step 1 s; its save steps are 0.5 s beyond it."""
    ends = [10, 11, 12, 13, 14.5, 15.5, 16.5, 17.5]
    return Job(0.0, 20.0, {0: list(zip(range(1, 9), ends))})


def killed() -> Job:
    """The same job, SIGKILLed 0.3 s after step 6 ended (at 15.8 s); the agent saw it at 15.9 s; the next attempt
    began 0.1 s later and took 0.3 s to build, 0.2 s to its process group, 0.4 s to its engine and 0.3 s to restore
    step 4's checkpoint; steps 5 and 6 again, its first step 1.5 s, then steps of 1 s; the same end."""
    restart = {"attempt": 2, "resumed_at": 4, "lost_steps": 2, "forked": 16.0, "built": 16.3, "grouped": 16.5,
               "set_up": 16.9, "restored": 17.2, "stepped": 18.7}
    steps = {0: [(1, 10), (2, 11), (3, 12), (4, 13), (5, 14.5), (6, 15.5)],
             1: [(5, 18.7), (6, 19.7), (7, 20.7), (8, 21.7)]}
    return Job(0.0, 24.2, steps, [restart], [{"attempt": 1, "ended": 15.9, "status": 137}], [(15.8, "SIGKILL")])


def test_every_second_of_a_killed_run_is_named():
    """Lost 24.2 - 20 = 4.2 s: the restart's gap from step 6's end (15.5) to the restore (17.2) is 1.7 s (0.3 cut
    short, 0.1 noticed, 0.1 stop and fork, 0.3 build, 0.2 process group, 0.4 engine, 0.3 restore); 2 steps more than
    the reference at its 1 s median; the first 3 steps after the restore 0.5 s beyond it (1.5, 1, 1); the save step
    of attempt 0 is the reference's own (nothing beyond), and so are the rest; nothing left for start and end."""
    buckets = lost_time(killed(), reference(), EVERY, first=3)
    want = {"step cut short": 0.3, "noticed": 0.1, "stop and fork": 0.1, "build": 0.3, "process group": 0.2,
            "engine": 0.4, "restore": 0.3, "re-trained steps": 2.0, "first steps": 0.5}
    assert buckets == pytest.approx({name: want.get(name, 0.0) for name in buckets}, abs=1e-9)
    assert sum(buckets.values()) == pytest.approx(24.2 - 20.0)


def test_slower_steps_and_a_longer_end_are_the_machines():
    """Every step of the killed run 0.1 s slower outside its first steps and its save steps (attempt 0's steps 2-4 and
    6, attempt 1's step 8: 5 steps) and its exit 0.4 s later: other steps +0.5 s, start and end +0.4 s, and the
    restart's buckets as before (the gap is the same 1.7 s)."""
    job = killed()
    shift = {2: 0.1, 3: 0.2, 4: 0.3, 5: 0.3, 6: 0.4}
    job.steps[0] = [(s, t + shift.get(s, 0.0)) for s, t in job.steps[0]]
    job.faults, job.attempts = [(16.2, "SIGKILL")], [{"attempt": 1, "ended": 16.3, "status": 137}]
    for key in ("forked", "built", "grouped", "set_up", "restored", "stepped"):
        job.restarts[0][key] += 0.4
    job.steps[1] = [(s, t + 0.4 + (0.1 if s == 8 else 0.0)) for s, t in job.steps[1]]
    job.ended = 24.2 + 0.5 + 0.4
    buckets = lost_time(job, reference(), EVERY, first=3)
    assert buckets["other steps"] == pytest.approx(0.5)
    assert buckets["start and end"] == pytest.approx(0.4)
    assert buckets["restore"] == pytest.approx(0.3) and buckets["step cut short"] == pytest.approx(0.3)
    assert buckets["periodic saves"] == pytest.approx(0.0) and buckets["first steps"] == pytest.approx(0.5)


def test_the_steps_after_a_restores_first_ones_are_compared_across_attempts():
    """Attempt 0's other steps (2, 3, 4 and 6; step 5 holds a save) take 1 s each; attempt 1's one other step (8, after
    its first 3) is made 0.6 s slower: 1.6 s. Without restarted attempts, or without their other steps: None."""
    job = killed()
    job.steps[1][-1] = (8, 22.3)
    assert job.other_step_means(EVERY, first=3) == pytest.approx({"first attempt": 1.0, "restarted attempts": 1.6})
    assert reference().other_step_means(EVERY, first=3) == {"first attempt": 1.0, "restarted attempts": None}
    assert killed().other_step_means(EVERY, first=4)["restarted attempts"] is None


def test_a_preemption_then_an_attempt_that_never_stepped():
    """SIGTERM at 11.6 s: step 3 ends at 12 s and the emergency checkpoint and exit take until the agent sees the
    attempt end with 75 at 12.6 s; the next attempt fails before stepping (seen at 13.5 s); the one after it began at
    13.7 s and restored at 14.5 s."""
    restart = {"attempt": 2, "resumed_at": 3, "lost_steps": 0, "forked": 13.7, "built": 14.0, "grouped": 14.1,
               "set_up": 14.3, "restored": 14.5, "stepped": 15.5}
    job = Job(0.0, 30.0, {0: [(1, 10), (2, 11), (3, 12)], 1: [(4, 15.5)]}, [restart],
              [{"attempt": 1, "ended": 12.6, "status": 75}, {"attempt": 2, "ended": 13.5, "status": 1}],
              [(11.6, "SIGTERM"), (13.4, "SIGKILL")])
    [gap] = gaps(job)
    assert gap == pytest.approx({"emergency checkpoint": 0.6, "failed attempts": 0.9, "stop and fork": 0.2,
                                 "build": 0.3, "process group": 0.1, "engine": 0.2, "restore": 0.2})


def test_the_records_read_back_from_a_run_directory(tmp_path):
    """``Job.read`` reads the step log (a line cut short by a SIGKILL left out), the restarts and the agent's record."""
    (tmp_path / "steps.csv").write_text("0,1,10.0\n0,2,11.0\n1,3,14.0\n1,4")
    (tmp_path / "restarts.jsonl").write_text(json.dumps({"attempt": 2, "restored": 13.0}) + "\n")
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"attempt": 1, "ended": 12.0, "status": 137}) + "\n")
    job = Job.read(tmp_path, 0.0, 16.0, [(11.5, "SIGKILL")])
    assert read_step_log(tmp_path) == {0: [(1, 10.0), (2, 11.0)], 1: [(3, 14.0)]}
    assert job.restarts == [{"attempt": 2, "restored": 13.0}] and job.attempts[0]["status"] == 137
    assert job.faults == [(11.5, "SIGKILL")]


def test_steps_are_measured_against_the_mean_step_not_the_median():
    """Skewed steps, as on shared cores: the reference's steps without a checkpoint take 1, 1, 2, 1, 1, 2 s (median 1,
    mean 4/3); a restart whose first 3 steps take the same 1, 1, 2 s cost nothing beyond them (against the median they
    would be 1 s slow), and its 2 re-trained steps cost 2 x 4/3 s."""
    ends = [10, 11, 12, 14, 15.5, 16.5, 17.5, 19.5]  # step 5 carries step 4's save (1.5 s)
    reference = Job(0.0, 22.0, {0: list(zip(range(1, 9), ends))})
    restart = {"attempt": 2, "resumed_at": 4, "lost_steps": 2, "forked": 17.6, "built": 17.7, "grouped": 17.8,
               "set_up": 17.9, "restored": 18.0, "stepped": 19.0}
    steps = {0: [(s, t) for s, t in zip(range(1, 7), ends)], 1: [(5, 19.0), (6, 20.0), (7, 22.0), (8, 24.0)]}
    job = Job(0.0, 26.5, steps, [restart], [{"attempt": 1, "ended": 17.6, "status": 137}], [(17.5, "SIGKILL")])
    buckets = lost_time(job, reference, EVERY, first=3)
    assert buckets["first steps"] == pytest.approx(0.0)
    assert buckets["re-trained steps"] == pytest.approx(2 * 4 / 3)
    assert sum(buckets.values()) == pytest.approx(26.5 - 22.0)
