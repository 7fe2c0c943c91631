"""The ``peers`` names, resolved again and again off the engine's thread.

A name in ``peers`` (a Kubernetes headless Service, a DNS round robin) names
every address it resolves to, and those change as pods come and go. A
:class:`Resolver` thread resolves each name at start and every
``refresh_s`` after; the runtime takes what it found (:meth:`Resolver.take`)
under its own lock and hands it to the pure
:class:`~p2p_kv.node.membership.Membership`. A lookup can take seconds (a DNS
server that does not answer), which the engine's thread never waits for.

A name that no longer exists resolves to no address: its members go. Any
other failure (a DNS server down) keeps what the name resolved to before,
so a resolver outage does not empty the fleet; it is logged at a bounded
rate.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

from p2p_kv.node.membership import Entry
from p2p_kv.ratelog import PeerLog

log = logging.getLogger("vllm.p2p_kv")

#: How a name is resolved: ``(host, port)`` to its IP addresses ([] when the
#: name does not exist); any other failure raises. Injectable for tests.
Resolve = Callable[[str, int], Sequence[str]]

#: getaddrinfo's answers that mean "no such name" (not "try again").
_NO_SUCH_NAME = {
    code
    for code in (
        getattr(socket, "EAI_NONAME", None),
        getattr(socket, "EAI_NODATA", None),
    )
    if code is not None
}


def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for a TCP connection, or [] when
    the name does not exist; OSError for a failure worth trying again."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_NAME:
            return []
        raise
    # A link-local IPv6 address carries its interface ("fe80::1%eth0").
    return sorted({str(info[4][0]).split("%", 1)[0] for info in infos})


class Resolver:
    """A daemon thread resolving ``names`` every ``refresh_s``."""

    def __init__(
        self,
        names: Sequence[Entry],
        refresh_s: float,
        resolve: Resolve = resolve_host,
    ) -> None:
        self.names = tuple(names)
        self.refresh_s = refresh_s
        self._resolve = resolve
        self._lock = threading.Lock()
        #: what each name resolved to since the last take
        self._found: dict[Entry, tuple[str, ...]] = {}
        #: rounds completed, every name tried (tests wait on it)
        self.rounds = 0
        self._stop = threading.Event()
        self._log = PeerLog()  # this thread's own: PeerLog is not thread-safe
        self.thread = threading.Thread(
            target=self._run, name="p2p_kv-peers", daemon=True
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.resolve_all()
            self._stop.wait(self.refresh_s)

    def resolve_all(self) -> None:
        """One round: each name resolved, what it gave kept for :meth:`take`."""
        for entry in self.names:
            if self._stop.is_set():
                return
            try:
                addresses = tuple(self._resolve(entry.host, entry.port))
            except Exception as exc:  # a resolver's failure, whatever its kind
                self._log.warning(
                    "peers_unresolved",
                    str(entry),
                    "could not resolve this peers entry (%s); its members stay "
                    "as last resolved, tried again in %g s",
                    exc,
                    self.refresh_s,
                )
                continue
            with self._lock:
                self._found[entry] = addresses
        with self._lock:
            self.rounds += 1

    def take(self) -> dict[Entry, tuple[str, ...]]:
        """What each name resolved to since the last call (the latest)."""
        with self._lock:
            found, self._found = self._found, {}
        return found

    def stop(self) -> None:
        """End the thread; a lookup under way is not waited for (a daemon)."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=1.0)
