"""Wire messages between p2p_kv peers.

Every frame on the control plane is one msgpack-encoded message from the
tagged union :data:`Message`. Decoding is the only place where bytes from a
peer become objects, so it is also the only place that validates them: sizes,
types and counts are checked here, and anything wrong surfaces as a single
:class:`ProtocolError` that names what was wrong. Nothing is ever unpickled.

Request-scoped messages carry ``req`` (the orchestrator's ``kv_request_id``)
*and* ``gen``: the consumer stamps every new use of an id with a fresh
generation, so a late reply addressed to an earlier use of the same id can
never complete, fail or suppress a later one. ``job`` names the fetch of a
generation (the engine's job id): the manager allows one load per
generation, since its end releases every pin the producer holds for it.
"""

from __future__ import annotations

from typing import Annotated, Final, get_args

import msgspec

PROTOCOL_VERSION: Final = 7

#: Largest frame accepted from a peer. A lookup of 65,536 keys of 36 bytes
#: is about 2.5 MiB, so 4 MiB fits the largest legal message with room.
MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
#: Most keys / slots one message may carry (a 2M-token prompt at 32 tokens
#: per block).
MAX_KEYS: Final = 65_536
MAX_KEY_BYTES: Final = 64
MAX_REQ_ID_CHARS: Final = 256
MAX_TEXT_CHARS: Final = 1024
MAX_BLOB_BYTES: Final = 1024 * 1024
#: Longest pin lifetime a LookupResp may announce (one hour).
MAX_TTL_MS: Final = 3_600_000

ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQ_ID_CHARS)]
Gen = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Slot = Annotated[int, msgspec.Meta(ge=0, lt=2**40)]
Slots = Annotated[list[Slot], msgspec.Meta(max_length=MAX_KEYS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
Blob = Annotated[bytes, msgspec.Meta(max_length=MAX_BLOB_BYTES)]
#: Digests, MACs and nonces: a SHA-512's worth at most. Each handshake
#: field is bounded by what it carries, not by the frame: a Hello of a
#: million 2-byte hashes decoded to 42.8 MiB, held by a session that never
#: proved the secret (and by the 1,024 closed ones kept for metrics).
Digest = Annotated[bytes, msgspec.Meta(max_length=64)]
#: Canonical block hashes a Hello carries (we send 3).
MAX_CANONICAL_HASHES: Final = 16


class ProtocolError(ValueError):
    """A frame from a peer that we refuse: malformed, oversized or illegal.
    ``reason``: its label in the protocol-errors metric."""

    def __init__(self, message: str, reason: str = "decode") -> None:
        super().__init__(message)
        self.reason = reason


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    pass


class Hello(_Msg, tag="hello", frozen=True):
    """First frame each side sends: everything that must match before any
    request traffic. Compared by :mod:`p2p_kv.peer.handshake`."""

    version: int
    engine_id: Text
    hash_algo: Text
    seed_digest: Digest
    canonical_hashes: Annotated[
        list[Key], msgspec.Meta(max_length=MAX_CANONICAL_HASHES)
    ]
    layout: Text
    block_bytes: Annotated[int, msgspec.Meta(gt=0)]
    num_blocks: Annotated[int, msgspec.Meta(ge=0)]
    authenticated: bool
    nonce: Digest


class HelloAck(_Msg, tag="hello_ack", frozen=True):
    """Proof of the shared secret (HMAC over both hellos); empty if none."""

    mac: Digest


class Region(_Msg, tag="region", frozen=True):
    """Our data-plane region (:class:`p2p_kv.data.RegionInfo`, encoded):
    sent once the peer's HelloAck has checked, encrypted under the session
    key when there is a secret (whoever holds it can write our KV cache).
    The session is ready when both sides have it."""

    region: Blob


class Lookup(_Msg, tag="lookup", frozen=True):
    """Consumer asks which of ``keys`` the producer holds; the producer pins
    the hits until a Fetch or an Abort for the same (req, gen)."""

    req: ReqId
    gen: Gen
    seq: Gen
    keys: Keys


class LookupResp(_Msg, tag="lookup_resp", frozen=True):
    """The answer to one Lookup. A producer that lets the consumer READ its
    pinned blocks one-sided also sends where they are (``slots``, parallel
    to ``hits``; a miss's entry means nothing) and how long the pins are
    held (``ttl_ms``, counted from when the Lookup arrived). The consumer
    reads only well inside that window, so a slot is never read after the
    producer could have reused it. Empty ``slots``: fetch with a Fetch."""

    req: ReqId
    gen: Gen
    seq: Gen
    hits: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS)]
    slots: Slots = []
    ttl_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_TTL_MS)] = 0


