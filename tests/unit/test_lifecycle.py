"""The transition tables, checked exhaustively: every (machine, state,
event) triple, every reachable path, and the fence rule of LOAD."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

import pytest

from p2p_kv.lifecycle import (
    ABORTED_WRITES,
    FENCED_LOADS,
    INITIAL,
    ROWS,
    TABLE,
    WRITES_IN_FLIGHT,
    Effect,
    Event,
    IllegalTransition,
    Machine,
    State,
    Tracked,
    allowed,
    is_terminal,
    step,
)

S, E = State, Event

#: What each machine is documented to end in.
TERMINALS: dict[Machine, frozenset[State]] = {
    Machine.PROBE: frozenset({S.ANSWERED, S.EXPIRED}),
    Machine.LOAD: frozenset({S.DONE, S.FAILED}),
    Machine.SERVE: frozenset({S.RELEASED}),
    Machine.PARKED: frozenset({S.RELEASED, S.EXPIRED}),
}

Edge = tuple[State, Event, State]


def states(machine: Machine) -> set[State]:
    """Every state the machine can be in: rows, targets and initial states."""
    table = TABLE[machine]
    out = set(table) | set(INITIAL[machine])
    for row in table.values():
        out |= set(row.values())
    return out


def edges(machine: Machine) -> list[Edge]:
    return [
        (src, event, dst)
        for src, row in TABLE[machine].items()
        for event, dst in row.items()
    ]


def reachable(
    machine: Machine, start: Iterable[State], skip: frozenset[Edge] = frozenset()
) -> dict[State, list[Event]]:
    """BFS over the table: each reachable state with one shortest path."""
    paths: dict[State, list[Event]] = {s: [] for s in start}
    todo = deque(paths)
    while todo:
        src = todo.popleft()
        for event, dst in TABLE[machine].get(src, {}).items():
            if (src, event, dst) in skip or dst in paths:
                continue
            paths[dst] = [*paths[src], event]
            todo.append(dst)
    return paths


def tracked_class(machine: Machine) -> type[Tracked]:
    return type(f"T{machine.name}", (Tracked,), {"machine": machine, "__slots__": ()})


ALL_MACHINES = list(Machine)


# ---------------------------------------------------------------------------
# shape of the tables
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_terminal_states_have_no_rows(machine: Machine) -> None:
    terminals = TERMINALS[machine]
    assert terminals <= states(machine)
    for state in terminals:
        assert state not in TABLE[machine]
        assert is_terminal(machine, state)
    # ... and every other state of the machine has a row (is not terminal).
    for state in states(machine) - terminals:
        assert TABLE[machine][state], f"{machine.name}.{state.name} has no events"
        assert not is_terminal(machine, state)


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_initial_states_are_not_terminal(machine: Machine) -> None:
    assert INITIAL[machine]
    for state in INITIAL[machine]:
        assert state in TABLE[machine]


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_every_state_is_reachable_from_an_initial_state(machine: Machine) -> None:
    assert set(reachable(machine, INITIAL[machine])) == states(machine)


def test_step_is_the_table_and_everything_else_is_illegal() -> None:
    legal = illegal = 0
    for machine, state, event in itertools.product(Machine, State, Event):
        row = TABLE[machine].get(state, {})
        if event in row:
            assert step(machine, state, event) is row[event]
            assert allowed(machine, state, event)
            legal += 1
            continue
        assert not allowed(machine, state, event)
        with pytest.raises(IllegalTransition) as info:
            step(machine, state, event)
        err = info.value
        assert (err.machine, err.state, err.event) == (machine, state, event)
        assert event.value in str(err) and state.value in str(err)
        illegal += 1
    assert legal == sum(len(edges(m)) for m in Machine)
    assert legal + illegal == len(Machine) * len(State) * len(Event)


# ---------------------------------------------------------------------------
# Tracked objects follow the table
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_tracked_fire_follows_the_table(machine: Machine) -> None:
    cls = tracked_class(machine)
    checked = 0
    for initial in INITIAL[machine]:
        for state, path in reachable(machine, [initial]).items():
            for event in Event:
                obj = cls(initial)
                for ev in path:  # replay the path through fire()
                    obj.fire(ev)
                assert obj.state is state
                assert obj.terminal == is_terminal(machine, state)
                assert obj.can(event) == allowed(machine, state, event)
                if allowed(machine, state, event):
                    row = ROWS[machine][state][event]
                    assert obj.fire(event) is row.effect
                    assert obj.state is row.to is TABLE[machine][state][event]
                else:
                    with pytest.raises(IllegalTransition):
                        obj.fire(event)
                    assert obj.state is state  # a refused event changes nothing
                checked += 1
    assert checked >= len(Event) * len(INITIAL[machine])


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_tracked_refuses_a_non_initial_start(machine: Machine) -> None:
    cls = tracked_class(machine)
    for state in State:
        if state in INITIAL[machine]:
            assert cls(state).state is state
        else:
            with pytest.raises(IllegalTransition):
                cls(state)


def test_terminal_tracked_objects_refuse_everything() -> None:
    for machine in Machine:
        cls = tracked_class(machine)
        for initial in INITIAL[machine]:
            for state, path in reachable(machine, [initial]).items():
                if state not in TERMINALS[machine]:
                    continue
                obj = cls(initial)
                for ev in path:
                    obj.fire(ev)
                assert obj.terminal
                for event in Event:
                    assert not obj.can(event)
                    with pytest.raises(IllegalTransition):
                        obj.fire(event)


# ---------------------------------------------------------------------------
# liveness: everything can end, and losing the peer ends it
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "machine", [Machine.PROBE, Machine.LOAD, Machine.SERVE, Machine.PARKED]
)
def test_every_non_terminal_state_can_reach_a_terminal(machine: Machine) -> None:
    for state in states(machine) - TERMINALS[machine]:
        ends = set(reachable(machine, [state])) & TERMINALS[machine]
        assert ends, f"{machine.name}.{state.name} can never finish"


@pytest.mark.parametrize(
    "machine", [m for m in Machine if any(E.PEER_LOST in r for r in TABLE[m].values())]
)
def test_peer_lost_ends_every_peer_owned_state(machine: Machine) -> None:
    # A PARKED store in STORED belongs to the manager's registry, not to any
    # peer, so no peer can be lost under it (it ends by TIMEOUT or RESET).
    # An ORPHANED serve's pins outlived their session (the peer may still
    # READ them): it belongs to the manager and ends only at its deadline.
    not_peer_owned = {
        Machine.PARKED: {S.STORED: {E.TIMEOUT, E.RESET}},
        Machine.SERVE: {S.ORPHANED: {E.TIMEOUT}},
    }.get(machine, {})
    for state in states(machine) - TERMINALS[machine]:
        if state in not_peer_owned:
            assert E.PEER_LOST not in TABLE[machine][state]
            assert not_peer_owned[state] <= set(TABLE[machine][state])
            continue
        if state is S.REVOKING:  # always offered: losing the peer orphans it
            assert step(machine, state, E.ORPHAN) is S.ORPHANED
            continue
        assert E.PEER_LOST in TABLE[machine][state], f"{state.name}: no PEER_LOST"
        assert step(machine, state, E.PEER_LOST) in TERMINALS[machine]


def test_every_machine_has_peer_lost() -> None:
    for machine in Machine:
        assert any(E.PEER_LOST in row for row in TABLE[machine].values())


# ---------------------------------------------------------------------------
# the fence rule of LOAD
# ---------------------------------------------------------------------------

#: Events that prove no remote write can still land in the job's slots.
FENCES: frozenset[tuple[State | None, Event]] = frozenset(
    {
        (None, E.TRANSFER_FAILED),
        (None, E.TRANSFER_OK),  # the producer's writes / our read are done
        (None, E.ABORT_ACK),
        (None, E.PEER_LOST),  # the session invalidates the peer's agent first
        (S.ABORTING, E.TIMEOUT),  # likewise: the session closes the peer
        (S.READ_CANCELLING, E.TIMEOUT),  # closing it also ends our READ
        # A read Fetch's answer: the producer offers its blocks instead of
        # writing them, so nothing of its lands; what follows is our READ.
        (S.FETCH_POSTED, E.OFFER),
    }
)


def fences(src: State, event: Event) -> bool:
    return (None, event) in FENCES or (src, event) in FENCES


def unfenced_paths_to_failed(table: dict[State, dict[Event, State]]) -> list[str]:
    """Every path from a started transfer (FETCH_POSTED or READING) that
    enters FAILED with no fencing event on it, found by exploring the table
    (each state visited once; past a fence every path is fenced)."""
    bad = []
    seen = {S.FETCH_POSTED, S.READING}
    todo: deque[tuple[State, list[str]]] = deque(
        [(S.FETCH_POSTED, []), (S.READING, [])]
    )
    while todo:
        src, path = todo.popleft()
        for event, dst in table.get(src, {}).items():
            here = [*path, f"{src.name} -{event.name}->"]
            if fences(src, event):
                continue
            if dst is S.FAILED:
                bad.append(" ".join([*here, dst.name]))
            if dst not in seen and dst is not S.FAILED:
                seen.add(dst)
                todo.append((dst, here))
    return bad


def test_load_never_fails_from_fetch_posted_without_a_fence() -> None:
    assert unfenced_paths_to_failed(TABLE[Machine.LOAD]) == []
    # ... and FAILED is reachable from FETCH_POSTED at all (else the check is
    # vacuous), but not once every fencing edge is removed.
    assert S.FAILED in reachable(Machine.LOAD, [S.FETCH_POSTED])
    fencing = frozenset(e for e in edges(Machine.LOAD) if fences(e[0], e[1]))
    assert S.FAILED not in reachable(Machine.LOAD, [S.FETCH_POSTED], skip=fencing)


def test_fence_checker_catches_an_unfenced_edge() -> None:
    for src, event in [
        (S.FETCH_POSTED, E.TIMEOUT),
        (S.FETCH_POSTED, E.ABORT),
        (S.ABORTING, E.ABORT),
        (S.READING, E.ABORT),
        (S.READ_CANCELLING, E.ABORT),
    ]:
        table = {s: dict(row) for s, row in TABLE[Machine.LOAD].items()}
        table[src][event] = S.FAILED
        assert unfenced_paths_to_failed(table), (src, event)


def test_load_slots_leave_only_from_done_or_failed() -> None:
    # Fenced states (a write may land) never lead to DONE except on
    # TRANSFER_OK, the producer's word that every write finished.
    for src, event, dst in edges(Machine.LOAD):
        if dst is S.DONE:
            assert event is E.TRANSFER_OK and src in (
                S.FETCH_POSTED,
                S.ABORTING,
                S.READING,
            )
    # A queued load never had its Fetch sent, nor a queued READ its post,
    # so failing either at once is safe; neither is re-entered once started.
    for queued, started in ((S.QUEUED, S.FETCH_POSTED), (S.READ_QUEUED, S.READING)):
        for event in (E.ABORT, E.TIMEOUT, E.PEER_LOST):
            assert step(Machine.LOAD, queued, event) is S.FAILED
        assert queued not in reachable(Machine.LOAD, [started])
    # A READ becomes fenced only by being posted.
    assert [e for s, e, d in edges(Machine.LOAD) if d is S.READING] == [E.POSTED]


# ---------------------------------------------------------------------------
# each row's effect
# ---------------------------------------------------------------------------

X = Effect


def load_rows() -> list[tuple[State, Event, State, Effect]]:
    return [
        (src, event, row.to, row.effect)
        for src, events in ROWS[Machine.LOAD].items()
        for event, row in events.items()
    ]


def test_a_load_fails_now_only_where_nothing_can_land() -> None:
    """A failure leaves at once (END) only from a state no transfer can
    land in, or on the event that proves the transfer over; from a fenced
    state the session's loss waits for the agent (FENCE)."""
    for src, event, dst, effect in load_rows():
        if dst is not S.FAILED:
            continue
        if event is E.PEER_LOST:
            assert effect is (X.FENCE if src in FENCED_LOADS else X.END), src
        else:
            assert effect is X.END, (src, event)
            assert src not in FENCED_LOADS or event in (
                E.TRANSFER_OK,
                E.TRANSFER_FAILED,
                E.ABORT_ACK,
            ), (src, event)


