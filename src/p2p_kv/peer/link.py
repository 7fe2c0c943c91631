"""The link to one peer: handshake, sealing, liveness, the outbox, the one
timer heap and the event queue both sides write to.

A :class:`Link` is what the consumer and producer sides share, and all they
share: they are handed it and never see each other or the session. It
knows nothing of requests: it carries messages, keeps time for the
records it is asked to arm, and reports the end of the link as a reason
(``Loss``) for the session to act on, never acting on it itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

from p2p_kv.peer.events import SessionEvent, Trusted
from p2p_kv.peer.handshake import (
    SEALED,
    FrameKeys,
    FrameRefused,
    HandshakeRefused,
    Identity,
    check_hashes,
    check_hello,
    frame_keys,
    handshake_mac,
    make_hello,
    verify_mac,
)
from p2p_kv.peer.records import (
    KeyCount,
    Limits,
    Load,
    Probe,
    Serve,
    SessionCounters,
    Timeouts,
)
from p2p_kv.protocol import (
    MAX_GREETING_BYTES,
    Error,
    Fetch,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    Lookup,
    Message,
    ProtocolError,
    Region,
    decode,
)

Timed = Probe | Load | Serve


def _none() -> int:
    return 0


class LinkState(Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"
    CLOSED = "closed"


class Loss(NamedTuple):
    """Why the link ended: ``kind`` is the failure reason every request in
    flight is counted under, ``reason`` the text the operator reads."""

    kind: str
    reason: str


class Link:
    """See the module docstring."""

    def __init__(
        self,
        peer: str,
        me: Identity,
        now: float,
        *,
        timeouts: Timeouts,
        limits: Limits,
        nonce: bytes,
    ) -> None:
        self.peer = peer
        self.me = me
        self.timeouts = timeouts
        self.limits = limits
        self.counters = SessionCounters()
        self.state = LinkState.HANDSHAKING
        self.close_reason = ""
        self.refusal: HandshakeRefused | None = None
        self.hello = make_hello(me, nonce)
        self.peer_hello: Hello | None = None
        self.acked = False
        #: the peer's data-plane region, once its proof checked (Region)
        self.peer_region: bytes | None = None
        #: sealing keys, with a shared secret, once the peer's Hello checked
        self._keys: FrameKeys | None = None
        self._created = now
        self._last_rx = now
        self._last_tx = now
        self._last_tick = now
        self._hb_seq = 0
        self._outbox: list[Message] = [self.hello]
        #: a message did not fit max_outbox: the session is lost when the
        #: outbox is next taken (see send)
        self.overflowed = False
        self._timers: list[tuple[float, int, Timed]] = []
        self._timer_ids = itertools.count()
        self._events: list[SessionEvent] = []
        #: How many records the sides hold (set by the session that owns
        #: both): the timer heap's rebuild bound counts them all.
        self.live: Callable[[], int] = _none

    # -- state ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is LinkState.READY

    @property
    def closed(self) -> bool:
        return self.state is LinkState.CLOSED

    @property
    def handshaking(self) -> bool:
        return self.state is LinkState.HANDSHAKING

    def close(self, loss: Loss) -> None:
        """The link is over: nothing is sent after what is queued, nothing
        fires again. A closed session is kept for its counters, so its
        timer heap (which holds every record it armed) and the peer's
        region (up to 1 MiB, sent by anyone who completes a handshake) go."""
        self.state = LinkState.CLOSED
        self.close_reason = f"{loss.kind}: {loss.reason}"

    def forget(self) -> None:
        self._timers.clear()
        self.peer_region = None
        # Its session set this to a closure over itself: a cycle, which
        # left every session of a flood of refused connections to the
        # cyclic collector (a pause per pass in an engine's heap).
        self.live = _none

    # -- events and messages -------------------------------------------------

    def emit(self, event: SessionEvent) -> None:
        self._events.append(event)

    def take_events(self) -> list[SessionEvent]:
        """Everything that happened since the last call, in order."""
        out, self._events = self._events, []
        return out

    def queued(self) -> Sequence[SessionEvent]:
        """The events not taken yet (a result there may still be marked)."""
        return self._events

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def send(self, msg: Message) -> None:
        if self.state is LinkState.CLOSED:
            return
        if len(self._outbox) >= self.limits.max_outbox:
            # Dropped, and the session is lost at the next take_outbox, not
            # here: send runs inside handlers halfway through a transition,
            # and losing the session under them would fire the rest of the
            # handler on records the loss had just failed.
            self.overflowed = True
            return
        self._outbox.append(msg)

    def say_goodbye(self, reason: str) -> None:
        """Queue a Goodbye past every bound: the last word of a link."""
        self._outbox.append(Goodbye(reason=reason[:1000]))

    def take_outbox(self, now: float) -> list[Message]:
        out, self._outbox = self._outbox, []
        if out:
            self._last_tx = now
        return out

    @property
    def has_outbox(self) -> bool:
        return bool(self._outbox)

    def protocol_error(
        self, code: str, detail: str, req: str = "", gen: int = -1
    ) -> None:
        """The peer broke the protocol: counted, and told why (an ``Error``)."""
        self.counters.error(code)
        self.send(Error(code=code, detail=detail[:1000], req=req, gen=gen))

    def over_bound(
        self,
        count: KeyCount,
        cost: int,
        bounds: tuple[int, int],
        name: str,
        what: str,
        msg: Lookup | Fetch,
    ) -> bool:
        """Whether ``cost`` more keys break ``count``'s per-peer bound or the
        engine's (``bounds``); if so the peer is told which (an Error
        counted under ``limit_[engine_]<name>``)."""
        over = count.over(cost, *bounds)
        if over is None:
            return False
        scope, held, whose = over
        self.protocol_error(
            f"limit_{scope}{name}", f"{held} {what}{whose}", msg.req, msg.gen
        )
        return True

    # -- sealing (with a shared secret; see p2p_kv.peer.handshake) ----------------

    def seal(self, msg: Message, frame: bytes) -> bytes:
        """The frame to put on the wire for ``msg``: sealed (encrypted and
        authenticated, :class:`~p2p_kv.peer.handshake.FrameKeys`) once the link
        has keys, except the handshake's own two messages and a Goodbye
        sent before the peer's proof checked (a refusal: a peer that
        failed the handshake has no keys to open it, and must read why).
        Once it checked, the peer has keys and may be ready, taking only
        sealed frames: so is our Goodbye then. Everything else is sealed,
        our Region first of all: its seal is what keeps it secret."""
        if self._keys is None or isinstance(msg, (Hello, HelloAck)):
            return frame
        if isinstance(msg, Goodbye) and not self.acked:
            return frame
        return self._keys.seal(frame)

    def open(self, frame: bytes) -> Message:
        """The message a frame from the peer carries, as the link may take
        it now. Before the handshake ends only a greeting is parsed
        (``protocol.Greeting``): anything else, or a frame larger than any
        greeting, is refused unread (:class:`ProtocolError`, reason
        ``before_handshake``). A seal that does not check, or a plain frame
        where a sealed one is due, raises :class:`FrameRefused`."""
        greeting = not self.ready
        if greeting and len(frame) > MAX_GREETING_BYTES:
            raise ProtocolError(
                f"a {len(frame)}-byte frame before the handshake", "before_handshake"
            )
        plain, sealed = self.unseal(frame)
        msg = decode(plain, greeting=greeting)
        if not sealed and not self.admits_plain(msg):
            raise FrameRefused(f"a plain {type(msg).__name__}")
        return msg

    def unseal(self, frame: bytes) -> tuple[bytes, bool]:
        """The plain frame, and whether it came sealed. Raises
        :class:`FrameRefused` for a seal that does not check."""
        if self._keys is not None and frame[:1] == bytes([SEALED]):
            return self._keys.open(frame), True
        return frame, False

    def admits_plain(self, msg: Message) -> bool:
        """Whether ``msg`` may come unsealed: always without a secret;
        with one, only the handshake (and a refusal's Goodbye during it)."""
        if self._keys is None or isinstance(msg, (Hello, HelloAck)):
            return True
        return isinstance(msg, Goodbye) and self.handshaking

    # -- handshake -----------------------------------------------------------

    def refuse(self, err: HandshakeRefused) -> Loss:
        """The peer failed the handshake (or a seal): the link ends."""
        # Kept without its traceback: its frames hold this link, and a
        # cycle per refused connection left every one of a flood to the
        # cyclic collector (a 0.1 s pause per pass in an engine's heap).
        self.refusal = err.with_traceback(None)
        self.counters.bump(self.counters.refused, err.reason)
        self.say_goodbye(f"refused: {err}")
        return Loss("refused", str(err))

    def on_hello(self, msg: Hello) -> Loss | None:
        if self.peer_hello is not None:
            # The peer greets again on this connection: it began a new
            # session there, so it holds nothing of ours any more (it
            # dropped ours without a Goodbye). Kept alive, this link would
            # answer every lookup after its deadline and never notice, as
            # each new Hello reset its silence timer. Nothing of the new
            # Hello is adopted: the peer's next session is dialled afresh.
            self.counters.error("duplicate_hello")
            # Plain: the peer's new session has no keys to open a sealed one.
            self._keys = None
            self.say_goodbye("second Hello: start again")
            return Loss("peer_down", "the peer began a new session on our connection")
        try:
            check_hello(self.hello, msg)
        except HandshakeRefused as err:
            return self.refuse(err)
        self.peer_hello = msg
        self._keys = frame_keys(self.me.secret, self.hello, msg)
        self.send(HelloAck(mac=handshake_mac(self.me.secret, self.hello, msg)))
        return None

    def on_hello_ack(self, msg: HelloAck) -> Loss | None:
        if self.peer_hello is None or self.acked:
            self.protocol_error("unexpected_hello_ack", "HelloAck out of order")
            return None
        try:
            verify_mac(self.me.secret, self.peer_hello, self.hello, msg.mac)
            if self.hello.authenticated:
                check_hashes(self.hello, self.peer_hello)  # keyed: now
        except HandshakeRefused as err:
            return self.refuse(err)
        self.acked = True
        self.emit(Trusted())
        # Only now, to a peer that proved itself: whoever holds our region
        # can write our KV cache. With a secret its frame is sealed (see
        # seal), which encrypts it.
        self.send(Region(region=self.me.region))
        return None

    def on_region(self, msg: Region) -> bool:
        """True if the link became ready with this Region."""
        if not self.acked or self.peer_region is not None:
            self.protocol_error("unexpected_region", "Region out of order")
            return False
        self.peer_region = msg.region
        if not self.handshaking:
            return False
        self.state = LinkState.READY
        return True

    # -- time ----------------------------------------------------------------

    def heard(self, now: float) -> None:
        self._last_rx = now

    def arm(self, item: Timed, deadline: float) -> None:
        """Set ``item``'s deadline; its old timer entry goes stale.

        Stale entries (re-armed or ended items) leave the heap only as they
        reach its top, so one live item with an early deadline keeps every
        later one, and what it references, until its own turn: rebuilt when
        they dominate (:attr:`live`: how many records the sides hold)."""
        item.deadline = deadline
        timers = self._timers
        heapq.heappush(timers, (deadline, next(self._timer_ids), item))
        if len(timers) > 4 * max(16, self.live()):
            self._timers = [
                t for t in timers if not t[2].terminal and t[2].deadline == t[0]
            ]
            heapq.heapify(self._timers)

    def pop_due(self, now: float) -> Timed | None:
        """The next record whose deadline passed, or None; stale entries
        (settled or re-armed since) are skipped."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, _, item = heapq.heappop(timers)
            if not item.terminal and item.deadline == deadline:
                return item
        return None

    def next_deadline(self) -> float:
        """Earliest time the link or an armed record has something to do."""
        if self.closed:
            return float("inf")
        timers = self._timers
        while timers and (
            timers[0][2].terminal or timers[0][2].deadline != timers[0][0]
        ):
            heapq.heappop(timers)
        first = timers[0][0] if timers else float("inf")
        if self.handshaking:
            return min(first, self._created + self.timeouts.handshake_s)
        return min(
            self._last_tx + self.timeouts.heartbeat_every_s,
            self._last_rx + self.timeouts.liveness_s,
            first,
        )

    def latest_deadline(self) -> float:
        """No earlier than the last deadline armed for any probe, load or
        serve of this session (a stale timer entry can only make it later):
        by then, and a cancel's wait, every job here has ended."""
        if self.closed:
            return float("-inf")
        return max(
            (at for at, _, item in self._timers if not item.terminal),
            default=float("-inf"),
        )

    def check(self, now: float) -> Loss | None:
        """The link's own deadlines: the handshake's, and the peer's
        silence (after which the peer hears Goodbye: one alive but slow
        must not keep using a link we dropped)."""
        if self.handshaking:
            if now >= self._created + self.timeouts.handshake_s:
                return Loss("handshake_timeout", "no handshake in time")
            return None
        if now - self._last_tick > self.timeouts.liveness_s:
            # It is we who were silent (a long engine step): do not blame
            # the peer for frames we did not read.
            self._last_rx = max(self._last_rx, now - self.timeouts.heartbeat_interval_s)
        self._last_tick = now
        if now >= self._last_rx + self.timeouts.liveness_s:
            self.say_goodbye("no heartbeat from you in time")
            return Loss("peer_down", "heartbeat deadline passed")
        return None

    def keep_alive(self, now: float) -> None:
        """A link that sent nothing for a while sends a Heartbeat."""
        if now >= self._last_tx + self.timeouts.heartbeat_every_s:
            self._hb_seq += 1
            self.send(Heartbeat(seq=self._hb_seq))
