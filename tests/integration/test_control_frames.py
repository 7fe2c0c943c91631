"""The control transport's framing over real loopback sockets: whatever way
the bytes of a trusted connection arrive (one frame per read, a frame cut
over many reads, several frames in one read, a frame larger than one read,
a header cut in two), every frame comes out whole, in order and byte-exact,
and a peer that closes is reported lost once.

A poll that wakes for one whole frame on a trusted connection takes it in
a single read (``Conn.read_one``, the round trip's fast path); every other
shape goes through the buffered path. The cases here drive both, and the
switch between them, from a raw socket that writes exactly the bytes
chosen, so a fast path that dropped, duplicated or reordered bytes fails.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from p2p_kv.control.connection import HEADER, RECV_CHUNK, _frame
from p2p_kv.control.listen import MAX_WAITING_PER_HOST, Waiting
from p2p_kv.control.transport import ADMITS_PER_POLL, ControlTransport, Inbound


def wire(frame: bytes) -> bytes:
    return len(frame).to_bytes(HEADER, "big") + frame


@pytest.fixture
def link() -> Iterator[tuple[ControlTransport, socket.socket, str]]:
    """A transport listening, a raw socket dialled into it, and the name of
    the accepted (trusted) connection."""
    t = ControlTransport("127.0.0.1", 0)
    raw = socket.create_connection(("127.0.0.1", t.port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    name = ""
    end = time.monotonic() + 10
    while not name and time.monotonic() < end:
        for got in t.poll(0.1):
            if got.new:
                name = got.conn
    assert name
    t.trust(name)
    try:
        yield t, raw, name
    finally:
        raw.close()
        t.close()


def collect(t: ControlTransport, count: int, timeout_s: float = 10.0) -> list[Inbound]:
    out: list[Inbound] = []
    end = time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < end:
        out.extend(t.poll(0.05))
    return out


def test_frames_arrive_whole_however_the_bytes_are_cut(
    link: tuple[ControlTransport, socket.socket, str],
) -> None:
    t, raw, name = link
    frames = [bytes([i % 251]) * (1 + 37 * i) for i in range(40)]
    big = bytes(range(256)) * (2 * RECV_CHUNK // 256 + 3)  # > one read
    # one frame per write: each poll's single read is the whole frame
    for f in frames[:10]:
        raw.sendall(wire(f))
        got = collect(t, 1)
        assert [g.frame for g in got] == [f] and got[0].conn == name
    # several frames in one write
    raw.sendall(b"".join(wire(f) for f in frames[10:20]))
    assert [g.frame for g in collect(t, 10)] == frames[10:20]
    # a frame cut into pieces, the header itself split
    for f in frames[20:25]:
        data = wire(f)
        raw.sendall(data[:2])
        assert collect(t, 1, timeout_s=0.2) == []
        raw.sendall(data[2:7])
        time.sleep(0.01)
        raw.sendall(data[7:])
        assert [g.frame for g in collect(t, 1)] == [f]
    # a whole frame followed by the start of the next in one write
    a, b = wire(frames[25]), wire(frames[26])
    raw.sendall(a + b[:6])
    first = collect(t, 1)
    raw.sendall(b[6:])
    assert [g.frame for g in first + collect(t, 1)] == frames[25:27]
    # a frame larger than one read
    raw.sendall(wire(big))
    assert [g.frame for g in collect(t, 1)] == [big]
    # and the fast path again after all that
    raw.sendall(wire(frames[27]))
    assert [g.frame for g in collect(t, 1)] == [frames[27]]


def test_a_frame_made_in_c_equals_the_named_tuple() -> None:
    """The fast path makes its :class:`Inbound` with ``tuple.__new__``,
    bypassing the named tuple's defaults: a field added or moved there
    must be added here too, or frames would read as lost or new."""
    made = _frame("in:1", b"frame")
    assert made == Inbound("in:1", b"frame") and type(made) is Inbound
    assert (made.new, made.lost, made.why, made.bad) == (False, False, "", "")


def test_a_peer_that_closes_is_reported_lost_once(
    link: tuple[ControlTransport, socket.socket, str],
) -> None:
    t, raw, name = link
    raw.sendall(wire(b"last"))
    raw.close()
    got = collect(t, 2)
    assert [g.frame for g in got if not g.lost] == [b"last"]
    lost = [g for g in got if g.lost]
    assert len(lost) == 1 and lost[0].conn == name
    assert not [g for g in t.poll(0.1) if g.conn == name]


def test_a_zero_length_frame_breaks_the_framing(
    link: tuple[ControlTransport, socket.socket, str],
) -> None:
    """A length the format forbids is refused on the fast path as on the
    buffered one: the connection ends as bad."""
    t, raw, name = link
    raw.sendall((0).to_bytes(HEADER, "big") + b"rest")
    got = collect(t, 1)
    assert len(got) == 1 and got[0].lost and got[0].bad == "framing"
    assert got[0].conn == name
    assert t.counters["framing_errors"] == 1


def accepted(t: ControlTransport, raw: socket.socket) -> str:
    """The name ``t`` gave the connection ``raw`` dialled (untrusted)."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for got in t.poll(0.1):
            if got.new:
                return got.conn
    raise AssertionError("not accepted")


