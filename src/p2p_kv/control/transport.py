"""Control plane: length-prefixed frames over plain non-blocking TCP.

Bytes in, bytes out, nothing else: what a frame means is the session's
business. Every frame on the wire is a 4-byte big-endian length, then that
many bytes (one msgpack message, or one sealed with the session's keys).
Each session has one TCP connection: we dial the peers we consume from
(the connection is named by the ``host:port`` dialled) and accept the
peers that consume from us (named ``in:<n>``, a counter).

The sockets belong to the runtime's thread that holds its lock: there is
no I/O thread of ours or anyone's, so nothing below us can assert, spin or
hold memory we did not give it. That is why this is not ZeroMQ: libzmq's
ROUTER aborts the process when a connecting party picks a routing id that
collides with the one it assigns the next peer (a peer chooses its own id,
and the assigned ones are predictable), before any frame of ours is read;
its I/O threads cost two thread wake-ups each way on every round trip;
and a listener flooded with half-open connections spun its I/O thread
while the process ran out of descriptors. ``docs/architecture.md``
("Control plane") has the numbers.

What anyone who reaches the port can make us hold, and for how long:

* **Connections still handshaking** (not yet :meth:`ControlTransport.trust`
  ed): at most :data:`MAX_HANDSHAKING` in all and
  :data:`MAX_HANDSHAKING_PER_HOST` from one address. A new one from an
  address at its bound is closed as it is accepted, before anything is
  read or built for it; past the global bound, an address holding fewer
  than the busiest takes the room of that one's oldest, and any other new
  one is closed. So a flood takes only its own addresses' room, and a
  member dialling from its own address gets in (``_admit``). Accepted
  connections wait for a session in :class:`~p2p_kv.control.listen.Waiting`
  (at most :data:`MAX_WAITING`, :data:`MAX_WAITING_PER_HOST` from one
  address), and the address holding the fewest is served first, so a
  member's dial does not queue behind a flood's. The session's
  handshake deadline closes any that stays silent. The kernel queues up to
  :data:`~p2p_kv.control.listen.LISTEN_BACKLOG` connections for us to
  accept, so a member's dial is not dropped while a flood fills the
  queue. An accepted descriptor within :data:`FD_RESERVE` of the
  process's limit is closed at once, so a flood cannot take the
  descriptors the engine itself needs.
* **Frames before trust** are read only up to :data:`MAX_UNTRUSTED_FRAME`
  bytes: a frame up to the largest greeting (a Region) waits unread until
  the connection is trusted or its handshake deadline passes, and a longer
  one ends the connection. At most :data:`MAX_FRAMES_BEFORE_TRUST` frames
  come before trust (an honest handshake takes three), and one that does
  not decode ends the connection (:mod:`p2p_kv.runtime.frames`). After trust a frame is
  at most :data:`MAX_WIRE_FRAME`; a longer one ends the connection.
* **Per poll**: at most :data:`MAX_FRAMES_PER_POLL` frames from one
  connection and :data:`MAX_BYTES_PER_POLL` bytes over all, the peers we
  dialled read first, so a flood on the port cannot starve the replies our
  own requests wait for; at most :data:`ACCEPTS_PER_POLL` accepts, of
  which at most :data:`ADMITS_PER_POLL` get a session, taken before the
  reads so a new connection's Hello is answered in the poll that accepts
  it.
* **Closed connections** wait at most :data:`CLOSE_LINGER_S` for the
  peer's end, at most :data:`MAX_LINGERING` at once, and what each still
  sends is read only up to :data:`LINGER_READ_BYTES`: past it, it is cut.
* **Output** queued for one peer is at most :data:`MAX_OUT_BYTES`: past
  it the send fails and the session ends (the peer stopped reading).

The pieces: one connection's bytes and the frame format are
:class:`~p2p_kv.control.connection.Conn`'s (``connection.py``); binding the
port and accepting from it within the descriptor reserve are
:class:`~p2p_kv.control.listen.Listener`'s (``listen.py``). This
module holds what spans connections: the poll set, the table of
connections, dialling, the budgets shared by a poll, the bounds on
connections still handshaking, and closing.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import itertools
import math
import os
import queue
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

from p2p_kv.control.connection import (
    HEADER,
    LOST,
    MAX_FRAMES_BEFORE_TRUST,
    MAX_FRAMES_PER_POLL,
    MAX_UNTRUSTED_FRAME,
    MAX_WIRE_FRAME,
    RECV_CHUNK,
    Conn,
    FramingError,
    Inbound,
    wire_size,
)
from p2p_kv.control.listen import (
    ACCEPT_PAUSE_S,
    ACCEPTS_PER_POLL,
    FD_RESERVE,
    MAX_WAITING,
    MAX_WAITING_PER_HOST,
    Listener,
    Waiting,
    family,
    resolve_bind_host,
)

__all__ = [
    "ACCEPTS_PER_POLL",
    "ACCEPT_PAUSE_S",
    "ADMITS_PER_POLL",
    "CLOSE_LINGER_S",
    "FD_RESERVE",
    "HEADER",
    "LINGER_READ_BYTES",
    "LOST",
    "MAX_BYTES_PER_POLL",
    "MAX_FRAMES_BEFORE_TRUST",
    "MAX_FRAMES_PER_POLL",
    "MAX_HANDSHAKING",
    "MAX_HANDSHAKING_PER_HOST",
    "MAX_LINGERING",
    "MAX_OUT_BYTES",
    "MAX_UNTRUSTED_FRAME",
    "MAX_WAITING",
    "MAX_WAITING_PER_HOST",
    "MAX_WIRE_FRAME",
    "RECV_CHUNK",
    "REFUSED",
    "ControlTransport",
    "FramingError",
    "Inbound",
    "dial_failure",
    "parse_peer",
    "resolve_bind_host",
    "wait_readable",
]

#: Connections still handshaking, in all and from one address.
MAX_HANDSHAKING: Final = 64
MAX_HANDSHAKING_PER_HOST: Final = 8
#: New connections given a session in one poll: each costs the engine's
#: thread a session and a greeting's answer, so this bounds what a flood
#: of connections adds to one step.
ADMITS_PER_POLL: Final = 8
#: Bytes read in one poll, over all connections; a dialled peer reads at
#: most a quarter of it first.
MAX_BYTES_PER_POLL: Final = 64 * 1024 * 1024
#: Bytes queued for one peer before a send fails.
MAX_OUT_BYTES: Final = 64 * 1024 * 1024
#: How long a connection we closed waits for the peer's end before its
#: descriptor goes (closing with unread input would reset the connection
#: and could lose the Goodbye we just sent), and how many may wait.
CLOSE_LINGER_S: Final = 1.0
MAX_LINGERING: Final = 256
#: What a closed connection may still send us before its descriptor goes
#: at once: a Goodbye's answer is a few hundred bytes, and a party that
#: writes on past our close is read no further.
LINGER_READ_BYTES: Final = 64 * 1024

_IN, _OUT = select.POLLIN, select.POLLOUT
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def parse_peer(peer: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` into host and port."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit() or not host.strip("[]"):
        raise ValueError(f"peer address {peer!r} is not host:port")
    if not 0 < int(port) < 65536:
        raise ValueError(f"peer address {peer!r}: port is not in 1..65535")
    return host.strip("[]"), int(port)


#: Why a dial ends, told apart from :data:`LOST` (the operator's fix
#: differs for each).
REFUSED = "connection refused: nothing listens there"


def wait_readable(fds: list[tuple[int, int]], timeout_s: float) -> None:
    """Sleep until one of ``fds`` (descriptor, poll events) is ready or
    hung up, or ``timeout_s`` passes (see
    :meth:`ControlTransport.readiness_fds`).

    A descriptor closed under us (the engine's thread ended its session
    after the list was taken) is dropped and the wait goes on over the
    others, so it neither spins nor hides a frame arriving on them. A list
    the kernel refuses sleeps the timeout."""
    end = time.monotonic() + timeout_s
    live = list(fds)
    while live:
        poller = select.poll()
        try:
            for fd, events in live:
                poller.register(fd, events)
            left = max(0.0, end - time.monotonic())
            ready = poller.poll(math.ceil(left * 1000))
        except (OSError, ValueError):
            break
        closed = {fd for fd, ev in ready if ev & select.POLLNVAL}
        if len(closed) < len(ready) or not ready:
            return  # ready, hung up, or the timeout
        live = [(fd, ev) for fd, ev in live if fd not in closed]
    time.sleep(max(0.0, end - time.monotonic()))


class ControlTransport:
    """Non-blocking TCP connections with a bounded wait. Not thread-safe
    but for :meth:`wake`: callers hold the runtime's lock."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_handshaking: int = MAX_HANDSHAKING,
        max_handshaking_per_host: int = MAX_HANDSHAKING_PER_HOST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.max_handshaking = max_handshaking
        self.max_handshaking_per_host = max_handshaking_per_host
        self._poller = select.poll()
        #: what the port saw, for metrics and tests
        self.counters: dict[str, int] = {
            "accepted": 0,
            "evicted_handshaking": 0,
            "refused_handshaking": 0,
            "refused_waiting": 0,
            "refused_fd_reserve": 0,
            "accept_errors": 0,
            "framing_errors": 0,
            "untrusted_frames_past_bound": 0,
            "send_overflows": 0,
            "lingering_bytes": 0,
            "lingering_cut": 0,
        }
        #: None once closed
        self._listener: Listener | None = Listener(
            host, port, poller=self._poller, counters=self.counters, clock=clock
        )
        self.host, self.port = self._listener.host, self._listener.port
        self._conns: dict[str, Conn] = {}
        self._by_fd: dict[int, Conn] = {}
        #: inbound connections not yet trusted, oldest first
        self._handshaking: dict[str, Conn] = {}
        self._inbound_ids = itertools.count(1)
        #: accepted, not yet given a session (a session a poll goes to the
        #: address holding the fewest)
        self._waiting = Waiting()
        #: connections with complete frames still buffered, or lost ones
        #: not yet reported: the next poll does not wait
        self._backlog: set[Conn] = set()
        #: closed by us, waiting for the peer's end: fd -> (socket, until,
        #: bytes it may still send)
        self._lingering: dict[int, tuple[socket.socket, float, int]] = {}
        self._resolver: ThreadPoolExecutor | None = None
        self._resolved: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        # A self-pipe lets another thread (an engine driver with new work,
        # the resolver) cut a wait short.
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, _IN)
        self._woken = False
        #: every read lands here first (``recv`` would allocate, and at
        #: this size map and unmap, a buffer of the largest read each time)
        self._chunk = memoryview(bytearray(RECV_CHUNK))

    # -- addresses -----------------------------------------------------------

    @property
    def address(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"{host}:{self.port}"

    # -- dialling ------------------------------------------------------------

    def connect(self, peer: str) -> None:
        """Dial ``host:port``; frames to it may be sent at once (queued until
        it connects). A name is resolved off this thread. Raises ValueError
        for an address that is not ``host:port``, leaving nothing open."""
        known = self._conns.get(peer)
        if known is not None and not known.dead:
            return
        if known is not None:
            self.close_conn(peer)
        host, port = parse_peer(peer)
        conn = Conn(peer, inbound=False)
        self._conns[peer] = conn
        try:
            ipaddress.ip_address(host)
        except ValueError:
            conn.resolving = True
            if self._resolver is None:
                self._resolver = ThreadPoolExecutor(2, thread_name_prefix="p2p_kv-dns")
            self._resolver.submit(_resolve, host, port).add_done_callback(
                lambda done: self._on_resolved(peer, done)
            )
            return
        self._dial(conn, (host, port))

    def _on_resolved(self, peer: str, done: Future[tuple[str, int]]) -> None:
        """The resolver thread's end: handed to the next poll."""
        try:
            result: object = done.result()
        except Exception as exc:
            result = exc
        self._resolved.put((peer, result))
        self.wake()

    def _dial(self, conn: Conn, addr: tuple[str, int]) -> None:
        conn.resolving = False
        try:
            sock = socket.socket(family(addr[0]), socket.SOCK_STREAM)
        except OSError as exc:
            self._kill(conn, f"cannot make a socket: {exc.strerror or exc}")
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sock, conn.fd = sock, sock.fileno()
        self._by_fd[conn.fd] = conn
        err = sock.connect_ex(addr)
        if err in (errno.EINPROGRESS, errno.EWOULDBLOCK):
            conn.connecting = True
        elif err:
            self._kill(conn, _dial_error(err, conn.name))
            return
        else:
            self._connected(conn)
        self._update(conn)

    def _connected(self, conn: Conn) -> None:
        conn.connecting = False
        with contextlib.suppress(OSError):
            conn.inode = str(os.fstat(conn.fd).st_ino)
        self._flush(conn)

    # -- sending -------------------------------------------------------------

    def send(self, conn: str, frames: list[bytes]) -> str:
        """Queue ``frames`` for ``conn`` and write what the socket takes now,
        never blocking. Returns "" or why the connection is unusable (its
        session must end): unknown, gone, or its peer stopped reading."""
        c = self._conns.get(conn)
        if c is None:
            return "no such connection"
        if c.dead:
            return c.dead
        size = HEADER + len(frames[0]) if len(frames) == 1 else wire_size(frames)
        if c.out_bytes + size > MAX_OUT_BYTES:
            self.counters["send_overflows"] += 1
            return f"more than {MAX_OUT_BYTES} bytes queued: the peer stopped reading"
        why = c.send(frames, size)
        if why:
            self._kill(c, why)
        elif c.out or c.mask != _IN:
            # Something stayed queued, or the mask is not the idle one:
            # register what it waits for now. (Input only, all written: the
            # mask stands, as the buffer it depends on is not touched here.)
            self._update(c)
        return c.dead

    def _flush(self, c: Conn) -> None:
        """Write what the socket takes of ``c``'s queue."""
        why = c.flush()
        if why:
            self._kill(c, why)

    # -- receiving -----------------------------------------------------------

    def poll(self, timeout_s: float) -> list[Inbound]:
        """Everything that arrived, up to the per-poll bounds; waits up to
        ``timeout_s`` if nothing has."""
        listener = self._listener
        wait_s = 0.0 if self.pending() else timeout_s
        if listener is not None and listener.paused_until:
            now = self._clock()
            listener.resume(now)
            if listener.paused_until:
                wait_s = min(wait_s, listener.paused_until - now)
        if self._lingering:
            wait_s = min(wait_s, CLOSE_LINGER_S)
        try:
            ready = self._poller.poll(max(0, math.ceil(wait_s * 1000)))
        except InterruptedError:
            ready = []
        if len(ready) == 1 and not (self._lingering or self._backlog or self._waiting):
            # The usual wake-up: one frame on one proven connection. Taken
            # in one read; anything else falls through to the general path.
            fd, ev = ready[0]
            c = self._by_fd.get(fd)
            if c is not None and ev == _IN and c.trusted and not c.rbuf and not c.dead:
                got = c.read_one(self._chunk)
                if got is not None:
                    return [got]
        out: list[Inbound] = []
        listen_fd = -1 if listener is None else listener.fd
        if self._lingering:
            self._linger(ready)
        readable: dict[Conn, bool] = {}  # -> hung up
        accept = False
        by_fd = self._by_fd
        for fd, ev in ready:
            if fd == self._wake_r:
                self._woken = True
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                continue
            if fd == listen_fd:
                accept = True
                continue
            c = by_fd.get(fd)
            if c is None or c.dead:
                continue
            if c.connecting:
                err = (
                    c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if c.sock
                    else 0
                )
                if err:
                    self._kill(c, _dial_error(err, c.name))
                    continue
                if ev & (_OUT | _IN):
                    self._connected(c)
            elif ev & _OUT:
                self._flush(c)
            if ev & (_IN | _GONE) and not c.dead:
                readable[c] = bool(ev & _GONE)  # _read registers its mask
            else:
                self._update(c)
        if (accept and listener is not None) or self._waiting:
            # Before the reads: a connection's Hello usually came with it,
            # and is answered in this poll, so a member's handshake does
            # not wait a poll for every step (while newer connections
            # queue behind it).
            for c in self._accept(listener, out):
                readable.setdefault(c, False)
        while not self._resolved.empty():
            peer, result = self._resolved.get_nowait()
            c = self._conns.get(peer)
            if c is None or not c.resolving:
                continue
            if isinstance(result, tuple):
                self._dial(c, result)
            else:
                host = parse_peer(peer)[0]
                self._kill(c, f"cannot resolve the host {host!r}: {result}")
        # Dialled peers first, each to a quarter of the budget, then the
        # connections that proved themselves, then those handshaking.
        for c in self._backlog:
            readable.setdefault(c, False)
        budget = MAX_BYTES_PER_POLL
        order = (
            readable
            if len(readable) < 2
            else sorted(readable, key=lambda c: (c.inbound, not c.trusted))
        )
        for c in order:
            if c.dead:
                continue
            share = budget if c.inbound else min(budget, MAX_BYTES_PER_POLL // 4)
            budget -= self._read(c, share, readable[c], out)
        if self._backlog:
            for c in [c for c in self._backlog if c.dead]:
                out.append(Inbound(c.name, b"", lost=True, why=c.dead, bad=c.bad))
                self._backlog.discard(c)
        return out

    def _read(self, c: Conn, budget: int, gone: bool, out: list[Inbound]) -> int:
        """Take ``c``'s frames into ``out``; the bytes read. ``gone``: the
        poll said the connection hung up or failed."""
        if self._backlog:
            self._backlog.discard(c)
        used, eof = c.fill(self._chunk, budget, gone)
        try:
            more = c.frames(out)
        except FramingError as exc:
            self.counters["framing_errors"] += 1
            if exc.reason == "frames_before_trust":
                self.counters["untrusted_frames_past_bound"] += 1
            self._kill(c, str(exc), bad=exc.reason)
            return used
        if more:
            self._backlog.add(c)
        elif eof:
            self._kill(c, eof)
        if c.rbuf or c.out or c.mask != _IN:
            # (All read, nothing queued, waiting for input: the mask stands.)
            self._update(c)
        return used

    def _accept(self, listener: Listener | None, out: list[Inbound]) -> list[Conn]:
        """Take what the listener accepted into :class:`Waiting` (one from
        an address at its bound of connections still handshaking is closed
        at once), then give sessions to up to :data:`ADMITS_PER_POLL` of the
        waiting, the address holding the fewest first, within the bounds on
        those handshaking (:meth:`_admit`); the new connections (their
        first frames are read in this poll)."""
        waiting = self._waiting
        held = Counter(c.host for c in self._handshaking.values())
        for sock, host in listener.accept() if listener is not None else ():
            if held[host] >= self.max_handshaking_per_host:
                # Closed before anything is read or built for it: a flood
                # from one address costs us an accept and a close each.
                self.counters["refused_handshaking"] += 1
                sock.close()
                continue
            dropped = waiting.add(sock, host)
            if dropped is not None:
                self.counters["refused_waiting"] += 1
                dropped.close()
        new: list[Conn] = []
        while len(new) < ADMITS_PER_POLL:
            got = waiting.take(held.__getitem__)
            if got is None:
                break
            sock, host = got
            if not self._admit(host, out):
                self.counters["refused_handshaking"] += 1
                sock.close()
                continue
            held[host] += 1
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Conn(
                f"in:{next(self._inbound_ids)}",
                inbound=True,
                host=host,
                remote=_far_end(sock, host),
            )
            c.sock, c.fd = sock, sock.fileno()
            self._conns[c.name] = c
            self._by_fd[c.fd] = c
            self._handshaking[c.name] = c
            self._update(c)
            out.append(Inbound(c.name, b"", new=True, why=host))
            new.append(c)
        return [c for c in new if not c.dead]

    def _admit(self, host: str, out: list[Inbound]) -> bool:
        """Whether a new connection from ``host`` may handshake. An address
        holding :attr:`max_handshaking_per_host` still handshaking gets no
        more. Past the global bound, an address holding fewer than the
        busiest one takes the room of that one's oldest; else the new one
        is refused. So a flood takes the room of its own addresses only,
        and a member dialling from its own address gets in and keeps its
        connection through the handshake, however fast the flood comes."""
        handshaking = self._handshaking
        held: dict[str, list[Conn]] = {}
        for c in handshaking.values():  # oldest first
            held.setdefault(c.host, []).append(c)
        mine = len(held.get(host, ()))
        if mine >= self.max_handshaking_per_host:
            return False
        if len(handshaking) < self.max_handshaking:
            return True
        busiest = max(held.values(), key=len)
        if len(busiest) <= mine + 1:
            return False
        victim = busiest[0]
        self.counters["evicted_handshaking"] += 1
        why = "closed: too many connections still handshaking"
        self._kill(victim, why)
        self._backlog.discard(victim)
        out.append(Inbound(victim.name, b"", lost=True, why=why))
        return True

    # -- state changes -------------------------------------------------------

    def trust(self, conn: str) -> None:
        """``conn``'s peer proved itself (the session checked its handshake):
        it may send frames of any legal size, and no longer counts against
        the bounds on connections still handshaking."""
        c = self._conns.get(conn)
        if c is None or c.trusted:
            return
        c.trusted = True
        self._handshaking.pop(conn, None)
        if c.rbuf:
            self._backlog.add(c)  # a frame held back for this
        self._update(c)

    def _kill(self, c: Conn, why: str, bad: str = "") -> None:
        """``c`` went down: reported by the next poll (once), closed by
        :meth:`close_conn`."""
        if c.dead:
            return
        c.fail(why or LOST, bad)
        self._handshaking.pop(c.name, None)
        self._backlog.add(c)
        if c.fd >= 0 and c.mask:
            self._poller.unregister(c.fd)
            c.mask = 0

    def _update(self, c: Conn) -> None:
        """Register what ``c`` waits for: input while its buffer has room,
        output while it has some queued or is connecting."""
        if c.dead or c.fd < 0:
            return
        mask = c.wants()
        if mask == c.mask:
            return
        if c.mask and mask:
            self._poller.modify(c.fd, mask)
        elif mask:
            self._poller.register(c.fd, mask)
        else:
            self._poller.unregister(c.fd)
        c.mask = mask

    def connection_inode(self, peer: str) -> str | None:
        """Socket inode of our live TCP connection to ``peer`` (outbound
        only; None before it connects or after it drops)."""
        c = self._conns.get(peer)
        return None if c is None or c.dead or c.inbound else c.inode

    def remote(self, conn: str) -> str | None:
        """The far end's ``host:port`` of inbound connection ``conn`` while
        it is open (None for a dialled one: its name is that address)."""
        c = self._conns.get(conn)
        if c is None or not c.inbound:
            return None
        return c.remote or None

    def connected(self, peer: str) -> bool:
        """Whether our dial to ``peer`` ever connected."""
        c = self._conns.get(peer)
        return c is not None and c.inode is not None

    def readiness_fds(self) -> list[tuple[int, int]]:
        """Descriptors and the events to wait for, when something may have
        arrived or may be written: the wake pipe, the listener, and every
        connection as :meth:`poll` waits on it. Taken under the runtime's
        lock, they let another thread sleep until traffic comes
        (:func:`wait_readable`) without touching the transport."""
        fds = [(self._wake_r, _IN)]
        listener = self._listener
        if listener is not None and not listener.paused_until:
            fds.append((listener.fd, _IN))
        fds.extend((c.fd, c.mask) for c in self._by_fd.values() if c.mask)
        fds.extend((fd, _IN) for fd in self._lingering)
        return fds

    def pending(self) -> bool:
        """Whether a poll now would return without waiting."""
        return bool(self._backlog or self._waiting) or not self._resolved.empty()

    def take_woken(self) -> bool:
        """Whether :meth:`wake` was called since the last check."""
        woken, self._woken = self._woken, False
        return woken

    def wake(self) -> None:
        """End a wait in :meth:`poll` now; safe from any thread, also after
        :meth:`close` (then it does nothing: the pipe's number may already
        name somebody else's file)."""
        with self._wake_lock, contextlib.suppress(BlockingIOError, OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    # -- closing -------------------------------------------------------------

    def close_conn(self, conn: str) -> None:
        """Close ``conn``: what is queued for it is written if the socket
        takes it now, then our end is shut, and the descriptor waits (at
        most :data:`CLOSE_LINGER_S`) for the peer's end so that unread input
        does not reset the connection under the frames just sent."""
        c = self._conns.pop(conn, None)
        if c is None:
            return
        self._handshaking.pop(conn, None)
        self._backlog.discard(c)
        if c.fd >= 0:
            self._by_fd.pop(c.fd, None)
            if c.mask:
                self._poller.unregister(c.fd)
                c.mask = 0
        sock, c.sock = c.sock, None
        if sock is None:
            return
        if not c.dead and not c.connecting:
            self._flush(c)
        if c.dead or c.connecting or len(self._lingering) >= MAX_LINGERING:
            sock.close()
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self._lingering[c.fd] = (
            sock,
            self._clock() + CLOSE_LINGER_S,
            LINGER_READ_BYTES,
        )
        self._poller.register(c.fd, _IN)

    def _linger(self, ready: list[tuple[int, int]]) -> None:
        """Read and drop what closing connections still send; close each at
        the peer's end or its deadline."""
        now = self._clock()
        hit = {fd for fd, _ in ready if fd in self._lingering}
        for fd, (sock, until, left) in list(self._lingering.items()):
            done = now >= until
            if fd in hit and not done:
                try:
                    got = sock.recv_into(self._chunk, left)
                except (BlockingIOError, InterruptedError):
                    got = -1
                except OSError:
                    got = 0
                self.counters["lingering_bytes"] += max(0, got)
                done = got == 0
                if got >= left:
                    # Still writing past our close: cut (a reset is all
                    # such a party hears).
                    self.counters["lingering_cut"] += 1
                    done = True
                elif got > 0:
                    self._lingering[fd] = (sock, until, left - got)
            if done:
                del self._lingering[fd]
                self._poller.unregister(fd)
                sock.close()

    def close(self) -> None:
        """Close every connection and the listener; a second call does
        nothing."""
        if self._listener is None:
            return
        for name in list(self._conns):
            self.close_conn(name)
        for sock, _, _ in self._lingering.values():
            sock.close()
        self._lingering.clear()
        self._waiting.close()
        self._listener.close()
        self._listener = None
        if self._resolver is not None:
            self._resolver.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _far_end(sock: socket.socket, host: str) -> str:
    """``host:port`` of an accepted socket's far end (``[host]:port`` for
    IPv6), as a dialled peer is named; ``host`` alone if the connection is
    already gone."""
    try:
        port = sock.getpeername()[1]
    except (OSError, IndexError):
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(host: str, port: int) -> tuple[str, int]:
    """The first TCP address of ``host`` (on the resolver thread)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"no address for {host!r}")
    addr = infos[0][4]
    return str(addr[0]), int(addr[1])


#: Why a dial ended, as the metric's label, from the reasons this module
#: gives (:data:`REFUSED`, ``cannot resolve``, ``answered as``, ``cannot
#: reach``).
_DIAL_FAILURES: Final = (
    (REFUSED, "refused"),
    ("cannot resolve", "unresolvable"),
    ("answered as", "not_p2p_kv"),
    ("cannot reach", "unreachable"),
    ("a frame of", "framing"),
)


def dial_failure(why: str) -> str:
    """The label of a failed dial's reason (``lost`` for anything else: the
    peer closed or reset the connection before its handshake ended)."""
    head = why[:200]
    for start, label in _DIAL_FAILURES:
        if start in head:
            return label
    return "lost"


def _dial_error(err: int, peer: str) -> str:
    """Why a dial to ``peer`` failed, as the operator's fix differs."""
    if err == errno.ECONNREFUSED:
        return f"{REFUSED} ({peer})"
    return f"cannot reach {peer}: {os.strerror(err)}"