class Fetch(_Msg, tag="fetch", frozen=True):
    """Consumer asks the producer to WRITE the blocks of ``keys`` into the
    consumer's primary-tier ``slots`` (parallel lists).

    ``parked``: the blocks may be a disaggregated prefill's parked stores,
    which may come after this Fetch; the producer waits for them. False
    when a lookup came first: only its pins can serve the Fetch, and a
    producer that no longer holds them (their lifetime ended, a cache
    reset, a reconnect) says so at once instead of waiting.

    ``read``: the consumer READs the blocks itself, so the producer
    answers with a :class:`FetchOffer` (once parked stores are all there,
    or at once for pins it holds) instead of writing: nothing of the
    producer's ever lands in the consumer's slots, so a producer that
    stalls and resumes cannot write into slots the consumer gave back (see
    ``docs/architecture.md``)."""

    req: ReqId
    gen: Gen
    job: Gen
    keys: Keys
    slots: Slots
    parked: bool = True
    read: bool = False


class FetchOffer(_Msg, tag="fetch_offer", frozen=True):
    """Producer's answer to a ``read`` Fetch: the fetch's blocks are in our
    ``slots`` (parallel to its keys), held until the consumer's Release, its
    Abort, or ``ttl_ms`` from when we sent this. The consumer counts the
    window from when it sent the Fetch (earlier), so it never reads after
    we could have let the blocks go."""

    req: ReqId
    gen: Gen
    job: Gen
    slots: Slots
    ttl_ms: Annotated[int, msgspec.Meta(gt=0, le=MAX_TTL_MS)]


class FetchWait(_Msg, tag="fetch_wait", frozen=True):
    """Producer: the ``parked`` Fetch ``job`` waits for the stores of a
    prefill that is running here now (its request is live); it will be
    answered, or refused, within ``ttl_ms``. Sent when the Fetch arrives
    before its prefill's stores and again every heartbeat interval while
    it waits, so a decoder that asked first waits as long as the prefill
    is alive (up to its own ``parked_ttl_s``) instead of its fetch
    deadline alone."""

    req: ReqId
    gen: Gen
    job: Gen
    ttl_ms: Annotated[int, msgspec.Meta(gt=0, le=MAX_TTL_MS)]


class TransferDone(_Msg, tag="transfer_done", frozen=True):
    """Producer: every write for this job has finished (``ok``) or none can
    still land (not ``ok``). Either way the consumer's slots are fenced."""

    req: ReqId
    gen: Gen
    job: Gen
    ok: bool
    reason: Text = ""


class Release(_Msg, tag="release", frozen=True):
    """Consumer: my one-sided reads for (req, gen) have ended (read or
    failed, none in flight); release the pins. No reply: the consumer's
    slots never depended on the producer."""

    req: ReqId
    gen: Gen
    blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_KEYS)] = 0


class Revoke(_Msg, tag="revoke", frozen=True):
    """Producer: I must drop the pins offered for (req, gen) (a cache
    reset). Start no new read of them and answer with a Release once no
    read is in flight; the pins are held until then (or their deadline)."""

    req: ReqId
    gen: Gen


class Abort(_Msg, tag="abort", frozen=True):
    """Consumer gives up on (req, gen): release pins; fence the writes."""

    req: ReqId
    gen: Gen


class AbortAck(_Msg, tag="abort_ack", frozen=True):
    """Producer: nothing for (req, gen) is pinned or can still be written."""

    req: ReqId
    gen: Gen


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    seq: Gen


class Goodbye(_Msg, tag="goodbye", frozen=True):
    reason: Text = ""


class Error(_Msg, tag="error", frozen=True):
    """Reply to a message we refused. Informational only: it never changes a
    request's state, so a forged or stray Error cannot tear anything down."""

    code: Text
    detail: Text = ""
    req: Text = ""
    gen: int = -1


#: Most fingerprints one Holdings message lists (8 bytes each: 2 MiB).
MAX_FINGERPRINTS: Final = 1 << 18


class Subscribe(_Msg, tag="subscribe", frozen=True):
    """Consumer asks the producer to tell it what its primary tier holds
    (``Holdings``): the producer answers with all it holds, then what it
    stores, once per step. Sent by an engine whose ``peers`` key lists the
    fleet, to each member it dials."""


class Holdings(_Msg, tag="holdings", frozen=True):
    """What the producer's primary tier stored (``add``) and no longer
    holds (``drop``), as packed little-endian 8-byte block fingerprints
    (:func:`p2p_kv.node.directory.fingerprint`). A hint: the consumer still asks
    for pins before it reads."""

    add: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_FINGERPRINTS)] = b""
    drop: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_FINGERPRINTS)] = b""


