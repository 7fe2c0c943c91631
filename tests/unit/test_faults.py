"""The fault injector keeps its own promises: it injects what it says, counts
it, and never breaks the transports' contracts (order among survivors,
exactly one completion per transfer), or the tests built on it would prove
nothing."""

from __future__ import annotations

from typing import Any

from p2p_kv.control.transport import Inbound
from p2p_kv.protocol import Heartbeat, Lookup, encode
from tests.support.faults import (
    REORDER_HOLD_S,
    ControlFaults,
    DataFaults,
    FaultyControl,
    FaultyData,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeControl:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.inbox: list[Inbound] = []
        self.closed: list[str] = []
        self._conns: dict[str, object] = {"p:1": object()}
        self.timeouts: list[float] = []

    def send(self, conn: str, frames: list[bytes]) -> str:
        self.sent += [(conn, f) for f in frames]
        return ""

    def poll(self, timeout_s: float) -> list[Inbound]:
        self.timeouts.append(timeout_s)
        out, self.inbox = self.inbox, []
        return out

    def close_conn(self, conn: str) -> None:
        self.closed.append(conn)


def hb(i: int) -> bytes:
    return encode(Heartbeat(seq=i))


def test_clean_control_passes_everything_in_order() -> None:
    inner, clock = FakeControl(), Clock()
    fc = FaultyControl(inner, clock=clock)
    assert fc.send("p:1", [hb(1), hb(2)]) == ""
    inner.inbox = [
        Inbound("in:aa", b"", new=True),
        Inbound("in:aa", hb(3)),
        Inbound("in:aa", hb(4)),
    ]
    got = fc.poll(0.5)
    assert inner.sent == [("p:1", hb(1)), ("p:1", hb(2))]
    assert [(i.frame, i.new) for i in got] == [
        (b"", True),
        (hb(3), False),
        (hb(4), False),
    ]


def test_drop_counts_frames_and_never_hides_a_new_connection() -> None:
    inner, clock = FakeControl(), Clock()
    fc = FaultyControl(inner, ControlFaults(drop=1.0, direction="in"), clock=clock)
    inner.inbox = [Inbound("in:aa", b"", new=True), Inbound("in:aa", hb(1))]
    (got,) = fc.poll(0)
    assert got.new, "the runtime must still learn of the connection"
    assert fc.counts.dropped == 1
    assert fc.connections() == ["p:1", "in:aa"]


def test_delay_holds_frames_and_bounds_the_wait() -> None:
    inner, clock = FakeControl(), Clock()
    fc = FaultyControl(inner, ControlFaults(delay_s=0.05), clock=clock)
    fc.send("p:1", [hb(1)])
    fc.send("p:1", [hb(2)])
    assert inner.sent == []
    fc.poll(1.0)
    assert inner.timeouts[-1] <= 0.05 + 1e-9  # never waits past a release
    clock.t += 0.06
    fc.poll(0)
    assert [f for _, f in inner.sent] == [hb(1), hb(2)]
    assert fc.counts.delayed == 2


def test_only_filters_by_message_type() -> None:
    inner, clock = FakeControl(), Clock()
    lookup = encode(Lookup("r", 1, 1, [b"k"]))
    fc = FaultyControl(
        inner, ControlFaults(drop=1.0, only=frozenset({"lookup"})), clock=clock
    )
    fc.send("p:1", [hb(1), lookup, hb(2)])
    assert [f for _, f in inner.sent] == [hb(1), hb(2)]


def test_reorder_swaps_and_never_turns_into_a_drop() -> None:
    inner, clock = FakeControl(), Clock()
    fc = FaultyControl(inner, ControlFaults(reorder=1.0), clock=clock)
    fc.send("p:1", [hb(1), hb(2)])
    assert [f for _, f in inner.sent] == [hb(2), hb(1)]
    fc.send("p:1", [hb(3)])  # held: nothing comes after it
    clock.t += REORDER_HOLD_S
    fc.poll(0)
    assert [f for _, f in inner.sent][-1] == hb(3)


def test_cut_reports_lost_and_blackholes_inbound() -> None:
    inner, clock = FakeControl(), Clock()
    fc = FaultyControl(inner, clock=clock)
    inner.inbox = [Inbound("in:aa", b"", new=True), Inbound("in:aa", hb(1))]
    fc.poll(0)
    assert set(fc.connections()) == {"p:1", "in:aa"}
    fc.cut("p:1")
    fc.cut("in:aa")
    got = fc.poll(5.0)
    assert inner.timeouts[-1] == 0  # a lost event is reported at once
    assert sorted((i.conn, i.lost) for i in got) == [("in:aa", True), ("p:1", True)]
    assert inner.closed == ["p:1"]
    inner.inbox = [Inbound("in:aa", hb(2))]
    assert fc.poll(0) == []
    assert fc.send("in:aa", [hb(3)]) == ""
    assert not [c for c, _ in inner.sent if c == "in:aa"]


class FakeData:
    def __init__(self) -> None:
        self.n = 0
        self.pending: list[int] = []
        self.cancelled: list[int] = []
        self.removed: list[str] = []

    def post_write(self, agent: str, src: Any, dst: Any, notif: bytes = b"") -> int:
        if agent == "gone":
            raise KeyError(agent)
        self.n += 1
        self.pending.append(self.n)
        return self.n

    def post_read(self, agent: str, remote: Any, local: Any) -> int:
        return self.post_write(agent, local, remote)

    def poll_completions(self) -> list[tuple[int, bool]]:
        out, self.pending = [(t, True) for t in self.pending], []
        return out

    def in_flight(self) -> int:
        return len(self.pending)

    def settling(self) -> bool:
        return False

    def take_unstopped(self) -> set[int]:
        return set()

    def take_faulted(self) -> set[str]:
        return set()

    def cancel(self, *tids: int, wait: bool = False) -> None:
        self.cancelled.extend(tids)

    def remove_peer(self, agent: str) -> None:
        self.removed.append(agent)


def drain(fd: FaultyData, clock: Clock) -> dict[int, list[bool]]:
    seen: dict[int, list[bool]] = {}
    for _ in range(3):
        clock.t += 1.0
        for tid, ok in fd.poll_completions():
            seen.setdefault(tid, []).append(ok)
    return seen


def test_every_transfer_completes_exactly_once_whatever_the_fault() -> None:
    clock = Clock()
    fd = FaultyData(
        FakeData(),
        DataFaults(fail_post=0.2, fail_completion=0.2, stall_s=0.5, stall_p=0.3),
        seed=3,
        clock=clock,
    )
    tids = [fd.post_write("p", [1], [2]) for _ in range(200)]
    tids += [fd.post_read("p", [1], [2]) for _ in range(50)]
    stalled = [t for t in tids if t in fd._held]
    fd.cancel(stalled[0])  # never posted: fails, never reaches NIXL
    seen = drain(fd, clock)
    assert sorted(seen) == sorted(tids)
    assert all(len(v) == 1 for v in seen.values())
    assert seen[stalled[0]] == [False]
    c = fd.counts
    assert c.failed_posts and c.failed_completions and c.stalled_posts
    assert sum(not v[0] for v in seen.values()) == (
        c.failed_posts + c.failed_completions + 1
    )
    assert fd.handles() == 0 and fd.in_flight() == 0


def test_held_transfers_to_a_removed_peer_fail_and_are_never_posted() -> None:
    clock = Clock()
    inner = FakeData()
    fd = FaultyData(inner, DataFaults(stall_s=1.0, stall_p=1.0), clock=clock)
    tid = fd.post_write("p", [1], [2])
    fd.remove_peer("p")
    assert fd.poll_completions() == [(tid, False)]
    clock.t += 2
    assert fd.poll_completions() == []
    assert inner.n == 0 and inner.removed == ["p"]
    late = fd.post_write("gone", [1], [2])  # peer vanished before the release
    clock.t += 2
    assert fd.poll_completions() == [(late, False)]
