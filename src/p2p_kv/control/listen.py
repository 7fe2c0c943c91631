"""The control port: binding it, and taking connections from it within the
bounds that keep a flood from costing the process its descriptors.

Split from :mod:`p2p_kv.control.transport` because the listening socket fails in ways
that concern no connection once it exists: a bind that fails names the key
to change; an accepted descriptor within :data:`FD_RESERVE` of the limit is
closed before anything reads it; an accept that fails for want of
descriptors or memory pauses accepting for :data:`ACCEPT_PAUSE_S` (the
listener stays readable, and asking again at once would spin). What becomes
of an accepted socket (its name, the bounds on connections still
handshaking, its reads) is :class:`~p2p_kv.control.transport.ControlTransport`'s.

The kernel's accept queue is first come, first served: a flood that fills
it makes a member's dial wait behind thousands of the flood's connections
(a second and more on two cores). So accepted connections wait in
:class:`Waiting`, bounded and grouped by address, and the transport gives
the next session to the address holding the fewest: the flood's
connections queue behind each other, not in front of a member's.
"""

from __future__ import annotations

import errno
import ipaddress
import resource
import select
import socket
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final

#: Descriptors kept free for the engine: an accepted connection whose
#: descriptor number comes within this of ``RLIMIT_NOFILE`` is closed.
FD_RESERVE: Final = 64
#: Connections accepted in one poll. Most of a flood's are closed as
#: they are accepted (the bounds on connections still handshaking), at a
#: few microseconds each: taking many a poll keeps the kernel's queue
#: short, so a member's dial waits behind few others.
ACCEPTS_PER_POLL: Final = 256
#: Engine-thread time one poll spends accepting, at most (checked every
#: 16 accepts): a flood's accepts and closes then add no more than this
#: to a step, whatever the machine's speed.
ACCEPT_BUDGET_S: Final = 0.002
#: How long accepting pauses after the process ran out of descriptors.
ACCEPT_PAUSE_S: Final = 0.1
#: Connections the kernel completes and queues for us to accept (it caps
#: this at ``net.core.somaxconn``, 4096 by default). A queue that
#: overflows drops the SYNs past it, and a dialler whose SYN was dropped
#: tries again only after a second: during a flood of connections a
#: member dialling in would wait that long. Queued connections cost the
#: kernel's memory, not ours, until accepted.
LISTEN_BACKLOG: Final = 4096
#: Accepted connections waiting for a session, in all and from one
#: address. Past the bound from one address a new one is closed; past the
#: bound in all, the oldest of the address with the most waiting is.
MAX_WAITING: Final = 256
MAX_WAITING_PER_HOST: Final = 8

_IN = select.POLLIN


def resolve_bind_host(host: str) -> str:
    """The address to bind for ``host`` (a name is resolved once, here, at
    start)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
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
    not an address of this machine."""
    if errno_ == errno.EADDRINUSE:
        return "pick a free port with the tier's 'port' key"
    if errno_ == errno.EADDRNOTAVAIL:
        return "set the tier's 'host' key to an address of this machine"
    return "check the tier's 'host' and 'port' keys"


def family(host: str) -> socket.AddressFamily:
    """The socket family of the address ``host``."""
    return (
        socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    )


