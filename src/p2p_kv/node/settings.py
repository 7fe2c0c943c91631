"""The node's settings: one value its parts share, read at each use.

The manager's parts (the sessions by peer, the parked stores, the
consumer legs) are handed this value, never the manager, so none can
reach another part's tables through it. It stays mutable: a caller may
change a bound after start-up (a test shrinking ``limits``, the doctor
its ``timeouts``), and every part sees the change at its next use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from p2p_kv.peer import Limits, Timeouts
from p2p_kv.peer.handshake import Identity


@dataclass(eq=False)
class NodeSettings:
    """What every part of the node reads. ``identity`` may be a callable:
    vLLM seeds its block hashes after the tier is built, so the engine's
    identity is known only once the first peer needs it (:attr:`me`)."""

    identity: Identity | Callable[[], Identity]
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    #: how long a producer's parked stores wait for a decoder's Fetch
    parked_ttl_s: float = 60.0
    #: the wait before a peer whose dial failed is dialled again
    reconnect_backoff_s: float = 1.0
    #: one-sided READ of offered blocks (else every load is a Fetch)
    reads: bool = True
    #: outbound sessions at once (p2p_kv.runtime.config.TierConfig.max_peers)
    max_peers: int = 256
    #: sessions peers open to us at once (TierConfig.max_inbound_peers)
    max_inbound: int = 512

    @property
    def me(self) -> Identity:
        """The engine's identity, resolved at the first use."""
        if not isinstance(self.identity, Identity):
            self.identity = self.identity()
        return self.identity
