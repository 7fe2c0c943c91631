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

import socket
import time
from collections.abc import Iterator

import pytest

from p2p_kv.control import ControlTransport, Inbound
from p2p_kv.control_conn import HEADER, RECV_CHUNK, _frame


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
    assert (made.new, made.lost, made.why, made.bad) == (False, False, "", False)


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
    assert len(got) == 1 and got[0].lost and got[0].bad and got[0].conn == name
    assert t.counters["framing_errors"] == 1
