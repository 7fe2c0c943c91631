"""The parked-store registry: a producer's stores kept for a decoder's Fetch.

A ``remote_decoder`` request's store jobs wait here, by ``kv_request_id``,
until a decoder's parked Fetch names one of their blocks, a cache reset
gives them back, or their ``parked_ttl_s`` passes. Fetches that arrive
before the stores wait here too. None of this belongs to one session (a
Fetch may come over any session, the stores from the engine), so the
registry sits beside the sessions, arms its timers in the node's one heap
(:mod:`p2p_kv.node.timers`; the manager fires them), and reaches the
sessions only through the lookup and ``touch`` it is given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p_kv.lifecycle import Event, State
from p2p_kv.node.indexes import residue_of
from p2p_kv.node.settings import NodeSettings
from p2p_kv.node.timers import LateFetchDue, StoreDue, Timers, WaitNoteDue
from p2p_kv.peer import ParkedStore, Serve, Session
from p2p_kv.peer.records import StoreResult

#: Finished producer requests remembered (see ``ParkedRegistry.finished``).
MAX_FINISHED_KV = 65_536
#: How long a Fetch for such a kv id waits for a new producer request
#: under the same id (a retry) before it is told nothing was stored.
LATE_FETCH_GRACE_S = 1.0


@dataclass(slots=True, eq=False)
class ParkedEntry:
    """Parked stores of one ``kv_request_id`` and the fetches waiting on them."""

    stores: list[ParkedStore] = field(default_factory=list)
    waiting: list[tuple[str, Serve]] = field(default_factory=list)  # (peer, Serve)
    live_producers: int = 0
    #: A producer request for this id was seen: once none is live, no more
    #: stores can come and a waiting fetch may be refused at once.
    producer_seen: bool = False
    #: a FetchWait note for its waiting fetches is armed
    noted: bool = False
    #: this entry's number among every entry the registry made: a timer
    #: armed for it names it (an entry gone and made again for the same
    #: kv id is another one)
    number: int = 0


class ParkedRegistry:
    """Entries by kv id, and what ends what waits in them.

    An entry lives while it holds stores, waiting Fetches or a live
    producer request (:meth:`_gc`). Its timers (a store's TTL, a late
    Fetch's grace, a FetchWait note) are armed in ``timers``; each may be
    stale when it fires (its store bound, its entry gone or replaced) and
    is checked then."""

    def __init__(
        self,
        settings: NodeSettings,
        timers: Timers,
        session_of: Callable[[str], Session | None],
        touch: Callable[[Session], None],
    ) -> None:
        self._settings = settings
        self._timers = timers
        self._session_of = session_of
        self._touch = touch
        self.entries: dict[str, ParkedEntry] = {}
        self._numbers = itertools.count(1)
        #: kv ids whose producer requests all ended with nothing parked,
        #: until when a Fetch may still come (``parked_ttl_s``): without
        #: them a late Fetch would wait out its deadline for stores that
        #: cannot come, and keep an idle producer stepping meanwhile.
        self.finished: dict[str, float] = {}
        #: the latest tick: what ``finished`` may hold is younger than this
        self._ticked = -float("inf")

    # -- producer requests and their stores ---------------------------------

    def producer_started(self, kv_id: str, carried: bool, now: float) -> None:
        """A ``remote_decoder`` request for ``kv_id`` began (``carried``: the
        same prefill re-registered under a reused engine id, already
        counted)."""
        self.finished.pop(kv_id, None)
        entry = self._entry(kv_id)
        entry.live_producers += 0 if carried else 1
        entry.producer_seen = True
        self._note_waiting(kv_id, now)  # a decoder came first

    def producer_ended(self, kv_id: str, now: float) -> None:
        entry = self.entries[kv_id]
        entry.live_producers -= 1
        if not entry.live_producers:
            # vLLM ends a request at the tier after its last store: no more
            # can come for this id (but from a retry under it). Noted whether
            # or not stores stay parked: a first decoder may take them, and a
            # retry's Fetch must then wait only the grace, not its deadline.
            self.finished.pop(kv_id, None)
            self.finished[kv_id] = now + self._settings.parked_ttl_s
            self._forget_finished(now)
        self._feed_waiting(kv_id, now)
        self._gc(kv_id)

    def park(self, store: ParkedStore, now: float) -> None:
        entry = self._entry(store.kv_id)
        entry.stores.append(store)
        self._timers.arm(store.deadline, StoreDue(store))
        self._feed_waiting(store.kv_id, now)

    def release(self) -> list[StoreResult]:
        """Cache reset: parked stores go back to the engine as failed."""
        out = []
        for entry in self.entries.values():
            for store in entry.stores:
                store.fire(Event.RESET)
                out.append(StoreResult(store.job_id, False, "reset"))
            entry.stores.clear()
        for kv_id in list(self.entries):
            self._gc(kv_id)
        return out

    def store_count(self) -> int:
        return sum(len(e.stores) for e in self.entries.values())

    # -- fetches waiting for stores -----------------------------------------

    def bind(self, peer: str, serve: Serve, now: float) -> None:
        """A parked Fetch from ``peer`` wants the stores of ``serve.req``."""
        entry = self.entries.get(serve.req)
        if entry is None:
            entry = self._entry(serve.req)
            # Its producer already ended with nothing parked: refused after
            # a short grace (a retry may reuse the id), not at the Fetch's
            # deadline, unless a producer request for it comes meanwhile.
            if self.finished.get(serve.req, 0.0) > now:
                late = LateFetchDue(serve.req, entry.number)
                self._timers.arm(now + LATE_FETCH_GRACE_S, late)
        entry.waiting.append((peer, serve))
        self._feed_waiting(serve.req, now)

    def _feed_waiting(self, kv_id: str, now: float) -> None:
        entry = self.entries.get(kv_id)
        if entry is None or not entry.waiting:
            return
        complete = entry.producer_seen and entry.live_producers == 0
        still_waiting = []
        for peer, serve in entry.waiting:
            session = self._session_of(peer)
            if (
                session is None
                or session.link.closed
                or serve.state is not State.FETCH_WAITING
            ):
                continue
            # A Fetch takes the stores only if it names a block of theirs:
            # one that names none (a stranger's guess at the id) must not
            # take them, fail, and fail them for the decoder they were
            # parked for. (A view's isdisjoint walks the Fetch's keys and
            # stops at the first held: no set of up to 65,536 keys per store
            # parked.)
            keys = serve.fetch.keys if serve.fetch is not None else ()
            stores: list[ParkedStore] = []
            if any(not s.slots.keys().isdisjoint(keys) for s in entry.stores):
                stores, entry.stores = entry.stores, []
            session.producer.attach_parked(serve, stores, complete, now)
            self._touch(session)
            if serve.state is State.FETCH_WAITING:
                still_waiting.append((peer, serve))
        entry.waiting = still_waiting
        self._note_waiting(kv_id, now)
        self._gc(kv_id)

    def _note_waiting(self, kv_id: str, now: float) -> None:
        """While ``kv_id``'s prefill is live here, or may still come (no
        producer request for it seen yet, none just finished), tell each
        peer whose Fetch waits on it so, now and every heartbeat interval:
        a decoder that asked first then waits as long as the prefill runs,
        or is queued before it runs (a router that sends the decode with
        the prefill, a prefiller under load), up to its parked_ttl_s, not
        its fetch deadline alone. What it holds here is bounded per peer
        (``max_waiting_fetch_keys``) and ends at parked_ttl_s."""
        entry = self.entries.get(kv_id)
        if entry is None or not entry.waiting:
            return
        may_come = not entry.producer_seen and kv_id not in self.finished
        if not entry.live_producers and not may_come:
            return
        for peer, serve in entry.waiting:
            session = self._session_of(peer)
            if session is not None:
                session.producer.tell_waiting(serve, now)
                self._touch(session)
        if not entry.noted:
            entry.noted = True
            when = now + self._settings.timeouts.heartbeat_interval_s
            self._timers.arm(when, WaitNoteDue(kv_id))

    def _entry(self, kv_id: str) -> ParkedEntry:
        """``kv_id``'s entry, made (and numbered) if it has none."""
        entry = self.entries.get(kv_id)
        if entry is None:
            entry = self.entries[kv_id] = ParkedEntry(number=next(self._numbers))
        return entry

    def _gc(self, kv_id: str) -> None:
        entry = self.entries.get(kv_id)
        if (
            entry is not None
            and not entry.stores
            and not entry.waiting
            and entry.live_producers == 0
        ):
            del self.entries[kv_id]

    def fetch_ended(self, serve: Serve) -> None:
        """A Fetch was released by its session (refused, timed out, aborted,
        its session lost): it waits no longer, and its entry goes once
        nothing else is in it. Its session says so as it happens
        (``ParkedFetchEnded``), so no step sweeps the entries for it. A new
        list, not a removal in place: :meth:`_feed_waiting` may be walking
        the old one (it handed this Fetch stores, and the session released
        it)."""
        entry = self.entries.get(serve.req)
        if entry is not None:
            entry.waiting = [w for w in entry.waiting if w[1] is not serve]
            self._gc(serve.req)

    # -- timers (fired by the manager, from the node's heap) ----------------

    def late_fetch_due(self, due: LateFetchDue, now: float) -> None:
        """Refuse the Fetches whose grace passed with no producer back."""
        entry = self.entries.get(due.kv_id)
        if (
            entry is not None
            and entry.number == due.entry
            and entry.live_producers == 0
        ):
            entry.producer_seen = True  # no producer came: none will
            self._feed_waiting(due.kv_id, now)

    def store_due(self, store: ParkedStore) -> StoreResult | None:
        """A parked store's TTL passed: it goes back to the engine as
        failed, unless a Fetch bound it or a reset released it meanwhile."""
        if store.state is not State.STORED:
            return None
        store.fire(Event.TIMEOUT)
        entry = self.entries.get(store.kv_id)
        if entry is not None:
            entry.stores.remove(store)
            self._gc(store.kv_id)
        return StoreResult(store.job_id, False, "parked_expired")

    def note_due(self, kv_id: str, now: float) -> None:
        """Renew the FetchWait note of ``kv_id``'s waiting Fetches."""
        entry = self.entries.get(kv_id)
        if entry is not None:
            entry.noted = False
            self._note_waiting(kv_id, now)

    def tick(self, now: float) -> None:
        """Forget finished producers past their TTL."""
        self._forget_finished(now)
        self._ticked = now

    def _forget_finished(self, now: float) -> None:
        """Drop the finished producers past their TTL, and the oldest past
        the cap: insertion order is deadline order (one TTL for all)."""
        fk = self.finished
        while fk and (len(fk) > MAX_FINISHED_KV or next(iter(fk.values())) <= now):
            del fk[next(iter(fk))]

    def residue(self) -> dict[str, int]:
        """Every index's size, and the stores the entries hold. ``finished``
        counts only what is overdue: one inside its TTL is a memory (a
        Fetch may still come for it)."""
        timers = ("finished",)
        report = residue_of(self, "parked_", timers=timers, ticked=self._ticked)
        report["parked_stores"] = self.store_count()
        return report
