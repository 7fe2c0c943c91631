"""The runtime stack, built in one place: the NIXL data plane, the control
socket, the :class:`~p2p_kv.node.manager.LoadManager` and the
:class:`~p2p_kv.runtime.tier_runtime.TierRuntime` that drives them.

The vLLM tier, the standalone peer (tests, benchmarks) and the doctor's
peer check all run this same stack, so they are built by the same code:
a default, a start-up order or a cleanup that differed between them would
make the tests and the doctor check something other than what serves.
What differs is passed in: the region, the configured values, and what the
engine states about itself (its :class:`~p2p_kv.peer.handshake.Identity`).

No vLLM here: only :mod:`p2p_kv.adapter` imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from p2p_kv.control.transport import ControlTransport
from p2p_kv.data import NixlDataTransport, Region, drain_timeout_for
from p2p_kv.data.staged import DEFAULT_READ_STAGING_BYTES
from p2p_kv.node.manager import LoadManager
from p2p_kv.node.membership import Entry, Membership
from p2p_kv.peer import Timeouts
from p2p_kv.peer.handshake import Identity
from p2p_kv.runtime.resolver import Resolve, Resolver, resolve_host
from p2p_kv.runtime.tier_runtime import TierRuntime, fresh_nonce

#: What an engine states in its Hello, from its data plane and its control
#: address (``host:port``). Called once: while the stack is built, or with
#: ``lazy_identity`` at the first handshake (vLLM derives its hash seed
#: after the tier is built).
IdentitySource = Callable[[NixlDataTransport, str], Identity]


def open_transports(
    data: Callable[[], NixlDataTransport], host: str, port: int
) -> tuple[NixlDataTransport, ControlTransport]:
    """The data plane, then the control socket bound to ``host:port``; a
    bind that fails closes the data plane (its NIXL agent and UCX's thread
    were left to the collector, alive as long as the caller kept the
    exception)."""
    plane = data()
    try:
        return plane, ControlTransport(host, port)
    except BaseException:
        plane.close()
        raise


def build_runtime(
    region: Region,
    block_bytes: int,
    identity: IdentitySource,
    *,
    name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    timeouts: Timeouts | None = None,
    same_host: bool = True,
    read_staging_bytes: int = DEFAULT_READ_STAGING_BYTES,
    reads: bool = True,
    parked_ttl_s: float = 60.0,
    max_peers: int = 256,
    max_inbound: int = 512,
    idle_wait_s: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    lazy_identity: bool = False,
    peers: Sequence[Entry] | None = None,
    peers_refresh_s: float = 10.0,
    resolve: Resolve = resolve_host,
) -> TierRuntime:
    """One engine's p2p_kv over ``region`` (blocks of ``block_bytes``),
    its control socket bound to ``host:port`` (0: any free port) and its
    NIXL agent called ``name``.

    ``peers``: the fleet it may dial (None: whatever a request names); its
    names are resolved with ``resolve`` every ``peers_refresh_s``, on a
    thread of the runtime's.

    The data plane's drain bound follows ``timeouts``' abort-ack deadline
    (:func:`~p2p_kv.data.drain_timeout_for`). A start that fails closes
    what it opened and raises; the caller's region is left as it was (the
    caller releases its own views of it)."""
    timeouts = timeouts or Timeouts()
    data, control = open_transports(
        lambda: NixlDataTransport(
            region,
            block_bytes,
            name=name,
            same_host=same_host,
            read_staging_bytes=read_staging_bytes,
            drain_timeout_s=drain_timeout_for(timeouts.abort_ack_s),
        ),
        host,
        port,
    )
    address = control.address
    membership = Membership(peers)
    resolver = (
        Resolver(membership.names, peers_refresh_s, resolve)
        if membership.names
        else None
    )
    try:
        manager = LoadManager(
            (lambda: identity(data, address))
            if lazy_identity
            else identity(data, address),
            nonces=fresh_nonce,
            timeouts=timeouts,
            parked_ttl_s=parked_ttl_s,
            reads=reads,
            max_peers=max_peers,
            max_inbound=max_inbound,
            membership=membership,
        )
        return TierRuntime(
            manager,
            control,
            data,
            idle_wait_s=idle_wait_s,
            clock=clock,
            resolver=resolver,
        )
    except BaseException:
        control.close()
        data.close()
        raise


def stated_identity(
    data: NixlDataTransport,
    *,
    engine_id: str,
    hash_algo: str,
    hash_seed: str,
    canonical_hashes: tuple[bytes, ...],
    layout: str,
    secret: bytes | None,
) -> Identity:
    """An :class:`~p2p_kv.peer.handshake.Identity` whose block size, block count
    and region are the data plane's own: what a peer READs and WRITEs is
    what was registered, never a number the caller restated."""
    return Identity(
        engine_id=engine_id,
        hash_algo=hash_algo,
        hash_seed=hash_seed,
        canonical_hashes=canonical_hashes,
        layout=layout,
        block_bytes=data.block_bytes,
        num_blocks=data.num_blocks,
        region=msgspec.msgpack.encode(data.local_region()),
        secret=secret,
    )
