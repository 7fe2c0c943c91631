"""One peer, both roles, no I/O.

A :class:`Session` is fed decoded messages, write completions and the
current time, and produces messages to send, writes to post and buffered
results. It owns no socket, thread or clock, so tests can drive two of them
against each other in memory through every interleaving.

Consumer role (we load from the peer): PROBE and LOAD machines.
Producer role (the peer loads from us): SERVE machines, which own the pins
they created and the parked stores bound to them until they are released.

Two ways to load. When the peer's lookup answer offers its pinned slots,
the consumer READs them one-sided (no producer step, no round trip after
the lookup) and then sends a Release; otherwise it sends a Fetch and the
producer WRITEs. A read is trusted only if it ended well inside the pins'
lifetime as the producer announced it, measured from before we sent the
Lookup, so a slot is never read after the producer could have reused it.

The fence rule lives here: a LOAD whose slots may still be written (by our
READ or by the peer's WRITE) never yields its result until that is over:
our READ ended, the peer said so (TransferDone or AbortAck), or the peer's
data agent was invalidated (:meth:`Session.confirm_invalidated`). Until
then its slots are counted as fenced.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import compress
from typing import Final, Protocol, TypeVar

from p2p_kv.handshake import (
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
from p2p_kv.lifecycle import (
    Event,
    IllegalTransition,
    Machine,
    State,
    Tracked,
)
from p2p_kv.protocol import (
    MAX_GREETING_BYTES,
    MAX_KEYS,
    MAX_TTL_MS,
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
    Lookup,
    LookupResp,
    Message,
    ProtocolError,
    Region,
    Release,
    Revoke,
    TransferDone,
    decode,
)

# ---------------------------------------------------------------------------
# configuration and results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Timeouts:
    """Every wait has a deadline. Transfers are sized to the bytes moved."""

    handshake_s: float = 5.0
    heartbeat_interval_s: float = 0.5
    lookup_s: float = 2.0
    fetch_floor_s: float = 2.0
    #: Deadline bandwidth, deliberately far below what NIXL does here
    #: (4-13 GB/s), so a slow but healthy transfer is never cut.
    fetch_bytes_per_s: float = 500e6
    abort_ack_s: float = 2.0
    pin_ttl_s: float = 15.0
    parked_wait_s: float = 30.0
    #: Share of a peer's announced pin lifetime that our READs may use; the
    #: rest absorbs delivery delay and timer lateness on both sides.
    read_window: float = 0.75

    @property
    def heartbeat_every_s(self) -> float:
        """A session that sent nothing for this long sends a Heartbeat: four
        per interval, so a peer that stalls up to 1.25 intervals (a VM
        pause, a long engine step on a host without a waker) keeps it."""
        return self.heartbeat_interval_s / 4

    @property
    def liveness_s(self) -> float:
        """A peer silent for this long is dead (crashed hosts and network
        partitions send no FIN): its loads fail and recompute. A dead
        process is noticed at once, by its closed connection."""
        return 1.5 * self.heartbeat_interval_s

    def fetch_deadline(self, now: float, nbytes: int) -> float:
        return now + self.fetch_floor_s + nbytes / self.fetch_bytes_per_s


@dataclass(frozen=True)
class Limits:
    """Per-peer bounds: a peer that exceeds them gets refusals, not memory."""

    max_serves: int = 4096
    max_pinned_blocks: int = 1 << 20
    #: Keys of a peer's lookups queued for our engine's serve window: what
    #: a peer can make us hold (and answer) before the engine looks.
    max_pending_keys: int = 1 << 19
    #: Keys of a peer's Fetches that wait for stores our engine has yet to
    #: park (disaggregated prefill): each is held until its stores come or
    #: ``parked_wait_s`` passes, about 110 bytes a key.
    max_waiting_fetch_keys: int = 1 << 19
    max_outbox: int = 65_536
    #: The two key bounds above for all peers together (about 270 and 490
    #: MB): each bound held per session, so every peer connected multiplied
    #: it (512 peers: ~60 GB). Far above any fleet's need: 4M keys of
    #: 16-token blocks are 64M tokens of prompts at once.
    engine_pending_keys: int = 1 << 22
    engine_waiting_fetch_keys: int = 1 << 22


@dataclass(slots=True)
class LoadResult:
    """Outcome of one consumer load job. ``request_finished`` travels with it:
    a failure of a request that vLLM already finished must never mark the
    request id as failed (that is the leak this project exists to avoid)."""

    job_id: int
    gen: int
    success: bool
    reason: str = ""
    nbytes: int = 0
    elapsed_s: float = 0.0
    request_finished: bool = False


@dataclass(slots=True)
class StoreResult:
    """Outcome of one producer-side store job (a pin or a parked store)."""

    job_id: int
    success: bool
    reason: str = ""


@dataclass(slots=True)
class ProbeAnswer:
    """Which of a lookup batch's keys the peer holds (``hits`` None: no
    answer -- timeout, peer lost, refused -- so treat all as misses)."""

    gen: int
    keys: list[bytes]
    hits: list[bool] | None


@dataclass(frozen=True, slots=True)
class ReadOrder:
    """The peer's pinned blocks ``remote`` into our slots ``local``."""

    job_id: int
    local: list[int]
    remote: list[int]


