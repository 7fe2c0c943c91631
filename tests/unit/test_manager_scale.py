"""What connections cost the engine's thread, and the inbound bounds the
manager keeps without scanning its sessions (pure core, in memory).

Anyone who reaches the port may open connections, and the runtime hands
each one's frames to the manager on the engine's thread: whatever a
connection costs there must not grow with how many others there are.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from p2p_kv.node.manager import LoadManager
from p2p_kv.peer import Session, Timeouts
from p2p_kv.peer.events import Closed
from p2p_kv.peer.handshake import make_hello
from p2p_kv.protocol import Hello, Message, encode

from .memnet import identity

SECRET = b"the fleet's shared secret"
HANDSHAKE_S = 5.0
MAX_INBOUND = 512


def manager(
    secret: bytes | None = SECRET, max_inbound: int = MAX_INBOUND
) -> LoadManager:
    nonces = itertools.count(1)
    return LoadManager(
        identity("v", secret=secret),
        nonces=lambda: next(nonces).to_bytes(16, "big"),
        timeouts=Timeouts(handshake_s=HANDSHAKE_S),
        max_inbound=max_inbound,
    )


def pump(m: LoadManager, now: float) -> dict[str, list[bytes]]:
    """The runtime's pump, the transports cut out: what leaves, by peer,
    as it would go on the wire; closed sessions are retired."""
    m.tick(now)
    closed = [peer for peer, ev in m.take_events() if isinstance(ev, Closed)]
    sent: dict[str, list[bytes]] = {}
    for peer, frames in m.take_frames(now):
        sent.setdefault(peer, []).extend(frames)
    for peer in closed:
        m.on_invalidated(peer, now)
    m.end_step(now)
    return sent


# ---------------------------------------------------------------------------
# a flood of connections that never prove themselves
# ---------------------------------------------------------------------------


class _OverBudget(Exception):
    pass


@contextmanager
def counting_calls(budget: float = float("inf")) -> Iterator[list[int]]:
    """Count every function call (Python and C) made inside: the work done,
    the same on every run and every machine, where a wall-clock time is
    not (two shared cores). Past ``budget`` the run stops at once (work
    that grows with the square of the connections would otherwise take
    minutes under the profiler before failing)."""
    count = [0]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" or event == "c_call":
            count[0] += 1
            if count[0] > budget:
                raise _OverBudget

    sys.setprofile(profile)
    try:
        yield count
    except _OverBudget:
        pass
    finally:
        sys.setprofile(None)


def hellos(n: int) -> list[tuple[str, bytes]]:
    """``n`` connections' names and first frames: a Hello each from a party
    without our secret (it says it has one: we answer and wait for a proof
    that never comes)."""
    stranger = identity("stranger", secret=b"not the fleet's secret")
    return [
        (f"in:{i:06d}", encode(make_hello(stranger, i.to_bytes(16, "big"))))
        for i in range(n)
    ]


def flood(n: int, budget: float = float("inf")) -> int:
    """``n`` connections, one Hello each, in one poll; then the newest
    half of those left drop their connection and the rest reach their
    handshake deadline. Returns the calls it all took (more than
    ``budget``: stopped there)."""
    m, frames = manager(), hellos(n)
    with counting_calls(budget) as calls:
        for conn, frame in frames:
            m.peers.on_inbound(1.0, conn)
            m.receive_frame(conn, frame, 1.0)
        out = pump(m, 1.0)
        left = [s.peer for s in m.sessions()]
        for conn in left[MAX_INBOUND // 2 :]:
            m.connection_lost(conn, "the stranger hung up", 2.0)
        pump(m, 2.0)
        pump(m, 1.0 + HANDSHAKE_S)
    if calls[0] > budget:
        return calls[0]
    # Every connection was answered, none got further, the newest
    # max_inbound were kept (each newer one dropped the oldest), and all
    # are gone once they hung up or ran out of time.
    assert len(out) == n
    assert left == [conn for conn, _ in frames[-MAX_INBOUND:]]
    assert m.refusals[("other", "too_many_handshaking")] == n - MAX_INBOUND
    assert not list(m.sessions())
    assert not any(m.state_report().values()), m.state_report()
    reasons = [s.link.close_reason for s in m.retired_sessions]
    assert reasons[-MAX_INBOUND // 2 :] == [
        "handshake_timeout: no handshake in time"
    ] * (MAX_INBOUND // 2)
    return calls[0]


def test_unauthenticated_connections_cost_the_engine_linear_work() -> None:
    """With a secret set, connections that each send one Hello and never
    prove themselves cost the engine's thread the same each, however many
    come in one poll: a scan of every session per new connection (the
    handshaking bound) or per retired one (collecting results) makes N of
    them cost N^2.

    Counted, not timed: the calls made are the same on every run, where
    the times of N and 4N on two shared cores are not, and a factor loose
    enough for their noise would be near the square's 16. Linear work
    makes 4N cost about 4x N; 8x is the bound."""
    small = flood(1_000)
    large = flood(4_000, budget=8 * small)
    assert large <= 8 * small, (
        f"4,000 connections took {large:,} calls or more, 1,000 took {small:,}: "
        f"over 8x (linear is 4x)"
    )


# ---------------------------------------------------------------------------
# the inbound bounds, exactly
# ---------------------------------------------------------------------------


class Dialler:
    """A peer that dials the engine on connection ``conn``; what the engine
    sends it waits in ``inbox`` until it hears it."""

    def __init__(self, m: LoadManager, conn: str, now: float) -> None:
        self.m, self.conn = m, conn
        self.session = Session(
            "v:1", identity(f"peer-{conn}"), now, nonce=conn.encode().ljust(16, b".")
        )
        self.inbox: list[bytes] = []
        assert m.peers.on_inbound(now, conn) == conn

    def say(self, now: float, only: type[Message] | None = None) -> None:
        """Send what our session has queued (or only its first ``only``)."""
        msgs = self.session.take_outbox(now)
        if only is not None:
            msgs = [next(msg for msg in msgs if isinstance(msg, only))]
        for msg in msgs:
            self.m.receive_frame(
                self.conn, self.session.link.seal(msg, encode(msg)), now
            )

    def hear(self, now: float) -> None:
        frames, self.inbox = self.inbox, []
        for frame in frames:
            self.session.receive(self.session.link.open(frame), now)


class Port:
    """An engine's manager and the peers that dialled it."""

    def __init__(self, max_inbound: int) -> None:
        self.m = manager(secret=None, max_inbound=max_inbound)
        self.diallers: dict[str, Dialler] = {}

    def dial(self, conn: str, now: float) -> Dialler:
        self.diallers[conn] = Dialler(self.m, conn, now)
        return self.diallers[conn]

    def step(self, now: float) -> None:
        """The engine's pump; what it sends waits in the diallers' inboxes."""
        for conn, frames in pump(self.m, now).items():
            self.diallers[conn].inbox.extend(frames)

    def greet(self, dialler: Dialler, now: float) -> None:
        """Frames go both ways until nothing is left to say."""
        for _ in range(6):
            dialler.hear(now)
            dialler.say(now)
            self.step(now)

    def session(self, conn: str) -> Session:
        session = self.m.session(conn)
        assert session is not None
        return session

    def handshaking(self) -> list[str]:
        return [
            s.peer for s in self.m.sessions() if not s.link.ready and not s.link.closed
        ]

    def refused(self, reason: str) -> int:
        return self.m.refusals.get(("other", reason), 0)


