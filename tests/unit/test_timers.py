"""The node layer's one timer heap (pure core): deadline order across every
kind of timer, ties in arm order, stale session timers compacted, and a
residue that names only what should have fired."""

from __future__ import annotations

from p2p_kv.node.timers import (
    LateFetchDue,
    SessionDue,
    Timers,
    WaitNoteDue,
)


def test_timers_of_every_kind_fire_in_deadline_order_ties_in_arm_order() -> None:
    timers = Timers()
    timers.arm(3.0, WaitNoteDue("kv3"))
    timers.arm(1.0, SessionDue("b"))
    timers.arm(2.0, LateFetchDue("kv2", 1))
    timers.arm(1.0, SessionDue("a"))  # same instant as b, armed later
    timers.arm(9.0, SessionDue("late"))
    assert timers.next_deadline() == 1.0
    fired = list(timers.due(3.0))
    assert [type(t).__name__ for t in fired] == [
        "SessionDue",
        "SessionDue",
        "LateFetchDue",
        "WaitNoteDue",
    ]
    assert fired[:2] == [SessionDue("b"), SessionDue("a")]
    assert timers.next_deadline() == 9.0
    assert list(timers.due(8.9)) == []


def test_a_timer_armed_while_firing_fires_in_the_same_pass_if_due() -> None:
    timers = Timers()
    timers.arm(1.0, WaitNoteDue("kv"))
    fired = []
    for timer in timers.due(5.0):
        fired.append(timer)
        if len(fired) == 1:
            timers.arm(4.0, SessionDue("a"))  # due: fires now
            timers.arm(6.0, SessionDue("b"))  # not yet
    assert fired == [WaitNoteDue("kv"), SessionDue("a")]
    assert timers.next_deadline() == 6.0


def test_stale_session_timers_are_compacted_and_the_rest_kept() -> None:
    timers = Timers()
    timers.arm(50.0, WaitNoteDue("kv"))
    for i in range(100):  # one session re-armed 100 times
        timers.arm(10.0 + i, SessionDue("a"))
    timers.compact([(7.0, "a")], live=1)
    assert sorted(when for when, _ in timers.pending()) == [7.0, 50.0]
    timers.compact([(8.0, "a")], live=1)  # two entries: nothing to do
    assert len(timers.heap) == 2


def test_residue_counts_only_overdue_timers_of_work_not_sessions() -> None:
    timers = Timers()
    timers.arm(1.0, WaitNoteDue("kv"))
    assert timers.residue() == {"timers_overdue": 0}  # never ticked
    list(timers.due(0.5))
    timers.arm(0.2, SessionDue("a"))  # a session re-armed after the tick
    assert timers.residue() == {"timers_overdue": 0}
    timers.arm(0.4, WaitNoteDue("late"))  # armed in the past, not fired
    assert timers.residue() == {"timers_overdue": 1}
