"""Every per-request state machine of p2p_kv, in one place.

Rules of this file (after h11's ``_state.py``):

* Everything that changes a request's state is a row of :data:`TABLE`.
  Code elsewhere never assigns a state; it calls :func:`step`.
* An event that has no row for the current state is illegal. Whether that
  is *our* bug or the *peer's* fault depends on where the event came from,
  so :func:`step` raises :class:`IllegalTransition` and the caller decides:
  local callers let it propagate (a bug, loud), the session turns an
  illegal *remote* event into an ``Error`` reply and a metric and leaves the
  request untouched.
* Terminal states have no rows: nothing moves a finished machine again,
  which is what makes late messages harmless.

The four machines
-----------------
``PROBE``  (consumer, one per Lookup batch) -- asks a peer which blocks it has.
``LOAD``   (consumer, one per load job)     -- a one-sided READ of blocks the
           peer offered with its lookup answer, or else a Fetch: the peer
           WRITEs, or (a disaggregated prefill's parked stores) answers with
           an offer we READ, and the fence behind each: the job's destination slots
           go back to the engine only from DONE or FAILED, and FAILED is
           reached only once nothing can land in them any more (our READ
           ended; TransferDone or AbortAck; or the peer's agent invalidated).
           A READ waits in READ_QUEUED until the data plane takes it, as a
           Fetch waits in QUEUED until the session is up: given up there,
           it fails at once, for nothing was started that could land.
``SERVE``  (producer, one per peer x (req, gen)) -- pins blocks for a peer's
           lookup (which it may READ until it releases them) or binds parked
           stores to its fetch and writes them, or offers them for READ as
           it offers pins; releases.
``PARKED`` (producer, one per store job of a ``remote_decoder`` request) --
           blocks kept for a decoder that has not fetched yet.
"""

from __future__ import annotations

from enum import Enum
from typing import Final


class Machine(Enum):
    PROBE = "probe"
    LOAD = "load"
    SERVE = "serve"
    PARKED = "parked"


class State(Enum):
    # PROBE
    PROBING = "probing"
    ANSWERED = "answered"
    EXPIRED = "expired"
    # LOAD
    QUEUED = "queued"  # session not ready yet: the Fetch waits in our outbox
    FETCH_POSTED = "fetch_posted"
    READ_QUEUED = "read_queued"  # our READ, not yet handed to the data plane
    READING = "reading"  # our one-sided READ of the peer's pinned blocks
    READ_CANCELLING = "read_cancelling"  # given up; waiting for the READ to end
    ABORTING = "aborting"  # Abort sent; slots quarantined until fenced
    DONE = "done"
    FAILED = "failed"
    # SERVE
    LOOKUP_QUEUED = "lookup_queued"  # waiting for the engine's serve window
    PINNED = "pinned"
    #: a ``read`` Fetch answered with its blocks' slots: held for the
    #: consumer's READ; no second Fetch, and no lookup (which re-armed the
    #: serve to the bare pin lifetime, under the READ)
    FETCH_OFFERED = "fetch_offered"
    FETCH_WAITING = "fetch_waiting"  # fetch arrived before its parked stores
    REVOKING = "revoking"  # reset: pins offered for READ wait for a Release
    ORPHANED = "orphaned"  # session gone; offered pins held to their deadline
    WRITING = "writing"
    ABORT_WRITING = "abort_writing"  # abort arrived mid-write: ack when fenced
    #: past its deadline: the write is being stopped; the reply (TransferDone
    #: or AbortAck) waits for the data plane, as NIXL cannot stop bytes
    WRITE_CANCELLING = "write_cancelling"
    ABORT_CANCELLING = "abort_cancelling"
    RELEASED = "released"
    # PARKED
    STORED = "stored"
    BOUND = "bound"
    # (PARKED also ends in RELEASED or EXPIRED)


class Event(Enum):
    LOOKUP = "lookup"
    LOOKUP_RESP = "lookup_resp"
    SERVED = "served"
    SESSION_READY = "session_ready"
    FETCH = "fetch"
    STORES_READY = "stores_ready"
    WRITES_DONE = "writes_done"
    WRITES_FAILED = "writes_failed"
    RELEASE = "release"
    REVOKE = "revoke"
    ORPHAN = "orphan"  # the session ended while the peer may still READ
    #: the blocks of a Fetch are offered for READ instead of written
    OFFER = "offer"
    POSTED = "posted"  # the data plane took our READ: bytes may land now
    TRANSFER_OK = "transfer_ok"
    TRANSFER_FAILED = "transfer_failed"
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    TIMEOUT = "timeout"
    PEER_LOST = "peer_lost"
    FINISH = "finish"
    RESET = "reset"
    #: the producer says the prefill a parked Fetch waits for is running:
    #: the load's deadline moves (up to ``parked_ttl_s``), nothing else
    WAIT = "wait"


