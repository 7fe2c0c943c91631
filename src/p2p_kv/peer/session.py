"""One peer, both roles, no I/O.

A :class:`Session` owns a :class:`~p2p_kv.peer.link.Link` and two sides
over it, as aioquic pairs a receiver and a sender half over one
connection: the :class:`~p2p_kv.peer.consumer.ConsumerSide` (we load from
the peer) and the :class:`~p2p_kv.peer.producer.ProducerSide` (the peer
loads from us). It is fed decoded messages, transfer completions and the
current time; it hands out messages to send (``take_outbox``) and one
ordered stream of typed events (``take_events``). It owns no socket,
thread or clock, so tests drive two of them against each other in memory
through every interleaving.

The session's own work is routing and the three turns the sides cannot
take alone: the link became ready (the consumer flushes what waited), the
link ended (each side loses what it holds, then ``Closed``), and a write
that could not be stopped (the session closes: only dropping our agent at
the peer fences it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from p2p_kv.lifecycle import Event, IllegalTransition, Machine
from p2p_kv.peer.consumer import ConsumerSide
from p2p_kv.peer.events import (
    Closed,
    HoldingsHeard,
    PostRead,
    PostWrite,
    RegionKnown,
    Subscribed,
)
from p2p_kv.peer.handshake import FrameRefused, HandshakeRefused, Identity
from p2p_kv.peer.link import Link, Loss
from p2p_kv.peer.producer import ProducerSide
from p2p_kv.peer.records import (
    PEER_REASON,
    KeyCount,
    Limits,
    Load,
    Probe,
    Serve,
    Timeouts,
    is_inbound,
)
from p2p_kv.protocol import (
    Abort,
    AbortAck,
    Error,
    Fetch,
    FetchOffer,
    FetchWait,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    Holdings,
    Lookup,
    LookupResp,
    Message,
    Region,
    Release,
    Revoke,
    Subscribe,
    TransferDone,
)

#: The one reason a session closes itself over a write (see
#: :meth:`Session.on_write_unstoppable`).
UNSTOPPABLE_WRITE: Final = "a write we could not stop may still land: drop our agent"


class Session:
    """The protocol with one peer. See the module docstring."""

    def __init__(
        self,
        peer: str,
        me: Identity,
        now: float,
        *,
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        nonce: bytes,
        reads: bool = True,
        engine_keys: tuple[KeyCount, KeyCount] | None = None,
    ) -> None:
        self.peer = peer
        self.link = Link(
            peer,
            me,
            now,
            timeouts=timeouts or Timeouts(),
            limits=limits or Limits(),
            nonce=nonce,
        )
        #: Offer our pinned blocks for one-sided READ, and READ offered ones.
        self.reads = reads
        self.consumer = ConsumerSide(self.link, reads=reads)
        self.producer = ProducerSide(self.link, reads=reads, engine_keys=engine_keys)
        self.link.live = lambda: len(self.consumer) + len(self.producer)
        #: when a request of ours last dialled or asked through it (the
        #: manager closes the one used longest ago for room at max_peers)
        self.used_at = now
        #: closed for room, not for a fault: its peer gets no backoff
        self.evicted = False
        #: Called once, as the link closes, whoever closes it (the manager,
        #: the peer, a deadline, the runtime): the manager keeps its counts
        #: of inbound sessions by link with it, not by scanning them all.
        self.on_close: Callable[[Session], None] | None = None

    # -- what the link knows ---------------------------------------------------

    @property
    def proven(self) -> bool:
        """The peer proved itself (its HelloAck checked): what it says of
        itself, its engine id included, may be believed."""
        return self.link.acked

    @property
    def proven_secret(self) -> bool:
        """The peer proved the shared secret (there is one, and its
        HelloAck checked)."""
        return self.link.acked and self.link.me.secret is not None

    def refuse_frame(self, err: FrameRefused) -> None:
        """A frame failed its seal (forged, replayed, reordered, or plain):
        the session ends, as a failed handshake does."""
        self._lose(self.link.refuse(HandshakeRefused("auth", str(err))))

    # -- outputs -----------------------------------------------------------------

    def take_outbox(self, now: float) -> list[Message]:
        """What to send now. A session whose peer let its outbox overflow
        is lost here, and nothing more is sent to it."""
        if self.link.overflowed:
            self.link.overflowed = False
            self.link.take_outbox(now)
            self._lose(Loss("outbox_full", "peer is not draining our messages"))
            return []
        return self.link.take_outbox(now)

    def posting(self, event: PostRead | PostWrite) -> bool:
        """Whether a transfer event is still to be posted, now that the data
        plane takes it: one whose load or write ended unposted meanwhile is
        stale (False). From True on, its bytes may land (its load fenced)."""
        if isinstance(event, PostRead):
            return self.consumer.posting(event)
        return self.producer.posting(event)

    @property
    def has_output(self) -> bool:
        return self.link.has_outbox or self.link.has_events

    # -- the end -------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Local decision to drop the peer (shutdown, idle, reset)."""
        if not self.link.closed:
            self.link.say_goodbye(reason)
        self._lose(Loss("closed", reason))

    def peer_lost(self, reason: str) -> None:
        """The transport says the peer is gone."""
        self._lose(Loss("peer_down", reason))

    def _lose(self, loss: Loss) -> None:
        """Fail everything in flight; loads that may still be written stay
        fenced until :meth:`ConsumerSide.confirm_invalidated`."""
        if self.link.closed:
            return
        self.link.close(loss)
        if self.on_close is not None:
            self.on_close(self)
        self.consumer.lose(loss.kind)
        self.producer.lose(loss.kind)
        self.link.forget()
        self.link.emit(
            Closed(self.link.close_reason, self.link.refusal, self.link.acked)
        )

    # -- input -----------------------------------------------------------------------

    def receive(self, msg: Message, now: float) -> None:
        """Feed one decoded message from the peer. Never raises for anything
        the peer sent: bad input costs the peer an Error reply and a count."""
        link = self.link
        if link.closed:
            return
        link.heard(now)
        match msg:
            case Hello():
                self._lose_if(link.on_hello(msg))
                return
            case HelloAck():
                self._lose_if(link.on_hello_ack(msg))
                return
            case Region():
                if link.on_region(msg):
                    if not is_inbound(self.peer) or self.proven_secret:
                        link.emit(RegionKnown(msg.region))
                    self.consumer.flush()
                return
            case Goodbye():
                self._lose(Loss("peer_down", f"peer said goodbye: {msg.reason}"))
                return
            case Error():
                link.counters.error(PEER_REASON + msg.code)
                return
            case Heartbeat():
                return
        if not link.ready:
            link.protocol_error(
                "before_handshake", f"{type(msg).__name__} before the handshake"
            )
            return
        consumer, producer = self.consumer, self.producer
        try:
            match msg:
                case Lookup():
                    producer.on_lookup(msg, now)
                case LookupResp():
                    consumer.lookups.on_lookup_resp(msg, now)
                case Fetch():
                    producer.on_fetch(msg, now)
                case FetchOffer():
                    consumer.on_fetch_offer(msg, now)
                case FetchWait():
                    consumer.on_fetch_wait(msg, now)
                case TransferDone():
                    consumer.on_transfer_done(msg, now)
                case Release():
                    producer.on_release(msg)
                case Revoke():
                    consumer.on_revoke(msg)
                case Abort():
                    producer.on_abort(msg)
                case AbortAck():
                    consumer.on_abort_ack(msg, now)
                case Holdings():
                    # The directory's feed: no request's state, so the
                    # session only hands it on.
                    link.emit(HoldingsHeard(msg.add, msg.drop))
                case Subscribe():
                    link.emit(Subscribed())
        except IllegalTransition as exc:
            req = getattr(msg, "req", "")
            gen = getattr(msg, "gen", -1)
            link.protocol_error("illegal", str(exc), req, gen)

    def _lose_if(self, loss: Loss | None) -> None:
        if loss is not None:
            self._lose(loss)

    # -- the consumer's calls ------------------------------------------------------

    def send_lookup(self, req: str, gen: int, keys: list[bytes], now: float) -> None:
        """Ask the peer about ``keys``; the answer comes as ProbeAnswered."""
        self.consumer.lookups.send(req, gen, keys, now)

    # -- the producer's calls ------------------------------------------------------

    def on_write_unstoppable(
        self, write_id: int, event: Event = Event.WRITES_FAILED
    ) -> None:
        """A write given up on may still land: the session ends."""
        self.producer.on_write_unstoppable(write_id, event)
        self.close(UNSTOPPABLE_WRITE)

    def pending_lookup_keys(self) -> int:
        """Keys of this peer's lookups queued for our engine."""
        return self.producer.pending.keys

    def waiting_fetch_keys(self) -> int:
        """Keys of this peer's Fetches that wait for stores to be parked."""
        return self.producer.waiting.keys

    def leave_engine(self) -> None:
        """The manager forgets this session: what it holds leaves the
        engine's counts (and whatever it drops later, only its own)."""
        self.producer.pending.detach()
        self.producer.waiting.detach()

    # -- time ------------------------------------------------------------------------

    def next_deadline(self) -> float:
        """Earliest time :meth:`tick` has something to do."""
        first = self.link.next_deadline()
        if self.link.ready:
            first = min(first, self.consumer.lookups.next_offer_deadline())
        return first

    def tick(self, now: float) -> None:
        """Fire every deadline that has passed. Each failure costs one
        request, never the session -- except silence from the peer itself."""
        link = self.link
        if link.closed:
            return
        loss = link.check(now)
        if loss is not None:
            self._lose(loss)
            return
        # A request's own deadline runs whether or not the peer ever
        # answers: a lookup to a peer that is down waits its own 2 s, not
        # the 5 s handshake.
        if not self._fire_timers(now) or link.handshaking:
            return
        self.consumer.lookups.expire_offers(now)
        link.keep_alive(now)

    def _fire_timers(self, now: float) -> bool:
        """Fire the deadlines that passed; False if that ended the session."""
        while (item := self.link.pop_due(now)) is not None:
            if item.machine is Machine.SERVE:
                assert isinstance(item, Serve)
                if not self.producer.expire(item, now):
                    self.close(UNSTOPPABLE_WRITE)
                    return False
                continue
            assert isinstance(item, (Probe, Load))
            if not self.consumer.expire(item, now):
                # Neither finished nor acknowledged: the peer (or the path
                # to it) is not healthy, and only dropping its agent fences
                # our slots.
                assert isinstance(item, Load)
                self._lose(Loss("abort_timeout", f"job {item.job} did not end"))
                return False
        return True

    # -- introspection -----------------------------------------------------------------

    def loads(self) -> Iterator[Load]:
        return iter(self.consumer.loads())

    def serves(self) -> Iterator[Serve]:
        return iter(self.producer.serves())

    @property
    def peer_transfers(self) -> bool:
        """The peer may be moving bytes to or from our region now: blocks of
        ours it was told of and still held for it (its READ), or a load of
        ours a transfer may still land in (its WRITE). Over UCX's TCP
        transport such a transfer moves only as our side makes progress."""
        return self.consumer.transfers or self.producer.transfers

    @property
    def active(self) -> bool:
        """Anything in flight that needs the poll loop."""
        return self.consumer.active or self.producer.active or self.link.handshaking

    def sizes(self) -> dict[str, int]:
        """Every record index of both sides, by name: all zero once the
        session's work has drained."""
        return {**self.consumer.sizes(), **self.producer.sizes()}