class Listener:
    """The bound, listening, non-blocking socket. It keeps itself in the
    transport's poll set while it accepts, out of it while paused or
    closed, and counts what it accepted, refused and failed to accept in
    the transport's counters."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        poller: select.poll,
        counters: dict[str, int],
        clock: Callable[[], float],
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"p2p_kv: control port {port} is not in 0..65535")
        host = host.strip("[]")  # an IPv6 literal as written beside a port
        bind_host = resolve_bind_host(host)
        sock = socket.socket(family(bind_host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind_host, port))
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno,
                f"p2p_kv cannot bind its control socket on {host}:{port}: "
                f"{exc.strerror or exc} ({_bind_fix(exc.errno)})",
            ) from exc
        self._sock: socket.socket | None = sock
        self.fd = sock.fileno()
        self.host, self.port = host, int(sock.getsockname()[1])
        self._poller = poller
        self._counters = counters
        self._clock = clock
        self._fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        #: when a pause in accepting ends (0.0: not paused)
        self.paused_until = 0.0
        poller.register(self.fd, _IN)

    def resume(self, now: float) -> None:
        """End the pause in accepting if its time has come."""
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            if self._sock is not None:
                self._poller.register(self.fd, _IN)

    def accept(self) -> Iterator[tuple[socket.socket, str]]:
        """Up to :data:`ACCEPTS_PER_POLL` new connections (within
        :data:`ACCEPT_BUDGET_S`), each with the far
        end's address, accepted as the caller asks for the next (those it
        does not ask for stay queued in the kernel). Blocking, as accepted:
        the caller makes those it keeps non-blocking."""
        end = self._clock() + ACCEPT_BUDGET_S
        for i in range(ACCEPTS_PER_POLL):
            if self._sock is None or (i % 16 == 15 and self._clock() >= end):
                break
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                # Out of descriptors or memory: stop asking for a while.
                self._counters["accept_errors"] += 1
                self._poller.unregister(self.fd)
                self.paused_until = self._clock() + ACCEPT_PAUSE_S
                break
            if sock.fileno() >= self._fd_limit - FD_RESERVE:
                self._counters["refused_fd_reserve"] += 1
                sock.close()
                continue
            self._counters["accepted"] += 1
            yield sock, str(addr[0]) if isinstance(addr, tuple) else ""

    def close(self) -> None:
        """Stop listening; a second call does nothing."""
        if self._sock is None:
            return
        if not self.paused_until:
            self._poller.unregister(self.fd)
        self._sock.close()
        self._sock = None


class Waiting:
    """Accepted connections not yet given a session, by the address they
    came from, each address's oldest first. Its owner takes them out
    (:meth:`take`) or closes them all (:meth:`close`); what it drops at a
    bound it hands back to be closed."""

    def __init__(
        self, bound: int = MAX_WAITING, per_host: int = MAX_WAITING_PER_HOST
    ) -> None:
        self.bound, self.per_host = bound, per_host
        self._by_host: dict[str, deque[socket.socket]] = {}
        #: addresses by how many they have waiting (1..per_host): the
        #: busiest is found without a scan
        self._with: list[set[str]] = [set() for _ in range(per_host + 1)]
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, sock: socket.socket, host: str) -> socket.socket | None:
        """Keep ``sock`` from ``host``; the connection to close if a bound
        was passed (``sock`` itself when its address has its bound
        waiting)."""
        q = self._by_host.setdefault(host, deque())
        if len(q) >= self.per_host:
            return sock
        self._move(host, len(q), len(q) + 1)
        q.append(sock)
        self._n += 1
        if self._n <= self.bound:
            return None
        busiest = next(iter(next(s for s in reversed(self._with) if s)))
        return self._pop(busiest)

    def take(self, rank: Callable[[str], int]) -> tuple[socket.socket, str] | None:
        """The oldest connection of the address ranked lowest (ties: the one
        with the fewest waiting), or None when none waits."""
        best: tuple[int, int, str] | None = None
        for host, q in self._by_host.items():
            key = (rank(host), len(q), host)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        return self._pop(best[2]), best[2]

    def close(self) -> None:
        """Close every waiting connection."""
        for q in self._by_host.values():
            for sock in q:
                sock.close()
        self._by_host.clear()
        for s in self._with:
            s.clear()
        self._n = 0

    def _pop(self, host: str) -> socket.socket:
        q = self._by_host[host]
        self._move(host, len(q), len(q) - 1)
        sock = q.popleft()
        self._n -= 1
        if not q:
            del self._by_host[host]
        return sock

    def _move(self, host: str, was: int, now: int) -> None:
        self._with[was].discard(host)
        if now:
            self._with[now].add(host)
