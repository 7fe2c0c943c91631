"""What a session tells its owner, in the order it happened.

A :class:`~p2p_kv.peer.session.Session` hands out one ordered stream of
these (``take_events``), as aioquic's connection does with ``next_event()``:
the owner reads them with one ``match``, and no output waits in a list of
its own that someone must remember to empty. Messages for the wire are the
one other output (``take_outbox``): they are bytes to send, not news.

A transfer between the session and the data plane is named by one small
value, :class:`TransferRef`: which way the bytes go and the session's id
for it (a load's job id for a READ, a serve's write id for a WRITE).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from p2p_kv.peer.handshake import HandshakeRefused
from p2p_kv.peer.records import LoadResult, Serve, StoreResult


class Direction(Enum):
    """Which way a transfer's bytes go, seen from our region."""

    READ = "read"  # the peer's blocks into our slots (we are the consumer)
    WRITE = "write"  # our blocks into the peer's slots (we are the producer)


@dataclass(frozen=True, slots=True)
class TransferRef:
    """One transfer of one session: a READ by its load's job id, a WRITE by
    its serve's write id. The data plane's own handle is the runtime's to
    map; nothing below the runtime sees it."""

    direction: Direction
    ident: int


@dataclass(slots=True)
class ProbeAnswer:
    """Which of a lookup batch's keys the peer holds (``hits`` None: no
    answer -- timeout, peer lost, refused -- so treat all as misses)."""

    gen: int
    keys: list[bytes]
    hits: list[bool] | None


@dataclass(frozen=True, slots=True)
class PostRead:
    """Post a READ of the peer's blocks ``remote`` into our slots ``local``.
    Its load is fenced from the moment this event is taken."""

    ref: TransferRef
    local: list[int]
    remote: list[int]


@dataclass(frozen=True, slots=True)
class PostWrite:
    """Post a WRITE of our blocks ``src`` into the peer's slots ``dst``,
    with ``notif`` for the peer's data plane."""

    ref: TransferRef
    src: list[int]
    dst: list[int]
    notif: bytes


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a posted transfer; its end is still reported (``on_read_done``
    or ``on_write_done``), or a write that could not be stopped is."""

    ref: TransferRef


@dataclass(frozen=True, slots=True)
class LoadDone:
    """A load job ended: nothing can land in its slots any more."""

    result: LoadResult


@dataclass(frozen=True, slots=True)
class StoreDone:
    """A store job (a pin, a parked store) goes back to the engine."""

    result: StoreResult


@dataclass(frozen=True, slots=True)
class ProbeAnswered:
    """A lookup batch was answered, or will never be."""

    answer: ProbeAnswer


@dataclass(frozen=True, slots=True)
class PinJob:
    """The engine created store job ``job_id`` to pin blocks for the peer:
    its result comes later, as a :class:`StoreDone`."""

    job_id: int


@dataclass(frozen=True, slots=True)
class WantsParked:
    """A Fetch for parked stores arrived with no lookup before it: the
    owner binds the stores (``attach_parked``) when they are there."""

    serve: Serve
    #: when it arrived: the owner's grace for a finished producer and the
    #: write it may start count from then
    at: float


@dataclass(frozen=True, slots=True)
class ParkedFetchEnded:
    """A Fetch for parked stores was released (answered, refused, timed
    out, aborted, or its session lost): the owner stops keeping it with
    the stores it waited for."""

    serve: Serve


@dataclass(frozen=True, slots=True)
class Orphaned:
    """The session ended while the peer may still READ these offered
    blocks: the owner holds them to the serve's deadline."""

    serve: Serve


@dataclass(frozen=True, slots=True)
class Closed:
    """The session ended (``reason``). The owner invalidates the peer's data
    agent and then calls ``confirm_invalidated``: fenced loads end then.
    ``refusal`` is the handshake's refusal, if that ended it (its reason,
    both values and the fix, for the operator's line); ``proven`` whether
    the peer had proved itself first (a dialled peer that never did is an
    address our clients named wrong)."""

    reason: str
    refusal: HandshakeRefused | None = None
    proven: bool = False


@dataclass(frozen=True, slots=True)
class Trusted:
    """The peer proved itself (its HelloAck checked): its connection may
    carry frames of any legal size and leaves the bounds on connections
    still handshaking."""


@dataclass(frozen=True, slots=True)
class RegionKnown:
    """The session is ready and the peer's data-plane region (``region``, a
    ``RegionInfo``, encoded) may be loaded. Never for a peer that dialled
    us without proving the shared secret: NIXL hands a peer's metadata to
    UCX unchecked, and some of it (a worker address) aborts the process
    when malformed, so only peers our own clients named or that proved the
    secret get that far. One that did not is never written to: it READs
    what we offer."""

    region: bytes


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame of the peer's did not decode (``reason``, ``detail``): counted
    in ``protocol_errors``. ``ended``: it came before the handshake, so the
    connection ended (an honest peer's greeting always decodes, and a
    stream of bad ones costs its sender a connection each); otherwise the
    frame was dropped and the session goes on."""

    reason: str
    detail: str
    ended: bool


@dataclass(frozen=True, slots=True)
class BadConnection:
    """The transport ended the peer's connection for what it sent below the
    protocol (``reason``, e.g. a frame over the size bound; ``why``)."""

    reason: str
    why: str


@dataclass(frozen=True, slots=True)
class SealRefused:
    """A frame failed its seal (forged, replayed, reordered, or plain where
    a sealed one is due): a party without the secret is speaking, and the
    session ended."""

    detail: str


@dataclass(frozen=True, slots=True)
class NotSent:
    """A message of ours (``what``) did not encode within the protocol's
    bounds (``detail``): it was not sent."""

    what: str
    detail: str


@dataclass(frozen=True, slots=True)
class Hangup:
    """A frame came on an inbound connection with no session (refused at
    ``max_inbound``, or its session ended): close the connection, unread."""


@dataclass(frozen=True, slots=True)
class HoldingsHeard:
    """The peer told us what its primary tier stored (``add``) and no
    longer holds (``drop``): packed fingerprints, for the directory."""

    add: bytes
    drop: bytes


@dataclass(frozen=True, slots=True)
class Subscribed:
    """The peer asked to hear what our primary tier holds."""


@dataclass(frozen=True, slots=True)
class Dial:
    """Open a connection to the peer (a session we started waits on it)."""


SessionEvent: TypeAlias = (
    Trusted
    | RegionKnown
    | PostRead
    | PostWrite
    | Cancel
    | LoadDone
    | StoreDone
    | ProbeAnswered
    | PinJob
    | WantsParked
    | ParkedFetchEnded
    | Orphaned
    | Closed
    | HoldingsHeard
    | Subscribed
)

#: What the manager hands the runtime, each with its peer: the session
#: events that need the transports or a log line, and its own dials.
RuntimeEvent: TypeAlias = (
    Trusted
    | RegionKnown
    | PostRead
    | PostWrite
    | Cancel
    | Closed
    | Dial
    | BadFrame
    | BadConnection
    | SealRefused
    | NotSent
    | Hangup
)
