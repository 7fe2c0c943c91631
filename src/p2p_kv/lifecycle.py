"""Every per-request state machine of p2p_kv, in one place.

Rules of this file (after h11's ``_state.py``):

* Everything that changes a request's state is a row of :data:`ROWS`, and
  each row names its effect beside its next state (after hyper-h2's
  stream table): code elsewhere never assigns a state, it fires an event
  (:meth:`Tracked.fire`) and runs what the returned :class:`Effect` says.
  State sets that mean something (:data:`FENCED_LOADS`, ...) sit beside
  the states.
* An event that has no row for the current state is illegal. Whether that
  is *our* bug or the *peer's* fault depends on where the event came from,
  so :func:`transition` raises :class:`IllegalTransition` and the caller decides:
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
from typing import Final, NamedTuple


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
    WRITE_QUEUED = "write_queued"  # our WRITE, not yet handed to the data plane
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


class Effect(Enum):
    """What a transition does, beside its next state (as each row of
    hyper-h2's stream table names its side effect). The side that fires an
    event runs one ``match`` on the effect :meth:`Tracked.fire` returns;
    nothing re-derives it from the state afterwards."""

    NONE = "none"
    # LOAD
    SEND_FETCH = "send_fetch"  # its Fetch leaves: the session is up
    QUEUE_READ = "queue_read"  # its READ waits for the data plane
    EXTEND = "extend"  # its deadline moves; nothing else changes
    POSTED = "posted"  # the data plane has the transfer: bytes may land now
    SUCCEED = "succeed"  # every byte is in: the result leaves
    #: nothing can land in its slots (never started, or the transfer ended
    #: or was acknowledged): the failure leaves now
    END = "end"
    #: a transfer may still land: the failure leaves once the peer's data
    #: agent is gone (``ConsumerSide.confirm_invalidated``)
    FENCE = "fence"
    STOP_READ = "stop_read"  # cancel our READ, and wait for it to end
    AWAIT_ACK = "await_ack"  # the peer is told to stop; wait for its word
    #: neither ended nor acknowledged in time: only closing the session
    #: (which drops the peer's agent) fences what is in flight
    LOSE_SESSION = "lose_session"
    # PROBE
    ANSWER = "answer"  # the lookup's answer (or its absence) goes out
    # SERVE
    QUEUE_LOOKUP = "queue_lookup"  # answered in the engine's serve window
    HOLD = "hold"  # pins held for the peer to READ or fetch
    OFFER = "offer"  # a FetchOffer tells the peer where to READ
    WRITE = "write"  # our WRITE of the blocks is posted
    CANCEL_WRITE = "cancel_write"  # stop our WRITE; reply once it stopped
    ACK_WHEN_SETTLED = "ack_when_settled"  # AbortAck once the WRITE settles
    REVOKE = "revoke"  # the peer is told; the pins wait for its Release
    ORPHAN = "orphan"  # held past the session, to the deadline
    RELEASE = "release"  # everything held goes back to the engine
    ACK_AND_RELEASE = "ack_and_release"  # AbortAck, then RELEASE
    REFUSE_AND_RELEASE = "refuse_and_release"  # TransferDone(ok=False), RELEASE
    # PARKED
    BIND = "bind"  # owned by one serve from now on


class Row(NamedTuple):
    """One transition: the next state and what the transition does."""

    to: State
    effect: Effect


S, E, X = State, Event, Effect

#: Loads in these states may still have bytes land in their slots (our
#: READ, or the peer's WRITE): their slots stay out of the engine's hands.
FENCED_LOADS: Final = frozenset(
    {S.FETCH_POSTED, S.READING, S.READ_CANCELLING, S.ABORTING}
)
#: Serves whose WRITE the peer aborted: it hears AbortAck, not TransferDone.
ABORTED_WRITES: Final = frozenset({S.ABORT_WRITING, S.ABORT_CANCELLING})
#: Serves with a WRITE of ours posted to the data plane that no deadline
#: has cancelled yet (WRITE_QUEUED: not posted, nothing can land).
WRITES_IN_FLIGHT: Final = frozenset({S.WRITING, S.ABORT_WRITING})

#: How a serve holding pins (maybe offered for READ) ends: the consumer's
#: Release (it READ them, or gave up on them), its Abort, their deadline,
#: the session's end or a reset. Offered pins may still be read: a reset
#: waits for the Release (REVOKE) and a lost session leaves them held to
#: their deadline (ORPHAN), since the peer may not know yet.
_PINS_END: Final[dict[Event, Row]] = {
    E.RELEASE: Row(S.RELEASED, X.RELEASE),
    E.REVOKE: Row(S.REVOKING, X.REVOKE),
    E.ORPHAN: Row(S.ORPHANED, X.ORPHAN),
    E.ABORT: Row(S.RELEASED, X.ACK_AND_RELEASE),
    E.TIMEOUT: Row(S.RELEASED, X.RELEASE),
    E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
    E.RESET: Row(S.RELEASED, X.RELEASE),
}

ROWS: Final[dict[Machine, dict[State, dict[Event, Row]]]] = {
    Machine.PROBE: {
        S.PROBING: {
            E.LOOKUP_RESP: Row(S.ANSWERED, X.ANSWER),
            E.TIMEOUT: Row(S.EXPIRED, X.ANSWER),
            E.PEER_LOST: Row(S.EXPIRED, X.ANSWER),
            # The request is gone: nobody reads an answer.
            E.FINISH: Row(S.EXPIRED, X.NONE),
        },
    },
    Machine.LOAD: {
        S.QUEUED: {
            E.SESSION_READY: Row(S.FETCH_POSTED, X.SEND_FETCH),
            # Never sent: no write can exist, so failing at once is fenced.
            E.ABORT: Row(S.FAILED, X.END),
            E.TIMEOUT: Row(S.FAILED, X.END),
            E.PEER_LOST: Row(S.FAILED, X.END),
        },
        S.FETCH_POSTED: {
            # The producer offers its parked stores instead of writing them
            # (a ``read`` Fetch): from here on it is our READ to fence.
            E.OFFER: Row(S.READ_QUEUED, X.QUEUE_READ),
            # Its prefill is still running there: nothing was offered or
            # written yet, so waiting longer lands nothing; the deadline
            # moves, bounded by parked_ttl_s from the load's start.
            E.WAIT: Row(S.FETCH_POSTED, X.EXTEND),
            E.TRANSFER_OK: Row(S.DONE, X.SUCCEED),
            E.TRANSFER_FAILED: Row(S.FAILED, X.END),
            # The producer may be mid-write: quarantine, do not fail yet.
            E.ABORT: Row(S.ABORTING, X.AWAIT_ACK),
            E.TIMEOUT: Row(S.ABORTING, X.AWAIT_ACK),
            # The session invalidates the peer's agent before results leave.
            E.PEER_LOST: Row(S.FAILED, X.FENCE),
        },
        S.READ_QUEUED: {
            E.POSTED: Row(S.READING, X.POSTED),
            # Not posted yet: nothing can land, so failing at once is fenced.
            E.ABORT: Row(S.FAILED, X.END),
            E.TIMEOUT: Row(S.FAILED, X.END),
            E.PEER_LOST: Row(S.FAILED, X.END),
        },
        S.READING: {
            E.TRANSFER_OK: Row(S.DONE, X.SUCCEED),
            E.TRANSFER_FAILED: Row(S.FAILED, X.END),
            # Our own READ may still land: cancel it and wait for its end.
            E.ABORT: Row(S.READ_CANCELLING, X.STOP_READ),
            E.TIMEOUT: Row(S.READ_CANCELLING, X.STOP_READ),
            E.PEER_LOST: Row(S.FAILED, X.FENCE),
        },
        S.READ_CANCELLING: {
            E.TRANSFER_OK: Row(S.FAILED, X.END),
            E.TRANSFER_FAILED: Row(S.FAILED, X.END),
            # Not ended in time: the session drops the peer's agent (which
            # closes our endpoints to it); its loss then fails the load.
            E.TIMEOUT: Row(S.READ_CANCELLING, X.LOSE_SESSION),
            E.PEER_LOST: Row(S.FAILED, X.FENCE),
        },
        S.ABORTING: {
            # The writes finished before the producer saw our Abort. The
            # bytes are whole and the slots safe, but we gave the load up:
            # it fails, so "aborted" always means "recompute".
            E.TRANSFER_OK: Row(S.FAILED, X.END),
            E.TRANSFER_FAILED: Row(S.FAILED, X.END),
            E.ABORT_ACK: Row(S.FAILED, X.END),
            # No ack in time: the session closes the peer (agent
            # invalidated); its loss then fails the load.
            E.TIMEOUT: Row(S.ABORTING, X.LOSE_SESSION),
            E.PEER_LOST: Row(S.FAILED, X.FENCE),
        },
    },
    Machine.SERVE: {
        S.LOOKUP_QUEUED: {
            # Another batch for the same request before the serve window:
            # it joins the queue and is answered in the same window.
            E.LOOKUP: Row(S.LOOKUP_QUEUED, X.QUEUE_LOOKUP),
            E.SERVED: Row(S.PINNED, X.HOLD),
            **_PINS_END,  # earlier batches' pins
        },
        S.PINNED: {
            E.LOOKUP: Row(S.LOOKUP_QUEUED, X.QUEUE_LOOKUP),
            E.FETCH: Row(S.WRITE_QUEUED, X.WRITE),
            # A ``read`` Fetch (the consumer's window on our answer closed
            # before its load): the pins are offered again, held anew.
            E.OFFER: Row(S.FETCH_OFFERED, X.OFFER),
            **_PINS_END,
        },
        S.FETCH_OFFERED: _PINS_END,
        S.REVOKING: {
            E.RELEASE: Row(S.RELEASED, X.RELEASE),
            E.ABORT: Row(S.RELEASED, X.ACK_AND_RELEASE),
            # The pins' own deadline: the consumer reads only well inside
            # it, so nothing can read these slots any more.
            E.TIMEOUT: Row(S.RELEASED, X.RELEASE),
            E.ORPHAN: Row(S.ORPHANED, X.ORPHAN),
        },
        # Owned by the manager once its session is gone; nothing but the
        # pins' deadline ends it (a reset cannot know the peer stopped).
        S.ORPHANED: {
            E.TIMEOUT: Row(S.RELEASED, X.RELEASE),
        },
        S.FETCH_WAITING: {
            E.STORES_READY: Row(S.WRITE_QUEUED, X.WRITE),
            # A ``read`` Fetch: the stores are offered, held as pins are.
            E.OFFER: Row(S.FETCH_OFFERED, X.OFFER),
            E.ABORT: Row(S.RELEASED, X.ACK_AND_RELEASE),
            # The stores never came: the peer hears so, and recomputes.
            E.TIMEOUT: Row(S.RELEASED, X.REFUSE_AND_RELEASE),
            E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
            E.RESET: Row(S.RELEASED, X.REFUSE_AND_RELEASE),
        },
        S.WRITE_QUEUED: {
            E.POSTED: Row(S.WRITING, X.POSTED),
            # Not posted yet: nothing can land, so the peer may hear at once
            # that it is over (its PostWrite goes stale).
            E.ABORT: Row(S.RELEASED, X.ACK_AND_RELEASE),
            E.TIMEOUT: Row(S.RELEASED, X.REFUSE_AND_RELEASE),
            E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
        },
        S.WRITING: {
            E.WRITES_DONE: Row(S.RELEASED, X.RELEASE),
            E.WRITES_FAILED: Row(S.RELEASED, X.RELEASE),
            E.ABORT: Row(S.ABORT_WRITING, X.ACK_WHEN_SETTLED),
            # Deadline: the write is cancelled, the pins held while it may
            # still read them; the reply goes once the data plane stopped it.
            E.TIMEOUT: Row(S.WRITE_CANCELLING, X.CANCEL_WRITE),
            E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
        },
        S.ABORT_WRITING: {
            E.WRITES_DONE: Row(S.RELEASED, X.RELEASE),
            E.WRITES_FAILED: Row(S.RELEASED, X.RELEASE),
            E.TIMEOUT: Row(S.ABORT_CANCELLING, X.CANCEL_WRITE),
            E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
        },
        S.WRITE_CANCELLING: {
            E.WRITES_DONE: Row(S.RELEASED, X.RELEASE),
            E.WRITES_FAILED: Row(S.RELEASED, X.RELEASE),
            E.ABORT: Row(S.ABORT_CANCELLING, X.ACK_WHEN_SETTLED),
            # The data plane never answered: as for a write it could not
            # stop, the session ends (the peer's agent drop fences it).
            E.TIMEOUT: Row(S.RELEASED, X.LOSE_SESSION),
            E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
        },
        S.ABORT_CANCELLING: {
            E.WRITES_DONE: Row(S.RELEASED, X.RELEASE),
            E.WRITES_FAILED: Row(S.RELEASED, X.RELEASE),
            E.TIMEOUT: Row(S.RELEASED, X.LOSE_SESSION),
            E.PEER_LOST: Row(S.RELEASED, X.RELEASE),
        },
    },
    Machine.PARKED: {
        S.STORED: {
            E.FETCH: Row(S.BOUND, X.BIND),
            E.TIMEOUT: Row(S.EXPIRED, X.END),
            E.RESET: Row(S.EXPIRED, X.END),
        },
        S.BOUND: {
            E.WRITES_DONE: Row(S.RELEASED, X.END),
            E.WRITES_FAILED: Row(S.RELEASED, X.END),
            E.PEER_LOST: Row(S.RELEASED, X.END),
            E.RESET: Row(S.RELEASED, X.END),
        },
    },
}

#: The next states alone, for the checks that walk the graph.
TABLE: Final[dict[Machine, dict[State, dict[Event, State]]]] = {
    machine: {
        state: {event: row.to for event, row in events.items()}
        for state, events in states.items()
    }
    for machine, states in ROWS.items()
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


def transition(machine: Machine, state: State, event: Event) -> Row:
    """The one function that computes a next state and its effect."""
    try:
        return ROWS[machine][state][event]
    except KeyError:
        raise IllegalTransition(machine, state, event) from None


def step(machine: Machine, state: State, event: Event) -> State:
    """The next state alone (see :func:`transition`)."""
    return transition(machine, state, event).to


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

    def fire(self, event: Event) -> Effect:
        """Move to the next state; returns what the move does."""
        row = transition(self.machine, self._state, event)
        self._state = row.to
        return row.effect
