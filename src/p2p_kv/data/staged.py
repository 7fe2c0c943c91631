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
rest, one block at least each). A load moves in pieces of at most
:data:`PIECE_BYTES` (and a quarter of the peer's share), up to
:data:`PIECES_IN_FLIGHT` at once: each is copied out on the copy threads
(:mod:`p2p_kv.data.copy_out`) as soon as it lands, while the next ones
run, so the copy adds only the last piece's to the READ's time (the
caller copies beside the threads while it waits for that one).

:class:`StagingPool` is the allocator (pure); :class:`StagingMemory` owns
the bytes and the copy out of them; :class:`Staging` runs the READs
(:class:`StagedRead`, a :class:`~p2p_kv.data.transfer.Transfer`) and
keeps the ones given up on (zombies) until UCX ends them. The transport
(``p2p_kv.data.nixl``) decides which READs are staged.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from p2p_kv.data.agent import Lists, disconnected
from p2p_kv.data.copy_out import INLINE_COPY_BYTES, Copying, CopyThreads
from p2p_kv.data.plan import plan_write
from p2p_kv.data.regions import MEM_VRAM, Peer, RegionSpan
from p2p_kv.data.shm_copy import shared_region
from p2p_kv.data.transfer import release_quietly
from p2p_kv.ratelog import PeerLog

__all__ = [
    "DEFAULT_READ_STAGING_BYTES",
    "PEER_STAGING_SHARE",
    "PIECES_IN_FLIGHT",
    "PIECE_BYTES",
    "StagedRead",
    "Staging",
    "StagingMemory",
    "StagingPool",
]

logger = logging.getLogger("vllm.p2p_kv.data")

#: 64 MiB: 32 blocks of 2 MiB, 1024 of 64 KiB. Host memory for host
#: regions, GPU memory for GPU ones; larger loads move in pieces.
DEFAULT_READ_STAGING_BYTES: Final = 64 << 20

Blocks = npt.NDArray[np.int64]


class StagingPool:
    """Which staging blocks are free: a sorted list, so blocks go lowest
    first (a piece's blocks are then mostly one run: one descriptor, one
    copy) and a take of any size is one slice of its head. (Popping a heap
    block by block cost about 30 us for a 64-block piece here.)"""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a staging pool needs blocks, got {num_blocks}")
        self._size = num_blocks
        self._free = list(range(num_blocks))
        self._taken = bytearray(num_blocks)

    @property
    def size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, want: int) -> Blocks:
        """Up to ``want`` free blocks, ascending (none when all are taken)."""
        free, taken = self._free, self._taken
        n = min(max(want, 0), len(free))
        got = free[:n]
        del free[:n]
        for b in got:
            taken[b] = 1
        return np.array(got, dtype=np.int64)

    def give(self, blocks: Blocks) -> None:
        """Return blocks; one not taken is a bug in the caller."""
        items = blocks.tolist()
        taken, free = self._taken, self._free
        if not all(taken[b] for b in items) or len(set(items)) != len(items):
            raise ValueError(f"staging blocks {items} were not taken")
        for b in items:
            taken[b] = 0
        if len(items) <= 8:
            for b in items:
                bisect.insort(free, b)
        else:
            free.extend(items)
            free.sort()  # two sorted runs: one merge


#: One copy out of staging: ``(stage start, slots)``, staging blocks
#: ``start .. start + len(slots) - 1`` into those slots.
Segment = tuple[int, Blocks]


