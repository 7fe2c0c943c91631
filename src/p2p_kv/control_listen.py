"""The control port: binding it, and taking connections from it within the
bounds that keep a flood from costing the process its descriptors.

Split from :mod:`p2p_kv.control` because the listening socket fails in ways
that concern no connection once it exists: a bind that fails names the key
to change; an accepted descriptor within :data:`FD_RESERVE` of the limit is
closed before anything reads it; an accept that fails for want of
descriptors or memory pauses accepting for :data:`ACCEPT_PAUSE_S` (the
listener stays readable, and asking again at once would spin). What becomes
of an accepted socket (its name, the bounds on connections still
handshaking, its reads) is :class:`~p2p_kv.control.ControlTransport`'s.
"""

from __future__ import annotations

import errno
import ipaddress
import resource
import select
import socket
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
#: How long accepting pauses after the process ran out of descriptors.
ACCEPT_PAUSE_S: Final = 0.1
#: Connections the kernel completes and queues for us to accept (it caps
#: this at ``net.core.somaxconn``, 4096 by default). A queue that
#: overflows drops the SYNs past it, and a dialler whose SYN was dropped
#: tries again only after a second: during a flood of connections a
#: member dialling in would wait that long. Queued connections cost the
#: kernel's memory, not ours, until accepted.
LISTEN_BACKLOG: Final = 4096

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
        """Up to :data:`ACCEPTS_PER_POLL` new connections, each with the far
        end's address, accepted as the caller asks for the next (those it
        does not ask for stay queued in the kernel). Blocking, as accepted:
        the caller makes those it keeps non-blocking."""
        for _ in range(ACCEPTS_PER_POLL):
            if self._sock is None:
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
