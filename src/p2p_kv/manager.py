"""The P2P load manager: one per engine, no I/O.

It is what vLLM's tier calls reach (through the adapter) and what the
transports feed (through :mod:`p2p_kv.runtime`). It composes one
:class:`~p2p_kv.session.Session` per peer connection with the engine-level
state no single peer owns:

* consumer requests (one per live engine request with a ``remote_kv_source``
  or ``remote_prefiller`` leg), each stamped with a fresh *generation*;
* the failed-ID set: engine request ids whose *live, unfinished* request must
  recompute, so :meth:`lookup` answers MISS;
* the parked-store registry for ``remote_decoder`` requests;
* job bookkeeping, so every submitted job yields exactly one result.

Finished means finished: :meth:`on_request_finished` drops the request's
failed-ID entry and marks its in-flight loads and already-buffered results
``request_finished``; a failure that arrives later still returns its job for
cleanup but can never put the id back. A reused ``kv_request_id`` is a new
request with a new generation, so nothing addressed to the old one touches it.

Failed-ID entries are keyed by engine request id, not by ``kv_request_id``:
two live engine requests may share one orchestrator id, and one failing must
not make the other recompute.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from p2p_kv.handshake import FrameRefused, Identity
from p2p_kv.lifecycle import Event
from p2p_kv.parked import ParkedRegistry
from p2p_kv.protocol import MAX_KEYS, Hello, Message

# Roles is re-exported: the runtime reads it from here.
from p2p_kv.roles import Roles as Roles
from p2p_kv.roles import Source
from p2p_kv.session import (
    KeyCount,
    Limits,
    Link,
    LoadResult,
    ParkedStore,
    Pinner,
    ReadOrder,
    Serve,
    Session,
    StoreResult,
    Timeouts,
    WriteOrder,
    is_inbound,
    tally,
)

#: Refused inbound connections remembered (their frames dropped unread).
MAX_REFUSED_INBOUND = 4096
#: The longest a cache reset's drain waits (an offered READ of 1 TB is held
#: about 45 minutes at the default deadlines).
MAX_DRAIN_S = 3600.0
#: Refusal reasons of the bounds on peers (never a handshake's).
LIMIT_REFUSALS: Final = frozenset(
    {"too_many_peers", "too_many_inbound", "too_many_handshaking"}
)
#: Dials past ``max_peers`` while idle sessions closed for room still hold
#: their sockets (``p2p_kv.config.MAX_PEERS`` leaves room for 20 there).
CLOSING_ROOM = 16


class Answer(Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass(slots=True)
class JobResult:
    """Engine-neutral twin of vLLM's JobResult."""

    job_id: int
    success: bool
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    #: why a load failed (the fallback reason); empty on success
    reason: str = ""
    #: a load's engine request, its ``kv_request_id`` and the peer: what
    #: an operator greps for when a request recomputed
    req_id: str = ""
    kv_id: str = ""
    peer: str = ""


@dataclass(slots=True)
class Consumer:
    req_id: str
    source: Source
    gen: int
    #: answered keys: True (hit) / False (miss)
    keys: dict[bytes, bool] = field(default_factory=dict)
    #: keys asked and not answered yet (each key is here or in ``keys``,
    #: never both): the engine's idle check reads its size every step
    asked: set[bytes] = field(default_factory=set)
    unsent: list[bytes] = field(default_factory=list)
    fetched: bool = False
    #: its peer was past ``max_peers`` when it began: it recomputes (asked
    #: again, it would only be refused again)
    refused: bool = False


@dataclass(slots=True)
class _Job:
    kind: str  # "load" | "store" | "pin"
    req_id: str
    peer: str = ""  # load jobs: the source peer
    submitted: float = 0.0
    gen: int = -1  # load jobs: the request's generation when submitted
    kv_id: str = ""  # load jobs: the leg's kv_request_id


@dataclass(frozen=True, slots=True)
class LoadObservation:
    """One finished load job, for the metrics (drained by p2p_kv.metrics)."""

    peer: str
    success: bool
    elapsed_s: float  # the session's: Fetch to result
    nbytes: int
    reason: str
    waited_s: float  # submit_load to get_finished_jobs: what vLLM waited


