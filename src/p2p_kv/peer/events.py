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


@dataclass(frozen=True, slots=True)
class Orphaned:
    """The session ended while the peer may still READ these offered
    blocks: the owner holds them to the serve's deadline."""

    serve: Serve


@dataclass(frozen=True, slots=True)
class Closed:
    """The session ended (``reason``). The owner invalidates the peer's data
    agent and then calls ``confirm_invalidated``: fenced loads end then."""

    reason: str


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
    PostRead
    | PostWrite
    | Cancel
    | LoadDone
    | StoreDone
    | ProbeAnswered
    | PinJob
    | WantsParked
    | Orphaned
    | Closed
    | HoldingsHeard
    | Subscribed
)

#: What the manager hands the runtime, each with its peer: the session
#: events that need the transports, and its own dials.
RuntimeEvent: TypeAlias = PostRead | PostWrite | Cancel | Closed | Dial