Message = (
    Hello
    | HelloAck
    | Region
    | Lookup
    | LookupResp
    | Fetch
    | FetchOffer
    | FetchWait
    | TransferDone
    | Release
    | Revoke
    | Abort
    | AbortAck
    | Heartbeat
    | Goodbye
    | Error
    | Subscribe
    | Holdings
)

#: What a peer may send before its session is ready. Anything else is
#: refused by its tag alone, before its body is parsed: a 4 MiB Fetch
#: from anyone who reaches the port took 16 ms to decode (for the session
#: to refuse it), under the lock the engine's step waits on.
Greeting = Hello | HelloAck | Region | Heartbeat | Goodbye | Error
#: The largest greeting frame: a Region's blob, sealed, with room.
MAX_GREETING_BYTES: Final = MAX_BLOB_BYTES + 4096

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_greeting_decoder: msgspec.msgpack.Decoder[Greeting] = msgspec.msgpack.Decoder(Greeting)


class _Tag(msgspec.Struct, array_like=True):
    """A frame's first field alone: the rest is skipped, not built."""

    t: str


_tag_decoder: msgspec.msgpack.Decoder[_Tag] = msgspec.msgpack.Decoder(_Tag)
_GREETING_TAGS = frozenset(t.__struct_config__.tag for t in get_args(Greeting))


def _tag_of(frame: bytes | bytearray | memoryview) -> str | None:
    try:
        return _tag_decoder.decode(frame).t
    except (msgspec.MsgspecError, RecursionError):
        return None


def encode(msg: Message) -> bytes:
    """Serialize one message. Refuses to emit a frame the peer would drop."""
    try:
        frame = _encoder.encode(msg)
    except UnicodeEncodeError as exc:  # a lone surrogate in some text
        raise ProtocolError(
            f"{type(msg).__name__} holds text UTF-8 cannot carry: {exc}"
        ) from exc
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"{type(msg).__name__} frame of {len(frame)} bytes exceeds "
            f"the {MAX_FRAME_BYTES}-byte limit"
        )
    return frame


def decode(frame: bytes | bytearray | memoryview, *, greeting: bool = False) -> Message:
    """Parse one frame from a peer; any defect raises :class:`ProtocolError`.
    ``greeting``: the session is not ready, so only a :data:`Greeting` is
    taken."""
    size = len(frame)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )
    if size == 0:
        raise ProtocolError("empty frame")
    try:
        msg = (_greeting_decoder if greeting else _decoder).decode(frame)
    except msgspec.ValidationError as exc:
        tag = _tag_of(frame) if greeting else None
        if tag is not None and tag not in _GREETING_TAGS:
            raise ProtocolError(
                f"a {tag[:64]!r} frame before the handshake", "before_handshake"
            ) from None
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    except RecursionError:
        # msgspec walks nesting in C recursion, even in a field it skips:
        # about 1,000 levels (1 KB from anyone who reaches the port) raised
        # this out of the engine's step.
        raise ProtocolError("undecodable frame: nested too deep") from None
    if isinstance(msg, LookupResp) and msg.slots and len(msg.slots) != len(msg.hits):
        raise ProtocolError(
            f"lookup_resp {msg.req!r}: {len(msg.hits)} hits but {len(msg.slots)} slots"
        )
    if isinstance(msg, Holdings) and (len(msg.add) % 8 or len(msg.drop) % 8):
        raise ProtocolError("holdings: a fingerprint list not in 8-byte words")
    if isinstance(msg, Lookup) and len(set(msg.keys)) != len(msg.keys):
        # A probe asks about each block once. Repeated, one held key made a
        # Lookup of 63,000 pins, and a peer dropping and dialling again
        # left each lost session's pins held to their deadline.
        raise ProtocolError(f"lookup {msg.req!r}: duplicate keys", "duplicate_keys")
    if isinstance(msg, Fetch):
        if len(msg.keys) != len(msg.slots):
            raise ProtocolError(
                f"fetch {msg.req!r}: {len(msg.keys)} keys but {len(msg.slots)} slots"
            )
        if len(set(msg.slots)) != len(msg.slots):
            raise ProtocolError(f"fetch {msg.req!r}: duplicate destination slots")
        if len(set(msg.keys)) != len(msg.keys):
            # A load asks for each block once. Repeated, one pinned key made
            # a Fetch of 65,536 entries (7 MiB kept per request, and a hold
            # as long as that many blocks' READ).
            raise ProtocolError(f"fetch {msg.req!r}: duplicate keys", "duplicate_keys")
    return msg
