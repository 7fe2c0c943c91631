"""The manager's sessions: which peers we talk to, and what they hold.

:class:`Peers` decides who gets a session: dials within ``max_peers``
(closing an idle one for room), inbound connections within
``max_inbound``, the reconnect backoff, and the connections refused for
good. :class:`SessionWork` is what the sessions hold for the engine's step:
the sessions touched since their output was taken, the peers with lookups
to serve, the timers that wake sessions, and the offered blocks of
sessions that ended. Neither reads a request: the manager passes what they
need (the peers live requests name) at each call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterator, Mapping
from typing import TypeVar

from p2p_kv.lifecycle import Event
from p2p_kv.node.indexes import residue_of
from p2p_kv.node.settings import NodeSettings
from p2p_kv.node.tallies import Tallies
from p2p_kv.node.timers import OrphanDue, SessionDue, Timers
from p2p_kv.peer import (
    KeyCount,
    Serve,
    Session,
    is_inbound,
)
from p2p_kv.peer.events import RuntimeEvent
from p2p_kv.peer.records import StoreResult

#: Refused inbound connections remembered (their frames dropped unread).
MAX_REFUSED_INBOUND = 4096
#: Dials past ``max_peers`` while idle sessions closed for room still hold
#: their sockets (``p2p_kv.runtime.config.MAX_PEERS`` leaves room for 20 there).
CLOSING_ROOM = 16
T = TypeVar("T")
#: Session counts a report always has, so a reader may index them while no
#: session is up.
SESSION_KEYS = (
    "probes",
    "loads",
    "serves",
    "writes",
    "fenced_results",
    "offers",
    "revoked",
)


class Peers:
    """Sessions by peer, and the bounds on opening them.

    What a connection's path reads of the sessions is kept as they change,
    so that none scans every session: anyone who reaches the port opens
    sessions, and a scan per connection would make N of them cost the
    engine's thread O(N^2) in one poll."""

    def __init__(
        self,
        settings: NodeSettings,
        tallies: Tallies,
        nonces: Callable[[], bytes],
        touch: Callable[[Session], None],
    ) -> None:
        self._settings = settings
        self._tallies = tallies
        #: A fresh handshake nonce per session, from the caller: the core
        #: draws no randomness, as it reads no clock (runs replay exactly).
        self._nonces = nonces
        self._touch = touch
        self._inbound_ids = itertools.count(1)
        #: every session together: lookup keys queued for our engine, and
        #: keys of fetches waiting for stores (Limits.engine_*)
        self.pending_keys, self.waiting_keys = KeyCount(), KeyCount()
        self.sessions: dict[str, Session] = {}
        #: Inbound sessions still handshaking, oldest first (the one
        #: max_inbound drops). Each leaves as it becomes ready
        #: (:meth:`on_ready`) or closes (Session.on_close, whoever closes it).
        self.handshaking: dict[str, Session] = {}
        #: Inbound sessions ready and not closed (max_inbound's other count).
        self.ready_inbound = 0
        #: Sessions we dialled, in ``sessions``' order (max_peers).
        self.dialled: dict[str, Session] = {}
        #: When a peer whose session ended may be dialled again, in expiry
        #: order (one backoff for all).
        self.retry_at: dict[str, float] = {}
        #: Inbound connections refused (max_inbound): their frames are
        #: dropped, and counted once. Insertion-ordered, the oldest go first.
        self.refused_inbound: dict[str, None] = {}
        self.to_connect: list[str] = []
        self._ticked = -float("inf")

    # -- dialling -----------------------------------------------------------

    def session_for(
        self, peer: str, now: float, busy: Callable[[], Container[str]]
    ) -> Session | None:
        """The live session to ``peer``, dialling one if none; None when
        closed, in the backoff, or refused for ``max_peers``. ``busy``: the
        peers live requests name (never closed for room), asked only when
        a dial needs room."""
        session = self.sessions.get(peer)
        if session is not None and not session.link.closed:
            session.used_at = now
            return session
        if session is not None:
            return None  # closed, awaiting invalidation
        if now < self.retry_at.get(peer, 0.0):
            return None
        if len(self.dialled) >= self._settings.max_peers and not self._make_room(
            busy()
        ):
            # Clients choose the peers; each dial costs sockets the engine
            # cannot run out of. This request recomputes.
            self._tallies.count_limit_refusal("too_many_peers")
            self._tallies.dials_refused += 1
            return None
        self.to_connect.append(peer)
        return self._new_session(peer, now)

    def refused_dial(self, peer: str, now: float) -> bool:
        """Whether :meth:`session_for` found no session for ``peer`` because
        max_peers refused the dial: in the reconnect backoff, or while the
        peer's last session closes, its lookups ask later instead."""
        return peer not in self.sessions and now >= self.retry_at.get(peer, 0.0)

    def _make_room(self, busy: Container[str]) -> bool:
        """Close the dialled session used longest ago that nothing needs (no
        live request names it, nothing in flight), so a new peer can be
        dialled; False if there is none. Sessions are never closed for
        idling otherwise, so without this ``max_peers`` would cap the
        distinct peers an engine ever talks to while they live. A closing
        session keeps its sockets until its invalidation (this step's
        pump), so at most :data:`CLOSING_ROOM` dials pass ``max_peers``
        meanwhile. It reads the sessions we dialled (at most that many),
        never the inbound ones, which anyone may open."""
        if len(self.dialled) >= self._settings.max_peers + CLOSING_ROOM:
            return False
        idle = [
            s
            for p, s in self.dialled.items()
            if not s.link.closed and not s.active and p not in busy
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda s: s.used_at)
        oldest.evicted = True
        self.close_session(oldest.peer, "idle: room for a new peer (max_peers)")
        return True

    def _new_session(self, peer: str, now: float) -> Session:
        settings = self._settings
        session = Session(
            peer,
            settings.me,
            now,
            timeouts=settings.timeouts,
            limits=settings.limits,
            nonce=self._nonces(),
            reads=settings.reads,
            engine_keys=(self.pending_keys, self.waiting_keys),
        )
        self.sessions[peer] = session
        if is_inbound(peer):
            self.handshaking[peer] = session
            session.on_close = self._inbound_closed
        else:
            self.dialled[peer] = session
        self._touch(session)
        return session

    def close_session(self, peer: str, reason: str) -> bool:
        """Drop one peer's session (the peer hears Goodbye); False if there
        is none open."""
        session = self.sessions.get(peer)
        if session is None or session.link.closed:
            return False
        session.close(reason)
        self._touch(session)
        return True

    def retire(self, session: Session, now: float) -> None:
        """Forget a session the data plane invalidated. One closed for room
        was healthy: the next request to it dials at once (with a backoff,
        peers used in turn slightly past max_peers would miss for a second
        after each eviction)."""
        peer = session.peer
        del self.sessions[peer]
        self.dialled.pop(peer, None)
        if not is_inbound(peer) and not session.evicted:
            # Re-inserted, so the entries stay in the order they expire.
            self.retry_at.pop(peer, None)
            self.retry_at[peer] = now + self._settings.reconnect_backoff_s

    def tick(self, now: float) -> None:
        """End the backoffs past due. In expiry order: those past it go from
        the front, each once. (One past it behind a later one, after the
        backoff was changed, reads as absent meanwhile: the same.)"""
        retry = self.retry_at
        while retry and next(iter(retry.values())) <= now:
            del retry[next(iter(retry))]
        self._ticked = now

    # -- inbound ------------------------------------------------------------

    def on_inbound(self, now: float, peer: str | None = None) -> str:
        """A new peer connected to us: its session's key (``peer``, or a
        fresh ``in:#N`` when none is given or that key is taken). A
        connection refused earlier gets its own key back, and no session."""
        if peer is not None and peer in self.refused_inbound:
            return peer
        if peer is None or peer in self.sessions:
            peer = f"in:#{next(self._inbound_ids)}"
        greeting = len(self.handshaking)
        if greeting >= self._settings.max_inbound:
            self._refuse_inbound(
                next(iter(self.handshaking.values())),  # the oldest
                "too_many_handshaking",
                f"{greeting} connections still handshaking",
            )
        self._new_session(peer, now)
        return peer

    def on_ready(self, session: Session) -> None:
        """An inbound session finished its handshake. Every per-peer bound
        holds per session: without this one, a party with the secret
        opening connections would multiply them (six held 6x the
        waiting-fetch bound)."""
        self.handshaking.pop(session.peer, None)
        self.ready_inbound += 1
        ready = self.ready_inbound
        if ready > self._settings.max_inbound:
            self._refuse_inbound(
                session, "too_many_inbound", f"{ready - 1} peers connected"
            )

    def _inbound_closed(self, session: Session) -> None:
        """An inbound session's link closed, whoever closed it (a bound,
        its peer, a deadline, the runtime): it leaves the count it was in.
        One not handshaking any more was ready (that is the only other
        link before closed)."""
        if self.handshaking.pop(session.peer, None) is None:
            self.ready_inbound -= 1

    def _refuse_inbound(self, session: Session, reason: str, why: str) -> None:
        self._tallies.count_limit_refusal(reason)
        session.close(f"refused: {why}, max_inbound_peers")
        self._touch(session)
        self.remember_refused(session.peer)

    def remember_refused(self, peer: str) -> None:
        """An inbound connection done with for good (refused, or its
        session ended by a second Hello): its later frames are dropped
        unread, so one connection cannot open a session (and a log line)
        every few frames. A peer that means well dials a new connection
        for a new session. Not for a session we dropped ourselves (its
        peer could not drain us): its next frame opens a new session, whose
        Hello tells the peer to end its own and dial again."""
        if not is_inbound(peer):
            return
        self.refused_inbound[peer] = None
        if len(self.refused_inbound) > MAX_REFUSED_INBOUND:
            del self.refused_inbound[next(iter(self.refused_inbound))]

    def residue(self) -> dict[str, int]:
        """What the sessions hold (their sizes summed, and fenced slots).
        The containers here are per-peer state, not per-request (a dial
        queued for the pump outlives the request that asked for it): none
        is residue but a backoff overdue at the last tick."""
        at_rest = (
            "sessions",
            "handshaking",
            "dialled",
            "refused_inbound",
            "to_connect",
        )
        report = residue_of(
            self, "peers_", at_rest=at_rest, timers=("retry_at",), ticked=self._ticked
        )
        report.update(dict.fromkeys(SESSION_KEYS, 0))
        sessions = self.sessions.values()
        report["fenced_slots"] = sum(s.consumer.fenced_slots for s in sessions)
        for session in sessions:
            for name, size in session.sizes().items():
                report[name] = report.get(name, 0) + size
        return report


