"""The control-plane side of the tier: the bytes between the control
transport and the sans-IO node, and the lines they cause.

Frames arrive on the :class:`~p2p_kv.control.transport.ControlTransport`'s
connections and go to the :class:`~p2p_kv.node.manager.LoadManager` as
they came (:meth:`~p2p_kv.node.manager.LoadManager.receive_frame`); the
frames it has to send (:meth:`~p2p_kv.node.manager.LoadManager.take_frames`,
sealed by their sessions) go back out. What a peer's frames cause that an
operator must hear (a bad frame, a refused seal, a closed session's
reason) reaches :class:`Frames` as the node's events, and becomes one line
each, bounded by the shared :class:`~p2p_kv.ratelog.PeerLog`. It is the
runtime's sibling of :class:`~p2p_kv.runtime.transfers.Transfers`: no
thread and no wait of its own (the runtime decides how long a poll may
block), run under the runtime's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from p2p_kv.control.transport import ControlTransport, dial_failure
from p2p_kv.node.manager import LoadManager
from p2p_kv.peer import is_inbound
from p2p_kv.peer.events import BadConnection, BadFrame, Closed, NotSent, SealRefused
from p2p_kv.ratelog import PeerLog
from p2p_kv.runtime.metrics import UNKNOWN, session_peer
from p2p_kv.runtime.transfers import Transfers

log = logging.getLogger("vllm.p2p_kv")


class Frames:
    """Inbound frames to the manager, its messages out, and the lines they
    cause. ``control`` is reassigned by the runtime when a caller swaps
    its transport (fault injectors wrap it before anything is sent)."""

    def __init__(
        self,
        manager: LoadManager,
        control: ControlTransport,
        transfers: Transfers,
        peer_log: PeerLog,
        clock: Callable[[], float],
    ) -> None:
        self.manager = manager
        self.control = control
        #: told of every frame a session opened: its peer's region may be
        #: known now
        self._transfers = transfers
        self._peer_log = peer_log
        self._clock = clock
        self._me_ready = False

    def peer_name(self, conn: str) -> str:
        """What log lines call the peer on ``conn``: the address its
        metrics carry in their ``peer`` label, so that an operator can
        match the two. A dialled peer's is the ``host:port`` dialled (the
        connection's own name); an inbound peer that proved itself, the
        address it is dialled at (its engine id's); one that has not, the
        connection's far end, ``host:port``. A name that is no connection
        of ours (a client's request naming an address) is itself."""
        if not is_inbound(conn):
            return conn
        session = self.manager.session(conn)
        if session is not None:
            label = session_peer(session)
            if label != UNKNOWN:
                return label
        return self.control.remote(conn) or conn

    def identity_ready(self) -> bool:
        """Whether our Hello can be made. vLLM seeds its block hashes after
        the tier is built, and the waker starts with the tier: a peer that
        dials in meanwhile would make the waker's pass raise, losing the
        pass's other frames. Until then frames wait in the sockets."""
        if self._me_ready:
            return True
        try:
            self.manager.settings.me  # noqa: B018  (resolves it, once)
        except Exception as exc:
            log.debug("p2p_kv: identity not ready yet: %s", exc)
            return False
        self._me_ready = True
        return True

    def receive(self, timeout: float) -> bool:
        """Feed whatever arrives within ``timeout`` to the manager; True if
        any of it is work (anything but a heartbeat) or a wake-up."""
        work = False
        if not self.identity_ready():
            time.sleep(timeout)
            return False
        inbound_frames = self.control.poll(timeout)
        if self.control.take_woken():
            work = True
        m = self.manager
        for inbound in inbound_frames:
            now = self._clock()
            conn = inbound.conn
            if inbound.lost:
                m.connection_lost(
                    conn,
                    inbound.why,
                    now,
                    bad=inbound.bad,
                    failure=dial_failure(inbound.why),
                )
                work = True
            elif inbound.new:
                m.peers.on_inbound(now, conn)
            else:
                work |= m.receive_frame(conn, inbound.frame, now)
                self._transfers.prove_pending(conn)
        return work

    def send_all(self, now: float) -> None:
        """Send what every session has to say."""
        for peer, frames in self.manager.take_frames(now):
            why = self.control.send(peer, frames)
            if why:
                self.manager.connection_lost(peer, f"send failed: {why}", now)

    def say(
        self, peer: str, event: BadFrame | BadConnection | SealRefused | NotSent
    ) -> None:
        """The line an event of the edge causes. A peer chooses how often
        these happen, so each kind is said at most once per interval per
        peer (the metrics count every one)."""
        match event:
            case BadFrame(_, detail, True):
                self._peer_log.warning(
                    "bad_frame",
                    peer,
                    "closed: a bad frame before the handshake: %s",
                    detail,
                )
            case BadFrame(_, detail, False):
                self._peer_log.warning(
                    "bad_frame",
                    peer,
                    "dropped a bad frame (protocol_errors): %s",
                    detail,
                )
            case BadConnection(reason, why):
                self._peer_log.warning(reason, peer, "connection ended: %s", why)
            case SealRefused(detail):
                # A refused seal ends its session: the refusals metric counts
                # each; such a party may open connection after connection.
                self._peer_log.warning(
                    "auth",
                    peer,
                    "refused a frame whose seal does not check: %s",
                    detail,
                )
            case NotSent(what, detail):
                log.error(
                    "p2p_kv: not sending %s to %s: %s",
                    what,
                    self.peer_name(peer),
                    detail,
                )

    def log_close(self, peer: str, closed: Closed) -> None:
        """Say once why a session closed, if anyone needs to hear it."""
        if closed.refusal is not None:
            # A refused handshake (wrong secret, another layout): the
            # operator's fix is on one side or the other. Any party can
            # cause it, so at most one line per reason per interval. Its
            # kind is the refusal's reason, the budget a refused seal's
            # line (``auth``) shares: one event, one line.
            # The detail names the peer's value and ours, then the fix.
            self._peer_log.warning(
                closed.refusal.reason,
                peer,
                "handshake refused: %.700s; fix: %s",
                closed.refusal,
                closed.refusal.fix,
            )
        elif closed.reason and not (closed.proven or is_inbound(peer)):
            # A peer our clients named that we never got a session with:
            # unresolvable, refused, unreachable, silent, or refusing us
            # (its Goodbye says why): requests naming it recompute.
            self._peer_log.warning(
                "dial_failed",
                peer,
                "no session: %.300r; requests naming it recompute",
                closed.reason,
            )
        elif closed.reason:
            # The reason may be the peer's text (its Goodbye): the PeerLog
            # line shows it as %r, cut.
            self._peer_log.info(
                "session_closed", peer, "session closed: %.300r", closed.reason
            )