def _segments(stage: Blocks, slots: Blocks) -> list[Segment]:
    """The copy cut where the staging blocks stop being one run. The pool
    hands a piece its blocks lowest first, so a piece is mostly one
    segment, whatever its slots, and each segment is one numpy assignment,
    which releases the GIL for the whole copy. A copy that came back to
    Python between blocks would need the GIL for each, and NIXL holds the
    GIL while it posts a READ (on one host UCX's CMA copy runs inside the
    post): the copy threads would stand still while the next piece's READ
    ran, and a staged load would take the READ's time plus the copy's."""
    if not stage.size:
        return []
    bounds = [0, *(np.flatnonzero(np.diff(stage) != 1) + 1).tolist(), int(stage.size)]
    return [(int(stage[a]), slots[a:b]) for a, b in itertools.pairwise(bounds)]


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
            # A memfd, like the regions: UCX's CMA READ of 32 MiB takes
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

    def copy_out(
        self, stage: Blocks, slots: Blocks, threads: CopyThreads | None = None
    ) -> Copying | None:
        """Staging block ``stage[i]`` into region block ``slots[i]``. None:
        done (on the GPU: finished) when this returns; else the copy runs on
        ``threads`` in stripes until the :class:`Copying` is done."""
        if isinstance(self._buf, np.ndarray):
            segments = _segments(stage, slots)
            if (
                threads is None
                or not threads.usable()
                or stage.size * self.block_bytes < INLINE_COPY_BYTES
            ):
                self._copy_segments(segments)
                return None
            return threads.run(
                [
                    functools.partial(self._copy_segments, part)
                    for part in _stripes(segments, threads.usable())
                ]
            )
        import torch

        device = self._buf.device
        self._region[torch.as_tensor(slots, device=device)] = self._buf[
            torch.as_tensor(stage, device=device)
        ]
        torch.cuda.current_stream(device).synchronize()
        return None

    def _copy_segments(self, segments: list[Segment]) -> None:
        region, buf = self._region, self._buf
        for start, slots in segments:
            n, first = int(slots.size), int(slots[0])
            if n == 1 or (
                int(slots[-1]) - first == n - 1 and bool((np.diff(slots) == 1).all())
            ):
                region[first : first + n] = buf[start : start + n]
            else:
                # Scattered slots: one gather-free assignment (the source
                # is a slice, so no temporary), the GIL released throughout.
                region[slots] = buf[start : start + n]