S, E = State, Event

#: How a serve holding pins (maybe offered for READ) ends: the consumer's
#: Release (it READ them, or gave up on them), its Abort, their deadline,
#: the session's end or a reset. Offered pins may still be read: a reset
#: waits for the Release (REVOKE) and a lost session leaves them held to
#: their deadline (ORPHAN), since the peer may not know yet.
_PINS_END: Final[dict[Event, State]] = {
    E.RELEASE: S.RELEASED,
    E.REVOKE: S.REVOKING,
    E.ORPHAN: S.ORPHANED,
    E.ABORT: S.RELEASED,
    E.TIMEOUT: S.RELEASED,
    E.PEER_LOST: S.RELEASED,
    E.RESET: S.RELEASED,
}

TABLE: Final[dict[Machine, dict[State, dict[Event, State]]]] = {
    Machine.PROBE: {
        S.PROBING: {
            E.LOOKUP_RESP: S.ANSWERED,
            E.TIMEOUT: S.EXPIRED,
            E.PEER_LOST: S.EXPIRED,
            E.FINISH: S.EXPIRED,
        },
    },
    Machine.LOAD: {
        S.QUEUED: {
            E.SESSION_READY: S.FETCH_POSTED,
            # Never sent: no write can exist, so failing at once is fenced.
            E.ABORT: S.FAILED,
            E.TIMEOUT: S.FAILED,
            E.PEER_LOST: S.FAILED,
        },
        S.FETCH_POSTED: {
            # The producer offers its parked stores instead of writing them
            # (a ``read`` Fetch): from here on it is our READ to fence.
            E.OFFER: S.READ_QUEUED,
            # Its prefill is still running there: nothing was offered or
            # written yet, so waiting longer lands nothing; the deadline
            # moves, bounded by parked_ttl_s from the load's start.
            E.WAIT: S.FETCH_POSTED,
            E.TRANSFER_OK: S.DONE,
            E.TRANSFER_FAILED: S.FAILED,
            # The producer may be mid-write: quarantine, do not fail yet.
            E.ABORT: S.ABORTING,
            E.TIMEOUT: S.ABORTING,
            # The session invalidates the peer's agent before results leave.
            E.PEER_LOST: S.FAILED,
        },
        S.READ_QUEUED: {
            E.POSTED: S.READING,
            # Not posted yet: nothing can land, so failing at once is fenced.
            E.ABORT: S.FAILED,
            E.TIMEOUT: S.FAILED,
            E.PEER_LOST: S.FAILED,
        },
        S.READING: {
            E.TRANSFER_OK: S.DONE,
            E.TRANSFER_FAILED: S.FAILED,
            # Our own READ may still land: cancel it and wait for its end.
            E.ABORT: S.READ_CANCELLING,
            E.TIMEOUT: S.READ_CANCELLING,
            E.PEER_LOST: S.FAILED,
        },
        S.READ_CANCELLING: {
            E.TRANSFER_OK: S.FAILED,
            E.TRANSFER_FAILED: S.FAILED,
            # Not ended in time: the session drops the peer's agent (which
            # closes our endpoints to it) and only then lets the failure out.
            E.TIMEOUT: S.FAILED,
            E.PEER_LOST: S.FAILED,
        },
        S.ABORTING: {
            # The writes finished before the producer saw our Abort. The
            # bytes are whole and the slots safe, but we gave the load up:
            # it fails, so "aborted" always means "recompute".
            E.TRANSFER_OK: S.FAILED,
            E.TRANSFER_FAILED: S.FAILED,
            E.ABORT_ACK: S.FAILED,
            # No ack in time: the session closes the peer (agent
            # invalidated) and only then lets the failure out.
            E.TIMEOUT: S.FAILED,
            E.PEER_LOST: S.FAILED,
        },
    },
    Machine.SERVE: {
        S.LOOKUP_QUEUED: {
            # Another batch for the same request before the serve window:
            # it joins the queue and is answered in the same window.
            E.LOOKUP: S.LOOKUP_QUEUED,
            E.SERVED: S.PINNED,
            **_PINS_END,  # earlier batches' pins
        },
        S.PINNED: {
            E.LOOKUP: S.LOOKUP_QUEUED,
            E.FETCH: S.WRITING,
            # A ``read`` Fetch (the consumer's window on our answer closed
            # before its load): the pins are offered again, held anew.
            E.OFFER: S.FETCH_OFFERED,
            **_PINS_END,
        },
        S.FETCH_OFFERED: _PINS_END,
        S.REVOKING: {
            E.RELEASE: S.RELEASED,
            E.ABORT: S.RELEASED,
            # The pins' own deadline: the consumer reads only well inside
            # it, so nothing can read these slots any more.
            E.TIMEOUT: S.RELEASED,
            E.ORPHAN: S.ORPHANED,
        },
        # Owned by the manager once its session is gone; nothing but the
        # pins' deadline ends it (a reset cannot know the peer stopped).
        S.ORPHANED: {
            E.TIMEOUT: S.RELEASED,
        },
        S.FETCH_WAITING: {
            E.STORES_READY: S.WRITING,
            # A ``read`` Fetch: the stores are offered, held as pins are.
            E.OFFER: S.FETCH_OFFERED,
            E.ABORT: S.RELEASED,
            E.TIMEOUT: S.RELEASED,
            E.PEER_LOST: S.RELEASED,
            E.RESET: S.RELEASED,
        },
        S.WRITING: {
            E.WRITES_DONE: S.RELEASED,
            E.WRITES_FAILED: S.RELEASED,
            E.ABORT: S.ABORT_WRITING,
            # Deadline: the write is cancelled, the pins held while it may
            # still read them; the reply goes once the data plane stopped it.
            E.TIMEOUT: S.WRITE_CANCELLING,
            E.PEER_LOST: S.RELEASED,
        },
        S.ABORT_WRITING: {
            E.WRITES_DONE: S.RELEASED,
            E.WRITES_FAILED: S.RELEASED,
            E.TIMEOUT: S.ABORT_CANCELLING,
            E.PEER_LOST: S.RELEASED,
        },
        S.WRITE_CANCELLING: {
            E.WRITES_DONE: S.RELEASED,
            E.WRITES_FAILED: S.RELEASED,
            E.ABORT: S.ABORT_CANCELLING,
            # The data plane never answered: as for a write it could not
            # stop, the session ends (the peer's agent drop fences it).
            E.TIMEOUT: S.RELEASED,
            E.PEER_LOST: S.RELEASED,
        },
        S.ABORT_CANCELLING: {
            E.WRITES_DONE: S.RELEASED,
            E.WRITES_FAILED: S.RELEASED,
            E.TIMEOUT: S.RELEASED,
            E.PEER_LOST: S.RELEASED,
        },
    },
    Machine.PARKED: {
        S.STORED: {
            E.FETCH: S.BOUND,
            E.TIMEOUT: S.EXPIRED,
            E.RESET: S.EXPIRED,
        },
        S.BOUND: {
            E.WRITES_DONE: S.RELEASED,
            E.WRITES_FAILED: S.RELEASED,
            E.PEER_LOST: S.RELEASED,
            E.RESET: S.RELEASED,
        },
    },
}

