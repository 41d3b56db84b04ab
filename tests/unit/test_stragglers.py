"""The straggler report and the chaos setting's rule, without processes."""

from lightning_mgpu.resilience.stragglers import StepClock, slow_rank_problems, straggler_report


def test_the_report_names_the_slow_rank_against_the_others():
    assert straggler_report([0.1, 0.1, 0.21, 0.1]).startswith("straggler report: straggler: rank 2 is busy 0.210")
    assert "2.10x the median 0.100 s of the other 3 ranks" in straggler_report([0.1, 0.1, 0.21, 0.1])
    assert straggler_report([0.1, 0.11, 0.1]).startswith("straggler report: no straggler: rank 1")


def test_a_slowed_clock_sleeps_its_factor():
    import time

    clock = StepClock(slowdown=3.0)
    clock.start()
    time.sleep(0.02)
    began = time.perf_counter()
    clock.before_step()
    slept = time.perf_counter() - began
    clock.after_step()
    assert 0.035 < slept < 0.2 and clock.busy[0] >= 0.06  # 2 x its 20 ms of work, then counted 3 x


def test_slow_ranks_must_be_ranks_with_a_factor_of_at_least_one():
    problems = [str(p) for p in slow_rank_problems({1: 0.5, 9: 2.0, -1: 2.0}, world_size=4)]
    assert len(problems) == 3, problems
    assert any("slow_ranks={1: 0.5}" in p and "factor >= 1" in p for p in problems), problems
    assert any("slow_ranks=9" in p and "ranks 0 to 3" in p for p in problems), problems
    assert slow_rank_problems({1: 2.0}, world_size=2) == []