def test_a_connection_sends_a_handful_of_frames_before_trust() -> None:
    """An honest peer's handshake takes a few frames; the one past
    MAX_FRAMES_BEFORE_TRUST ends the connection, and what came behind it
    is never handed on, so a stream of tiny frames costs its sender a
    connection, not our thread."""
    from p2p_kv.control.connection import MAX_FRAMES_BEFORE_TRUST

    t = ControlTransport("127.0.0.1", 0)
    raw = socket.create_connection(("127.0.0.1", t.port))
    try:
        name = accepted(t, raw)
        raw.sendall(wire(b"x") * 1000)
        got = collect(t, MAX_FRAMES_BEFORE_TRUST + 1)
        frames = [g for g in got if not g.lost]
        lost = [g for g in got if g.lost]
        assert len(frames) == MAX_FRAMES_BEFORE_TRUST
        assert len(lost) == 1 and lost[0].bad == "frames_before_trust"
        assert lost[0].conn == name
        assert t.counters["untrusted_frames_past_bound"] == 1
    finally:
        raw.close()
        t.close()


def test_a_connection_accepted_has_its_first_frame_read_in_the_same_poll() -> None:
    """A dialler's Hello usually arrives with its connection: the poll that
    accepts it reads it too, so its handshake does not wait a poll more
    while newer connections queue behind it. The accept says from where."""
    t = ControlTransport("127.0.0.1", 0)
    raw = socket.create_connection(("127.0.0.1", t.port))
    raw.sendall(wire(b"hello"))
    time.sleep(0.2)
    try:
        got = t.poll(1.0)
        assert [(g.new, g.frame) for g in got] == [(True, b""), (False, b"hello")]
        assert got[0].why == "127.0.0.1"
    finally:
        raw.close()
        t.close()


def test_room_among_handshaking_connections_goes_to_the_address_holding_least() -> None:
    """An address at its bound gets no more (closed as accepted); past the
    global bound an address holding fewer takes the room of the busiest
    one's oldest. A member dialling from its own address keeps its
    connection whatever other addresses open."""
    t = ControlTransport("127.0.0.1", 0, max_handshaking=4, max_handshaking_per_host=3)
    socks: list[socket.socket] = []
    lost: set[str] = set()

    def dial(source: str) -> str:
        s = socket.create_connection(("127.0.0.1", t.port), source_address=(source, 0))
        socks.append(s)
        before = t.counters["accepted"]
        name = ""
        end = time.monotonic() + 5
        while t.counters["accepted"] == before and time.monotonic() < end:
            for got in t.poll(0.05):
                lost.update([got.conn] if got.lost else [])
                name = got.conn if got.new else name
        return name

    try:
        first = dial("127.0.0.2")
        dial("127.0.0.2")
        dial("127.0.0.2")
        assert dial("127.0.0.2") == ""  # its address is at its bound
        member = dial("127.0.0.1")
        assert dial("127.0.0.3")  # takes the busiest address's oldest
        assert lost == {first}
        assert dial("127.0.0.3") == ""  # it holds as many as the busiest, less one
        assert dial("127.0.0.4")  # .2 still holds 2, .4 none
        assert member and member not in lost
        assert t.counters["evicted_handshaking"] == 2
        assert t.counters["refused_handshaking"] == 2
    finally:
        for s in socks:
            s.close()
        t.close()