#: A SERVE may start in LOOKUP_QUEUED (a Lookup arrived) or FETCH_WAITING
#: (a Fetch for parked stores arrived with no lookup before it).
INITIAL: Final[dict[Machine, frozenset[State]]] = {
    Machine.PROBE: frozenset({S.PROBING}),
    Machine.LOAD: frozenset({S.QUEUED, S.FETCH_POSTED, S.READ_QUEUED}),
    Machine.SERVE: frozenset({S.LOOKUP_QUEUED, S.FETCH_WAITING}),
    Machine.PARKED: frozenset({S.STORED}),
}


class IllegalTransition(Exception):
    """``event`` has no row for ``state`` in ``machine``'s table."""

    def __init__(self, machine: Machine, state: State, event: Event) -> None:
        super().__init__(
            f"{machine.value}: event {event.value!r} is illegal in state "
            f"{state.value!r}"
        )
        self.machine = machine
        self.state = state
        self.event = event


def allowed(machine: Machine, state: State, event: Event) -> bool:
    return event in TABLE[machine].get(state, {})


def step(machine: Machine, state: State, event: Event) -> State:
    """The one function that computes a next state."""
    try:
        return TABLE[machine][state][event]
    except KeyError:
        raise IllegalTransition(machine, state, event) from None


def is_terminal(machine: Machine, state: State) -> bool:
    return state not in TABLE[machine]


class Tracked:
    """Base of every object that carries a lifecycle state.

    Holding the state behind :meth:`fire` keeps the rule "only this file
    moves states" checkable: grep for ``.state =`` outside this module.
    """

    machine: Machine
    __slots__ = ("_state",)

    def __init__(self, initial: State) -> None:
        if initial not in INITIAL[self.machine]:
            raise IllegalTransition(self.machine, initial, Event.RESET)
        self._state = initial

    @property
    def state(self) -> State:
        return self._state

    @property
    def terminal(self) -> bool:
        return is_terminal(self.machine, self._state)

    def can(self, event: Event) -> bool:
        return allowed(self.machine, self._state, event)

    def fire(self, event: Event) -> State:
        self._state = step(self.machine, self._state, event)
        return self._state
