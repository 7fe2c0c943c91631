"""READs from a peer on this host, done as our own copies.

What we offer of our region (its shared file, or its CUDA IPC export), and
for each peer that offers its own and proves it is its to offer
(:mod:`p2p_kv.data.offer`): the region opened (a ``Source``), the copier
into ours, and the rule for when our copy beats NIXL. A READ copied is the
same contract as a NIXL one; anything that fails on the way leaves the
peer's READs on NIXL, which is always correct.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from p2p_kv.data.cuda_ipc import CudaCopier, CudaIpcMapping, export_cuda_region
from p2p_kv.data.offer import Copier, CudaIpcRegion, Offer, ShmRegion, Source
from p2p_kv.data.plan import Indices, WritePlan, plan_write
from p2p_kv.data.regions import MEM_DRAM, MEM_VRAM, Peer, RegionSpan
from p2p_kv.data.shm_copy import HostCopier, PeerMapping, find_backing
from p2p_kv.data.transfer import Transfer
from p2p_kv.ratelog import PeerLog

__all__ = ["IPC_MIN_RUNS", "LocalReads", "may_copy", "plan_copy"]

logger = logging.getLogger("vllm.p2p_kv.data")

#: Blocks in another GPU's memory are copied here only when a load has this
#: many runs or more; fewer go through NIXL's cuda_ipc, which posts them
#: faster. On the lent H200 pair (GPU to GPU), 256 scattered runs: 241 GB/s
#: copied against 209 through NIXL (2 MiB blocks), 27.5 against 14.5 (64
#: KiB); 16 runs: 83 against 103, 4.2 against 6.1; one run: 315 against 345.
IPC_MIN_RUNS: Final = 64


def may_copy(mapping: Source, local: Indices, remote: Indices) -> bool:
    """Whether our own copy could beat NIXL for this load, known before
    planning it: always where :attr:`Source.copy_always` (a host region; a
    region on our own GPU); from another GPU only for :data:`IPC_MIN_RUNS`
    blocks or more that are not one run on both sides (planning 256 blocks
    cost 100 us there, a third of a 16 MiB load, and one run is NIXL's
    fastest case). The plan's run count decides the rest
    (:func:`plan_copy`)."""
    if mapping.copy_always:
        return True
    n = len(local)
    if n < IPC_MIN_RUNS or len(remote) != n:
        return False  # (a mismatch is refused, with its reason, by the plan)
    if not local[-1] - local[0] == n - 1 == remote[-1] - remote[0]:
        return True
    # The ends say one run; a shuffled middle has the same ends (a few us
    # to be sure, against the plan's 100).
    return not (_consecutive(local) and _consecutive(remote))


def _consecutive(blocks: Indices) -> bool:
    first = int(blocks[0])
    return list(map(int, blocks)) == list(range(first, first + len(blocks)))


def plan_copy(
    mapping: Source, local: Indices, remote: Indices, ours: int, theirs: int
) -> tuple[WritePlan | None, bool]:
    """The load's plan where one was made (``ours``/``theirs``: the
    regions' block counts; bad indices raise), and whether it is ours to
    copy."""
    if not may_copy(mapping, local, remote):
        return None, False
    plan = plan_write(local, remote, ours, theirs)
    return plan, mapping.copy_always or len(plan.counts) >= IPC_MIN_RUNS


class LocalReads:
    """Our offer to same-host peers, and the peers we copy from.

    Not thread-safe: the transport's lock covers it."""

    def __init__(
        self,
        span: RegionSpan,
        region: Any,
        block_bytes: int,
        plog: PeerLog,
        *,
        enabled: bool,
    ) -> None:
        self._span = span
        #: The region object, for a GPU copier; dropped at close.
        self._region: Any = region
        self._block_bytes = block_bytes
        self._plog = plog
        self.enabled = enabled
        self.shm: ShmRegion | None = None
        self.cuda_ipc: CudaIpcRegion | None = None
        self.copier: Copier | None = None
        if enabled and span.mem_kind == MEM_DRAM:
            try:
                self.shm = find_backing(span.addr, span.nbytes)
            except OSError as exc:
                logger.info("not offering same-host reads: %s", exc)
        elif enabled:
            try:
                self.cuda_ipc = export_cuda_region(
                    span.addr, span.nbytes, span.device_id
                )
            except OSError as exc:
                logger.info("not offering same-host GPU reads: %s", exc)

    def maybe_map(self, peer: Peer, conn: str | None) -> None:
        """Open the peer's region if it offers one, ``conn`` (our
        connection's inode) is known to prove it, and it was not tried."""
        # GPU memory is copied only into GPU memory: a GPU-to-host copy
        # would block the engine's thread, where NIXL's READ does not.
        offer = peer.info.shm or (
            peer.info.cuda_ipc if self._span.mem_kind == MEM_VRAM else None
        )
        if not self.enabled or offer is None or conn is None or peer.map_tried:
            return
        peer.map_tried = True
        self._map(peer, offer, conn)

    def _map(self, peer: Peer, offer: Offer, conn: str) -> None:
        name = peer.info.agent_name
        if offer.length != peer.info.region_bytes:
            self._plog.warning(
                "shared_region_size",
                name,
                "offers a %d-byte shared region for %d bytes of blocks: "
                "reading through NIXL",
                offer.length,
                peer.info.region_bytes,
            )
            return
        try:
            mapping: Source = (
                PeerMapping(offer, conn)
                if isinstance(offer, ShmRegion)
                else CudaIpcMapping(offer, conn)
            )
        except Exception as exc:
            # The offer is the peer's word: whatever it makes the opening
            # raise, its READs go through NIXL.
            self._plog.info(
                "shared_region_refused",
                name,
                "same-host reads unavailable (%s); reading through NIXL",
                exc,
            )
            return
        try:
            if self.copier is None:
                span = self._span
                self.copier = (
                    HostCopier(span.addr, span.nbytes, self._block_bytes)
                    if span.mem_kind == MEM_DRAM
                    else CudaCopier(self._region, self._block_bytes)
                )
            self.copier.register(mapping)
        except Exception as exc:
            mapping.close()
            self._plog.warning(
                "shared_region_copier",
                name,
                "cannot copy from its region (%s); reading through NIXL",
                exc,
            )
            return
        peer.mapping = mapping
        self._plog.info(
            "shared_region_mapped",
            name,
            "same-host copies from its %s region (pid %d)",
            peer.info.mem_kind,
            offer.pid,
        )

    def unmap(self, peer: Peer) -> None:
        """After every copy from the peer has ended."""
        if peer.mapping is not None:
            if self.copier is not None:
                self.copier.unregister(peer.mapping)
            peer.mapping.close()
            peer.mapping = None

    def copy(self, peer: Peer, plan: WritePlan) -> Transfer | None:
        """Start a copy from a mapped peer: None when done already."""
        assert peer.mapping is not None and self.copier is not None
        return self.copier.copy(peer.mapping, plan)

    def close(self) -> None:
        """After every peer was unmapped."""
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        self._region = None
