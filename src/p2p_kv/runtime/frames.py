"""The control-plane side of the tier: the sessions' frames in and out.

Frames arrive on the :class:`~p2p_kv.control.transport.ControlTransport`'s
connections and leave through it; in between they are opened (checked,
their seal verified) or sealed by their session, and handed to or taken
from the :class:`~p2p_kv.node.manager.LoadManager`. :class:`Frames` is that
path, and the log lines a peer's frames can cause (bad frames, refused
seals, a closed session's reason), each bounded by the shared
:class:`~p2p_kv.ratelog.PeerLog`. It is the runtime's sibling of
:class:`~p2p_kv.runtime.transfers.Transfers`: no thread and no wait of its own
(the runtime decides how long a poll may block), run under the runtime's
lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from p2p_kv.control.transport import ControlTransport, dial_failure
from p2p_kv.node.manager import LoadManager
from p2p_kv.peer import is_inbound
from p2p_kv.peer.handshake import FrameRefused
from p2p_kv.protocol import Heartbeat, Message, ProtocolError, encode
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
            self.manager.me  # noqa: B018  (resolves it, once)
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
                if not is_inbound(conn):
                    session = m.session(conn)
                    if session is not None and not session.proven:
                        # A source a request named that is no p2p_kv peer
                        # (a wrong port, a dead pod, a name that does not
                        # resolve): counted by what the operator must fix.
                        m.on_dial_failed(conn, dial_failure(inbound.why))
                elif inbound.bad:
                    m.on_bad_frame(conn, inbound.bad)
                    session = m.session(conn)
                    if session is not None and not session.closed:
                        # (The tail of a connection already refused, for a
                        # seal or a handshake, was said once: no more.)
                        self._peer_log.warning(
                            inbound.bad, conn, "connection ended: %s", inbound.why
                        )
                m.on_disconnected(conn, inbound.why, now)
                work = True
                continue
            if inbound.new:
                m.peers.on_inbound(now, conn)
                continue
            session = m.session(conn)
            if session is None:
                # A connection refused (max_inbound) or whose session ended:
                # its frames go unread.
                if is_inbound(conn):
                    self.control.close_conn(conn)
                continue
            if session.closed:
                # Ended in this poll (the pump retires it): the rest of its
                # frames go unread.
                continue
            try:
                msg = session.link.open(inbound.frame)
            except ProtocolError as exc:
                m.on_bad_frame(conn, exc.reason)
                if not session.proven:
                    # An honest peer's greeting always decodes: before its
                    # proof, one that does not ends the connection, so a
                    # stream of them costs its sender a new connection each.
                    self._peer_log.warning(
                        "bad_frame",
                        conn,
                        "closed: a bad frame before the handshake: %s",
                        exc,
                    )
                    m.on_disconnected(
                        conn, f"a bad frame before the handshake: {exc}", now
                    )
                    work = True
                    continue
                self._peer_log.warning(
                    "bad_frame", conn, "dropped a bad frame (protocol_errors): %s", exc
                )
                continue
            except FrameRefused as exc:
                self._refuse(conn, exc)
                work = True
                continue
            if not isinstance(msg, Heartbeat):
                work = True
            m.on_message(conn, msg, now)
            if session.proven:
                self.control.trust(conn)
            self._transfers.maybe_add_agent(conn)
        return work

    def _refuse(self, conn: str, exc: FrameRefused) -> None:
        """A frame that failed its seal ends its session: a party without
        the secret is speaking (over one TCP connection nothing else loses
        or reorders a frame). The refusals metric counts each; the log
        says so at most once per interval (such a party may open
        connection after connection)."""
        self.manager.on_frame_refused(conn, exc)
        self._peer_log.warning(
            "auth", conn, "refused a frame whose seal does not check: %s", exc
        )

    def send_all(self, now: float) -> None:
        """Seal and send what every session has to say."""
        for peer, msgs in self.manager.take_outgoing(now):
            self._send(peer, msgs, now)

    def _send(self, peer: str, msgs: list[Message], now: float) -> None:
        frames = []
        session = self.manager.session(peer)
        for msg in msgs:
            try:
                frame = encode(msg)
                frames.append(
                    frame if session is None else session.link.seal(msg, frame)
                )
            except ProtocolError as exc:
                log.error(
                    "p2p_kv: not sending %s to %s: %s",
                    type(msg).__name__,
                    self.peer_name(peer),
                    exc,
                )
        why = self.control.send(peer, frames)
        if why:
            self.manager.on_disconnected(peer, f"send failed: {why}", now)

    def log_close(self, peer: str) -> None:
        """Say once why a session closed, if anyone needs to hear it."""
        session = self.manager.session(peer)
        if session is None:
            return
        if session.refusal is not None:
            # A refused handshake (wrong secret, another layout): the
            # operator's fix is on one side or the other. Any party can
            # cause it, so at most one line per reason per interval. Its
            # kind is the refusal's reason, the budget a refused seal's
            # line (``auth``) shares: one event, one line.
            # The detail names the peer's value and ours, then the fix.
            self._peer_log.warning(
                session.refusal.reason,
                peer,
                "handshake refused: %.700s; fix: %s",
                session.refusal,
                session.refusal.fix,
            )
        elif session.close_reason and not (session.proven or is_inbound(peer)):
            # A peer our clients named that we never got a session with:
            # unresolvable, refused, unreachable, silent, or refusing us
            # (its Goodbye says why): requests naming it recompute.
            self._peer_log.warning(
                "dial_failed",
                peer,
                "no session: %.300r; requests naming it recompute",
                session.close_reason,
            )
        elif session.close_reason:
            # The reason may be the peer's text (its Goodbye): the PeerLog
            # line shows it as %r, cut.
            self._peer_log.info(
                "session_closed", peer, "session closed: %.300r", session.close_reason
            )
