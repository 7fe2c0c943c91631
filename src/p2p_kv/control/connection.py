"""One control connection: its socket, the bytes queued each way, and how
a frame lies on the wire.

Every frame is a 4-byte big-endian length, then that many bytes. A
:class:`Conn` turns frames into queued bytes and read bytes into frames, and
knows the bounds that are one connection's alone: the largest frame for its
state (trusted or not), and how many frames one poll takes from it. It
never touches the poller, the table of connections, the byte budget shared
by a poll, the counters or the bounds on connections still handshaking:
those span every connection, so they are
:class:`~p2p_kv.control.transport.ControlTransport`'s, which owns the conns. What
goes wrong here comes back as the reason the connection is lost (a string)
or a :class:`FramingError`, and the transport decides what follows.
"""

from __future__ import annotations

import itertools
import select
import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from p2p_kv.protocol import MAX_FRAME_BYTES, MAX_GREETING_BYTES

#: A frame's length prefix: 4 bytes, big-endian.
HEADER: Final = 4
#: Largest frame after trust: a protocol frame, sealed, with room.
MAX_WIRE_FRAME: Final = MAX_FRAME_BYTES + 1024
#: Largest frame read before trust. A Hello, HelloAck, Goodbye or Error is
#: a few hundred bytes (their text fields are bounded at 1,024 characters).
#: A larger one up to :data:`MAX_GREETING_BYTES` (the peer's Region, which
#: may arrive in one read with the proof that earns trust) waits unread;
#: past that it breaks the framing.
MAX_UNTRUSTED_FRAME: Final = 16 * 1024
#: Frames taken from one connection in one poll (the rest stay buffered
#: for the next, which then does not wait).
MAX_FRAMES_PER_POLL: Final = 4096
#: Frames a connection may send before its handshake ends. An honest peer
#: sends its Hello, its HelloAck and its Region, or a Goodbye saying why
#: it refuses us: one more frame is a party that cannot prove the secret
#: spending our thread, and ends the connection.
MAX_FRAMES_BEFORE_TRUST: Final = 8
#: Largest single read.
RECV_CHUNK: Final = 1024 * 1024
#: The largest greeting as it goes on the wire (sealed).
_MAX_GREETING_WIRE: Final = MAX_GREETING_BYTES + 64
#: Buffers one ``sendmsg`` takes (the kernel's IOV_MAX is 1024).
_IOV: Final = 512
#: Frames of at most this many bytes in all are joined into one buffer
#: when nothing is queued ahead of them (a copy is cheaper than a
#: scatter list at this size).
_JOIN: Final = 64 * 1024

#: The length prefix, read in place from the buffer a read landed in.
_PREFIX: Final = struct.Struct(">I")

#: Why a connection ends when its socket fails or closes.
LOST = "connection lost"

_IN, _OUT = select.POLLIN, select.POLLOUT


class Inbound(NamedTuple):
    """What a poll saw on one connection: a frame; ``new``, an inbound
    connection accepted (no frame); or ``lost``, the connection went down
    (no frame), ``why`` saying how, ``bad`` the reason when it was ended
    for breaking the framing (:class:`FramingError`); for ``new``, ``why``
    is the far end's address. A named tuple:
    one is made per frame, and a frozen dataclass costs several times as
    much to make."""

    conn: str
    frame: bytes
    new: bool = False
    lost: bool = False
    why: str = ""
    #: the metric's label when the connection broke the framing, else ""
    bad: str = ""


def _frame(conn: str, frame: bytes) -> Inbound:
    """An :class:`Inbound` holding a frame, made in C: a named tuple with
    defaults runs a Python ``__new__`` (about 0.3 us), and one is made for
    every frame on the round trip's hot path."""
    return tuple.__new__(Inbound, (conn, frame, False, False, "", ""))


class FramingError(Exception):
    """A peer broke the framing: the connection ends. ``reason`` is the
    metric's label: ``framing`` for a length no frame may have,
    ``frames_before_trust`` for more frames than a handshake takes, and
    ``not_p2p_kv`` for an answer in another protocol (HTTP, TLS): a
    connection to a port that is not a p2p_kv tier's."""

    def __init__(self, message: str, reason: str = "framing") -> None:
        super().__init__(message)
        self.reason = reason


