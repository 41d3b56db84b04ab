"""The pipeline timeline's analysis on a timeline written by hand: the replay with instant messages and the waits
for messages, which the bubble benchmark uses to split a measured bubble's excess over theory."""

import pytest

from lightning_mgpu.parallel.timeline import (Action, bubble_fraction, load_actions, message_waits, replayed_bubble,
                                                save_actions)

LATENCY = 0.5


def one_f_one_b(latency: float) -> list[list[Action]]:
    """1F1B at P=2, M=2 with forwards of 1 s and backwards of 2 s, each message between the ranks taking
    ``latency``."""
    r0 = [Action(0, 0, "F", 0, 0, 1), Action(0, 0, "F", 1, 1, 2)]
    r1 = [Action(0, 1, "F", 0, 1 + latency, 2 + latency), Action(0, 1, "B", 0, 2 + latency, 4 + latency),
          Action(0, 1, "F", 1, 4 + latency, 5 + latency), Action(0, 1, "B", 1, 5 + latency, 7 + latency)]
    r0 += [Action(0, 0, "B", 0, 4 + 2 * latency, 6 + 2 * latency), Action(0, 0, "B", 1, 7 + 2 * latency,
                                                                          9 + 2 * latency)]
    return [r0, r1]


def test_the_replay_removes_what_messages_cost_and_keeps_what_durations_cost():
    instant = one_f_one_b(0.0)
    assert bubble_fraction(instant) == pytest.approx(1 / 3) == replayed_bubble(instant)
    slow = one_f_one_b(LATENCY)
    assert bubble_fraction(slow) == pytest.approx(1 - 12 / 20)  # 12 s of work on 2 ranks over 10 s
    assert replayed_bubble(slow) == pytest.approx(1 / 3)  # the same actions, messages instant


def test_message_waits_are_the_idle_gaps_after_an_input_from_another_rank():
    assert message_waits(one_f_one_b(LATENCY)) == pytest.approx([LATENCY] * 3)  # F0 on rank 1, B0 and B1 on rank 0
    assert message_waits(one_f_one_b(0.0)) == pytest.approx([0.0] * 3)


def test_a_timeline_that_is_not_one_pipeline_step_is_refused():
    r0 = [Action(0, 0, "B", 0, 0, 1)]  # its input gradient never comes: no later stage ran
    r1 = [Action(0, 1, "B", 0, 1, 2), Action(0, 1, "F", 0, 2, 3)]  # recorded backward before its own forward
    with pytest.raises(ValueError, match="wait on one another"):
        replayed_bubble([r0, r1])


def test_start_delays_are_what_the_messages_added_to_each_kind_of_action():
    from lightning_mgpu.parallel.timeline import start_delays

    delays = start_delays(one_f_one_b(LATENCY))
    # forwards: rank 1's first waits one message (of 4 forwards); backwards: rank 0's two wait one each (of 4)
    assert delays == pytest.approx({"F": LATENCY / 4, "B": LATENCY / 2})
    assert start_delays(one_f_one_b(0.0)) == pytest.approx({"F": 0.0, "B": 0.0})


def test_saved_actions_read_back_equal(tmp_path):
    """``timeline.json`` (what ``mgpu-train`` writes beside ``timeline.png``, and the docs' pictures are drawn from)."""
    per_rank = one_f_one_b(LATENCY)
    assert load_actions(save_actions(per_rank, tmp_path / "timeline.json", "1f1b")) == (per_rank, "1f1b")