def test_fenced_loads_are_the_states_a_transfer_may_land_in() -> None:
    """Entered by sending the Fetch or posting the READ; left only to a
    terminal state, or from one fenced state to another."""
    entered = {dst for src, _, dst, x in load_rows() if x in (X.SEND_FETCH, X.POSTED)}
    assert entered == {S.FETCH_POSTED, S.READING}
    assert S.FETCH_POSTED in INITIAL[Machine.LOAD]  # a Fetch sent at once
    for src, _, dst, _ in load_rows():
        if src in FENCED_LOADS and dst not in FENCED_LOADS:
            assert dst in TERMINALS[Machine.LOAD] or (src, dst) == (
                S.FETCH_POSTED,
                S.READ_QUEUED,  # the producer offered instead of writing
            ), (src, dst)


def test_giving_a_started_load_up_stops_it_or_waits_for_the_peer() -> None:
    for src in (S.FETCH_POSTED, S.READING):
        for event in (E.ABORT, E.TIMEOUT):
            row = ROWS[Machine.LOAD][src][event]
            assert row.effect is (X.STOP_READ if src is S.READING else X.AWAIT_ACK)
            assert row.to in FENCED_LOADS
    # Given up and still unanswered at the next deadline: only the
    # session's end (dropping the peer's agent) fences it.
    for src in (S.ABORTING, S.READ_CANCELLING):
        assert ROWS[Machine.LOAD][src][E.TIMEOUT] == (src, X.LOSE_SESSION)