#: How the first bytes of other protocols' answers read as a length
#: prefix, and what the port then is (an engine's own API port named as
#: the tier's is the usual mistake).
_FOREIGN: Final = (
    (b"HTTP", "an HTTP server"),
    (b"\x16\x03", "a TLS server"),
    (b"\x15\x03", "a TLS server"),
    (b"SSH-", "an SSH server"),
)


def foreign_protocol(head: bytes | bytearray) -> str:
    """What kind of server sent ``head`` (the first bytes read from a
    connection), or "" if it may be a p2p_kv peer."""
    for prefix, what in _FOREIGN:
        if bytes(head[: len(prefix)]) == prefix:
            return what
    return ""


def wire_size(frames: list[bytes]) -> int:
    """The bytes ``frames`` take on the wire, prefixes included."""
    return sum(HEADER + len(f) for f in frames)


@dataclass(eq=False, slots=True)
class Conn:
    """One TCP connection's state and bytes. The transport sets ``sock``,
    ``fd``, the dial flags, ``trusted`` and ``mask``; the methods here keep
    the buffers."""

    name: str
    inbound: bool
    sock: socket.socket | None = None
    fd: int = -1
    #: the far end's address, for the per-address bound (inbound only)
    host: str = ""
    #: the far end's ``host:port`` (inbound only): what log lines call a
    #: peer that has not said who it is
    remote: str = ""
    trusted: bool = False
    #: outbound: resolving its name (no socket yet) or connect() running
    resolving: bool = False
    connecting: bool = False
    rbuf: bytearray = field(default_factory=bytearray)
    out: deque[memoryview] = field(default_factory=deque)
    out_bytes: int = 0
    #: the poll mask registered for ``fd`` (0: not registered)
    mask: int = 0
    #: our socket's inode once connected (outbound: the same-host proof)
    inode: str | None = None
    #: why it went down, once it did (reported once, then it waits for
    #: close_conn), and the metric's label if for breaking the framing
    dead: str = ""
    bad: str = ""
    #: frames taken before trust (:data:`MAX_FRAMES_BEFORE_TRUST`)
    untrusted_frames: int = 0
    #: whether anything was read yet (the first bytes tell another
    #: protocol's answer apart)
    heard: bool = False

    @property
    def cap(self) -> int:
        """The largest frame this connection may send us in its state."""
        return MAX_WIRE_FRAME if self.trusted else MAX_UNTRUSTED_FRAME

    def wants(self) -> int:
        """The poll events it waits for: output while connecting; else
        input while its buffer has room, and output while some is queued."""
        if self.connecting:
            return _OUT
        mask = 0
        cap = MAX_WIRE_FRAME if self.trusted else MAX_UNTRUSTED_FRAME
        if len(self.rbuf) < cap + HEADER:
            mask |= _IN
        if self.out:
            mask |= _OUT
        return mask

    def fail(self, why: str, bad: str) -> None:
        """Mark it down for ``why``; what either buffer held is dropped (no
        frame of a dead connection is read or written)."""
        self.dead = why
        self.bad = bad
        self.out.clear()
        self.out_bytes = 0
        self.rbuf.clear()

    # -- output --------------------------------------------------------------

    def send(self, frames: list[bytes], size: int) -> str:
        """Queue ``frames`` (``size`` bytes on the wire) and write what the
        socket takes now, never blocking; "" or why the connection is
        lost."""
        sock = self.sock
        if not self.out and sock is not None and not self.connecting and size <= _JOIN:
            # Nothing queued ahead (the usual case, a lookup or a reply):
            # one buffer, one send.
            if len(frames) == 1:
                buf = len(frames[0]).to_bytes(HEADER, "big") + frames[0]
            else:
                buf = b"".join(
                    part for f in frames for part in (len(f).to_bytes(HEADER, "big"), f)
                )
            try:
                sent = sock.send(buf)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                return f"{LOST}: {exc.strerror or exc}"
            if sent < size:
                self.out.append(memoryview(buf)[sent:])
                self.out_bytes += size - sent
            return ""
        for frame in frames:
            self.out.append(memoryview(len(frame).to_bytes(HEADER, "big")))
            self.out.append(memoryview(frame))
        self.out_bytes += size
        if sock is not None and not self.connecting:
            return self.flush()
        return ""

    def flush(self) -> str:
        """Write what the socket takes of the queue; "" or why the
        connection is lost."""
        sock, out = self.sock, self.out
        while out and sock is not None:
            bufs = list(itertools.islice(out, _IOV))
            try:
                sent = sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return ""
            except OSError as exc:
                return f"{LOST}: {exc.strerror or exc}"
            self.out_bytes -= sent
            while sent:
                head = out[0]
                if sent >= len(head):
                    sent -= len(head)
                    out.popleft()
                else:
                    out[0] = head[sent:]
                    sent = 0
        return ""

    # -- input ---------------------------------------------------------------

    def read_one(self, chunk: memoryview) -> Inbound | None:
        """One read into ``chunk`` with nothing buffered, on a trusted
        connection: the frame, if the read was exactly one whole frame (a
        request or its reply, the usual case); else None, with what was
        read buffered (or the connection marked lost) for :meth:`fill` and
        :meth:`frames` to go on with."""
        sock = self.sock
        if sock is None or self.connecting or not self.trusted:
            return None
        try:
            # Trusted: its largest frame is past the chunk, so no bound
            # below the chunk's own size applies.
            got = sock.recv_into(chunk)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return None  # fill's next read says why
        if got > HEADER and _PREFIX.unpack_from(chunk)[0] == got - HEADER:
            return _frame(self.name, bytes(chunk[HEADER:got]))
        if got:
            self.rbuf += chunk[:got]
        return None

    def fill(self, chunk: memoryview, budget: int, gone: bool) -> tuple[int, str]:
        """Read up to ``budget`` bytes, never past the room its largest
        frame leaves in the buffer, through ``chunk`` (a buffer the
        transport reuses: ``recv`` would allocate one per read). Returns the
        bytes read and, if the connection ended, why. ``gone``: the poll
        said it hung up or failed, so a full buffer ends it too."""
        used = 0
        sock, most = self.sock, self.cap + HEADER
        while sock is not None and used < budget:
            room = most - len(self.rbuf)
            if room <= 0:
                if gone:  # nothing more can come, and it cannot be read
                    return used, LOST
                break
            want = min(RECV_CHUNK, room, budget - used)
            try:
                got = sock.recv_into(chunk, want)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                return used, f"{LOST}: {exc.strerror or exc}"
            if not got:
                return used, f"{LOST}: closed by the peer"
            self.rbuf += chunk[:got]
            used += got
            if got < want and not gone:
                break  # drained: the poll says when more comes
        return used, ""

    def frames(self, out: list[Inbound]) -> bool:
        """Move the complete frames buffered into ``out``; True if more are
        buffered past the per-poll bound. Raises :class:`FramingError` for a
        length no frame may have in this state. Before trust, a frame over
        :data:`MAX_UNTRUSTED_FRAME` but within the largest greeting stays
        buffered, unread, until trust or the handshake deadline."""
        buf, pos, end, taken = self.rbuf, 0, len(self.rbuf), 0
        name, cap = self.name, self.cap
        if not self.heard and end >= HEADER:
            self.heard = True
            what = foreign_protocol(buf[:HEADER])
            if what and not self.inbound:
                raise FramingError(
                    f"{self.name} answered as {what}: that is not a p2p_kv "
                    "port (did you name the engine's API port? name the "
                    "tier's 'port')",
                    "not_p2p_kv",
                )
        try:
            while end - pos >= HEADER:
                size = int.from_bytes(buf[pos : pos + HEADER], "big")
                if size > cap or size == 0:
                    if self.trusted or size == 0 or size > _MAX_GREETING_WIRE:
                        most = cap if self.trusted else _MAX_GREETING_WIRE
                        raise FramingError(
                            f"a frame of {size} bytes (at most {most} here)"
                        )
                    return False  # held until trusted or its deadline
                if end - pos - HEADER < size:
                    return False
                if taken == MAX_FRAMES_PER_POLL:
                    return True
                if not self.trusted:
                    self.untrusted_frames += 1
                    if self.untrusted_frames > MAX_FRAMES_BEFORE_TRUST:
                        raise FramingError(
                            f"more than {MAX_FRAMES_BEFORE_TRUST} frames before "
                            "the handshake ended",
                            "frames_before_trust",
                        )
                out.append(_frame(name, bytes(buf[pos + HEADER : pos + HEADER + size])))
                pos += HEADER + size
                taken += 1
            return False
        finally:
            if pos:
                del buf[:pos]
