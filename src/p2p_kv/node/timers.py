"""The node layer's one timer heap.

Everything in the node layer that ends at a time (a session's next
deadline, an ended session's offered blocks, a parked store's TTL, a late
Fetch's grace, a FetchWait note's renewal) waits here, in one heap owned
by the manager. Its parts arm timers; only the manager's ``tick`` fires
them, in deadline order, so what happens at a tick does not depend on
which part a timer belongs to, and the runtime's wake-up is one heap's
head.

A timer is never cancelled: what it names may have moved on (a session
re-armed, a store bound) by the time it fires, and the part it belongs to
checks that when it fires. Stale entries are cheap to skip; the session
timers, re-armed at every step a session is touched, are the only ones
that can pile up, and :meth:`Timers.compact` rebuilds them when they
dominate.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

from p2p_kv.peer import ParkedStore, Serve


@dataclass(frozen=True, slots=True)
class SessionDue:
    """A session's next deadline (heartbeat, load, serve) is due."""

    peer: str


@dataclass(frozen=True, slots=True)
class OrphanDue:
    """An ended session's offered blocks reach their deadline."""

    serve: Serve


@dataclass(frozen=True, slots=True)
class StoreDue:
    """A parked store's ``parked_ttl_s`` passed."""

    store: ParkedStore


@dataclass(frozen=True, slots=True)
class LateFetchDue:
    """A Fetch that came after its producer ended waited out its grace.
    ``entry`` numbers the parked entry it was armed for: a later Fetch of
    the same id, once that entry is gone, makes a new one, with a grace of
    its own."""

    kv_id: str
    entry: int


@dataclass(frozen=True, slots=True)
class WaitNoteDue:
    """Tell the peers whose Fetches wait on a live prefill it still runs."""

    kv_id: str


Due: TypeAlias = SessionDue | OrphanDue | StoreDue | LateFetchDue | WaitNoteDue


class Timers:
    """``(when, arm order, timer)``: the arm order breaks ties, so timers
    due at one instant fire in the order they were armed."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.heap: list[tuple[float, int, Due]] = []
        #: the latest tick: nothing may be left in the heap due before it
        self._ticked = -math.inf

    def arm(self, when: float, timer: Due) -> None:
        heapq.heappush(self.heap, (when, next(self._ids), timer))

    def due(self, now: float) -> Iterator[Due]:
        """Each timer due by ``now``, popped once, earliest first. Timers a
        fired one arms for ``now`` or before fire in the same pass."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            yield heapq.heappop(heap)[2]
        self._ticked = now

    def next_deadline(self) -> float:
        return self.heap[0][0] if self.heap else math.inf

    def pending(self) -> Iterator[tuple[float, Due]]:
        """Every armed timer and when it fires, in no order."""
        return ((when, timer) for when, _, timer in self.heap)

    def compact(self, current: Iterable[tuple[float, str]], live: int) -> None:
        """Stale session timers (a session re-armed several times before its
        last fired) must not pile up: once the heap holds over four entries
        per live session (64 at least), drop every session timer and arm
        ``current``, each live session's deadline, instead. ``current`` is
        read only then."""
        if len(self.heap) <= 4 * max(16, live):
            return
        kept = [item for item in self.heap if not isinstance(item[2], SessionDue)]
        kept += [(when, next(self._ids), SessionDue(p)) for when, p in current]
        heapq.heapify(kept)
        self.heap = kept

    def residue(self) -> dict[str, int]:
        """The timers overdue at the last tick: each should have fired. One
        not yet due is no residue (it may be stale), and neither is a
        session's: sessions re-arm theirs after the tick, at the step's end,
        and a session is per-peer state."""
        overdue = sum(
            1
            for when, _, timer in self.heap
            if when <= self._ticked and not isinstance(timer, SessionDue)
        )
        return {"timers_overdue": overdue}