def test_a_serve_tells_the_peer_how_its_abort_ended() -> None:
    """An Abort is acknowledged at once where nothing of ours is being
    written, and only once the write settled where it is."""
    for src, events in ROWS[Machine.SERVE].items():
        row = events.get(E.ABORT)
        if row is None:
            continue
        if src in WRITES_IN_FLIGHT or src is S.WRITE_CANCELLING:
            assert row == (
                S.ABORT_WRITING if src is S.WRITING else S.ABORT_CANCELLING,
                X.ACK_WHEN_SETTLED,
            )
            assert row.to in ABORTED_WRITES
        else:
            assert row == (S.RELEASED, X.ACK_AND_RELEASE), src
    # A WRITE becomes one that may land only by being posted; before, an
    # Abort or the deadline ends the serve at once, as for a queued READ.
    assert [e for s, e, d in edges(Machine.SERVE) if d is S.WRITING] == [E.POSTED]
    queued = ROWS[Machine.SERVE][S.WRITE_QUEUED]
    assert queued[E.TIMEOUT] == (S.RELEASED, X.REFUSE_AND_RELEASE)
    assert queued[E.POSTED] == (S.WRITING, X.POSTED)
    # A write that missed its deadline is cancelled; one that missed the
    # cancel's ends the session.
    for src in WRITES_IN_FLIGHT:
        assert ROWS[Machine.SERVE][src][E.TIMEOUT].effect is X.CANCEL_WRITE
    for src in ABORTED_WRITES - WRITES_IN_FLIGHT | {S.WRITE_CANCELLING}:
        assert ROWS[Machine.SERVE][src][E.TIMEOUT].effect is X.LOSE_SESSION


def test_every_effect_is_named_by_some_row() -> None:
    used = {
        row.effect
        for machine in ROWS.values()
        for events in machine.values()
        for row in events.values()
    }
    assert used == set(Effect) - {X.NONE} | ({X.NONE} & used)
