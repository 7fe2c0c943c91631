"""The data plane: moves KV blocks between peers' registered regions.

:class:`NixlDataTransport` (``nixl.py``) is the whole interface the other
layers use; the package splits what it joins:

* ``regions.py``: what a region is, on the wire (:class:`RegionInfo`) and
  here; descriptor arithmetic; checks of a peer's region. Pure.
* ``agent.py``: the NIXL agent (loaded lazily), its backends and
  descriptor lists.
* ``remote_agents.py``: the peers' agents, loaded, retired and dropped.
* ``transfer.py``: the :class:`~p2p_kv.data.transfer.Transfer` protocol
  every kind of transfer in flight implements, and the ledger that gives
  them up within their drain bound.
* ``staged.py``: READs landing in staging, in pieces, and the ones given
  up on (zombies).
* ``offer.py``: what a same-host peer offers of its region, the proof,
  and the ``Source`` a copier reads; ``shm_copy.py`` (shared files) and
  ``cuda_ipc.py`` (GPU memory) open offers and copy; ``local.py``
  decides when a READ is our copy.

Importing this package never imports NIXL: only a transport does.
"""

from p2p_kv.data.agent import (
    DEFAULT_UCX_ERROR_HANDLING_MODE,
    check_ucx_error_handling_mode,
    ucx_tls_allows_peer_mode,
)
from p2p_kv.data.nixl import NixlDataTransport
from p2p_kv.data.regions import (
    MEM_DRAM,
    MEM_VRAM,
    Region,
    RegionInfo,
    RegionSpan,
    TensorLike,
    build_descs,
    check_peer_metadata,
    describe_region,
)
from p2p_kv.data.transfer import DEFAULT_DRAIN_TIMEOUT_S, drain_timeout_for

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_UCX_ERROR_HANDLING_MODE",
    "MEM_DRAM",
    "MEM_VRAM",
    "NixlDataTransport",
    "Region",
    "RegionInfo",
    "RegionSpan",
    "TensorLike",
    "build_descs",
    "check_peer_metadata",
    "check_ucx_error_handling_mode",
    "describe_region",
    "drain_timeout_for",
    "ucx_tls_allows_peer_mode",
]
