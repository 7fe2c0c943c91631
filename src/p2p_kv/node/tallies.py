"""The manager's counters and recent history: what the metrics and the logs
read, never per-request state, so never residue.

They sit apart from the parts that count into them (the sessions, the
requests) so that each part imports them and none imports another part or
the manager for them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar, cast

from p2p_kv.peer import Session

T = TypeVar("T")

#: Addresses whose engine is remembered, to tell a restart.
MAX_ENGINES_AT = 4096
#: Refusal reasons of the bounds on peers (never a handshake's).
LIMIT_REFUSALS: Final = frozenset(
    {"too_many_peers", "too_many_inbound", "too_many_handshaking"}
)


@dataclass(frozen=True, slots=True)
class LoadObservation:
    """One finished load job, for the metrics (drained by p2p_kv.runtime.metrics)."""

    peer: str
    success: bool
    elapsed_s: float  # the session's: Fetch to result
    nbytes: int
    reason: str
    waited_s: float  # submit_load to get_finished_jobs: what vLLM waited


@dataclass(eq=False)
class Tallies:
    """Counters and recent history for the metrics and the logs: never
    per-request state, so never residue."""

    refusals: dict[tuple[str, str], int] = field(default_factory=dict)
    protocol_errors: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    # Drained by p2p_kv.runtime.metrics at every stats poll; bounded, so nothing
    # piles up when stats are off.
    load_observations: deque[LoadObservation] = field(
        default_factory=lambda: deque(maxlen=4096)
    )
    #: ended sessions, for their last counts (metrics)
    retired_sessions: deque[Session] = field(default_factory=lambda: deque(maxlen=1024))
    #: Dials that ended before a handshake, by reason
    #: (:func:`p2p_kv.control.transport.dial_failure`'s labels: our own codes).
    dial_failures: dict[str, int] = field(default_factory=dict)
    #: The engine last met at each address we dialled (at most
    #: MAX_ENGINES_AT, the oldest forgotten): another one there is a
    #: restart under the same address.
    engines_at: dict[str, str] = field(default_factory=dict)
    #: Peers not dialled because max_peers were (the runtime logs it).
    dials_refused: int = 0
    double_results: int = 0

    def met(self, peer: str, engine_id: str) -> bool:
        """Our dial to ``peer`` reached ``engine_id``; True if another
        engine answered there before (a pod restarted under the address: a
        router's requests naming the old one's blocks now miss)."""
        before = self.engines_at.pop(peer, None)
        if len(self.engines_at) >= MAX_ENGINES_AT:
            del self.engines_at[next(iter(self.engines_at))]
        self.engines_at[peer] = engine_id
        return before is not None and before != engine_id

    def count_limit_refusal(self, reason: str) -> None:
        """Outside the table's cap (these are :data:`LIMIT_REFUSALS`, three
        keys): tallied, they would go to ``("other", "other")`` once 64
        refused sessions, each its own key, had filled the table, which
        anyone who reaches the port can do."""
        key = ("other", reason)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def limit_refusals(self) -> dict[str, int]:
        """Refusals of ours no session counts (``max_peers``,
        ``max_inbound_peers``), by reason: the metrics export them."""
        return {
            reason: n
            for (peer, reason), n in self.refusals.items()
            if peer == "other" and reason in LIMIT_REFUSALS
        }


class FromTallies(Generic[T]):
    """A read-only attribute that is its owner's ``tallies``' of the same
    name: the counters' readers keep reading them off the manager."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        return cast(T, getattr(obj.tallies, self._name))