class SessionWork:
    """What the sessions hold for the engine's step; their timers are armed
    in the node's heap (``timers``)."""

    def __init__(self, timers: Timers) -> None:
        self._timers = timers
        #: ended sessions' offers armed and not yet due: the heap is
        #: scanned for them only while there are some (rarely)
        self.orphaned = 0
        #: sessions changed since their output was last taken
        self.dirty: set[str] = set()
        #: peers whose sessions hold lookups for our engine to answer
        self.to_serve: set[str] = set()
        #: what the runtime's next pump carries out, in order (transfers,
        #: closed sessions; see LoadManager.take_events)
        self.out: list[tuple[str, RuntimeEvent]] = []

    def rearm(self, sessions: Mapping[str, Session]) -> None:
        """Re-arm the deadlines of sessions touched this step, then forget
        them. Sessions with output too: a result the engine has yet to
        collect (a long step) must not stop the session's heartbeats and
        deadlines, or the peer finds it silent and drops it, failing all
        its loads."""
        if not self.dirty:
            return
        for peer in self.dirty:
            session = sessions.get(peer)
            if session is not None and not session.link.closed:
                deadline = session.next_deadline()
                if deadline != float("inf"):
                    self._timers.arm(deadline, SessionDue(peer))
        self.dirty = {
            p
            for p in self.dirty
            if (s := sessions.get(p)) is not None and (s.has_output or s.link.closed)
        }
        current = (
            (s.next_deadline(), p) for p, s in sessions.items() if not s.link.closed
        )
        self._timers.compact(current, len(sessions))

    def adopt(self, serve: Serve) -> None:
        """An ended session's offered blocks, held until their deadline (a
        peer may still be READing them)."""
        self._timers.arm(serve.deadline, OrphanDue(serve))
        self.orphaned += 1

    def orphan_due(self, serve: Serve) -> list[StoreResult]:
        """An ended session's offered blocks reached their deadline."""
        self.orphaned -= 1
        serve.fire(Event.TIMEOUT)
        return serve.let_go(Event.PEER_LOST, False, "peer_down")

    def orphans(self) -> Iterator[tuple[float, Serve]]:
        """The ended sessions' offers still armed, and when each ends."""
        if not self.orphaned:
            return
        for when, timer in self._timers.pending():
            if isinstance(timer, OrphanDue):
                yield when, timer.serve

    def has_output(self, sessions: Mapping[str, Session]) -> bool:
        """Events, or a touched session's messages, for the pump."""
        return bool(self.out) or any(
            (s := sessions.get(p)) is not None and s.has_output for p in self.dirty
        )

    def peer_transfers(self, sessions: Mapping[str, Session]) -> bool:
        """A peer may be moving bytes to or from our region: READing blocks
        we offered (held by a live session, or orphaned past a lost one) or
        WRITing a load of ours. No descriptor announces such a transfer,
        yet over UCX's TCP transport it needs our progress."""
        return any(s.peer_transfers for s in sessions.values()) or any(
            not sv.terminal and sv.exposed for _, sv in self.orphans()
        )

    def residue(self) -> dict[str, int]:
        """Lookups left to serve, and the blocks orphans hold. Touched
        sessions are per-peer state, not residue; the timers report their
        own (the node's heap)."""
        report = residue_of(self, at_rest=("dirty",))
        report["orphaned_blocks"] = sum(sv.held_blocks for _, sv in self.orphans())
        return report