def test_a_closed_connection_that_keeps_writing_is_cut() -> None:
    """What a connection we closed still sends is read and dropped only up
    to LINGER_READ_BYTES: past that its descriptor goes at once."""
    from p2p_kv.control.transport import LINGER_READ_BYTES

    t = ControlTransport("127.0.0.1", 0)
    raw = socket.create_connection(("127.0.0.1", t.port))
    try:
        name = accepted(t, raw)
        t.close_conn(name)
        raw.setblocking(False)
        junk = b"\0" * (1 << 20)
        end = time.monotonic() + 3
        while not t.counters["lingering_cut"] and time.monotonic() < end:
            with contextlib.suppress(
                BlockingIOError, ConnectionResetError, BrokenPipeError
            ):
                raw.send(junk)
            t.poll(0.01)
        assert t.counters["lingering_cut"] == 1
        assert t.counters["lingering_bytes"] <= LINGER_READ_BYTES
    finally:
        raw.close()
        t.close()


def test_a_port_that_answers_in_http_is_named_as_such() -> None:
    """A dial to a port another protocol serves (an engine's API port
    named as the tier's) ends with a reason that says so, not as a framing
    attack."""
    from p2p_kv.control.transport import dial_failure

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    t = ControlTransport("127.0.0.1", 0)
    try:
        peer = f"127.0.0.1:{port}"
        t.connect(peer)
        t.send(peer, [b"hello"])
        conn, _ = server.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        got = collect(t, 1)
        assert len(got) == 1 and got[0].lost and got[0].bad == "not_p2p_kv", got
        assert "not a p2p_kv port" in got[0].why
        assert dial_failure(got[0].why) == "not_p2p_kv"
        conn.close()
    finally:
        server.close()
        t.close()


def test_a_member_dialling_behind_a_queued_flood_gets_the_next_session() -> None:
    """Connections queued from other addresses before a member's dial do
    not go first: the poll after they all arrived gives its session to the
    member's address, the one holding fewest. Those past the bound on
    waiting connections are closed, the busiest address's oldest first."""
    t = ControlTransport("127.0.0.1", 0)
    socks = [
        socket.create_connection(
            ("127.0.0.1", t.port), source_address=(f"127.0.0.{2 + i % 2}", 0)
        )
        for i in range(2 * MAX_WAITING_PER_HOST + 4)
    ]
    member = socket.create_connection(
        ("127.0.0.1", t.port), source_address=("127.0.0.1", 0)
    )
    try:
        time.sleep(0.2)  # all of them in the kernel's queue
        first = [got for got in t.poll(1.0) if got.new]
        hosts = [got.why for got in first]
        assert len(first) == ADMITS_PER_POLL
        assert hosts[0] == "127.0.0.1", hosts
        assert t.counters["refused_waiting"] == 4
    finally:
        for s in [*socks, member]:
            s.close()
        t.close()


def test_waiting_keeps_each_address_oldest_first_and_drops_the_busiest() -> None:
    """The waiting room's bounds: one address's own bound closes its
    newest; the bound in all closes the busiest address's oldest."""
    made: list[socket.socket] = []

    def sock() -> socket.socket:
        made.append(socket.socket())
        return made[-1]

    try:
        w = Waiting(bound=3, per_host=2)
        a1, a2, a3 = sock(), sock(), sock()
        assert w.add(a1, "a") is None and w.add(a2, "a") is None
        assert w.add(a3, "a") is a3  # "a" has its 2
        b1 = sock()
        assert w.add(b1, "b") is None
        c1 = sock()
        assert w.add(c1, "c") is a1  # 4 > 3: the busiest ("a") loses its oldest
        assert len(w) == 3
        rank = {"a": 0, "b": 1, "c": 1}
        assert w.take(rank.__getitem__) == (a2, "a")
        assert w.take(rank.__getitem__) == (b1, "b")  # ties: fewest waiting, then name
        assert w.take(rank.__getitem__) == (c1, "c")
        assert w.take(rank.__getitem__) is None and len(w) == 0
    finally:
        for s in made:
            s.close()
