"""ZeroMQ control plane: bytes in, bytes out, nothing else.

One ROUTER socket bound per engine receives every inbound peer; one DEALER
per outbound peer carries our requests to it. A connection is therefore one
direction of use (we consume over our DEALERs, we produce over our ROUTER),
which keeps each session's identity unambiguous without a second handshake
to merge two connections.

What pyzmq needs from us (and vLLM's in-tree tier got wrong): ``LINGER`` 0
so closing never blocks the engine; a bounded high-water mark and
non-blocking sends, so a stuck peer costs that peer its session, not our
memory; ``MAXMSGSIZE`` so an oversized frame is dropped by libzmq before it
is ever buffered; waiting with a Poller and a timeout instead of spinning.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import math
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from p2p_kv.procfs import socket_inode
from p2p_kv.protocol import MAX_FRAME_BYTES

HWM: Final = 10_000
#: Frames libzmq queues for us per connection, inbound (anyone who reaches
#: the port may open connections and send frames of up to 4 MiB before any
#: handshake: at HWM that queued 40 GiB a connection) or dialled (clients
#: name the peers we dial). A peer past it is held back by TCP, and its own
#: SNDHWM (HWM) queues the rest, so a healthy peer's burst is not lost;
#: only the memory moves to it.
RCV_HWM: Final = 256
#: Frames taken from one socket in one poll. A peer sending faster than we
#: read held the engine's step inside poll (5.5 s and 1.7 M frames for one
#: flood of 8-byte frames); the rest waits for the next poll.
MAX_FRAMES_PER_POLL: Final = 4096
#: Bytes taken in one poll, over all sockets: 4,096 frames of 4 MiB were
#: 16 GiB held in one list before any of it was looked at. The peers we
#: dialled are read first, each to a quarter of it, so a flood on the port
#: cannot starve the replies and heartbeats our own sessions wait for.
MAX_BYTES_PER_POLL: Final = 64 * 1024 * 1024


def parse_peer(peer: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` into host and port."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit() or not host.strip("[]"):
        raise ValueError(f"peer address {peer!r} is not host:port")
    if not 0 < int(port) < 65536:
        raise ValueError(f"peer address {peer!r}: port is not in 1..65535")
    return host.strip("[]"), int(port)


def zmq_endpoint(host: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}"


def _drain(
    sock: zmq.Socket[bytes], budget: int, multipart: bool = False
) -> tuple[list[Any], int, bool]:
    """What ``sock`` holds, up to :data:`MAX_FRAMES_PER_POLL` messages or
    ``budget`` bytes (the message that crosses it included): the messages,
    their bytes, and whether any were left unread."""
    got: list[Any] = []
    used = 0
    for _ in range(MAX_FRAMES_PER_POLL):
        if used >= budget:
            return got, used, True
        try:
            msg: Any = (
                sock.recv_multipart(flags=zmq.NOBLOCK)
                if multipart
                else sock.recv(flags=zmq.NOBLOCK)
            )
        except zmq.Again:
            return got, used, False
        used += len(msg[-1]) if multipart else len(msg)
        got.append(msg)
    return got, used, True


def resolve_bind_host(host: str) -> str:
    """libzmq binds interfaces or literal addresses, not names: resolve."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if host == "*":
        return host
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        infos, why = [], f": {exc}"
    else:
        why = ""
    if not infos:
        raise ValueError(
            f"p2p_kv: cannot resolve the host {host!r} to bind{why}; set the "
            "tier's 'host' key to an address or a name of this machine"
        )
    return str(infos[0][4][0])


def _bind_fix(errno_: int | None) -> str:
    """What to change when a bind fails: the port is taken, or the host is
    not an address of this machine (the fix named only the port, whatever
    the cause)."""
    if errno_ == errno.EADDRINUSE:
        return "pick a free port with the tier's 'port' key"
    if errno_ == errno.EADDRNOTAVAIL:
        return "set the tier's 'host' key to an address of this machine"
    return "check the tier's 'host' and 'port' keys"


#: Why a dial is lost when nothing accepts the connection.
UNREACHABLE = "nothing accepts connections there (refused or unreachable)"


@dataclass(frozen=True, slots=True)
class Inbound:
    """A frame from a peer: ``conn`` is ``in:<identity hex>`` for inbound
    connections or the ``host:port`` we dialled for outbound ones. ``lost``:
    no frame, the connection itself went down."""

    conn: str
    frame: bytes
    new: bool
    lost: bool = False
    #: why it went down, for the log (``lost`` only)
    why: str = ""