@dataclass(slots=True)
class Offer:
    """Blocks a peer pinned for one generation and let us READ, and until
    when (our clock) a READ of them may still be trusted."""

    req: str
    valid_until: float
    slots: dict[bytes, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WriteOrder:
    """Our blocks ``src`` to the peer's slots ``dst``, for the data plane."""

    write_id: int
    src: list[int]
    dst: list[int]
    notif: bytes


@dataclass(frozen=True, slots=True)
class PinResult:
    """What the engine's primary tier answered for one lookup batch."""

    hits: list[bool]
    #: (store job id, keys, local slots) of each pin the engine created.
    pins: list[tuple[int, list[bytes], list[int]]]


class Pinner(Protocol):
    """The engine's primary tier, as the producer sees it during a serve
    window: look keys up and pin the hits (the adapter implements this over
    vLLM's ParentManager)."""

    def pin(self, label: str, keys: Sequence[bytes]) -> PinResult: ...


class Link(Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"
    CLOSED = "closed"


# ---------------------------------------------------------------------------
# the tracked objects
# ---------------------------------------------------------------------------


class Probe(Tracked):
    machine = Machine.PROBE
    __slots__ = ("created", "deadline", "gen", "keys", "req", "sent", "seq")

    def __init__(
        self, req: str, gen: int, seq: int, keys: list[bytes], now: float, ttl: float
    ) -> None:
        super().__init__(State.PROBING)
        self.req, self.gen, self.seq, self.keys = req, gen, seq, keys
        #: Before the Lookup left, so before the peer's pins can start.
        self.created = now
        self.deadline = now + ttl
        self.sent = False


class Load(Tracked):
    machine = Machine.LOAD
    __slots__ = (
        "blocks",
        "deadline",
        "failed_as",
        "fetch",
        "gen",
        "job",
        "nbytes",
        "read_until",
        "req",
        "request_finished",
        "started",
    )

    def __init__(
        self,
        job: int,
        req: str,
        gen: int,
        blocks: int,
        nbytes: int,
        now: float,
        deadline: float,
        initial: State,
        *,
        fetch: Fetch | None = None,
        read_until: float = 0.0,
    ) -> None:
        super().__init__(initial)
        self.job, self.req, self.gen, self.blocks = job, req, gen, blocks
        self.nbytes, self.started = nbytes, now
        #: The Fetch: kept while queued (it is sent when the handshake
        #: ends) and, for a ``read`` Fetch, until the peer's offer, whose
        #: READ goes into its slots. A READ of a lookup's offer sends no
        #: request: its order goes to our own data plane.
        self.fetch = fetch
        self.deadline = deadline
        self.read_until = read_until
        self.request_finished = False
        #: The reason its failure was counted under, once it was: a load
        #: that timed out and then ended through the peer's AbortAck, a
        #: cancelled READ or the session's end is one failure, not two.
        self.failed_as = ""

    @property
    def is_read(self) -> bool:
        return self.read_until > 0.0

    @property
    def fenced(self) -> bool:
        """True while a transfer into this job's slots may still land."""
        return self.state in (
            State.FETCH_POSTED,
            State.ABORTING,
            State.READING,
            State.READ_CANCELLING,
        )


@dataclass(slots=True)
class Pin:
    """A store job the engine created for our lookup answer."""

    job_id: int
    slots: dict[bytes, int]


class ParkedStore(Tracked):
    """A ``remote_decoder`` store job: blocks kept for a decoder's fetch.

    Owned by the manager's registry while STORED, by one SERVE once BOUND.
    """

    machine = Machine.PARKED
    __slots__ = ("deadline", "job_id", "kv_id", "slots")

    def __init__(
        self,
        job_id: int,
        kv_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        deadline: float,
    ) -> None:
        super().__init__(State.STORED)
        self.job_id, self.kv_id, self.deadline = job_id, kv_id, deadline
        self.slots = dict(zip(keys, slots, strict=True))


class KeyCount:
    """Keys held in one place (a session's queued lookups, its fetches
    waiting for stores), kept as they come and go, and passed on to the
    engine's count of the same (``engine``) while the session belongs to
    the engine: both bounds read a number, never a scan."""

    __slots__ = ("engine", "keys")

    def __init__(self, engine: KeyCount | None = None) -> None:
        self.keys = 0
        self.engine = engine

    def add(self, n: int) -> None:
        self.keys += n
        if self.engine is not None:
            self.engine.keys += n

    def detach(self) -> None:
        """Take these keys out of the engine's count, for good."""
        if self.engine is not None:
            self.engine.keys -= self.keys
            self.engine = None


class Serve(Tracked):
    machine = Machine.SERVE
    __slots__ = (
        "complete",
        "deadline",
        "fetch",
        "gen",
        "offered",
        "parked",
        "pending_lookups",
        "pins",
        "req",
        "told_wait",
        "waiting",
        "write_id",
    )

    def __init__(self, req: str, gen: int, initial: State, deadline: float) -> None:
        super().__init__(initial)
        #: In FETCH_WAITING: its session's count of waiting keys, which this
        #: serve's keys leave as it leaves the state (whatever moves it).
        self.waiting: KeyCount | None = None
        self.req, self.gen, self.deadline = req, gen, deadline
        self.pending_lookups: list[Lookup] = []
        self.pins: list[Pin] = []
        self.parked: list[ParkedStore] = []
        self.fetch: Fetch | None = None
        self.write_id = -1
        #: Our pins' slots went to the peer in a LookupResp: it may be
        #: READing them, so they are held until its Release or the deadline.
        self.offered = False
        #: For FETCH_WAITING: the producer request finished, no more stores.
        self.complete = False
        #: For FETCH_WAITING: when we last told the peer its prefill is
        #: running here (FetchWait); -inf: never
        self.told_wait = -math.inf

    def fire(self, event: Event) -> State:
        new = super().fire(event)
        if self.waiting is not None and new is not State.FETCH_WAITING:
            self.waiting.add(-len(self.fetch.keys) if self.fetch is not None else 0)
            self.waiting = None
        return new

    def slot_table(self) -> Mapping[bytes, int]:
        """Key -> our slot over every pin, then every parked store (the
        first holder of a key wins). Built once per answer or write, so the
        per-key work is a dict read. Typed read-only: with one pin and no
        store it is that pin's own dict, not a copy."""
        if len(self.pins) == 1 and not self.parked:
            return self.pins[0].slots
        table: dict[bytes, int] = {}
        for store in reversed(self.parked):
            table.update(store.slots)
        for pin in reversed(self.pins):
            table.update(pin.slots)
        return table

    @property
    def pinned_blocks(self) -> int:
        return sum(len(p.slots) for p in self.pins)

    @property
    def held_blocks(self) -> int:
        """Pins and bound parked stores: blocks a peer may be told of."""
        return self.pinned_blocks + sum(len(p.slots) for p in self.parked)

    @property
    def exposed(self) -> bool:
        """Blocks held and told to the peer: it may be READing them now, so
        they outlive a reset (REVOKE) or the session (ORPHAN) to their
        deadline, and over UCX's TCP transport the READ needs our progress."""
        return self.offered and self.held_blocks > 0

    def let_go(self, event: Event | None, ok: bool, reason: str) -> list[StoreResult]:
        """Everything held goes back to the engine: the pins' jobs (which
        only held blocks, so they succeed) and the bound parked stores
        (``ok``: served). A store takes the serve's own ``event`` where its
        table has a row for it (peer lost, reset), else the outcome's. The
        results are the caller's to deliver."""
        results = [StoreResult(pin.job_id, True) for pin in self.pins]
        self.pins.clear()
        outcome = Event.WRITES_DONE if ok else Event.WRITES_FAILED
        for store in self.parked:
            store.fire(event if event is not None and store.can(event) else outcome)
            results.append(StoreResult(store.job_id, ok, reason))
        self.parked.clear()
        return results


_K = TypeVar("_K")

#: Distinct keys one tally keeps; any further key counts under an "other"
#: key. Peers choose some keys (an Error's code, a TransferDone's reason, an
#: inbound connection's name): uncapped, a peer could grow a table by one
#: entry a frame.
MAX_TALLY_KEYS = 64


def is_inbound(conn: str) -> bool:
    """Whether a session's peer key names a connection the peer opened to
    us (the transports name those ``in:...``; a peer we dial is its
    ``host:port``, and no client host may be ``in``)."""
    return conn.startswith("in:")


#: How a count of an Error the peer sent starts: its code is the peer's
#: choice, counted apart from ours (p2p_kv.metrics gives it its own labels).
PEER_REASON: Final = "peer:"


def tally(table: dict[_K, int], key: _K, other: _K) -> None:
    """Count ``key`` in ``table``, or ``other`` once the table is full."""
    if key not in table and len(table) >= MAX_TALLY_KEYS:
        key = other
    table[key] = table.get(key, 0) + 1


@dataclass(slots=True)
class SessionCounters:
    """Per-session tallies the manager exports as metrics."""

    refused: dict[str, int] = field(default_factory=dict)
    protocol_errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    bytes_served: int = 0
    #: Load jobs by path: one-sided READ of offered pins, or Fetch + WRITE.
    loads_read: int = 0
    loads_fetched: int = 0
    #: Loads whose bytes the peer WROTE into our slots (``read_path:
    #: false`` on either side): the one path fenced only by its word.
    loads_written: int = 0

    def bump(self, table: dict[str, int], key: str) -> None:
        tally(table, key, "other")


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
        #: the engine's counts of queued lookup keys and of keys of fetches
        #: waiting for stores (Limits.engine_*; None: this session alone)
        pending, waiting = engine_keys or (KeyCount(), KeyCount())
        self.timeouts = timeouts or Timeouts()
        self.limits = limits or Limits()
        #: Offer our pinned blocks for one-sided READ, and READ offered ones.
        self.reads = reads
        self._me = me
        self._hello = make_hello(me, nonce)
        self._peer_hello: Hello | None = None
        self._peer_acked = False
        #: the peer's data-plane region, once its proof checked (Region)
        self._peer_region: bytes | None = None
        #: sealing keys, with a shared secret, once the peer's Hello checked
        self._keys: FrameKeys | None = None
        self.link = Link.HANDSHAKING
        self.close_reason = ""
        self.refusal: HandshakeRefused | None = None
        #: when a request of ours last dialled or asked through it (the
        #: manager closes the one used longest ago for room at max_peers)
        self.used_at = now
        #: closed for room, not for a fault: its peer gets no backoff
        self.evicted = False
        #: Called once, as the link closes, whoever closes it (the manager,
        #: the peer, a deadline, the runtime): the manager keeps its counts
        #: of inbound sessions by link with it, not by scanning them all.
        self.on_close: Callable[[Session], None] | None = None
        self.counters = SessionCounters()
        self._created = now
        self._last_rx = now
        self._last_tx = now
        self._last_tick = now
        self._hb_seq = 0
        self._outbox: list[Message] = [self._hello]
        #: a message did not fit max_outbox: the session is lost when the
        #: outbox is next taken (see _send)
        self._overflowed = False
        self._timers: list[tuple[float, int, Probe | Load | Serve]] = []
        self._timer_ids = itertools.count()
        self._writes: list[WriteOrder] = []
        # consumer role
        self._probes: dict[tuple[int, int], Probe] = {}
        self._probe_seq = 0
        self._loads: dict[int, Load] = {}  # by job id
        self._load_results: list[LoadResult] = []
        self._probe_answers: list[ProbeAnswer] = []
        self._fenced_results: list[tuple[LoadResult, int]] = []
        self._offers: dict[int, Offer] = {}  # by gen
        self._offer_heap: list[tuple[float, int]] = []
        self._reads: list[ReadOrder] = []
        self.cancelled_reads: list[int] = []  # job ids
        #: Live gens whose pins the peer revoked before we loaded: their
        #: load fails at once instead of waiting on pins that are going.
        self._revoked: set[int] = set()
        # producer role
        self._serves: dict[tuple[str, int], Serve] = {}
        self._serve_queue: list[Serve] = []  # LOOKUP_QUEUED, in arrival order
        #: keys of queued lookups (Limits.max_pending_keys)
        self._pending = KeyCount(pending)
        #: keys of this peer's serves in FETCH_WAITING (see Serve.waiting)
        self._waiting = KeyCount(waiting)
        self._writing: dict[int, Serve] = {}  # by write id
        self._next_write = 0
        self._store_results: list[StoreResult] = []
        self.wants_parked: list[Serve] = []
        self.new_pin_jobs: list[int] = []
        #: Serves whose offered pins outlived the session (see ``_lose``).
        self.orphans: list[Serve] = []
        self.cancelled_writes: list[int] = []
        self._contacted: set[int] = set()  # gens the peer may hold pins for

    # ------------------------------------------------------------------
    # link state
    # ------------------------------------------------------------------

    @property
    def peer_hello(self) -> Hello | None:
        return self._peer_hello

    @property
    def proven(self) -> bool:
        """The peer proved itself (its HelloAck checked): what it says of
        itself, its engine id included, may be believed."""
        return self._peer_acked

    @property
    def proven_secret(self) -> bool:
        """The peer proved the shared secret (there is one, and its
        HelloAck checked)."""
        return self._peer_acked and self._me.secret is not None

    @property
    def peer_region(self) -> bytes | None:
        """The peer's data-plane region (``RegionInfo``, encoded), set
        before the session is ready."""
        return self._peer_region

    # -- sealing (with a shared secret; see p2p_kv.handshake) ----------------

    def seal(self, msg: Message, frame: bytes) -> bytes:
        """The frame to put on the wire for ``msg``: sealed (encrypted and
        authenticated, :class:`~p2p_kv.handshake.FrameKeys`) once the
        session has keys, except the handshake's own two messages and a
        Goodbye sent before the peer's proof checked (a refusal: a peer that
        failed the handshake has no keys to open it, and must read why).
        Once it checked, the peer has keys and may be ready, taking only
        sealed frames: so is our Goodbye then. Everything else is sealed,
        our Region first of all: its seal is what keeps it secret."""
        if self._keys is None or isinstance(msg, (Hello, HelloAck)):
            return frame
        if isinstance(msg, Goodbye) and not self._peer_acked:
            return frame
        return self._keys.seal(frame)

    def open(self, frame: bytes) -> Message:
        """The message a frame from the peer carries, as this session may
        take it now. Before the handshake ends only a greeting is parsed
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
        return isinstance(msg, Goodbye) and self.link is Link.HANDSHAKING

    def refuse_frame(self, err: FrameRefused) -> None:
        """A frame failed its seal (forged, replayed, reordered, or plain):
        the session ends, as a failed handshake does."""
        self._refuse(HandshakeRefused("auth", str(err)))

    @property
    def ready(self) -> bool:
        return self.link is Link.READY

    @property
    def closed(self) -> bool:
        return self.link is Link.CLOSED

    def _send(self, msg: Message) -> None:
        if self.link is Link.CLOSED:
            return
        if len(self._outbox) >= self.limits.max_outbox:
            # Dropped, and the session is lost at the next take_outbox, not
            # here: _send runs inside handlers halfway through a transition
            # (a serve answered, a load settled), and losing the session
            # under them made the rest of the handler fire on machines
            # _lose had just failed, raising out of the engine's step.
            self._overflowed = True
            return
        self._outbox.append(msg)

    def take_outbox(self, now: float) -> list[Message]:
        """What to send now. A session whose peer let its outbox overflow
        is lost here, and nothing more is sent to it."""
        if self._overflowed:
            self._overflowed = False
            self._outbox = []
            self._lose("outbox_full", "peer is not draining our messages")
            return []
        out, self._outbox = self._outbox, []
        if out:
            self._last_tx = now
        return out

    def take_writes(self) -> list[WriteOrder]:
        out, self._writes = self._writes, []
        return out

    def take_reads(self) -> list[ReadOrder]:
        """READs for the data plane to post now: from here on their bytes
        may land, so their loads are fenced until the data plane ends them."""
        out, self._reads = self._reads, []
        for order in out:
            self._loads[order.job_id].fire(Event.POSTED)
        return out

    def _refuse(self, err: HandshakeRefused) -> None:
        # Kept without its traceback: its frames hold this session, and a
        # cycle per refused connection left every one of a flood to the
        # cyclic collector (a 0.1 s pause per pass in an engine's heap).
        self.refusal = err.with_traceback(None)
        self.counters.bump(self.counters.refused, err.reason)
        self._outbox.append(Goodbye(reason=f"refused: {err}"[:1000]))
        self._lose("refused", str(err))

    def _on_hello(self, msg: Hello, now: float) -> None:
        if self._peer_hello is not None:
            # The peer greets again on this session's connection: it began a
            # new session there, so it holds nothing of ours any more (it
            # dropped ours without a Goodbye: its send to us failed, or we
            # overflowed its outbox). Kept alive, this session answered every
            # lookup after its deadline and never noticed, as each new
            # session's Hello reset its silence timer. Nothing of the new
            # Hello is adopted: the peer's next session is dialled afresh.
            self.counters.bump(self.counters.protocol_errors, "duplicate_hello")
            # Plain: the peer's new session has no keys to open a sealed one
            # (sealed, it was dropped as undecodable, and that session waited
            # out its handshake deadline).
            self._keys = None
            self._outbox.append(Goodbye(reason="second Hello: start again"))
            self._lose("peer_down", "the peer began a new session on our connection")
            return
        try:
            check_hello(self._hello, msg)
        except HandshakeRefused as err:
            self._refuse(err)
            return
        self._peer_hello = msg
        self._keys = frame_keys(self._me.secret, self._hello, msg)
        self._send(HelloAck(mac=handshake_mac(self._me.secret, self._hello, msg)))

    def _on_hello_ack(self, msg: HelloAck, now: float) -> None:
        if self._peer_hello is None or self._peer_acked:
            self._protocol_error("unexpected_hello_ack", "HelloAck out of order")
            return
        try:
            verify_mac(self._me.secret, self._peer_hello, self._hello, msg.mac)
            if self._hello.authenticated:
                check_hashes(self._hello, self._peer_hello)  # keyed: now
        except HandshakeRefused as err:
            self._refuse(err)
            return
        self._peer_acked = True
        # Only now, to a peer that proved itself: whoever holds our region
        # can write our KV cache. With a secret its frame is sealed (see
        # seal), which encrypts it.
        self._send(Region(region=self._me.region))

    def _on_region(self, msg: Region, now: float) -> None:
        if not self._peer_acked or self._peer_region is not None:
            self._protocol_error("unexpected_region", "Region out of order")
            return
        self._peer_region = msg.region
        self._maybe_ready(now)

    def _maybe_ready(self, now: float) -> None:
        if self._peer_region is None or self.link is not Link.HANDSHAKING:
            return
        self.link = Link.READY
        for probe in self._probes.values():
            if not probe.sent:
                self._send_probe(probe)
        for load in self._loads.values():
            if load.state is State.QUEUED:
                load.fire(Event.SESSION_READY)
                assert load.fetch is not None  # only a Fetch waits for READY
                self._send(load.fetch)
                if not load.fetch.read:
                    load.fetch = None  # sent: the keys and slots are not kept

    def close(self, reason: str) -> None:
        """Local decision to drop the peer (shutdown, idle, reset)."""
        if self.link is not Link.CLOSED:
            self._outbox.append(Goodbye(reason=reason))
        self._lose("closed", reason)

    def peer_lost(self, reason: str) -> None:
        """The transport says the peer is gone."""
        self._lose("peer_down", reason)

    def _lose(self, kind: str, reason: str) -> None:
        """Fail everything in flight; loads that may still be written wait
        in ``_fenced_results`` until :meth:`confirm_invalidated`."""
        if self.link is Link.CLOSED:
            return
        self.link = Link.CLOSED
        self.close_reason = f"{kind}: {reason}"
        if self.on_close is not None:
            self.on_close(self)
        for probe in self._probes.values():
            probe.fire(Event.PEER_LOST)
            self._probe_answers.append(ProbeAnswer(probe.gen, probe.keys, None))
        self._probes.clear()
        for load in self._loads.values():
            fenced = load.fenced
            load.fire(Event.PEER_LOST)
            why = self._count_failure(load, kind)
            result = self._result(load, False, why, load.started)
            if fenced:
                self._fenced_results.append((result, load.blocks))
            else:
                self._load_results.append(result)
        self._loads.clear()
        self._contacted.clear()
        self._offers.clear()
        self._offer_heap.clear()
        self._revoked.clear()
        self._reads.clear()  # never posted: nothing to fence
        self._writes.clear()
        self.cancelled_reads.clear()
        for serve in list(self._serves.values()):
            if serve.exposed and serve.can(Event.ORPHAN):
                # The peer may not know yet and READ on inside its window:
                # the pins outlive us, owned by the manager to their deadline.
                serve.fire(Event.ORPHAN)
                self._drop_pending(serve)
                del self._serves[(serve.req, serve.gen)]
                self.orphans.append(serve)
                continue
            self._release_serve(serve, Event.PEER_LOST, ok=False, reason=kind)
        self._serve_queue.clear()
        # Nothing here fires again, and a closed session is kept for its
        # counters (LoadManager.retired_sessions): its timer heap would keep
        # every probe, load and serve it armed (5 MB for 2,000 lookups of
        # 256 keys, up to 1,024 sessions kept), as its peer's region would
        # (up to 1 MiB, sent by anyone who completes a handshake).
        self._timers.clear()
        self._peer_region = None

    def confirm_invalidated(self) -> None:
        """The peer's data agent is gone: its writes can no longer land."""
        self._load_results.extend(r for r, _ in self._fenced_results)
        self._fenced_results.clear()

    # ------------------------------------------------------------------
    # input
    # ------------------------------------------------------------------

    def receive(self, msg: Message, now: float) -> None:
        """Feed one decoded message from the peer. Never raises for anything
        the peer sent: bad input costs the peer an Error reply and a count."""
        if self.link is Link.CLOSED:
            return
        self._last_rx = now
        if isinstance(msg, Hello):
            self._on_hello(msg, now)
            return
        if isinstance(msg, HelloAck):
            self._on_hello_ack(msg, now)
            return
        if isinstance(msg, Region):
            self._on_region(msg, now)
            return
        if isinstance(msg, Goodbye):
            self._lose("peer_down", f"peer said goodbye: {msg.reason}")
            return
        if isinstance(msg, Error):
            self.counters.bump(self.counters.protocol_errors, PEER_REASON + msg.code)
            return
        if isinstance(msg, Heartbeat):
            return
        if self.link is not Link.READY:
            self._protocol_error(
                "before_handshake", f"{type(msg).__name__} before the handshake"
            )
            return
        try:
            match msg:
                case Lookup():
                    self._on_lookup(msg, now)
                case LookupResp():
                    self._on_lookup_resp(msg, now)
                case Fetch():
                    self._on_fetch(msg, now)
                case FetchOffer():
                    self._on_fetch_offer(msg, now)
                case FetchWait():
                    self._on_fetch_wait(msg, now)
                case TransferDone():
                    self._on_transfer_done(msg, now)
                case Release():
                    self._on_release(msg)
                case Revoke():
                    self._on_revoke(msg)
                case Abort():
                    self._on_abort(msg)
                case AbortAck():
                    self._on_abort_ack(msg, now)
        except IllegalTransition as exc:
            req = getattr(msg, "req", "")
            gen = getattr(msg, "gen", -1)
            self._protocol_error("illegal", str(exc), req, gen)

    def _protocol_error(
        self, code: str, detail: str, req: str = "", gen: int = -1
    ) -> None:
        self.counters.bump(self.counters.protocol_errors, code)
        self._send(Error(code=code, detail=detail[:1000], req=req, gen=gen))

    # ------------------------------------------------------------------
    # consumer role
    # ------------------------------------------------------------------

    def send_lookup(self, req: str, gen: int, keys: list[bytes], now: float) -> None:
        """Ask the peer about ``keys``; the answer arrives as a ProbeAnswer."""
        if self.link is Link.CLOSED:
            self._probe_answers.append(ProbeAnswer(gen, keys, None))
            return
        self._probe_seq += 1
        probe = Probe(req, gen, self._probe_seq, keys, now, self.timeouts.lookup_s)
        self._arm(probe, probe.deadline)
        self._probes[(gen, self._probe_seq)] = probe
        if self.ready:
            self._send_probe(probe)

    def _send_probe(self, probe: Probe) -> None:
        probe.sent = True
        self.counters.lookups += 1
        self._contacted.add(probe.gen)
        self._send(Lookup(req=probe.req, gen=probe.gen, seq=probe.seq, keys=probe.keys))

    def _on_lookup_resp(self, msg: LookupResp, now: float) -> None:
        probe = self._probes.get((msg.gen, msg.seq))
        if probe is None or probe.req != msg.req:
            # A reply to a probe we gave up on, or to an earlier use of the
            # id: count it, change nothing.
            self.counters.bump(self.counters.protocol_errors, "stale_lookup_resp")
            return
        # (``decode`` already checked that ``slots`` is empty or parallel.)
        n = len(probe.keys)
        if len(msg.hits) != n:
            self._protocol_error(
                "bad_lookup_resp",
                f"{len(msg.hits)} answers for {n} keys",
                msg.req,
                msg.gen,
            )
            return
        probe.fire(Event.LOOKUP_RESP)
        del self._probes[(msg.gen, msg.seq)]
        if msg.slots and msg.ttl_ms and self.reads:
            self._take_offer(probe, msg, now)
        nhit = sum(msg.hits)
        self.counters.hits += nhit
        self.counters.misses += n - nhit
        self._probe_answers.append(ProbeAnswer(msg.gen, probe.keys, msg.hits))

    def _take_offer(self, probe: Probe, msg: LookupResp, now: float) -> None:
        if probe.gen not in self._contacted:
            # We already released (or gave up) what the peer holds for this
            # generation: a late answer's pins may go any moment.
            return
        region = self._peer_hello
        assert region is not None
        # Per-key work in C (compress, max, dict.update): a 256-key answer
        # is on the request's critical path.
        hit_slots = list(compress(msg.slots, msg.hits))
        if hit_slots and max(hit_slots) >= region.num_blocks:
            # Never read outside the region the peer registered: the Fetch
            # path (which the peer range-checks itself) still works.
            self.counters.bump(self.counters.protocol_errors, "offer_out_of_range")
            return
        until = probe.created + msg.ttl_ms / 1000.0 * self.timeouts.read_window
        offer = self._offers.get(probe.gen)
        if offer is None or offer.valid_until <= now:
            # An offer past its window (not purged yet: no tick since) may
            # name pins the peer let go: this answer came from a new serve,
            # which pinned only its own keys. Within the window the serve
            # that answered is the one that holds them all.
            offer = self._offers[probe.gen] = Offer(probe.req, until)
        # Every lookup answer re-arms all of the generation's pins.
        offer.valid_until = max(offer.valid_until, until)
        heapq.heappush(self._offer_heap, (offer.valid_until, probe.gen))
        offer.slots.update(zip(compress(probe.keys, msg.hits), hit_slots, strict=True))

    def send_fetch(
        self,
        job_id: int,
        req: str,
        gen: int,
        keys: list[bytes],
        slots: list[int],
        block_bytes: int,
        now: float,
        *,
        parked: bool = True,
    ) -> None:
        """Load ``keys`` into our ``slots`` (one load job): READ them if the
        peer offered all of them and the offer is still good, else ask the
        peer to WRITE them (from parked stores, if ``parked``: no lookup
        came first)."""
        nbytes = len(keys) * block_bytes
        if job_id in self._loads:
            raise ValueError(f"load job {job_id} submitted twice")
        if self.link is Link.CLOSED:
            self._load_results.append(
                LoadResult(job_id, gen, False, "peer_down", request_finished=False)
            )
            return
        if slots and max(slots) >= self._me.num_blocks:
            # Our own caller's mistake: refuse before any message or READ.
            self.counters.bump(self.counters.failures, "slot_out_of_range")
            self._load_results.append(
                LoadResult(job_id, gen, False, "slot_out_of_range")
            )
            return
        if gen in self._revoked:
            self.counters.bump(self.counters.failures, "revoked")
            self._load_results.append(LoadResult(job_id, gen, False, "revoked"))
            return
        deadline = self.timeouts.fetch_deadline(now, nbytes)
        self._contacted.add(gen)
        offer = self._offers.pop(gen, None)
        fetch: Fetch | None = None
        if (
            offer is not None
            # Time to READ it all inside the trust window, at the rate the
            # deadlines assume (a READ chosen at the window's end failed,
            # where a Fetch, the pins still held, would load).
            and now + nbytes / self.timeouts.fetch_bytes_per_s < offer.valid_until
            and all(map(offer.slots.__contains__, keys))
        ):
            deadline = min(deadline, offer.valid_until)
            initial, read_until = State.READ_QUEUED, offer.valid_until
            self.counters.loads_read += 1
        else:
            if len(keys) > MAX_KEYS or len(set(keys)) != len(keys):
                # A Fetch asks for each block once, at most MAX_KEYS of them
                # (a peer refuses the frame): recompute now, not at the
                # deadline.
                self.counters.bump(self.counters.failures, "unsendable_keys")
                self._load_results.append(
                    LoadResult(job_id, gen, False, "unsendable_keys")
                )
                return
            fetch = Fetch(
                req=req,
                gen=gen,
                job=job_id,
                keys=keys,
                slots=slots,
                parked=parked,
                # Offered to a reader, not written: a producer's WRITE into
                # our slots is fenced only by its word or its death.
                read=self.reads,
            )
            initial = State.FETCH_POSTED if self.ready else State.QUEUED
            offer, read_until = None, 0.0
            self.counters.loads_fetched += 1
        load = Load(
            job_id,
            req,
            gen,
            len(keys),
            nbytes,
            now,
            deadline,
            initial,
            fetch=fetch if initial is State.QUEUED or self.reads else None,
            read_until=read_until,
        )
        self._loads[job_id] = load
        self._arm(load, load.deadline)
        if offer is not None:
            remote = list(map(offer.slots.__getitem__, keys))
            self._reads.append(ReadOrder(job_id, list(slots), remote))
        elif fetch is not None and initial is State.FETCH_POSTED:
            self._send(fetch)

    def _on_fetch_wait(self, msg: FetchWait, now: float) -> None:
        """The prefill our parked Fetch waits for is running at the peer:
        wait on, a fetch deadline from now, but no longer than it holds our
        Fetch (``ttl_ms``) nor ``parked_ttl_s`` from the load's start."""
        load = self._loads.get(msg.job)
        fetch = load.fetch if load is not None else None
        if (
            load is None
            or load.state is not State.FETCH_POSTED
            or (load.req, load.gen) != (msg.req, msg.gen)
        ):
            self.counters.bump(self.counters.protocol_errors, "stale_fetch_wait")
            return
        if fetch is not None and not fetch.parked:
            self.counters.bump(self.counters.protocol_errors, "bad_fetch_wait")
            return
        until = min(
            self.timeouts.fetch_deadline(now, load.nbytes),
            now + msg.ttl_ms / 1000,
            load.started + self.timeouts.parked_wait_s,
        )
        if until > load.deadline:
            load.fire(Event.WAIT)
            self._arm(load, until)

    def _on_fetch_offer(self, msg: FetchOffer, now: float) -> None:
        load = self._loads.get(msg.job)
        fetch = load.fetch if load is not None else None
        if (
            load is None
            or fetch is None  # kept in FETCH_POSTED for a read Fetch only
            or load.state is not State.FETCH_POSTED
            or (load.req, load.gen) != (msg.req, msg.gen)
        ):
            # For a load we gave up on (its Abort crossed this offer) or
            # never asked an offer for: the peer holds nothing past our
            # Abort or its deadline, so nothing to answer.
            self.counters.bump(self.counters.protocol_errors, "stale_fetch_offer")
            return
        region = self._peer_hello
        assert region is not None
        if (
            len(msg.slots) != load.blocks
            or not msg.slots
            or max(msg.slots) >= region.num_blocks
        ):
            self._protocol_error(
                "bad_fetch_offer",
                f"{len(msg.slots)} slots for {load.blocks} keys, or outside the "
                f"peer's {region.num_blocks} blocks",
                msg.req,
                msg.gen,
            )
            # Nothing read, and the producer offered rather than wrote: end
            # it as an abort does, through the peer's ack (the fence), but
            # counted and reported as what it was.
            self._count_failure(load, "bad_fetch_offer")
            load.fire(Event.ABORT)
            self._arm(load, now + self.timeouts.abort_ack_s)
            self._send(Abort(load.req, load.gen))
            return
        # Counted from when our Fetch left, before the peer's hold began.
        until = load.started + msg.ttl_ms / 1000.0 * self.timeouts.read_window
        load.fire(Event.OFFER)
        load.fetch, load.read_until = None, until
        if now + load.nbytes / self.timeouts.fetch_bytes_per_s >= until:
            # No time left to READ it all inside the window: the load
            # recomputes, and its Release frees what the peer holds.
            load.fire(Event.TIMEOUT)
            self._end_unstarted(load, "offer_too_late", now)
            return
        if until < load.deadline:
            self._arm(load, until)
        self._reads.append(ReadOrder(load.job, list(fetch.slots), list(msg.slots)))

    def on_read_done(self, job_id: int, ok: bool, now: float) -> None:
        """The data plane ended our READ of job ``job_id`` (exactly once)."""
        load = self._loads.get(job_id)
        if load is None or not load.is_read:
            return
        late = ok and now > load.read_until
        if late:
            ok = False  # it may have read slots the peer had already reused
        was_cancelled = load.state is State.READ_CANCELLING
        load.fire(Event.TRANSFER_OK if ok else Event.TRANSFER_FAILED)
        del self._loads[job_id]
        self._offers.pop(load.gen, None)
        if load.gen in self._contacted:
            # Nothing of ours reads the pins any more: the peer may drop them.
            self._contacted.discard(load.gen)
            # (A count, for the peer's bytes-served total: a frame carries
            # at most MAX_KEYS; a larger one was dropped, and with it the
            # Release, so the pins stayed to their deadline.)
            read = min(load.blocks, MAX_KEYS) if ok else 0
            self._send(Release(load.req, load.gen, read))
        if load.state is State.DONE:
            self.counters.bytes_loaded += load.nbytes
            self._load_results.append(self._result(load, True, "", now))
            return
        reason = "abort" if was_cancelled else "read_late" if late else "read_failed"
        reason = self._count_failure(load, reason)
        self._load_results.append(self._result(load, False, reason, now))

    def _end_unstarted(self, load: Load, reason: str, now: float) -> None:
        """A load that failed from QUEUED or READ_QUEUED: its Fetch was
        never sent, its READ never posted, so nothing can land and it ends
        now. A READ's order is forgotten and the peer may drop the pins."""
        if load.is_read:
            self._reads = [o for o in self._reads if o.job_id != load.job]
            if load.gen in self._contacted:
                self._contacted.discard(load.gen)
                self._send(Release(load.req, load.gen, 0))
        del self._loads[load.job]
        reason = self._count_failure(load, reason)
        self._load_results.append(self._result(load, False, reason, now))

    def _count_failure(self, load: Load, reason: str) -> str:
        """Count ``load``'s failure once, under the first reason it failed
        for, and return that reason (the one its result carries)."""
        if not load.failed_as:
            load.failed_as = reason
            self.counters.bump(self.counters.failures, reason)
        return load.failed_as

    def _on_revoke(self, msg: Revoke) -> None:
        offer = self._offers.get(msg.gen)
        if offer is not None and offer.req == msg.req:
            del self._offers[msg.gen]
        if msg.gen in self._contacted:  # live: finish_gen forgets it
            self._revoked.add(msg.gen)
        reading = any(
            ld.is_read and ld.gen == msg.gen and ld.req == msg.req
            for ld in self._loads.values()
        )
        if not reading:
            # A read in flight sends the Release when it ends.
            self._contacted.discard(msg.gen)
            self._send(Release(msg.req, msg.gen, 0))

    def finish_gen(self, gen: int, req: str, now: float) -> None:
        """vLLM finished the consumer request: mark every in-flight load and
        buffered result of ``gen``, stop its probes, and tell the peer to
        release whatever it pinned for us (fencing any write in flight)."""
        for load in self._loads.values():
            if load.gen == gen:
                load.request_finished = True
        for result in (*self._load_results, *(r for r, _ in self._fenced_results)):
            if result.gen == gen:
                result.request_finished = True
        for key in [k for k, p in self._probes.items() if p.gen == gen]:
            self._probes.pop(key).fire(Event.FINISH)
        self._offers.pop(gen, None)
        self._revoked.discard(gen)
        for job_id, load in list(self._loads.items()):
            if load.gen != gen or not load.can(Event.ABORT):
                continue
            load.fire(Event.ABORT)
            if load.state is State.FAILED:  # was only queued: nothing to fence
                self._end_unstarted(load, "abort", now)
                continue
            if load.state is State.READ_CANCELLING:
                self.cancelled_reads.append(job_id)
            # The ack comes once the transfer it fences has settled, which
            # may take as long as the transfer was given: only a peer silent
            # past that is unhealthy (and closing it fails every load).
            self._arm(load, max(load.deadline, now) + self.timeouts.abort_ack_s)
        # The peer pins hits when it answers a lookup and releases them on a
        # fetch, on our Abort or at its pin deadline. Which came first is
        # unknowable here; an Abort is cheap and always safe.
        if gen in self._contacted:
            self._contacted.discard(gen)
            if self.ready:
                self._send(Abort(req=req, gen=gen))

    def _on_transfer_done(self, msg: TransferDone, now: float) -> None:
        load = self._loads.get(msg.job)
        if (
            load is None
            or load.is_read  # only our own data plane ends a READ
            or load.gen != msg.gen
            or load.req != msg.req
        ):
            self.counters.bump(self.counters.protocol_errors, "stale_transfer_done")
            return
        load.fire(Event.TRANSFER_OK if msg.ok else Event.TRANSFER_FAILED)
        del self._loads[msg.job]
        if msg.ok:
            # A producer releases everything for (req, gen) once its writes
            # are done, so finishing the request needs no Abort round trip.
            # (A refusal may leave pins behind: the Abort still goes.)
            self._contacted.discard(msg.gen)
            self.counters.loads_written += 1
        ok = load.state is State.DONE  # an aborted load fails even if whole
        if ok:
            self.counters.bytes_loaded += load.nbytes
            reason = ""
        elif msg.ok or load.failed_as:  # (failed_as: it timed out first)
            reason = self._count_failure(load, "abort")
        else:
            self._count_failure(load, "transfer_failed")
            reason = f"peer: {msg.reason}"
        self._load_results.append(self._result(load, ok, reason, now))

    def _on_abort_ack(self, msg: AbortAck, now: float) -> None:
        acked = [
            job
            for job, load in self._loads.items()
            if load.gen == msg.gen
            and load.req == msg.req
            and load.state is State.ABORTING
        ]
        for job in acked:
            load = self._loads.pop(job)
            load.fire(Event.ABORT_ACK)
            reason = self._count_failure(load, "abort")
            self._load_results.append(self._result(load, False, reason, now))

    def _result(self, load: Load, ok: bool, reason: str, now: float) -> LoadResult:
        return LoadResult(
            job_id=load.job,
            gen=load.gen,
            success=ok,
            reason=reason,
            nbytes=load.nbytes if ok else 0,
            elapsed_s=max(0.0, now - load.started),
            request_finished=load.request_finished,
        )

    # ------------------------------------------------------------------
    # producer role
    # ------------------------------------------------------------------

    def pending_lookup_keys(self) -> int:
        return self._pending.keys

    def leave_engine(self) -> None:
        """The manager forgets this session: what it holds leaves the
        engine's counts (and whatever it drops later, only its own)."""
        self._pending.detach()
        self._waiting.detach()

    def waiting_fetch_keys(self) -> int:
        """Keys of this peer's Fetches that wait for stores to be parked."""
        return self._waiting.keys

    def _on_lookup(self, msg: Lookup, now: float) -> None:
        cost = max(1, len(msg.keys))
        held = self._pending.keys
        engine = self._pending.engine.keys if self._pending.engine else held
        mine = held + cost > self.limits.max_pending_keys
        if mine or engine + cost > self.limits.engine_pending_keys:
            self._protocol_error(
                "limit_pending_keys" if mine else "limit_engine_pending_keys",
                f"{held if mine else engine} lookup keys already "
                f"wait for our engine{'' if mine else ' from all peers'}",
                msg.req,
                msg.gen,
            )
            self._send(LookupResp(msg.req, msg.gen, msg.seq, [False] * len(msg.keys)))
            return
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None:
            if len(self._serves) >= self.limits.max_serves:
                self._protocol_error(
                    "limit_serves", "too many requests in flight", msg.req, msg.gen
                )
                self._send(
                    LookupResp(msg.req, msg.gen, msg.seq, [False] * len(msg.keys))
                )
                return
            serve = Serve(
                msg.req, msg.gen, State.LOOKUP_QUEUED, now + self.timeouts.pin_ttl_s
            )
            self._arm(serve, serve.deadline)
            self._serves[(msg.req, msg.gen)] = serve
        elif not serve.can(Event.LOOKUP):
            # Revoking, or past its Fetch (one load per generation: a key
            # asked in the step of the load, sent after it).
            self._send(LookupResp(msg.req, msg.gen, msg.seq, [False] * len(msg.keys)))
            return
        else:
            serve.fire(Event.LOOKUP)
        serve.pending_lookups.append(msg)
        self._pending.add(cost)
        if serve not in self._serve_queue:
            self._serve_queue.append(serve)

    def _drop_pending(self, serve: Serve) -> list[Lookup]:
        """Take a serve's queued lookups off the pending-keys budget."""
        pending, serve.pending_lookups = serve.pending_lookups, []
        self._pending.add(-sum(max(1, len(lk.keys)) for lk in pending))
        return pending

    @property
    def has_lookups_to_serve(self) -> bool:
        return bool(self._serve_queue)

    @property
    def peer_transfers(self) -> bool:
        """The peer may be moving bytes to or from our region now: blocks of
        ours it was told of and that are still held for it (its READ), or a
        load of ours a transfer may still land in (its WRITE; our own READ
        is in the data plane's flight anyway).
        Over UCX's TCP transport such a transfer moves only as our side
        makes progress too."""
        return any(ld.fenced for ld in self._loads.values()) or any(
            sv.exposed for sv in self._serves.values()
        )

    def serve_lookups(self, pinner: Pinner, now: float) -> None:
        """Answer queued lookups against the engine (its serve window)."""
        queue, self._serve_queue = self._serve_queue, []
        if not queue:
            return
        # Counted once per window, not per lookup: with thousands of serves
        # a per-lookup sum made a busy window quadratic.
        pinned = self.pinned_blocks
        for serve in queue:
            pending = self._drop_pending(serve)
            if serve.state is not State.LOOKUP_QUEUED:
                continue
            for lookup in pending:
                budget = self.limits.max_pinned_blocks - pinned
                keys = lookup.keys if len(lookup.keys) <= budget else []
                if len(keys) < len(lookup.keys):
                    self.counters.bump(self.counters.refused, "limit_pinned_blocks")
                label = f"p2p_kv:{self.peer}:{serve.req}:{serve.gen}:{lookup.seq}"
                try:
                    result = pinner.pin(label, keys) if keys else PinResult([], [])
                except Exception:
                    # The engine could not pin: an all-miss answer, and the
                    # window goes on for every other lookup.
                    self.counters.bump(self.counters.failures, "pin_error")
                    result = PinResult([], [])
                hits = result.hits or [False] * len(lookup.keys)
                for job_id, pkeys, pslots in result.pins:
                    pinned += len(pkeys)
                    self.new_pin_jobs.append(job_id)
                    serve.pins.append(
                        Pin(job_id, dict(zip(pkeys, pslots, strict=True)))
                    )
                self._send(self._answer(serve, lookup, hits))
            serve.fire(Event.SERVED)
            # Never less than an offer announces (whole milliseconds, one at
            # least): a pin lifetime under 1 ms was announced as 1 ms and
            # released before it, under a READ the consumer still trusted.
            self._arm(serve, now + max(self.timeouts.pin_ttl_s, self._hold_s()))

    def _answer(self, serve: Serve, lookup: Lookup, hits: list[bool]) -> LookupResp:
        if not self.reads or not any(hits):
            return LookupResp(serve.req, serve.gen, lookup.seq, hits)
        table = serve.slot_table()
        slots = [
            table.get(key, -1) if hit else 0
            for key, hit in zip(lookup.keys, hits, strict=True)
        ]
        if -1 in slots:
            # A hit the engine did not pin for us: no READ offer at all.
            return LookupResp(serve.req, serve.gen, lookup.seq, hits)
        serve.offered = True
        ttl_ms = round(self._hold_s() * 1000)
        return LookupResp(serve.req, serve.gen, lookup.seq, hits, slots, ttl_ms)

    def _hold_s(self, nbytes: int = 0) -> float:
        """How long blocks offered for a READ of ``nbytes`` are held, as
        announced: the pins' lifetime, plus the READ's own time (at the rate
        the deadlines assume, over the reader's share of the window), so a
        load too large for the bare lifetime can still be read inside it.
        Whole milliseconds, as the wire carries them: announcing less than
        we hold is always safe, more never happens."""
        t = self.timeouts
        hold = t.pin_ttl_s + nbytes / t.fetch_bytes_per_s / t.read_window
        return max(1, min(int(hold * 1000), MAX_TTL_MS)) / 1000.0

    def _on_release(self, msg: Release) -> None:
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None:
            return  # already released (deadline, abort): nothing to do
        serve.fire(Event.RELEASE)
        blocks = min(msg.blocks, serve.held_blocks)
        self.counters.bytes_served += blocks * self._me.block_bytes
        # Parked stores the consumer never read (it gave the load up) were
        # not served; pins only held blocks either way.
        ok = blocks > 0 or not serve.parked
        self._release_serve(serve, None, ok=ok, reason="" if ok else "unread")

    @property
    def pinned_blocks(self) -> int:
        return sum(s.pinned_blocks for s in self._serves.values())

    def _on_fetch(self, msg: Fetch, now: float) -> None:
        region = self._peer_hello
        assert region is not None
        bad = [s for s in msg.slots if s >= region.num_blocks]
        if bad:
            self._protocol_error(
                "slot_out_of_range",
                f"slot {bad[0]} outside the peer's {region.num_blocks} blocks",
                msg.req,
                msg.gen,
            )
            self._send(
                TransferDone(msg.req, msg.gen, msg.job, False, "slot out of range")
            )
            return
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None and not msg.parked:
            # A lookup came first, and its pins are gone: nothing of ours
            # will ever serve this.
            self.counters.bump(self.counters.failures, "fetch_not_pinned")
            self._send(TransferDone(msg.req, msg.gen, msg.job, False, "not pinned"))
            return
        if serve is None:
            if len(self._serves) >= self.limits.max_serves:
                self._send(TransferDone(msg.req, msg.gen, msg.job, False, "busy"))
                return
            waiting = self._waiting.keys
            engine = self._waiting.engine.keys if self._waiting.engine else waiting
            cost = len(msg.keys)
            mine = waiting + cost > self.limits.max_waiting_fetch_keys
            if mine or engine + cost > self.limits.engine_waiting_fetch_keys:
                # Counted per serve alone, a peer could make us hold 4,096
                # Fetches of 65,536 keys each: 28 GiB.
                self._protocol_error(
                    "limit_waiting_fetch_keys"
                    if mine
                    else "limit_engine_waiting_fetch_keys",
                    f"{waiting if mine else engine} keys of fetches already wait "
                    f"for our stores{'' if mine else ' from all peers'}",
                    msg.req,
                    msg.gen,
                )
                self._send(TransferDone(msg.req, msg.gen, msg.job, False, "busy"))
                return
            # No lookup came first: a disaggregated-prefill fetch for parked
            # stores. The manager binds them (wants_parked).
            serve = Serve(
                msg.req, msg.gen, State.FETCH_WAITING, now + self.timeouts.parked_wait_s
            )
            serve.fetch = msg
            self._arm(serve, serve.deadline)
            self._serves[(msg.req, msg.gen)] = serve
            serve.waiting = self._waiting
            self._waiting.add(cost)
            self.wants_parked.append(serve)
            return
        if serve.state is State.REVOKING:
            # The consumer had not seen our Revoke yet: the pins are going.
            self._send(TransferDone(msg.req, msg.gen, msg.job, False, "reset"))
            return
        if serve.state is not State.PINNED:
            # One Fetch per serve: a second one re-offering (or writing)
            # blocks whose Release a first READ may send would let a peer
            # hold parked stores for good, or read them after their release.
            self._protocol_error(
                "duplicate_fetch",
                f"fetch job {msg.job} while the request is {serve.state.value}",
                msg.req,
                msg.gen,
            )
            # A replay of the job being served must not fail it early (its
            # slots would be released while our write can still land); a
            # different job has nothing in flight and can be refused.
            if serve.fetch is None or msg.job != serve.fetch.job:
                self._send(
                    TransferDone(msg.req, msg.gen, msg.job, False, "duplicate fetch")
                )
            return
        # (A read Fetch here: the consumer's READ window on our lookup
        # answer closed before its load; the pins are offered again.)
        serve.fetch = msg
        self._serve_fetch(serve, Event.FETCH, now)

    def attach_parked(
        self, serve: Serve, stores: list[ParkedStore], complete: bool, now: float
    ) -> None:
        """The manager hands over parked stores for a waiting fetch."""
        for store in stores:
            store.fire(Event.FETCH)
            serve.parked.append(store)
        serve.complete = serve.complete or complete
        fetch = serve.fetch
        assert fetch is not None
        table = serve.slot_table()
        if all(k in table for k in fetch.keys):
            self._serve_fetch(serve, Event.STORES_READY, now)
        elif serve.complete:
            self._send(
                TransferDone(
                    serve.req, serve.gen, fetch.job, False, "blocks not stored"
                )
            )
            self._release_serve(serve, Event.TIMEOUT, ok=False, reason="missing")

    def tell_waiting(self, serve: Serve, now: float) -> None:
        """The prefill ``serve``'s Fetch waits for is running here: tell the
        peer (FetchWait), at most once a heartbeat interval, so that it
        waits on past its fetch deadline. Promised for no longer than we
        hold the Fetch ourselves (its deadline, ``parked_ttl_s``)."""
        fetch = serve.fetch
        if (
            fetch is None
            or serve.state is not State.FETCH_WAITING
            or now < serve.told_wait + self.timeouts.heartbeat_interval_s
            or self.link is not Link.READY
        ):
            return
        ttl_ms = min(MAX_TTL_MS, round((serve.deadline - now) * 1000))
        if ttl_ms <= 0:
            return
        serve.told_wait = now
        self._send(FetchWait(serve.req, serve.gen, fetch.job, ttl_ms))

    def _serve_fetch(self, serve: Serve, write_event: Event, now: float) -> None:
        """The serve's Fetch, its blocks all held: offered for the consumer
        to READ if it asked and we offer reads at all (``read_path``), else
        written (``write_event`` starts the write)."""
        assert serve.fetch is not None
        if serve.fetch.read and self.reads:
            self._offer(serve, now)
        else:
            self._start_writes(serve, write_event, now)

    def _offer(self, serve: Serve, now: float) -> None:
        """Answer a ``read`` Fetch whose blocks we hold (pins, or parked
        stores all here) with where they are, and hold them as offered pins
        are held: to the consumer's Release or Abort, the hold's deadline,
        or orphaned past a lost session."""
        src = self._fetch_sources(serve)
        if src is None:
            return
        serve.fire(Event.OFFER)
        serve.offered = True
        hold_s = self._hold_s(len(src) * self._me.block_bytes)
        self._arm(serve, now + hold_s)
        fetch = serve.fetch
        assert fetch is not None
        ttl_ms = round(hold_s * 1000)
        self._send(FetchOffer(fetch.req, fetch.gen, fetch.job, src, ttl_ms))

    def _fetch_sources(self, serve: Serve) -> list[int] | None:
        """Our slots of the serve's Fetch, key by key; None (the peer told,
        the serve released) if a key is not among what it holds."""
        fetch = serve.fetch
        assert fetch is not None
        table = serve.slot_table()
        src = [table.get(key, -1) for key in fetch.keys]
        if -1 in src:
            self._send(
                TransferDone(serve.req, serve.gen, fetch.job, False, "block not pinned")
            )
            self._release_serve(serve, Event.ABORT, ok=False, reason="not_pinned")
            return None
        return src

    def _start_writes(self, serve: Serve, event: Event, now: float) -> None:
        fetch = serve.fetch
        assert fetch is not None
        src = self._fetch_sources(serve)
        if src is None:
            return
        serve.fire(event)
        self._next_write += 1
        serve.write_id = self._next_write
        nbytes = len(src) * self._me.block_bytes
        self._arm(serve, self.timeouts.fetch_deadline(now, nbytes))
        self._writing[serve.write_id] = serve
        self._writes.append(
            WriteOrder(
                serve.write_id,
                src,
                list(fetch.slots),
                f"{fetch.req}:{fetch.gen}:{fetch.job}".encode(),
            )
        )

    def on_write_done(self, write_id: int, ok: bool, now: float) -> None:
        """The data plane finished (or failed) a posted write."""
        serve = self._writing.pop(write_id, None)
        if serve is None:
            return
        fetch = serve.fetch
        assert fetch is not None
        self._send(self._write_reply(serve, ok))
        if ok:
            self.counters.bytes_served += len(fetch.keys) * self._me.block_bytes
        self._release_serve(
            serve,
            Event.WRITES_DONE if ok else Event.WRITES_FAILED,
            ok=ok,
            reason="" if ok else "write_failed",
        )

    def _write_reply(self, serve: Serve, ok: bool) -> Message:
        """What the peer hears once a posted write can no longer land."""
        if serve.state in (State.ABORT_WRITING, State.ABORT_CANCELLING):
            return AbortAck(serve.req, serve.gen)
        assert serve.fetch is not None
        why = (
            "write deadline"
            if serve.state is State.WRITE_CANCELLING
            else "write failed"
        )
        return TransferDone(
            serve.req, serve.gen, serve.fetch.job, ok, "" if ok else why
        )

    def on_write_unstoppable(
        self, write_id: int, event: Event = Event.WRITES_FAILED
    ) -> None:
        """A write of ours was given up on while still running: its bytes
        may yet land in the peer's slots (NIXL cannot stop them). The peer
        must not hear that it is over; it hears Goodbye, fails the load and
        drops our agent, which is what fences it. ``event``: what ended the
        serve (the data plane's report, or its own TIMEOUT row when no
        report came)."""
        serve = self._writing.pop(write_id, None)
        if serve is not None:
            self._release_serve(serve, event, ok=False, reason="write_failed")
        self.close("a write we could not stop may still land: drop our agent")

    def _on_abort(self, msg: Abort) -> None:
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None:
            # Nothing held for it (already released): the fence holds.
            self._send(AbortAck(msg.req, msg.gen))
            return
        if serve.state in (State.ABORT_WRITING, State.ABORT_CANCELLING):
            return
        serve.fire(Event.ABORT)
        if serve.state is State.RELEASED:
            self._send(AbortAck(msg.req, msg.gen))
            self._release_serve(serve, None, ok=False, reason="abort")
        # else ABORT_WRITING / ABORT_CANCELLING: AbortAck goes out once the
        # write settles.

    def _release_serve(
        self, serve: Serve, event: Event | None, *, ok: bool, reason: str
    ) -> None:
        """The one release path of a SERVE: pins back to the engine, bound
        parked stores released, bookkeeping dropped."""
        if event is not None and serve.state is not State.RELEASED:
            serve.fire(event)
        for lookup in self._drop_pending(serve):
            # Answered, not dropped: the consumer need not wait for its
            # lookup deadline to learn that nothing is held.
            self._send(
                LookupResp(serve.req, serve.gen, lookup.seq, [False] * len(lookup.keys))
            )
        self._serves.pop((serve.req, serve.gen), None)
        if serve.write_id in self._writing:
            del self._writing[serve.write_id]
        self._store_results.extend(serve.let_go(event, ok, reason))
        # Its timer entry may outlive it (see _arm): not the peer's keys and
        # slots (8 MiB for 60,000 keys, outside every per-peer bound).
        serve.fetch = None

    def release_unwritten(self) -> None:
        """Release every serve with no write in flight (cache reset). A later
        fetch for it is answered TransferDone(ok=False): the peer recomputes.
        Pins offered for READ are revoked instead: they go back when the
        peer's Release says no read is in flight (or at their deadline)."""
        for serve in list(self._serves.values()):
            if serve.exposed and serve.can(Event.REVOKE):
                for lookup in self._drop_pending(serve):
                    self._send(
                        LookupResp(
                            serve.req, serve.gen, lookup.seq, [False] * len(lookup.keys)
                        )
                    )
                if serve in self._serve_queue:
                    self._serve_queue.remove(serve)
                serve.fire(Event.REVOKE)
                self._send(Revoke(serve.req, serve.gen))
                continue
            if serve.can(Event.RESET):
                fetch = serve.fetch
                if fetch is not None:
                    self._send(
                        TransferDone(serve.req, serve.gen, fetch.job, False, "reset")
                    )
                self._release_serve(serve, Event.RESET, ok=False, reason="reset")

    # ------------------------------------------------------------------
    # time
    # ------------------------------------------------------------------

    def next_deadline(self) -> float:
        """Earliest time :meth:`tick` has something to do."""
        if self.link is Link.CLOSED:
            return float("inf")
        timers = self._timers
        while timers and (
            timers[0][2].terminal or timers[0][2].deadline != timers[0][0]
        ):
            heapq.heappop(timers)
        first = timers[0][0] if timers else float("inf")
        if self.link is Link.HANDSHAKING:
            return min(first, self._created + self.timeouts.handshake_s)
        times = [
            self._last_tx + self.timeouts.heartbeat_every_s,
            self._last_rx + self.timeouts.liveness_s,
            first,
        ]
        offers = self._offer_heap
        while offers and (
            offers[0][1] not in self._offers
            or self._offers[offers[0][1]].valid_until != offers[0][0]
        ):
            heapq.heappop(offers)
        if offers:
            times.append(offers[0][0])
        return min(times)

    def latest_deadline(self) -> float:
        """No earlier than the last deadline armed for any probe, load or
        serve of this session, or for the offered pins it leaves orphaned
        when closed (a stale timer entry can only make it later): by then,
        and a cancel's wait, every job here has ended."""
        held = [sv.deadline for sv in self.orphans]
        if self.link is not Link.CLOSED:
            held += [at for at, _, item in self._timers if not item.terminal]
        return max(held, default=float("-inf"))

    def _arm(self, item: Probe | Load | Serve, deadline: float) -> None:
        """Set ``item``'s deadline; the old timer entry goes stale.

        Stale entries (re-armed or ended items) leave the heap only as they
        reach its top, so one live item with an early deadline kept every
        later one, and what it references, until its own turn: a peer's
        Fetch + Abort a frame apart piled up 30 s of them. Rebuilt when
        they dominate."""
        item.deadline = deadline
        timers = self._timers
        heapq.heappush(timers, (deadline, next(self._timer_ids), item))
        live = len(self._probes) + len(self._loads) + len(self._serves)
        if len(timers) > 4 * max(16, live):
            self._timers = [
                t for t in timers if not t[2].terminal and t[2].deadline == t[0]
            ]
            heapq.heapify(self._timers)

    def tick(self, now: float) -> None:
        """Fire every deadline that has passed. Each failure costs one
        request, never the session -- except silence from the peer itself."""
        if self.link is Link.CLOSED:
            return
        if self.link is Link.HANDSHAKING:
            if now >= self._created + self.timeouts.handshake_s:
                self._lose("handshake_timeout", "no handshake in time")
                return
            # A request's own deadline runs whether or not the peer ever
            # answers: a lookup to a peer that is down waited out the 5 s
            # handshake, not its 2 s.
            self._fire_timers(now)
            return
        if now - self._last_tick > self.timeouts.liveness_s:
            # It is we who were silent (a long engine step): do not blame the
            # peer for frames we did not read.
            self._last_rx = max(self._last_rx, now - self.timeouts.heartbeat_interval_s)
        self._last_tick = now
        if now >= self._last_rx + self.timeouts.liveness_s:
            # Say so: a peer that is alive but was slow must not keep using
            # a session we dropped.
            self._outbox.append(Goodbye(reason="no heartbeat from you in time"))
            self._lose("peer_down", "heartbeat deadline passed")
            return
        if not self._fire_timers(now):
            return
        offers = self._offer_heap
        while offers and offers[0][0] <= now:
            until, gen = heapq.heappop(offers)
            offer = self._offers.get(gen)
            if offer is not None and offer.valid_until == until:
                del self._offers[gen]  # a load now takes the Fetch path
        if now >= self._last_tx + self.timeouts.heartbeat_every_s:
            self._hb_seq += 1
            self._send(Heartbeat(seq=self._hb_seq))

    def _fire_timers(self, now: float) -> bool:
        """Fire the probes', loads' and serves' deadlines that passed; False
        if that ended the session."""
        while self._timers and self._timers[0][0] <= now:
            deadline, _, item = heapq.heappop(self._timers)
            if item.terminal or item.deadline != deadline:
                continue  # settled or re-armed since: a stale timer
            if isinstance(item, Probe):
                del self._probes[(item.gen, item.seq)]
                item.fire(Event.TIMEOUT)
                self.counters.bump(self.counters.failures, "lookup_timeout")
                self._probe_answers.append(ProbeAnswer(item.gen, item.keys, None))
            elif isinstance(item, Load):
                if item.state in (State.ABORTING, State.READ_CANCELLING):
                    # Neither finished nor acknowledged: the peer (or the
                    # path to it) is not healthy, and only dropping its agent
                    # fences our slots.
                    self._lose("abort_timeout", f"job {item.job} did not end")
                    return False
                item.fire(Event.TIMEOUT)
                self._count_failure(item, "timeout")
                if item.state is State.FAILED:  # was only queued
                    self._end_unstarted(item, "timeout", now)
                elif item.is_read:  # READ_CANCELLING
                    self._arm(item, now + self.timeouts.abort_ack_s)
                    self.cancelled_reads.append(item.job)
                else:
                    self._arm(item, now + self.timeouts.abort_ack_s)
                    self._send(Abort(item.req, item.gen))
            elif isinstance(item, Serve):
                self._expire_serve(item, now)
                if self.closed:
                    # A write it could not stop ended the session: what it
                    # held is now the manager's (orphans) or released.
                    return False
        return True

    def _expire_serve(self, serve: Serve, now: float) -> None:
        fetch = serve.fetch
        if serve.state in (State.WRITE_CANCELLING, State.ABORT_CANCELLING):
            # The data plane never said the write stopped.
            self.on_write_unstoppable(serve.write_id, Event.TIMEOUT)
            return
        if serve.state in (State.WRITING, State.ABORT_WRITING):
            self.counters.bump(self.counters.failures, "write_timeout")
            queued = [w for w in self._writes if w.write_id == serve.write_id]
            if queued:
                # Never handed to the data plane, and now it never will be:
                # nothing can land, so the peer may hear so at once.
                self._writes.remove(queued[0])
                self._send(self._write_reply(serve, False))
                self._release_serve(
                    serve, Event.WRITES_FAILED, ok=False, reason="deadline"
                )
                return
            # The data plane stops it (cancelled_writes) and then reports
            # it (on_write_done: the reply goes), or reports it unstopped
            # (on_write_unstoppable: the session ends instead).
            serve.fire(Event.TIMEOUT)
            self.cancelled_writes.append(serve.write_id)
            serve.deadline = now + self.timeouts.abort_ack_s
            self._arm(serve, serve.deadline)
            return
        if serve.state is State.FETCH_WAITING and fetch is not None:
            self._send(
                TransferDone(
                    serve.req, serve.gen, fetch.job, False, "blocks not stored in time"
                )
            )
        self._release_serve(serve, Event.TIMEOUT, ok=False, reason="deadline")

    # ------------------------------------------------------------------
    # output buffers
    # ------------------------------------------------------------------

    def take_load_results(self) -> list[LoadResult]:
        out, self._load_results = self._load_results, []
        return out

    def take_probe_answers(self) -> list[ProbeAnswer]:
        out, self._probe_answers = self._probe_answers, []
        return out

    def take_store_results(self) -> list[StoreResult]:
        out, self._store_results = self._store_results, []
        return out

    @property
    def has_results(self) -> bool:
        return bool(self._load_results or self._store_results or self._probe_answers)

    @property
    def has_output(self) -> bool:
        return bool(
            self._outbox
            or self._writes
            or self._reads
            or self.cancelled_reads
            or self._load_results
            or self._probe_answers
            or self._store_results
            or self.wants_parked
            or self.new_pin_jobs
            or self.orphans
            or self.cancelled_writes
        )

    # ------------------------------------------------------------------
    # introspection (state report, invariants)
    # ------------------------------------------------------------------

    def loads(self) -> Iterator[Load]:
        return iter(self._loads.values())

    def serves(self) -> Iterator[Serve]:
        return iter(self._serves.values())

    @property
    def fenced_slots(self) -> int:
        """Destination slots a remote write may still land in."""
        n = sum(ld.blocks for ld in self._loads.values() if ld.fenced)
        return n + sum(n_slots for _, n_slots in self._fenced_results)

    @property
    def active(self) -> bool:
        """Anything in flight that needs the poll loop."""
        return bool(
            self._probes
            or self._loads
            or self._serves
            or self._fenced_results
            or self._offers
            or self.link is Link.HANDSHAKING
        )

    def sizes(self) -> dict[str, int]:
        return {
            "probes": len(self._probes),
            "loads": len(self._loads),
            "serves": len(self._serves),
            "writes": len(self._writing),
            "fenced_results": len(self._fenced_results),
            "offers": len(self._offers),
            "pending_lookup_keys": self._pending.keys,
            "revoked": len(self._revoked),
            "buffered_results": len(self._load_results) + len(self._store_results),
        }
