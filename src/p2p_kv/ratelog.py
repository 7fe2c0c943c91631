"""Log lines that a peer (or anyone who reaches the port) can cause.

Whoever triggers a line chooses how often it happens: a line per event let
a party without the secret write the log at the rate it opened connections
or sent bad frames. :class:`PeerLog` writes at most one line per kind of
event per ``interval_s``; that line names the peer of the latest event and
says how many more were suppressed since the last line. The budget is per
kind, not per peer, because peers are free to take new names (a new
connection is a new peer): a per-peer budget would bound nothing.

Every event is still counted by the caller's metrics; this only bounds the
log. Not thread-safe by itself: callers hold the runtime's lock.

A line names the peer as ``names`` says, when its owner sets it: the
runtime's names a connection by the address its metrics label shows
(:meth:`p2p_kv.runtime.frames.Frames.peer_name`), so a log line and a metric
about one peer carry the same name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("vllm.p2p_kv")

#: One line per kind of peer-triggered event at most this often.
INTERVAL_S = 10.0


@dataclass(slots=True)
class _Kind:
    next_at: float = 0.0
    suppressed: int = 0


class PeerLog:
    """At most one line per kind per ``interval_s``, naming the peer."""

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._kinds: dict[str, _Kind] = {}
        #: what a line calls the peer named ``peer`` (None: that name)
        self.names: Callable[[str], str] | None = None
        #: lines written and suppressed, over all kinds (tests read them)
        self.written = 0
        self.suppressed = 0

    def line(self, level: int, kind: str, peer: str, msg: str, *args: object) -> bool:
        """Log ``"p2p_kv: <peer>: " + msg % args`` at ``level`` unless a line
        of this ``kind`` was written less than ``interval_s`` ago; True if
        it was written. ``kind`` must come from our code, never from the
        peer (a peer-chosen kind would be a new budget each time)."""
        now = self._clock()
        state = self._kinds.get(kind)
        if state is None:
            state = self._kinds[kind] = _Kind()
        if now < state.next_at:
            state.suppressed += 1
            self.suppressed += 1
            return False
        more = ""
        if state.suppressed:
            more = f" ({state.suppressed} more like it since the last line)"
        state.next_at, state.suppressed = now + self.interval_s, 0
        self.written += 1
        if self.names is not None:
            peer = self.names(peer)
        # %r, cut: a peer's text may hold newlines (forged log lines).
        self._log.log(level, "p2p_kv: %.200r: " + msg + more, peer, *args)
        return True

    def warning(self, kind: str, peer: str, msg: str, *args: object) -> bool:
        return self.line(logging.WARNING, kind, peer, msg, *args)

    def info(self, kind: str, peer: str, msg: str, *args: object) -> bool:
        return self.line(logging.INFO, kind, peer, msg, *args)