def _stripes(segments: list[Segment], k: int) -> list[list[Segment]]:
    """``segments`` cut into at most ``k`` parts of about equal blocks (a
    segment may be split between two)."""
    total = sum(int(slots.size) for _, slots in segments)
    per = -(-total // max(1, k))
    parts: list[list[Segment]] = [[]]
    room = per
    for start, slots in segments:
        while slots.size:
            if not room:
                parts.append([])
                room = per
            take = min(int(slots.size), room)
            parts[-1].append((start, slots[:take]))
            start, slots, room = start + take, slots[take:], room - take
    return parts


#: Staging bytes of transports closed while READs into them still ran
#: (see :meth:`Staging.close_reads`).
_KEPT_STAGING: list[Any] = []

#: Pieces of one staged READ in flight at once (running, or being copied
#: out): the next piece's READ runs while the last one's copy does, instead
#: of each waiting for the one before.
PIECES_IN_FLIGHT = 4
#: A piece is at most this many bytes (a block at least): the copy of the
#: last piece, which nothing overlaps, stays short, and a piece copied
#: right after it landed is still in the CPU's cache.
PIECE_BYTES = 4 << 20

#: One peer's staged READs, running or given up on, hold at most this share
#: of the staging the other peers leave (pieces are this share over
#: :data:`PIECES_IN_FLIGHT`). A peer that stalls mid-READ, alive and
#: connected, keeps its READs' staging until it resumes or dies (UCX does
#: not end them); with no share, one such READ could hold all of it, and
#: every other peer's READs would wait out their deadlines for as long as
#: the stall lasts. A share of the whole pool would let two stalled peers take it
#: all; of what is left, k stalled peers leave about 1/2**k of it to the
#: rest (one block at least each: 32 blocks last 6 stalled peers).
PEER_STAGING_SHARE = 0.5


@dataclass(eq=False)
class _Piece:
    """One piece of a staged READ: the peer's blocks for ``local[lo:lo +
    stage.size]``, landing in staging blocks ``stage``, then copied out
    (``copying``, once UCX ended it: the handle is then released)."""

    handle: Any
    stage: Blocks
    lo: int
    state: str
    copying: Copying | None = None


@dataclass(eq=False)
class StagedRead:
    """A READ landing in staging in pieces, up to :data:`PIECES_IN_FLIGHT`
    at once; ``posted`` blocks of ``local`` have gone to pieces so far.

    A :class:`~p2p_kv.data.transfer.Transfer` that detaches: given up on,
    its pieces still running keep their staging (as zombies), not the
    caller's slots."""

    staging: Staging
    peer: Peer
    local: Blocks
    remote: Blocks
    posted: int = 0
    pieces: list[_Piece] = field(default_factory=list)

    detaches: ClassVar[bool] = True

    def state(self, post: bool = True) -> str:
        return self.staging.advance(self, post)

    def release(self) -> None:
        self.staging.bury(self)


@dataclass(eq=False)
class _Zombie:
    """A staged READ given up on while UCX still runs it: its staging blocks
    stay taken until UCX ends it (``lost``: until close, when its state can
    no longer be read)."""

    handle: Any
    stage: Blocks
    peer: str
    lost: bool = False
    #: UCX failed it with the peer's endpoint (remote disconnect): its
    #: staging returns once the peer's agent is dropped, after which
    #: nothing of that peer's can land (see :meth:`Staging.dropped`).
    gone: bool = False

    @property
    def running(self) -> bool:
        """Whether UCX may still end it (and its state can be read)."""
        return not (self.lost or self.gone)


class Staging:
    """One transport's staging: its memory, the READs running through it
    and the zombies.

    The memory is made at the first READ that needs it: an engine whose
    peers are all copied from on this host never holds it. (Made at start,
    its 64 MiB coincides with 16 s stalls of an idle `vllm serve` pair in
    about half of test_serve_metrics' runs, not explained; made lazily, it
    does not.)

    Not thread-safe: the transport's lock covers it. ``fault`` is told of
    a peer whose data plane broke under its session (see the transport's
    ``take_faulted``); ``prepare`` gives a peer's prepared per-block list
    (None: build descriptors per transfer)."""

    def __init__(
        self,
        *,
        lists: Lists,
        span: RegionSpan,
        region: Any,
        nbytes: int,
        plog: PeerLog,
        fault: Callable[[str], None],
        prepare: Callable[[Peer], tuple[Any, Any] | None],
    ) -> None:
        self._lists = lists
        self._span = span
        #: The region object, for GPU staging on its device; dropped at close.
        self._region: Any = region
        self._block_bytes = lists.block_bytes
        self.nbytes = nbytes
        self._plog = plog
        self._fault = fault
        self._prepare = prepare
        #: Staging that could not be made is tried again at each READ (the
        #: memory may free), but said once.
        self._error = ""
        self.mem: StagingMemory | None = None
        self.pool: StagingPool | None = None
        self._descs: Any = None
        self._prepped: Any = None
        self.zombies: list[_Zombie] = []
        #: READs that may hold pieces: what a peer's share is counted over.
        self._reads: set[StagedRead] = set()
        #: copies out of staging, off the caller's thread (see copy_out.py)
        self.copy_threads = CopyThreads()
        self._piece_blocks = max(1, PIECE_BYTES // self._block_bytes)

    def _setup(self) -> None:
        """Staging beside the region, registered after the region's
        metadata was taken: only we address it, so peers get no key to it."""
        span = self._span
        mem = StagingMemory(
            max(1, self.nbytes // self._block_bytes),
            self._block_bytes,
            span.addr,
            span.nbytes,
            cuda_region=self._region if span.mem_kind == MEM_VRAM else None,
        )
        self._descs = self._lists.agent.register_memory(
            [(mem.addr, mem.nbytes, mem.device_id, "")], span.mem_kind
        )
        self.mem = mem
        self.pool = StagingPool(mem.num_blocks)

    def read(
        self, peer: Peer, local: list[int], remote: list[int]
    ) -> StagedRead | None:
        """A READ of the peer's ``remote`` blocks into our ``local`` ones,
        not started yet (its first :meth:`advance` posts it); None when no
        staging can be made now (said once): it fails, and the next tries
        again. No READ may land in place instead."""
        if self.pool is None:
            try:
                self._setup()
            except Exception as exc:
                if str(exc) != self._error:
                    self._error = str(exc)
                    logger.warning(
                        "cannot make %d bytes of read staging (staged READs "
                        "recompute until it can be made; lower "
                        "read_staging_mib, or 0 to READ in place): %s",
                        self.nbytes,
                        exc,
                    )
                return None
        read = StagedRead(
            self, peer, np.asarray(local, dtype=np.int64), np.asarray(remote, np.int64)
        )
        self._reads.add(read)
        return read

    def advance(self, read: StagedRead, post: bool = True) -> str:
        """Copy out the pieces that landed and post the next ones: "PROC"
        while pieces run, are copied out, or wait for free staging, then
        "DONE" or "ERR" (the pieces still running are then buried). ``post``
        False: a READ being given up on, whose next pieces must not start.

        A check that raises is raised: the piece's fate is then unknown,
        and the caller's release buries it (its staging is not reused)."""
        pool, mem = self.pool, self.mem
        assert pool is not None and mem is not None
        name = read.peer.info.agent_name
        while True:
            for piece in list(read.pieces):
                if piece.copying is None:
                    if piece.state == "PROC":
                        piece.state = str(
                            self._lists.agent.check_xfer_state(piece.handle)
                        )
                        if piece.state == "PROC":
                            continue
                    if not self._landed(read, piece):
                        return "ERR"
                done = piece.copying is not None and piece.copying.done()
                if done and not self._copied(read, piece):
                    return "ERR"
            left = int(read.local.size) - read.posted
            if not left:
                if not read.pieces:
                    self._reads.discard(read)
                    return "DONE"
                if not post or any(p.copying is None for p in read.pieces):
                    return "PROC"
                # Only our own copies are left: wait for them here (at
                # memory speed, a piece's bytes) rather than for a wake-up.
                for piece in list(read.pieces):
                    if not self._copied(read, piece):
                        return "ERR"
                continue
            if not post:
                return "PROC"
            if len(read.pieces) >= PIECES_IN_FLIGHT:
                if any(p.copying is None for p in read.pieces):
                    return "PROC"  # UCX moves one: its end wakes us
                # Every piece landed inside its post (UCX's CMA on one host)
                # and is being copied: wait for the oldest copy here, at
                # memory speed, rather than for a wake-up a piece.
                if not self._copied(read, read.pieces[0]):
                    return "ERR"
                continue
            mine = self._held(read)
            # A share of what the other peers leave, not of the whole pool:
            # shares of the whole let two stalled peers take all of it.
            share = max(1, int((pool.free + mine) * PEER_STAGING_SHARE))
            most = max(1, min(share // PIECES_IN_FLIGHT, self._piece_blocks))
            stage = pool.take(min(left, most, share - mine))
            if not stage.size:
                return "PROC"  # the peer's share or the pool is taken: wait
            lo, handle = read.posted, None
            try:
                handle = self._xfer(read.peer, stage, read.remote[lo : lo + stage.size])
                state = str(self._lists.agent.transfer(handle))
            except Exception as exc:
                if self._plog.warning(
                    "post",
                    name,
                    "READ of %d blocks failed to post: %s",
                    stage.size,
                    exc,
                ):
                    logger.debug("post failure detail", exc_info=True)
                if handle is None:
                    pool.give(stage)  # nothing was posted
                else:
                    # NIXL posts a piece a descriptor at a time and cancels
                    # the posted ones when one fails: cancelled, not
                    # stopped. Its staging waits for the peer's agent to be
                    # dropped, as a READ failed with the endpoint does, and
                    # the session ends so that it is.
                    self.zombies.append(_Zombie(handle, stage, name, gone=True))
                    self._fault(name)
                self.bury(read)
                return "ERR"
            read.pieces.append(_Piece(handle, stage, lo, state))
            read.posted += int(stage.size)

    def _landed(self, read: StagedRead, piece: _Piece) -> bool:
        """A piece UCX ended: start its copy out if it landed. False: the
        READ failed (buried)."""
        pool, mem = self.pool, self.mem
        assert pool is not None and mem is not None
        name = read.peer.info.agent_name
        release_quietly(piece.handle, name, self._plog)
        piece.handle = None
        copying = None
        try:
            if piece.state == "DONE":
                end = piece.lo + piece.stage.size
                copying = mem.copy_out(
                    piece.stage, read.local[piece.lo : end], self.copy_threads
                )
        except Exception as exc:
            self._copy_failed(name, exc)
            piece.state = "ERR"
        if piece.state != "DONE":
            read.pieces.remove(piece)
            pool.give(piece.stage)
            self.bury(read)
            return False
        if copying is None:  # copied already
            read.pieces.remove(piece)
            pool.give(piece.stage)
        piece.copying = copying
        return True

    def _copied(self, read: StagedRead, piece: _Piece) -> bool:
        """A piece whose copy out ran: its staging goes back. False: the
        copy failed and the READ with it (buried)."""
        assert self.pool is not None and piece.copying is not None
        error = piece.copying.wait()
        read.pieces.remove(piece)
        self.pool.give(piece.stage)
        if error is None:
            return True
        self._copy_failed(read.peer.info.agent_name, error)
        self.bury(read)
        return False

    def _copy_failed(self, name: str, exc: BaseException) -> None:
        if self._plog.warning(
            "copy_out", name, "copying a READ out of staging failed: %s", exc
        ):
            logger.debug("copy-out failure detail", exc_info=exc)

    def _held(self, read: StagedRead) -> int:
        """Staging blocks held by ``read``'s peer: its READs' pieces running
        and its READs given up on."""
        name = read.peer.info.agent_name
        # Only zombies that may still run: the lost ones keep their blocks
        # until close and the gone ones until the peer's agent is dropped
        # (which a new session that takes the agent back defers), and
        # charged to the peer they stopped its staged READs for good.
        held = sum(
            int(z.stage.size) for z in self.zombies if z.peer == name and z.running
        )
        return held + sum(
            int(p.stage.size)
            for r in self._reads
            if r.peer is read.peer
            for p in r.pieces
        )

    def _xfer(self, peer: Peer, stage: Blocks, remote: Blocks) -> Any:
        """A NIXL READ of the peer's ``remote`` blocks into staging ``stage``."""
        mem = self.mem
        assert mem is not None
        agent, info, kind = self._lists.agent, peer.info, self._span.mem_kind
        prepped = self._prepare(peer)
        if prepped is not None:
            if self._prepped is None:
                self._prepped = self._lists.blocks(
                    "NIXL_INIT_AGENT", mem.addr, mem.num_blocks, mem.device_id, kind
                )
            return agent.make_prepped_xfer(
                "READ", self._prepped, stage.tolist(), prepped[1], remote.tolist(), b""
            )
        plan = plan_write(stage, remote, mem.num_blocks, info.num_blocks)
        ours = RegionSpan(mem.addr, mem.nbytes, kind, mem.device_id)
        return self._lists.xfer("READ", plan, ours, info, b"")

    def bury(self, read: StagedRead) -> None:
        """A staged READ given up on: its pieces in flight become zombies,
        and those being copied out are waited for (their copies write the
        slots the caller is about to hand back)."""
        self._reads.discard(read)
        for piece in read.pieces:
            if piece.copying is not None:
                piece.copying.wait()
                assert self.pool is not None
                self.pool.give(piece.stage)
                continue
            self.zombies.append(
                _Zombie(piece.handle, piece.stage, read.peer.info.agent_name)
            )
        read.pieces.clear()

    # -- zombies, by peer ----------------------------------------------------

    def busy(self, name: str) -> bool:
        """Whether a READ given up on from ``name`` may still run: its agent
        must stay loaded, or its state can no longer be read."""
        return any(z.peer == name and z.running for z in self.zombies)

    def settling(self) -> bool:
        return any(z.running for z in self.zombies)

    def lose(self, name: str) -> None:
        """``name``'s agent is gone: its zombies can no longer be checked,
        and keep their staging until close."""
        for z in self.zombies:
            z.lost = z.lost or z.peer == name

    def settle(self) -> set[str]:
        """Free the staging of zombies UCX has ended; the peers that still
        have some running (their agents must stay loaded)."""
        pool = self.pool
        if not self.zombies or pool is None:
            return set()
        live: list[_Zombie] = []
        for z in self.zombies:
            if z.running:
                try:
                    state = str(self._lists.agent.check_xfer_state(z.handle))
                except Exception as exc:
                    # Either way the peer's endpoint is no use to its
                    # session any more: it ends, and the agent is dropped.
                    self._fault(z.peer)
                    if disconnected(exc):
                        # Over, failed with the peer's endpoint. (Taken for
                        # an unknown state, a dead peer's READ held its
                        # staging for good, and with the whole pool taken
                        # every later NIXL READ waited out its deadline.)
                        z.gone = True
                        live.append(z)
                        continue
                    self._plog.warning(
                        "unreadable",
                        z.peer,
                        "a cancelled READ from it can no longer be checked (%s): "
                        "its %d staging blocks stay taken until close",
                        exc,
                        z.stage.size,
                    )
                    z.lost = True
                    state = "PROC"
                if state != "PROC":
                    release_quietly(z.handle, z.peer, self._plog)
                    pool.give(z.stage)
                    continue
            live.append(z)
        self.zombies = live
        return {z.peer for z in live if z.running}

    def dropped(self, name: str) -> None:
        """``name``'s agent was dropped: nothing of that peer's can land
        now, so READs UCX failed with its endpoint give their staging back."""
        pool, kept = self.pool, []
        for z in self.zombies:
            if z.gone and z.peer == name and pool is not None:
                release_quietly(z.handle, name, self._plog)
                pool.give(z.stage)
            else:
                kept.append(z)
        self.zombies = kept

    def blocks(self) -> tuple[int, int, int]:
        """Staging blocks: (all, free, held by READs given up on)."""
        pool = self.pool
        if pool is None:
            return 0, 0, 0
        return pool.size, pool.free, sum(int(z.stage.size) for z in self.zombies)

    # -- close ---------------------------------------------------------------

    def close_reads(self) -> None:
        """Release every zombie, before the agents are dropped. UCX may
        still write into the staging of those still running until their
        agent is gone, and when that is cannot be known: it is kept for the
        life of the process (at most the pool). Those failed with their
        peer's endpoint cannot: their agents are dropped before the
        staging is freed."""
        if self.mem is not None and any(not z.gone for z in self.zombies):
            _KEPT_STAGING.append(self.mem.buffer)
        for z in self.zombies:
            release_quietly(z.handle, z.peer, self._plog)
        self.zombies.clear()
        self._reads.clear()

    def close_memory(self) -> None:
        """Release the staging's list and registration (after every READ
        into it was released)."""
        self.copy_threads.close()  # no copy reads the staging past this
        try:
            if self._prepped is not None:
                release_quietly(self._prepped, None, self._plog)
                self._prepped = None
            if self._descs is not None:
                try:
                    self._lists.agent.deregister_memory(self._descs)
                except Exception:
                    logger.warning("deregistering NIXL memory failed", exc_info=True)
                self._descs = None
        finally:
            self.mem = None
            self._region = None