def wait_readable(fds: list[int], timeout_s: float) -> None:
    """Sleep until one of ``fds`` is readable (or its peer hung up) or
    ``timeout_s`` passes (see :meth:`ControlTransport.readiness_fds`).

    A descriptor closed under us (the engine's thread ended its session
    after the list was taken) is reported at once, every time: it is
    dropped and the wait goes on over the others, so it neither spins nor
    hides a frame arriving on them (sleeping the whole timeout instead
    held a lookup for the waker's idle bound). A list the kernel refuses
    (a negative descriptor) sleeps the timeout."""
    end = time.monotonic() + timeout_s
    live = list(fds)
    while live:
        poller = select.poll()
        try:
            for fd in live:
                poller.register(fd, select.POLLIN)
            left = max(0.0, end - time.monotonic())
            events = poller.poll(math.ceil(left * 1000))
        except (OSError, ValueError):
            break
        closed = {fd for fd, ev in events if ev & select.POLLNVAL}
        if len(closed) < len(events) or not events:
            return  # readable, hung up, or the timeout
        live = [fd for fd in live if fd not in closed]
    time.sleep(max(0.0, end - time.monotonic()))


class ControlTransport:
    """Non-blocking ZeroMQ sockets with a bounded wait."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        heartbeat_s: float = 0.5,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            # libzmq would bind it modulo 65536, and peers could not dial
            # the port we advertise.
            raise ValueError(f"p2p_kv: control port {port} is not in 0..65535")
        host = host.strip("[]")  # an IPv6 literal as written beside a port
        bind_host = resolve_bind_host(host)
        self._ctx = ctx or zmq.Context.instance()
        self._heartbeat_ms = max(1, int(heartbeat_s * 1000))
        self._router = self._socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if port == 0:
                port = self._router.bind_to_random_port(zmq_endpoint(bind_host, 0)[:-2])
            else:
                self._router.bind(zmq_endpoint(bind_host, port))
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            raise OSError(
                exc.errno,
                f"p2p_kv cannot bind its control socket on {host}:{port}: {exc} "
                f"({_bind_fix(exc.errno)})",
            ) from exc
        self.host, self.port = host, port
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._conn_inodes: dict[str, str] = {}
        self._by_socket: dict[zmq.Socket[bytes], str] = {}
        self._known_inbound: set[bytes] = set()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        # A self-pipe lets another thread (an engine driver with new work)
        # cut an idle wait short.
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.dropped_sends = 0
        self._woken = False

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 64)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # ZMTP heartbeats run on libzmq's I/O thread: a dead or hung peer is
        # found even while our engine step is blocked. A link that goes dark
        # (no FIN, no RST) is noticed only through a PING left unanswered,
        # so detection takes at most one PING interval plus the wait: kept
        # at 1.5 intervals, inside the two-interval target with room for
        # the poll loop. Frequent PINGs leave most of that to the wait, and
        # the wait is what a live peer must answer within: a process stalled
        # longer (a VM pause, a starved I/O thread) loses its sessions and
        # its loads fall back. PING every 1/8 interval, wait 11/8: a stall
        # of 1.375 intervals is survived (0.69 s at the default 0.5 s; with
        # a PING every 1/2 and a wait of 1, one interval).
        # (PING every interval with a two-interval wait took 2.5-2.9
        # intervals in the netns partition test.)
        ping_ms = max(1, self._heartbeat_ms // 8)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms // 2 - ping_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 2 * self._heartbeat_ms)
        return sock

    @property
    def address(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"{host}:{self.port}"

    def connect(self, peer: str) -> None:
        """Dial ``host:port``; frames to it may be sent at once (queued).
        Raises ValueError for an address libzmq refuses, leaving nothing
        open."""
        if peer in self._dealers:
            return
        host, port = parse_peer(peer)
        sock = monitor = None
        try:
            # Each of these may fail for want of sockets or descriptors
            # (EMFILE): the dial fails, the engine's step goes on.
            sock = self._socket(zmq.DEALER)
            # The monitor first: on loopback the connection can be up before
            # connect() returns, and its CONNECTED event names our socket.
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            )
            sock.connect(zmq_endpoint(host, port))
        except Exception as exc:
            if sock is not None:
                if monitor is not None:
                    sock.disable_monitor()
                    monitor.close(linger=0)
                sock.close(linger=0)
            if isinstance(exc, zmq.ZMQError | UnicodeError):
                raise ValueError(f"cannot dial {peer}: {exc}") from exc
            raise
        self._dealers[peer] = sock
        self._by_socket[sock] = peer
        self._poller.register(sock, zmq.POLLIN)
        self._monitors[monitor] = peer
        self._poller.register(monitor, zmq.POLLIN)

    def send(self, conn: str, frames: list[bytes]) -> bool:
        """Queue frames without blocking; False means the connection is
        unusable (queue full or peer unknown) and its session must close."""
        if conn.startswith("in:"):  # our names for inbound connections
            sock = self._router
        else:
            found = self._dealers.get(conn)
            if found is None:
                return False
            sock = found
        try:
            if sock is self._router:
                ident = bytes.fromhex(conn[3:])
                for frame in frames:
                    sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
            else:
                for frame in frames:
                    sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped_sends += 1
            return False
        finally:
            # A send, refused ones included, may take the edge of ZMQ_FD
            # that a frame arriving meanwhile raised: a thread asleep on
            # that descriptor (the waker) would not see the frame. The wake
            # pipe says it.
            with contextlib.suppress(zmq.ZMQError):
                if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    self.wake()
        return True

    def poll(self, timeout_s: float) -> list[Inbound]:
        """Drain everything readable; wait up to ``timeout_s`` if nothing is."""
        out: list[Inbound] = []
        events = dict(self._poller.poll(max(0, math.ceil(timeout_s * 1000))))
        if not events:
            return out
        if self._wake_r in events:
            self._woken = True
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        more = False
        budget = MAX_BYTES_PER_POLL
        for sock, peer in list(self._by_socket.items()):
            if sock in events:
                frames, used, left = _drain(sock, min(budget, MAX_BYTES_PER_POLL // 4))
                budget -= used
                more |= left
                out.extend(Inbound(peer, f, False) for f in frames)
        if self._router in events:
            # What the peers we dialled left, and at least their share.
            frames, _, left = _drain(
                self._router, max(budget, MAX_BYTES_PER_POLL // 4), multipart=True
            )
            more |= left
            for parts in frames:
                if len(parts) != 2:
                    continue
                ident, frame = parts
                new = ident not in self._known_inbound
                if new:
                    self._known_inbound.add(ident)
                out.append(Inbound(f"in:{ident.hex()}", frame, new))
        for monitor, peer in list(self._monitors.items()):
            if monitor not in events:
                continue
            lost = ""
            while True:
                try:
                    event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_CONNECTED:
                    if lost == UNREACHABLE:
                        lost = ""  # libzmq's retry got through after all
                    # The fd is libzmq's, in this process, and live now:
                    # name its socket before it can be closed and reused.
                    inode = socket_inode(int(event["value"]))
                    if inode is not None:
                        self._conn_inodes[peer] = inode
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    lost = "connection lost"
                    self._conn_inodes.pop(peer, None)
                elif event["event"] == zmq.EVENT_CONNECT_RETRIED:
                    # The dial failed (refused, unreachable) and libzmq will
                    # retry: it says nothing else, so a dial to a peer that
                    # is down waited out the handshake (5 s) a request.
                    lost = lost or UNREACHABLE
            if lost:
                out.append(Inbound(peer, b"", False, lost=True, why=lost))
        if more:
            # Left unread: the next poll must not wait (and a waker asleep
            # on the edge-triggered ZMQ_FD would not see them).
            self.wake()
        return out

    def connection_inode(self, peer: str) -> str | None:
        """Socket inode of our live TCP connection to ``peer`` (outbound
        only; None before it connects or after it drops)."""
        return self._conn_inodes.get(peer)

    def readiness_fds(self) -> list[int]:
        """Plain OS descriptors that turn readable when something may have
        arrived: each socket's ``ZMQ_FD`` and the wake pipe. Taken under the
        runtime's lock, they let another thread sleep until traffic comes
        (:func:`wait_readable`) without touching a ZeroMQ socket, which is
        not thread-safe. ``ZMQ_FD`` is edge-triggered and any call on its
        socket may consume the edge, so a wait that ends is a hint to poll,
        and a wait that does not end must still be bounded."""
        socks = [self._router, *self._dealers.values(), *self._monitors]
        return [self._wake_r, *(int(s.getsockopt(zmq.FD)) for s in socks)]

    def take_woken(self) -> bool:
        """Whether :meth:`wake` was called since the last check."""
        woken, self._woken = self._woken, False
        return woken

    def wake(self) -> None:
        """End a wait in :meth:`poll` now; safe from any thread, also
        after :meth:`close` (then it does nothing: the pipe's number may
        already name somebody else's file)."""
        with self._wake_lock, contextlib.suppress(BlockingIOError, OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    def close_conn(self, conn: str) -> None:
        if conn.startswith("in:"):
            self._known_inbound.discard(bytes.fromhex(conn[3:]))
            return
        sock = self._dealers.pop(conn, None)
        self._conn_inodes.pop(conn, None)
        if sock is not None:
            for monitor in [m for m, p in self._monitors.items() if p == conn]:
                self._poller.unregister(monitor)
                del self._monitors[monitor]
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                monitor.close(linger=0)
            self._poller.unregister(sock)
            del self._by_socket[sock]
            sock.close(linger=0)

    def close(self) -> None:
        """Close every socket; a second call does nothing (direct users,
        the doctor and benchmarks, close in ``finally`` blocks too)."""
        if self._router.closed:
            return
        for conn in list(self._dealers):
            self.close_conn(conn)
        self._poller.unregister(self._router)
        self._router.close(linger=0)
        with self._wake_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