def test_past_max_inbound_the_oldest_still_handshaking_goes_and_the_ready_stay() -> (
    None
):
    """Two bounds on inbound connections: those still handshaking (past
    ``max_inbound`` the oldest of them is dropped: a ready one never, and
    one that became ready or closed no longer counts) and those ready
    (past it, the one just proven is refused; closed ones do not count,
    whoever closed them)."""
    port = Port(max_inbound=2)
    a = port.dial("in:a", 0.0)
    port.greet(a, 0.0)
    assert a.session.link.ready
    for conn in ("in:b", "in:c"):
        port.dial(conn, 0.0).say(0.0, only=Hello)  # a Hello, nothing more yet
    d = port.dial("in:d", 0.0)  # two handshaking: the oldest, b, makes way
    assert port.session("in:b").link.close_reason == (
        "closed: refused: 2 connections still handshaking, max_inbound_peers"
    )
    assert port.refused("too_many_handshaking") == 1
    port.greet(port.diallers["in:c"], 0.0)  # ready: a and c; d handshaking
    assert port.session("in:c").link.ready
    e = port.dial("in:e", 0.0)  # d and e handshaking: nobody made way
    assert port.handshaking() == ["in:d", "in:e"]
    port.greet(d, 0.0)  # a third ready one is refused as it is proven
    assert d.session.link.closed and "2 peers connected" in d.session.link.close_reason
    assert port.m.session("in:d") is None  # refused and retired
    assert port.refused("too_many_inbound") == 1
    # A ready one closed by a caller the manager does not hear from (the
    # runtime drops a peer whose region its data plane refuses) frees its
    # place at once: e gets in.
    port.session("in:a").close("bad data-plane region")
    port.greet(e, 0.0)
    assert port.session("in:e").link.ready
    assert port.refused("too_many_inbound") == 1
    # Handshaking ones that hang up or run out of time leave the count too.
    port.dial("in:f", 0.0)
    port.dial("in:g", 0.0)
    port.m.connection_lost("in:f", "hung up", 0.1)
    port.dial("in:h", 0.1)  # g and h handshaking: nobody made way
    assert port.refused("too_many_handshaking") == 1
    port.step(0.1)  # arms their deadlines
    port.step(0.1 + HANDSHAKE_S)  # both out of time
    for conn in ("in:i", "in:j", "in:k"):
        port.dial(conn, 10.0)
    assert port.refused("too_many_handshaking") == 2  # i made way for k
    assert port.handshaking() == ["in:j", "in:k"]
    assert {s.peer for s in port.m.sessions() if s.link.ready} == {"in:c", "in:e"}


def test_a_refused_connection_leaves_nothing_to_the_cyclic_collector() -> None:
    """A Hello we refuse (another layout) is kept as the session's
    ``refusal``: with its traceback, whose frames hold the session, every
    refused connection of a flood was a reference cycle, and CPython's
    full collections (0.1 s each in an engine's heap) came for them."""
    import gc

    m = manager()
    other = identity("stranger", secret=SECRET, layout="another-layout")
    gc.collect()
    gc.disable()
    try:
        for i in range(50):
            conn = f"in:{i}"
            m.peers.on_inbound(0.0, conn)
            m.receive_frame(conn, encode(make_hello(other, i.to_bytes(16, "big"))), 0.0)
            pump(m, 0.0)
        assert (
            sum(s.link.counters.refused.get("layout", 0) for s in m.retired_sessions)
            == 50
        )
        m.retired_sessions.clear()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, Session)]
        assert not cyclic, f"{len(cyclic)} refused sessions were reference cycles"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
