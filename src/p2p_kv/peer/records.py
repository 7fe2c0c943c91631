"""The records a session keeps, and the bounds and deadlines it keeps them by.

Each tracked record (:class:`Probe`, :class:`Load`, :class:`Serve`,
:class:`ParkedStore`) carries one lifecycle state that only
:mod:`p2p_kv.lifecycle`'s table moves, one deadline, and everything its
request needs, so a side's bookkeeping is an index of records and ending a
request is popping its record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeVar

from p2p_kv.lifecycle import (
    ABORTED_WRITES,
    FENCED_LOADS,
    Effect,
    Event,
    Machine,
    State,
    Tracked,
)
from p2p_kv.protocol import (
    MAX_TTL_MS,
    AbortAck,
    Fetch,
    FetchWait,
    Lookup,
    LookupResp,
    Message,
    TransferDone,
)


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

    def hold_s(self, nbytes: int = 0) -> float:
        """How long blocks offered for a READ of ``nbytes`` are held, as
        announced: the pins' lifetime, plus the READ's own time (at the rate
        the deadlines assume, over the reader's share of the window), so a
        load too large for the bare lifetime can still be read inside it.
        Whole milliseconds, as the wire carries them: announcing less than
        we hold is always safe, more never happens."""
        hold = self.pin_ttl_s + nbytes / self.fetch_bytes_per_s / self.read_window
        return max(1, min(int(hold * 1000), MAX_TTL_MS)) / 1000.0


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
class Offer:
    """Blocks a peer pinned for one generation and let us READ, and until
    when (our clock) a READ of them may still be trusted."""

    req: str
    valid_until: float
    slots: dict[bytes, int] = field(default_factory=dict)

    def covers(self, keys: Iterable[bytes], done_by: float) -> bool:
        """Every key offered, and a READ ending by ``done_by`` (at the rate
        the deadlines assume) still inside the trust window: a READ chosen
        at the window's end fails, where a Fetch, the pins still held,
        would load."""
        return done_by < self.valid_until and all(map(self.slots.__contains__, keys))


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


class Gen:
    """One consumer generation (one engine request asking this peer): its
    probes, the offer its lookup answers made, and whether the peer may
    hold pins for it. Its load jobs are indexed by job id (a finished
    generation's may still settle); the record itself goes when it holds
    nothing, or when the request finishes."""

    __slots__ = ("contacted", "gen", "offer", "probes", "req", "revoked")

    def __init__(self, req: str, gen: int) -> None:
        self.req, self.gen = req, gen
        self.probes: dict[int, Probe] = {}  # by seq
        #: blocks the peer pinned and let us READ (see Offer)
        self.offer: Offer | None = None
        #: the peer may hold pins for it (we asked, and released nothing)
        self.contacted = False
        #: the peer revoked its pins before we loaded: the load fails at once
        self.revoked = False

    @property
    def offer_until(self) -> float:
        return self.offer.valid_until if self.offer is not None else -1.0

    @property
    def empty(self) -> bool:
        return not (self.probes or self.offer or self.contacted or self.revoked)


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
        "wait_cap",
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
        #: the latest a FetchWait may move the deadline to (a cache reset
        #: lowers it: the drain that follows waits for this load)
        self.wait_cap = float("inf")
        self.request_finished = False
        #: The reason its failure was counted under, once it was: a load
        #: that timed out and then ended through the peer's AbortAck, a
        #: cancelled READ or the session's end is one failure, not two.
        self.failed_as = ""

    def fail_as(self, counters: SessionCounters, reason: str) -> str:
        """Count this load's failure once, under the first reason it failed
        for (a load that timed out and then ended through the peer's
        AbortAck is one failure), and return that reason."""
        if not self.failed_as:
            self.failed_as = reason
            counters.failed(reason)
        return self.failed_as

    def result(self, ok: bool, reason: str, now: float) -> LoadResult:
        return LoadResult(
            job_id=self.job,
            gen=self.gen,
            success=ok,
            reason=reason,
            nbytes=self.nbytes if ok else 0,
            elapsed_s=max(0.0, now - self.started),
            request_finished=self.request_finished,
        )

    @property
    def is_read(self) -> bool:
        return self.read_until > 0.0

    @property
    def fenced(self) -> bool:
        """True while a transfer into this job's slots may still land."""
        return self.state in FENCED_LOADS


def all_miss(lookup: Lookup) -> LookupResp:
    """A lookup's answer when nothing is held for it: every key a miss, at
    once (the consumer need not wait for its lookup deadline)."""
    return LookupResp(lookup.req, lookup.gen, lookup.seq, [False] * len(lookup.keys))


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

    def over(self, cost: int, mine: int, engine: int) -> tuple[str, int, str] | None:
        """None if ``cost`` more keys fit this count's bound (``mine``) and
        the engine's (``engine``); else which bound refused them (a metric
        name's scope: ``""`` or ``"engine_"``), the keys it holds, and whose
        they are (for the peer's Error)."""
        if self.keys + cost > mine:
            return "", self.keys, ""
        held = self.engine.keys if self.engine is not None else self.keys
        if held + cost > engine:
            return "engine_", held, " from all peers"
        return None

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

    def fire(self, event: Event) -> Effect:
        effect = super().fire(event)
        if self.waiting is not None and self.state is not State.FETCH_WAITING:
            self.waiting.add(-len(self.fetch.keys) if self.fetch is not None else 0)
            self.waiting = None
        return effect

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

    def answer(self, lookup: Lookup, hits: list[bool], hold_ms: int) -> LookupResp:
        """The answer to ``lookup``: with our slots of its hits, offered for
        READ for ``hold_ms`` (0: we offer no READs), when every hit is pinned
        here; else the hits alone."""
        if not hold_ms or not any(hits):
            return LookupResp(self.req, self.gen, lookup.seq, hits)
        table = self.slot_table()
        slots = [
            table.get(key, -1) if hit else 0
            for key, hit in zip(lookup.keys, hits, strict=True)
        ]
        if -1 in slots:
            # A hit the engine did not pin for us: no READ offer at all.
            return LookupResp(self.req, self.gen, lookup.seq, hits)
        self.offered = True
        return LookupResp(self.req, self.gen, lookup.seq, hits, slots, hold_ms)

    def write_reply(self, ok: bool) -> Message:
        """What the peer hears once a posted write can no longer land."""
        if self.state in ABORTED_WRITES:
            return AbortAck(self.req, self.gen)
        assert self.fetch is not None
        cancelled = self.state is State.WRITE_CANCELLING
        why = "" if ok else "write deadline" if cancelled else "write failed"
        return TransferDone(self.req, self.gen, self.fetch.job, ok, why)

    def bind(self, stores: list[ParkedStore], complete: bool) -> bool:
        """Take parked stores for this serve's Fetch (``complete``: no more
        will come); True once it holds every block the Fetch names."""
        for store in stores:
            store.fire(Event.FETCH)
            self.parked.append(store)
        self.complete = self.complete or complete
        assert self.fetch is not None
        table = self.slot_table()
        return all(k in table for k in self.fetch.keys)

    def wait_note(self, now: float, every_s: float) -> FetchWait | None:
        """A FetchWait for the peer while this serve's Fetch waits for a
        prefill running here, at most once every ``every_s``: promised for
        no longer than we hold the Fetch ourselves (its deadline)."""
        fetch = self.fetch
        if (
            fetch is None
            or self.state is not State.FETCH_WAITING
            or now < self.told_wait + every_s
        ):
            return None
        ttl_ms = min(MAX_TTL_MS, round((self.deadline - now) * 1000))
        if ttl_ms <= 0:
            return None
        self.told_wait = now
        return FetchWait(self.req, self.gen, fetch.job, ttl_ms)

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
#: choice, counted apart from ours (p2p_kv.runtime.metrics gives it its own labels).
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

    def failed(self, reason: str) -> None:
        """Count a request's failure (a load's, a lookup's, a pin's)."""
        tally(self.failures, reason, "other")

    def error(self, code: str) -> None:
        """Count a protocol error (the peer's, or one it told us of)."""
        tally(self.protocol_errors, code, "other")
