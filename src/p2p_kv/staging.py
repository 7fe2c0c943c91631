"""Read staging: where a NIXL READ lands before its bytes reach the slots.

Why it exists: a READ we give up on (cancelled, its peer dropped) is not
stopped by NIXL. Over UCX's TCP transport the peer's progress serves it and
ours writes the reply, so a peer that stalls past the READ's deadline and
then resumes writes into the buffer the READ named, seconds later; NIXL
has no forced close of the connection, and invalidating the peer's agent
closes it gracefully (after the READ). Had the READ named the engine's
slots, those would by then hold another request's KV.

So a READ from a peer we do not copy from ourselves lands in staging blocks
of ours (made and registered once, at the first such READ). Its bytes are
copied into the engine's slots only after UCX reports it done. One given
up on hands the engine's slots back at once (reported failed, no drain to
wait out) and keeps its staging blocks, quarantined, until UCX ends it: a
peer that resumes lands its bytes there, a dead one errors it. One
peer's READs, running or given up on, hold at most half of the staging
the other peers leave (a peer stalled mid-READ keeps its share for the
stall, and only its share; k stalled peers leave about 1/2**k to the
rest, one block at least each), so a load larger than that moves in
pieces of half its share, two in flight: one lands and is copied out
while the next runs.

:class:`StagingPool` is the allocator (pure); :class:`StagingMemory` owns
the bytes and the copy out of them. ``p2p_kv.data`` drives both.
"""

from __future__ import annotations

import ctypes
import heapq
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from p2p_kv.plan import coalesce
from p2p_kv.same_host import shared_region

__all__ = ["DEFAULT_READ_STAGING_BYTES", "StagingMemory", "StagingPool"]

#: 64 MiB: 32 blocks of 2 MiB, 1024 of 64 KiB. Host memory for host
#: regions, GPU memory for GPU ones; larger loads move in pieces.
DEFAULT_READ_STAGING_BYTES: Final = 64 << 20

Blocks = npt.NDArray[np.int64]


class StagingPool:
    """Which staging blocks are free. Blocks are handed out lowest first,
    so a piece's blocks are mostly one run (one descriptor). A heap: a
    one-block take and give cost about 2 us (a numpy scan of 1,024 flags
    cost 10)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a staging pool needs blocks, got {num_blocks}")
        self._size = num_blocks
        self._heap = list(range(num_blocks))  # sorted: already a heap
        self._taken = bytearray(num_blocks)

    @property
    def size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        return len(self._heap)

    def take(self, want: int) -> Blocks:
        """Up to ``want`` free blocks, ascending (none when all are taken)."""
        heap, taken = self._heap, self._taken
        got = [heapq.heappop(heap) for _ in range(min(max(want, 0), len(heap)))]
        for b in got:
            taken[b] = 1
        return np.array(got, dtype=np.int64)

    def give(self, blocks: Blocks) -> None:
        """Return blocks; one not taken is a bug in the caller."""
        items = blocks.tolist()
        taken = self._taken
        if not all(taken[b] for b in items) or len(set(items)) != len(items):
            raise ValueError(f"staging blocks {items} were not taken")
        for b in items:
            taken[b] = 0
            heapq.heappush(self._heap, b)


def _runs(stage: Blocks, slots: Blocks) -> list[tuple[int, int, int]]:
    """``(stage start, slot start, count)`` runs, in the given order: one
    pass, no sort (coalescing a one-block pair cost 6 us)."""
    if stage.size > 64:
        return coalesce(stage, slots)
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(stage.tolist(), slots.tolist(), strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if a == s0 + n and b == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((a, b, 1))
    return runs


class StagingMemory:
    """The staging bytes, in the region's kind of memory, and the copy from
    them into the region's blocks (rows of ``block_bytes``)."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        region_addr: int,
        region_bytes: int,
        cuda_region: Any = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        rows = region_bytes // block_bytes
        if cuda_region is None:
            # A memfd, like the regions: UCX's CMA READ of 32 MiB took
            # 12-15 ms into it here, 28-35 ms into numpy's anonymous pages.
            self._buf: Any = shared_region(num_blocks * block_bytes).reshape(
                num_blocks, block_bytes
            )
            self.addr = int(self._buf.ctypes.data)
            self.device_id = 0
            raw: Any = (ctypes.c_uint8 * region_bytes).from_address(region_addr)
            self._region: Any = np.frombuffer(raw, dtype=np.uint8).reshape(
                rows, block_bytes
            )
        else:
            import torch

            device = cuda_region.device
            self._buf = torch.zeros(
                (num_blocks, block_bytes), dtype=torch.uint8, device=device
            )
            self.addr = int(self._buf.data_ptr())
            self.device_id = int(device.index or 0)
            self._region = (
                cuda_region.reshape(-1).view(torch.uint8).view(rows, block_bytes)
            )
        self.nbytes = num_blocks * block_bytes

    @property
    def buffer(self) -> Any:
        """The staging bytes alone: what must outlive a transport closed
        while a READ given up on may still write them. Not this object,
        whose view of the region would keep the engine's whole KV cache
        (GPU memory) alive with it."""
        return self._buf

    def copy_out(self, stage: Blocks, slots: Blocks) -> None:
        """Staging block ``stage[i]`` into region block ``slots[i]``; done
        (on the GPU: finished) when this returns."""
        if isinstance(self._buf, np.ndarray):
            # One memcpy a run: fancy indexing copied through a temporary
            # (32 MiB in 10 ms here, against about 5 by runs).
            for src, dst, n in _runs(stage, slots):
                self._region[dst : dst + n] = self._buf[src : src + n]
            return
        import torch

        device = self._buf.device
        self._region[torch.as_tensor(slots, device=device)] = self._buf[
            torch.as_tensor(stage, device=device)
        ]
        torch.cuda.current_stream(device).synchronize()
