"""A peer: one session owning a link, a consumer side and a producer side.

See :mod:`p2p_kv.peer.session`; the records it keeps are in
:mod:`p2p_kv.peer.records`, what it tells its owner in
:mod:`p2p_kv.peer.events`. The names other layers use are here.
"""

from p2p_kv.peer.link import LinkState
from p2p_kv.peer.records import (
    MAX_TALLY_KEYS,
    PEER_REASON,
    KeyCount,
    Limits,
    ParkedStore,
    Pinner,
    PinResult,
    Serve,
    SessionCounters,
    Timeouts,
    is_inbound,
    tally,
)
from p2p_kv.peer.session import Session

__all__ = [
    "MAX_TALLY_KEYS",
    "PEER_REASON",
    "KeyCount",
    "Limits",
    "LinkState",
    "ParkedStore",
    "PinResult",
    "Pinner",
    "Serve",
    "Session",
    "SessionCounters",
    "Timeouts",
    "is_inbound",
    "tally",
]