class LoadManager:
    """See the module docstring. Every method takes ``now``; none blocks."""

    def __init__(
        self,
        me: Identity | Callable[[], Identity],
        *,
        nonces: Callable[[], bytes],
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        parked_ttl_s: float = 60.0,
        reconnect_backoff_s: float = 1.0,
        reads: bool = True,
        max_peers: int = 256,
        max_inbound: int = 512,
    ) -> None:
        # The engine's identity may be known only after start-up (vLLM seeds
        # its block hashes after the tier is built), so it can come lazily.
        self._me: Identity | Callable[[], Identity] = me
        #: A fresh handshake nonce per session, from the caller: the core
        #: draws no randomness, as it reads no clock (runs replay exactly).
        self._nonces = nonces
        self.timeouts = timeouts or Timeouts()
        self.limits = limits or Limits()
        self.parked_ttl_s = parked_ttl_s
        #: One-sided READ of offered blocks (else every load is a Fetch).
        self.reads = reads
        self.reconnect_backoff_s = reconnect_backoff_s
        #: Outbound sessions at once (p2p_kv.config.TierConfig.max_peers).
        self.max_peers = max_peers
        #: Sessions peers open to us at once (TierConfig.max_inbound_peers).
        self.max_inbound = max_inbound
        self._gens = itertools.count(1)
        self._inbound_ids = itertools.count(1)
        self._sessions: dict[str, Session] = {}
        # What a connection's path reads of the sessions, kept as they
        # change, so that none scans every session: anyone who reaches the
        # port opens sessions, and a scan per connection would make N of
        # them cost the engine's thread O(N^2) in one poll.
        #: Inbound sessions still handshaking, oldest first (the one
        #: max_inbound drops). Each leaves as it becomes ready (on_message)
        #: or closes (Session.on_close, whoever closes it).
        self._handshaking: dict[str, Session] = {}
        #: Inbound sessions ready and not closed (max_inbound's other count).
        self._ready_inbound = 0
        #: Sessions we dialled, in ``_sessions``' order (max_peers).
        self._dialled: dict[str, Session] = {}
        self._consumers: dict[str, Consumer] = {}
        #: Live consumer requests by the peer they name: what a session's
        #: end or a dial for room reads, not every request.
        self._named: dict[str, dict[str, Consumer]] = {}
        self._by_gen: dict[int, Consumer] = {}
        self._unsent: set[str] = set()  # req ids with lookups to flush
        self._failed: set[str] = set()
        self._producers: dict[str, str] = {}  # req_id -> remote_decoder kv id
        #: every session together: lookup keys queued for our engine, and
        #: keys of fetches waiting for stores (Limits.engine_*)
        self._pending_keys, self._waiting_keys = KeyCount(), KeyCount()
        #: Offered pins of sessions that ended, held to their deadline.
        self._orphans: list[tuple[float, int, Serve]] = []
        self._heap_ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._results: list[LoadResult | StoreResult] = []
        self._finished: list[JobResult] = []
        self._dirty: set[str] = set()
        self._to_serve: set[str] = set()
        self._deadlines: list[tuple[float, str]] = []
        self._to_connect: list[str] = []
        self._closing: set[str] = set()
        self._retry_at: dict[str, float] = {}
        #: Peers not dialled because max_peers were (the runtime logs it).
        self.dials_refused = 0
        #: Inbound connections refused (max_inbound): their frames are
        #: dropped, and counted once. Insertion-ordered, the oldest go first.
        self._refused_inbound: dict[str, None] = {}
        self.refusals: dict[tuple[str, str], int] = {}
        self.protocol_errors: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.double_results = 0
        # Drained by p2p_kv.metrics at every stats poll; bounded, so nothing
        # piles up when stats are off.
        self.load_observations: deque[LoadObservation] = deque(maxlen=4096)
        self.retired_sessions: deque[Session] = deque(maxlen=1024)
        self.parked = ParkedRegistry(self, self._sessions.get, self._touch)

    # ------------------------------------------------------------------
    # vLLM-facing: consumer leg
    # ------------------------------------------------------------------

    @property
    def me(self) -> Identity:
        if not isinstance(self._me, Identity):
            self._me = self._me()
        return self._me

    def on_new_request(self, req_id: str, roles: Roles, now: float) -> bool:
        """Start a request; True if it replaced a live one of the same id.

        vLLM may reuse an id whose request it aborted before that
        request's end reaches the tier (with its id randomization off):
        raising here would take the engine down, so the old request ends
        first, as if finished (a finished request never enters the failed
        set, and its loads are fenced by generation). The id's later
        finish cannot say which request it meant; it ends this one, which
        then recomputes: never wrong bytes."""
        replaced = req_id in self._consumers or req_id in self._producers
        carried = ""
        if replaced:
            tally(self.protocol_errors, "reused_live_id", "other")
            # The same prefill again: its producer leg carries over, or a
            # decoder's Fetch waiting on the id is refused as if no producer
            # could come, just before this one parks the stores.
            if roles.dest_kv_id and self._producers.get(req_id) == roles.dest_kv_id:
                carried = self._producers.pop(req_id)
            self.on_request_finished(req_id, now)
        if roles.source is not None:
            consumer = Consumer(req_id, roles.source, next(self._gens))
            self._consumers[req_id] = consumer
            self._by_gen[consumer.gen] = consumer
            self._named.setdefault(roles.source.peer, {})[req_id] = consumer
            if self._session_for(roles.source.peer, now) is None:
                consumer.refused = self._refused_dial(roles.source.peer, now)
        if roles.dest_kv_id:
            self._producers[req_id] = roles.dest_kv_id
            self.parked.producer_started(roles.dest_kv_id, bool(carried), now)
        return replaced

    def lookup(self, req_id: str, key: bytes) -> Answer:
        # vLLM calls this once per block, twice per block for a remote hit
        # (RETRY, then the answer): the common case, an answered key of a
        # live request, is tested first and costs a few dict reads. It takes
        # no time: nothing here has a deadline (the lookups leave at flush),
        # so the clock read the callers made per key was spent for nothing.
        consumer = self._consumers.get(req_id)
        if consumer is None or req_id in self._failed:
            return Answer.MISS
        session = self._sessions.get(consumer.source.peer)
        if session is None and consumer.refused:
            return Answer.MISS
        if session is not None and session.link is Link.CLOSED:
            return Answer.MISS
        if consumer.fetched:
            # One fetch per generation: the peer released its pins with it
            # (a prefiller's blocks were all loaded by it).
            return Answer.MISS
        if not consumer.source.probe:
            return Answer.HIT if session is not None else Answer.MISS
        # No session (one lost since the request began): the key is asked
        # all the same, and flush dials again (or, in the reconnect backoff
        # or past max_peers, answers it a miss). Answered MISS here, the
        # request never asked again, and lost its remote hits for good.
        known = consumer.keys.get(key)
        if known is not None:
            return Answer.HIT if known else Answer.MISS
        if key not in consumer.asked:
            consumer.asked.add(key)
            consumer.unsent.append(key)
            self._unsent.add(req_id)
        return Answer.RETRY

    def flush(self, now: float) -> None:
        """Send the lookups gathered this step, one message per request."""
        for req_id in self._unsent:
            consumer = self._consumers.get(req_id)
            if consumer is None or not consumer.unsent:
                continue
            keys, consumer.unsent = consumer.unsent, []
            session = self._session_for(consumer.source.peer, now)
            if session is None:
                # Refused for max_peers, the request is counted once and
                # misses from now on, not dialled (and counted) each batch.
                consumer.refused = self._refused_dial(consumer.source.peer, now)
                consumer.keys.update(dict.fromkeys(keys, False))
                consumer.asked.difference_update(keys)
                continue
            # A peer refuses a Lookup of more keys than a frame may list
            # (a 1M-token prompt in 16-token chunks): several, then.
            for i in range(0, len(keys), MAX_KEYS):
                batch = keys[i : i + MAX_KEYS]
                session.send_lookup(consumer.source.kv_id, consumer.gen, batch, now)
            self._touch(session)
        self._unsent.clear()

    def submit_load(
        self,
        job_id: int,
        req_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> None:
        consumer = self._consumers.get(req_id)
        peer = consumer.source.peer if consumer is not None else ""
        gen = consumer.gen if consumer is not None else -1
        self._register_job(job_id, "load", req_id, peer, now, gen)
        if consumer is not None:
            self._jobs[job_id].kv_id = consumer.source.kv_id
        if not keys:
            self._results.append(LoadResult(job_id, -1, True))
            return
        if consumer is None:
            self._results.append(
                LoadResult(job_id, -1, False, "unknown_request", request_finished=True)
            )
            return
        if consumer.fetched:
            # One load per generation: the first one's READ or WRITE ends by
            # releasing every pin the peer holds for it, so a second job
            # could only read slots that are no longer ours to trust.
            self._results.append(LoadResult(job_id, consumer.gen, False, "second_load"))
            return
        session = self._sessions.get(consumer.source.peer)
        if session is None or session.closed:
            self._results.append(LoadResult(job_id, consumer.gen, False, "peer_down"))
            return
        consumer.fetched = True
        session.send_fetch(
            job_id,
            consumer.source.kv_id,
            consumer.gen,
            list(keys),
            list(slots),
            self.me.block_bytes,
            now,
            parked=not consumer.source.probe,
        )
        self._touch(session)

    # ------------------------------------------------------------------
    # vLLM-facing: producer leg
    # ------------------------------------------------------------------

    def submit_store(
        self,
        job_id: int,
        req_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> bool:
        """Park a ``remote_decoder`` request's blocks for its decoder (True:
        a waiting Fetch may have been answered); any other store has
        nothing to do in a peer tier and succeeds at once (False)."""
        self._register_job(job_id, "store", req_id)
        kv_id = self._producers.get(req_id)
        if kv_id is None:
            self._results.append(StoreResult(job_id, True))
            return False
        store = ParkedStore(job_id, kv_id, keys, slots, now + self.parked_ttl_s)
        self.parked.park(store, now)
        return True

    def refuse_store(self, job_id: int, req_id: str, reason: str) -> None:
        """Fail a store job at once, counted in ``protocol_errors`` under
        ``reason``: a store of a request whose ``remote_decoder`` leg is
        malformed (:attr:`Roles.bad_decoder`) has no decoder to wait for."""
        self._register_job(job_id, "store", req_id)
        tally(self.protocol_errors, reason, "other")
        self._results.append(StoreResult(job_id, False, reason))

    def on_request_finished(self, req_id: str, now: float) -> None:
        """Finish both legs of a request. Idempotent for unknown ids."""
        self._failed.discard(req_id)
        consumer = self._consumers.pop(req_id, None)
        if consumer is not None:
            self._unsent.discard(req_id)
            del self._by_gen[consumer.gen]
            named = self._named[consumer.source.peer]
            del named[req_id]
            if not named:
                del self._named[consumer.source.peer]
            for result in self._results:
                if isinstance(result, LoadResult) and result.gen == consumer.gen:
                    result.request_finished = True
            session = self._sessions.get(consumer.source.peer)
            if session is not None:
                session.finish_gen(consumer.gen, consumer.source.kv_id, now)
                self._touch(session)
        kv_id = self._producers.pop(req_id, None)
        if kv_id is not None:
            self.parked.producer_ended(kv_id, now)

    # ------------------------------------------------------------------
    # vLLM-facing: results
    # ------------------------------------------------------------------

    def get_finished_jobs(self, now: float) -> list[JobResult]:
        """Every job that ended since the last call, each exactly once."""
        self._collect(now)
        out, self._finished = self._finished, []
        for result in self._results:
            job = self._jobs.pop(result.job_id, None)
            if job is None:
                self.double_results += 1
                continue
            if isinstance(result, LoadResult):
                if not result.success:
                    tally(self.fallbacks, result.reason, "other")
                    consumer = self._by_gen.get(result.gen)
                    if (
                        not result.request_finished
                        and consumer is not None
                        and job.req_id == consumer.req_id
                    ):
                        self._failed.add(consumer.req_id)
                self.load_observations.append(
                    LoadObservation(
                        job.peer,
                        result.success,
                        result.elapsed_s,
                        result.nbytes,
                        result.reason,
                        max(0.0, now - job.submitted),
                    )
                )
                out.append(
                    JobResult(
                        result.job_id,
                        result.success,
                        result.elapsed_s if result.success else None,
                        result.nbytes if result.success else None,
                        result.reason,
                        job.req_id,
                        job.kv_id,
                        job.peer,
                    )
                )
            else:
                out.append(JobResult(result.job_id, result.success))
        self._results.clear()
        return out

    def _collect(self, now: float) -> None:
        """Take every touched session's results (once a step: the engine's
        results poll)."""
        for peer in self._dirty:
            session = self._sessions.get(peer)
            if session is not None:
                self._collect_one(session)

    def _collect_one(self, session: Session) -> None:
        self._apply_answers(session)
        self._results.extend(session.take_load_results())
        self._results.extend(session.take_store_results())

    def _register_job(
        self,
        job_id: int,
        kind: str,
        req_id: str,
        peer: str = "",
        now: float = 0.0,
        gen: int = -1,
    ) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} submitted twice")
        self._jobs[job_id] = _Job(kind, req_id, peer, now, gen)

    # ------------------------------------------------------------------
    # serve window (producer answers lookups against the engine)
    # ------------------------------------------------------------------

    def serve(self, pinner: Pinner, now: float) -> None:
        to_serve, self._to_serve = self._to_serve, set()
        for peer in to_serve:
            session = self._sessions.get(peer)
            if session is not None and session.has_lookups_to_serve:
                try:
                    session.serve_lookups(pinner, now)
                finally:
                    # Pins made before anything raised are the engine's
                    # store jobs all the same: their results must come.
                    for job_id in session.new_pin_jobs:
                        self._register_job(job_id, "pin", "")
                    session.new_pin_jobs.clear()
                    self._touch(session)

    # ------------------------------------------------------------------
    # transport-facing
    # ------------------------------------------------------------------

    def _session_for(self, peer: str, now: float) -> Session | None:
        session = self._sessions.get(peer)
        if session is not None and not session.closed:
            session.used_at = now
            return session
        if session is not None:
            return None  # closed, awaiting invalidation
        if now < self._retry_at.get(peer, 0.0):
            return None
        if len(self._dialled) >= self.max_peers and not self._make_room():
            # Clients choose the peers; each dial costs sockets the engine
            # cannot run out of. This request recomputes.
            self._count_limit_refusal("too_many_peers")
            self.dials_refused += 1
            return None
        self._to_connect.append(peer)
        return self._new_session(peer, now)

    def _refused_dial(self, peer: str, now: float) -> bool:
        """Whether :meth:`_session_for` found no session for ``peer`` because
        max_peers refused the dial: in the reconnect backoff, or while the
        peer's last session closes, its lookups ask later instead."""
        return peer not in self._sessions and now >= self._retry_at.get(peer, 0.0)

    def _make_room(self) -> bool:
        """Close the dialled session used longest ago that nothing needs (no
        live request names it, nothing in flight), so a new peer can be
        dialled; False if there is none. Sessions are never closed for
        idling otherwise, so without this ``max_peers`` capped the distinct
        peers an engine ever talked to while they lived: past it, every
        new peer lost the tier for good. A closing session keeps its
        sockets until its invalidation (this step's pump), so at most
        :data:`CLOSING_ROOM` dials pass ``max_peers`` meanwhile. It reads
        the sessions we dialled (at most that many), never the inbound
        ones, which anyone may open."""
        if len(self._dialled) >= self.max_peers + CLOSING_ROOM:
            return False
        named = self._named
        idle = [
            s
            for p, s in self._dialled.items()
            if not s.closed and not s.active and p not in named
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda s: s.used_at)
        oldest.evicted = True
        self.close_session(oldest.peer, "idle: room for a new peer (max_peers)")
        return True

    def _new_session(self, peer: str, now: float) -> Session:
        session = Session(
            peer,
            self.me,
            now,
            timeouts=self.timeouts,
            limits=self.limits,
            nonce=self._nonces(),
            reads=self.reads,
            engine_keys=(self._pending_keys, self._waiting_keys),
        )
        self._sessions[peer] = session
        if is_inbound(peer):
            self._handshaking[peer] = session
            session.on_close = self._inbound_closed
        else:
            self._dialled[peer] = session
        self._touch(session)
        return session

    def _inbound_closed(self, session: Session) -> None:
        """An inbound session's link closed, whoever closed it (a bound,
        its peer, a deadline, the runtime): it leaves the count it was in.
        One not handshaking any more was ready (that is the only other
        link before closed)."""
        if self._handshaking.pop(session.peer, None) is None:
            self._ready_inbound -= 1

    def on_inbound(self, now: float, peer: str | None = None) -> str:
        """A new peer connected to us; returns the key to feed its frames
        (the transport's connection name if it has one).

        Connections are bounded twice: those still handshaking (anyone may
        open them; past ``max_inbound`` the oldest is dropped, so a flood
        of them cannot lock the fleet out) and those that finished it
        (:meth:`on_message`). A connection refused either way stays
        refused: its later frames are dropped here, counted once."""
        if peer is not None and peer in self._refused_inbound:
            return peer
        if peer is None or peer in self._sessions:
            peer = f"in:#{next(self._inbound_ids)}"
        greeting = len(self._handshaking)
        if greeting >= self.max_inbound:
            self._refuse_inbound(
                next(iter(self._handshaking.values())),  # the oldest
                "too_many_handshaking",
                f"{greeting} connections still handshaking",
            )
        self._new_session(peer, now)
        return peer

    def _count_limit_refusal(self, reason: str) -> None:
        """Outside the table's cap (these are :data:`LIMIT_REFUSALS`, three
        keys): tallied, they went to ``("other", "other")`` once 64 refused
        sessions, each its own key, had filled the table, which anyone who
        reaches the port can do, and the metrics never saw them again."""
        key = ("other", reason)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def _refuse_inbound(self, session: Session, reason: str, why: str) -> None:
        self._count_limit_refusal(reason)
        session.close(f"refused: {why}, max_inbound_peers")
        self._touch(session)
        self._remember_refused(session.peer)

    def _remember_refused(self, peer: str) -> None:
        """An inbound connection done with for good (refused, or its
        session ended by a second Hello): its later frames are
        dropped unread. A refused handshake or seal used to end only the
        session, and the connection's next frame opened a new one (a log
        line and a session per few frames from one connection). A peer
        that means well dials a new connection for a new session. Not for
        a session we dropped ourselves (its peer could not drain us): its
        next frame opens a new session, whose Hello tells the peer to end
        its own and dial again."""
        if not is_inbound(peer):
            return
        self._refused_inbound[peer] = None
        if len(self._refused_inbound) > MAX_REFUSED_INBOUND:
            del self._refused_inbound[next(iter(self._refused_inbound))]

    def on_message(self, peer: str, msg: Message, now: float) -> None:
        session = self._sessions.get(peer)
        if session is None:
            return
        refused = session.refusal is not None
        closed = session.closed
        greeting = not session.ready
        session.receive(msg, now)
        if not refused:
            self._tally_refusal(peer, session)
        ended = session.closed and not closed
        if ended and (session.refusal is not None or isinstance(msg, Hello)):
            # Refused, or ended by a second Hello: one inbound connection,
            # one session. (Not a Goodbye's end: its connection closes next,
            # and each remembered would push a refused one out of the list.)
            self._remember_refused(peer)
        if greeting and session.ready and is_inbound(peer):
            # Every per-peer bound holds per session: without this one, a
            # party with the secret opening connections multiplied them
            # (six held 6x the waiting-fetch bound, 360 MiB).
            self._handshaking.pop(peer, None)
            self._ready_inbound += 1
            ready = self._ready_inbound
            if ready > self.max_inbound:
                self._refuse_inbound(
                    session, "too_many_inbound", f"{ready - 1} peers connected"
                )
        self._touch(session)
        if session.has_lookups_to_serve:
            self._to_serve.add(peer)
        self._bind_parked(session, now)

    def pending_lookup_keys(self) -> int:
        """Lookup keys every peer together has queued for our engine."""
        return self._pending_keys.keys

    def waiting_fetch_keys(self) -> int:
        """Keys of every peer's Fetches waiting for stores we have yet to
        park (Limits.engine_waiting_fetch_keys)."""
        return self._waiting_keys.keys

    def on_bad_frame(self, peer: str, reason: str) -> None:
        """A frame that did not decode: counted, the session goes on."""
        tally(self.protocol_errors, reason, "other")

    def _tally_refusal(self, peer: str, session: Session) -> None:
        """Count a session's refusal once, when it happens (a refused
        session's later frames are ignored, and were counted again)."""
        if session.refusal is not None:
            reason = session.refusal.reason
            tally(self.refusals, (peer, reason), ("other", reason))

    def on_frame_refused(self, peer: str, exc: FrameRefused) -> None:
        """A frame from ``peer`` failed its seal: its session ends."""
        session = self._sessions.get(peer)
        if session is not None and not session.closed:
            session.refuse_frame(exc)
            self._tally_refusal(peer, session)
            self._touch(session)
            self._remember_refused(peer)

    def on_disconnected(self, peer: str, reason: str, now: float) -> None:
        session = self._sessions.get(peer)
        if session is not None:
            session.peer_lost(reason)
            self._touch(session)

    def on_write_unstoppable(self, peer: str, write_id: int) -> None:
        """A write given up on may still land: its session ends (see
        :meth:`Session.on_write_unstoppable`)."""
        session = self._sessions.get(peer)
        if session is not None:
            session.on_write_unstoppable(write_id)
            self._touch(session)

    def on_write_done(self, peer: str, write_id: int, ok: bool, now: float) -> None:
        session = self._sessions.get(peer)
        if session is not None:
            session.on_write_done(write_id, ok, now)
            self._touch(session)

    def take_connects(self) -> list[str]:
        out, self._to_connect = self._to_connect, []
        return out

    def take_outgoing(self, now: float) -> list[tuple[str, list[Message]]]:
        out = []
        for peer in list(self._dirty):
            session = self._sessions.get(peer)
            if session is None:
                continue
            msgs = session.take_outbox(now)
            if msgs:
                out.append((peer, msgs))
        return out

    def on_read_done(self, peer: str, job_id: int, ok: bool, now: float) -> None:
        session = self._sessions.get(peer)
        if session is not None:
            session.on_read_done(job_id, ok, now)
            self._touch(session)

    def take_reads(self) -> list[tuple[str, ReadOrder]]:
        return [
            (peer, order)
            for peer in list(self._dirty)
            if (s := self._sessions.get(peer)) is not None
            for order in s.take_reads()
        ]

    def take_writes(self) -> list[tuple[str, WriteOrder]]:
        return [
            (peer, order)
            for peer in list(self._dirty)
            if (s := self._sessions.get(peer)) is not None
            for order in s.take_writes()
        ]

    def take_cancels(self) -> list[tuple[str, str, int]]:
        """``(peer, "write" | "read", id)`` of transfers to stop: a write
        by its write id, a read by its job id."""
        out: list[tuple[str, str, int]] = []
        for peer in list(self._dirty):
            session = self._sessions.get(peer)
            if session is None:
                continue
            out.extend((peer, "write", w) for w in session.cancelled_writes)
            out.extend((peer, "read", j) for j in session.cancelled_reads)
            session.cancelled_writes.clear()
            session.cancelled_reads.clear()
        return out

    def take_closed(self) -> list[str]:
        """Closed sessions whose peer agent the data plane must invalidate;
        answer with :meth:`on_invalidated`."""
        out = []
        for peer in self._dirty:
            session = self._sessions.get(peer)
            if session is not None and session.closed and peer not in self._closing:
                self._closing.add(peer)
                out.append(peer)
        return out

    def on_invalidated(self, peer: str, now: float) -> None:
        """The data plane dropped the peer's agent: fenced loads may fail now,
        and the session's last results are collected before it goes."""
        session = self._sessions.get(peer)
        if session is None:
            return
        self._closing.discard(peer)
        session.confirm_invalidated()
        for serve in session.orphans:
            heapq.heappush(self._orphans, (serve.deadline, next(self._heap_ids), serve))
        session.orphans.clear()
        self._touch(session)
        # Its own results only: the other sessions' wait for the engine's
        # results poll (collecting them all here would cost each retired
        # session a visit to every touched one).
        self._collect_one(session)
        self.retired_sessions.append(session)  # its last counts, for metrics
        session.leave_engine()
        session.on_close = None
        del self._sessions[peer]
        self._dialled.pop(peer, None)
        self._dirty.discard(peer)
        self._forget_hits_through(peer)
        # One closed for room was healthy: the next request to it dials at
        # once (with a backoff, peers used in turn slightly past max_peers
        # missed for a second after each eviction). Re-inserted, so the
        # entries stay in the order they expire (one backoff for all).
        if not is_inbound(peer) and not session.evicted:
            self._retry_at.pop(peer, None)
            self._retry_at[peer] = now + self.reconnect_backoff_s

    def _forget_hits_through(self, peer: str) -> None:
        """The hits a session answered died with it: the peer pinned them
        for that session, so a load of them through the next one is
        refused (``not pinned``) and recomputes. Asked again instead, as
        keys never asked are. (Misses stay misses.) Runs once a session,
        over the live requests that name its peer (none for an inbound
        one)."""
        for consumer in self._named.get(peer, {}).values():
            if consumer.fetched:
                continue
            if consumer.source.probe and any(consumer.keys.values()):
                consumer.keys = {k: hit for k, hit in consumer.keys.items() if not hit}

    def tick(self, now: float) -> None:
        """Fire deadlines that have passed; O(due work), not O(peers)."""
        self.parked.tick_late_fetches(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, peer = heapq.heappop(self._deadlines)
            session = self._sessions.get(peer)
            if session is not None:
                session.tick(now)
                self._touch(session)
        self._results.extend(self.parked.tick(now))
        while self._orphans and self._orphans[0][0] <= now:
            _, _, serve = heapq.heappop(self._orphans)
            serve.fire(Event.TIMEOUT)
            self._results.extend(serve.let_go(Event.PEER_LOST, False, "peer_down"))
        # In expiry order (see on_invalidated): those past it go from the
        # front, each once. (One past it behind a later one, after the
        # backoff was changed, reads as absent meanwhile: the same.)
        retry = self._retry_at
        while retry and next(iter(retry.values())) <= now:
            del retry[next(iter(retry))]

    def next_deadline(self) -> float:
        best = self._deadlines[0][0] if self._deadlines else float("inf")
        best = min(best, self.parked.next_deadline())
        if self._orphans:
            best = min(best, self._orphans[0][0])
        return best

    def drain_deadline(self, now: float) -> float:
        """When a cache reset's drain may give up on jobs still running.

        Every job ends by a deadline armed now (sessions' timers, orphaned
        serves, parked stores, late Fetches) or by a cancel's wait after
        it. A fixed 30 s was shorter than an offered READ's hold, which
        grows with its bytes (6 GB: 15 s + 16 s): vLLM's reset then found a
        job left and asserted."""
        held = self.parked.held_until()
        held += [at for at, _, sv in self._orphans if not sv.terminal]
        held += [s.latest_deadline() for s in self._sessions.values()]
        latest = max(held, default=-math.inf) + self.timeouts.abort_ack_s + 5.0
        return min(max(now + 30.0, latest), now + MAX_DRAIN_S)

    def end_step(self, now: float) -> None:
        """Re-arm deadlines of sessions touched this step, then forget them."""
        self.parked.end_step()
        for peer in self._dirty:
            # Sessions with output too: a result the engine has yet to
            # collect (a long step) must not stop the session's heartbeats
            # and deadlines; re-armed only once it was collected, a session
            # went silent and its peer dropped it, failing all its loads.
            session = self._sessions.get(peer)
            if session is not None and not session.closed:
                deadline = session.next_deadline()
                if deadline != float("inf"):
                    heapq.heappush(self._deadlines, (deadline, peer))
        self._dirty = {
            p
            for p in self._dirty
            if (s := self._sessions.get(p)) is not None and (s.has_output or s.closed)
        }
        # Stale heap entries (a session re-armed several times) are cheap to
        # skip but must not pile up: rebuild when they dominate.
        if len(self._deadlines) > 4 * max(16, len(self._sessions)):
            self._deadlines = [
                (s.next_deadline(), p) for p, s in self._sessions.items()
            ]
            heapq.heapify(self._deadlines)

    def _touch(self, session: Session) -> None:
        """Note the session changed; probe answers apply at once so the next
        lookup() sees them without waiting for a results poll."""
        self._dirty.add(session.peer)
        self._apply_answers(session)

    def _apply_answers(self, session: Session) -> None:
        for answer in session.take_probe_answers():
            consumer = self._by_gen.get(answer.gen)
            if consumer is None:
                continue
            if answer.hits is None:
                consumer.keys.update(dict.fromkeys(answer.keys, False))
            else:
                consumer.keys.update(zip(answer.keys, answer.hits, strict=True))
            consumer.asked.difference_update(answer.keys)

    # ------------------------------------------------------------------
    # parked stores
    # ------------------------------------------------------------------

    def _bind_parked(self, session: Session, now: float) -> None:
        while session.wants_parked:
            self.parked.bind(session.peer, session.wants_parked.pop(), now)

    # ------------------------------------------------------------------
    # drain, reset, close
    # ------------------------------------------------------------------

    def release_parked(self, now: float) -> None:
        """Cache reset: parked stores go back to the engine as failed."""
        self._results.extend(self.parked.release())

    def close_all(self, reason: str) -> None:
        for session in self._sessions.values():
            session.close(reason)
            self._touch(session)

    def close_session(self, peer: str, reason: str) -> bool:
        """Drop one peer's session (the peer hears Goodbye); False if none."""
        session = self._sessions.get(peer)
        if session is None:
            return False
        session.close(reason)
        self._touch(session)
        return True

    # ------------------------------------------------------------------
    # introspection
    # ------------------------------------------------------------------

    @property
    def has_lookups_to_serve(self) -> bool:
        return bool(self._to_serve)

    @property
    def limit_refusals(self) -> dict[str, int]:
        """Refusals of ours no session counts (``max_peers``,
        ``max_inbound_peers``), by reason: the metrics export them."""
        return {
            reason: n
            for (peer, reason), n in self.refusals.items()
            if peer == "other" and reason in LIMIT_REFUSALS
        }

    def has_unsent(self) -> bool:
        """A session changed since the last pump and holds output for it."""
        sessions = self._sessions
        return any(
            (s := sessions.get(p)) is not None and s.has_output for p in self._dirty
        )

    def peer_transfers(self) -> bool:
        """A peer may be moving bytes to or from our region: READing blocks
        we offered (held by a live session, or orphaned past a lost one) or
        WRITing a load of ours. No descriptor announces such a transfer,
        yet over UCX's TCP transport it needs our progress."""
        return any(s.peer_transfers for s in self._sessions.values()) or any(
            not sv.terminal and sv.exposed for _, _, sv in self._orphans
        )

    def waiting_requests(self) -> int:
        """Live consumer requests blocked on us (an unanswered lookup or a
        load in flight): when every live request is, the engine is idle."""
        consumers = self._consumers
        # A finished request's load may still be settling (its abort, its
        # fence): it blocks nobody, and its id may already name a new
        # request that computes.
        waiting = {
            j.req_id
            for j in self._jobs.values()
            if j.kind == "load"
            and (c := consumers.get(j.req_id)) is not None
            and c.gen == j.gen
        }
        waiting.update(c.req_id for c in consumers.values() if c.unsent or c.asked)
        return len(waiting)

    def has_pending_work(self) -> bool:
        """Work of ours in flight that needs the engine to keep stepping.

        Pins and parked stores are not: they end by a peer's message or a
        deadline, which the poll (or the waker) handles without an engine
        step, and their result then wakes the engine (``results_ready``).
        Counting them kept a producer stepping for a pin's whole lifetime.
        """
        return bool(self._results or self._unsent or self._to_serve) or (
            self.waiting_requests() > 0
        )

    def results_ready(self) -> bool:
        """Something for the engine: a job result or a lookup answer."""
        return bool(self._results) or any(
            s.has_results
            for s in (self._sessions.get(p) for p in self._dirty)
            if s is not None
        )

    def jobs_in_flight(self) -> int:
        return len(self._jobs) + len(self._results)

    def jobs_unended(self, now: float) -> int:
        """Jobs with no result yet: what a cache reset's drain waits for.
        A result buffered for the engine's next :meth:`get_finished_jobs`
        has ended (vLLM's drain contract: "yielded by a prior call or queued
        for the next one"); counting it, as :meth:`jobs_in_flight` does,
        held every reset that found a job for the drain's whole bound."""
        self._collect(now)
        ended = {r.job_id for r in self._results}
        return sum(1 for job_id in self._jobs if job_id not in ended)

    def release_for_reset(self, now: float) -> None:
        """Cache reset: give back everything not mid-write (parked stores,
        pins of unfetched lookups); writes in flight finish normally."""
        self.release_parked(now)
        for session in self._sessions.values():
            session.release_unwritten()
            self._touch(session)

    def failed_ids(self) -> frozenset[str]:
        return frozenset(self._failed)

    def parked_store_count(self) -> int:
        return self.parked.store_count()

    def sessions(self) -> Iterable[Session]:
        return self._sessions.values()

    def session(self, peer: str) -> Session | None:
        return self._sessions.get(peer)

    def state_report(self) -> dict[str, int]:
        """Every per-request structure's size: all zero once work drains."""
        report = {
            "consumers": len(self._consumers),
            "generations": len(self._by_gen),
            "failed_ids": len(self._failed),
            "producers": len(self._producers),
            "jobs": len(self._jobs),
            "buffered_results": len(self._results),
            "unsent_lookups": len(self._unsent),
            "fenced_slots": sum(s.fenced_slots for s in self._sessions.values()),
            "orphaned_blocks": sum(sv.held_blocks for _, _, sv in self._orphans),
        }
        report.update(self.parked.residue())
        for session in self._sessions.values():
            for name, size in session.sizes().items():
                report[name] = report.get(name, 0) + size
        for name in (
            "probes",
            "loads",
            "serves",
            "writes",
            "fenced_results",
            "offers",
            "revoked",
        ):
            report.setdefault(name, 0)
        return report
