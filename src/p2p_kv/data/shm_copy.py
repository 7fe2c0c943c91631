"""Same-host READs: copy straight out of a peer's shared-memory region.

Two engines on one host reach each other's host memory through NIXL's UCX
backend with CMA (``process_vm_readv``): about 4.4 GB/s for large loads here
against 11.5 GB/s for a plain memcpy, and into GPU memory UCX falls back to
a software path at about 1% of a pinned ``cudaMemcpy`` (``shared/notes``).
But a vLLM engine's primary tier already lives in a shared file
(``SharedOffloadRegion`` maps ``/dev/shm/vllm_offload_*``), and a
:class:`~p2p_kv.runtime.standalone.StandalonePeer` puts its region in a memfd. So a
producer can tell a consumer on the same host *which open file* backs its
region, and the consumer opens it read-only and copies the blocks itself:
``preadv`` into host memory (in parallel for large loads), a DMA from
CUDA-registered pages into GPU memory.

A producer whose region is in GPU memory offers a CUDA IPC handle instead
(:mod:`p2p_kv.data.cuda_ipc`, with the copier into GPU memory). What a
peer offers, and the proof that it is its to offer, are
:mod:`p2p_kv.data.offer`'s.

Nothing about the protocol changes: these are the READ path's READs (the
producer pins, the consumer copies inside the pin window, then Releases),
done by a different mover. NIXL stays for everything else: other hosts, the
write path, GPU memory into host memory, and any peer whose region cannot
be opened (another pid or network namespace, a closed file, a changed
inode, an allocation CUDA cannot export).

The map is read-only, so a consumer cannot write into the producer's
memory. Host copies read the file with ``preadv``
rather than through a map, so a peer that shrinks its file fails our
load instead of killing us with SIGBUS.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import weakref
from bisect import bisect_left
from concurrent.futures import Future, ThreadPoolExecutor, wait
from itertools import accumulate
from operator import itemgetter
from typing import Final

import numpy as np
import numpy.typing as npt

from p2p_kv.data.offer import ShmRegion, Source, check_peer
from p2p_kv.data.plan import WritePlan
from p2p_kv.data.procfs import (
    boot_id,
    mapping_of,
    process_dir,
    process_uids,
    shm_devices,
)

__all__ = [
    "HostCopier",
    "PeerMapping",
    "find_backing",
    "host_buffer",
    "shared_region",
    "split_segments",
]

log = logging.getLogger("vllm.p2p_kv.same_host")


def find_backing(addr: int, nbytes: int) -> ShmRegion | None:
    """The shared file behind ``[addr, addr + nbytes)`` in this process and
    an fd of ours that holds it open, or None (anonymous or private memory,
    a region spanning mappings, no open fd): such a region is served by
    NIXL alone."""
    if nbytes <= 0 or not boot_id():
        return None
    found = mapping_of(addr)
    if found is None:
        return None
    start, end, perms, offset, dev, ino = found
    if ino == 0 or perms[3:4] != "s" or addr + nbytes > end:
        return None
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the listing's own fd
        if (st.st_dev, st.st_ino) == (dev, ino):
            return ShmRegion(
                boot_id(),
                os.getpid(),
                int(name),
                dev,
                ino,
                offset + addr - start,
                nbytes,
            )
    return None


def host_buffer(addr: int, nbytes: int) -> memoryview:
    """Writable bytes of our own host memory at ``addr``: whatever object
    the region came as (memoryview, numpy, CPU tensor)."""
    return memoryview((ctypes.c_uint8 * nbytes).from_address(addr)).cast("B")


class PeerMapping:
    """A peer's region, opened read-only through its owner's fd.

    Host copies read it with ``preadv`` on that fd, never through a map:
    should the peer shrink its file, a read comes up short and the load
    fails, where a load from a mapping would kill us with SIGBUS. A GPU
    consumer maps it (:meth:`map`) for CUDA to pin and DMA from; pinned
    pages stay valid even if the file shrinks. A :class:`Source`."""

    on_gpu: Final = False
    #: Our copy beats NIXL for every load from host memory: NIXL's
    #: host-to-GPU path is a software copy, and CMA is slower than
    #: ``preadv``.
    copy_always: Final = True

    def __init__(self, info: ShmRegion, conn_inode: str) -> None:
        """Open the region of the peer at the far end of our TCP
        connection ``conn_inode``, or raise ``ValueError``/``OSError``
        saying why not."""
        with process_dir(info.pid) as proc:
            check_peer(info, conn_inode, proc)
            # Its uids while it holds our connection: after it exits the
            # read fails, where a later process given its pid would answer.
            uids = process_uids(proc)
            # A handle on the file, not an open of it: whatever it names (a
            # FIFO with no writer blocked the open for good, a device would
            # be opened with our rights) is checked before it is opened.
            path = os.open(f"fd/{info.fd}", os.O_PATH | os.O_CLOEXEC, dir_fd=proc)
        fd = -1
        try:
            st = os.fstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("peer's region is not a regular file")
            if (st.st_dev, st.st_ino) != (info.dev, info.ino):
                raise ValueError(
                    f"/proc/{info.pid}/fd/{info.fd} is not the peer's region "
                    "(another pid namespace, or the pid or fd was reused)"
                )
            if st.st_dev not in shm_devices():
                raise ValueError("peer's region is not in shared memory (tmpfs)")
            if uids is None:
                raise ValueError(f"pid {info.pid} exited while proving itself")
            real, effective = uids
            if st.st_uid != real and (real, effective) != (0, 0):
                # We open its file with our own rights: a peer that holds a
                # file it may not read (an O_PATH fd to a root-only file)
                # must not get us, running as root, to read it for it. A
                # file of its own it could read itself; root reads anything.
                # Its real uid, not its effective one: a setuid-root
                # program that inherited the handle (su at its prompt)
                # runs as root for a user who is not.
                raise ValueError(
                    f"peer's region file belongs to uid {st.st_uid}, and the "
                    f"peer runs for uid {real}: not a file of its own"
                )
            if st.st_size < info.offset + info.length:
                raise ValueError(
                    f"peer's file holds {st.st_size} bytes, region ends at "
                    f"{info.offset + info.length}"
                )
            fd = os.open(
                f"/proc/self/fd/{path}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
            )
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        finally:
            os.close(path)
        self.info = info
        self.fd: int | None = fd
        self._mmap: mmap.mmap | None = None
        self.view: npt.NDArray[np.uint8] = np.empty(0, dtype=np.uint8)
        self.addr = 0

    def map(self) -> None:
        """Map the region read-only (for CUDA); ``view``/``addr`` then
        address it."""
        info = self.info
        if self._mmap is not None or self.fd is None:
            return
        lead = info.offset % mmap.ALLOCATIONGRANULARITY
        self._mmap = mmap.mmap(
            self.fd,
            info.length + lead,
            flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ,
            offset=info.offset - lead,
        )
        flat = np.frombuffer(self._mmap, dtype=np.uint8)
        self.view = flat[lead : lead + info.length]
        self.addr = int(self.view.ctypes.data)

    def close(self) -> None:
        """Unmap and close; callers first make sure no copy still reads."""
        if self._mmap is not None:
            self.view = np.empty(0, dtype=np.uint8)
            try:
                self._mmap.close()
            except BufferError:
                # A view escaped (a caller kept a slice): the mapping goes
                # when the last view does, still read-only and harmless.
                log.debug("peer mapping still referenced; left to the GC")
            self._mmap = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


#: Buffers one ``preadv`` may take (Linux's IOV_MAX).
_IOV_MAX = 1024

#: Copies this large are split across threads (``preadv`` drops the GIL).
#: Below it a thread hand-off costs more than it saves.
PARALLEL_MIN_BYTES = 8 << 20


def split_segments(
    segments: list[tuple[int, int, int]], parts: int
) -> list[list[tuple[int, int, int]]]:
    """Cut ``(dst offset, src offset, bytes)`` segments into at most
    ``parts`` lists of about equal bytes, splitting segments where needed;
    together they cover every byte exactly once. Only the segments a cut
    falls in are touched (a bisection per cut, list slices between): a loop
    over every segment cost 90 us at 256 of them, a third of a 16 MiB
    load's bookkeeping."""
    ends = list(accumulate(map(itemgetter(2), segments)))
    total = ends[-1] if ends else 0
    share = max(1, -(-total // max(1, parts)))
    out: list[list[tuple[int, int, int]]] = []
    i, taken = 0, 0  # the next part starts ``taken`` bytes into segment i
    for cut in range(share, total, share):
        j = bisect_left(ends, cut)  # the segment holding the cut's last byte
        upto = cut - (ends[j] - segments[j][2])  # its bytes before the cut
        d, s, n = segments[i]
        if j == i:
            part = [(d + taken, s + taken, upto - taken)]
        else:
            dj, sj, _ = segments[j]
            part = [(d + taken, s + taken, n - taken), *segments[i + 1 : j]]
            part.append((dj, sj, upto))
        out.append(part)
        i, taken = (j + 1, 0) if upto == segments[j][2] else (j, upto)
    if i < len(segments):
        d, s, n = segments[i]
        out.append([(d + taken, s + taken, n - taken), *segments[i + 1 :]])
    return out


class HostCopier:
    """Copies a peer's blocks into our host-memory region, synchronously:
    the load is done when :meth:`copy` returns, like a CMA READ is done
    when NIXL's post returns. Large loads are split across ``threads``
    (the calling one included): one thread does not saturate a server's
    memory bandwidth (11.5 GB/s against 47.6 with 32, ``shared/notes``)."""

    def __init__(
        self, addr: int, nbytes: int, block_bytes: int, threads: int = 0
    ) -> None:
        self._mv = host_buffer(addr, nbytes)
        self._bb = block_bytes
        if threads <= 0:
            threads = min(4, len(os.sched_getaffinity(0)))
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def register(self, src: Source) -> None:
        """Nothing to do for host memory; GPU memory is NIXL's to read."""
        if not isinstance(src, PeerMapping):
            raise OSError("a host region does not copy from a peer's GPU memory")

    def unregister(self, src: Source) -> None:
        """Nothing to do for host memory."""

    def copy(self, src: Source, plan: WritePlan) -> None:
        """The plan's runs (ours from ``src_starts``, theirs from
        ``dst_starts``); returns when done, or raises (the load fails) once
        no part of it still runs."""
        assert isinstance(src, PeerMapping)  # register refused anything else
        bb, base, runs = self._bb, src.info.offset, plan.runs()
        # In the peer's file order, so its side-by-side blocks read at once
        # (our slots are distinct: the order of the copies does not matter).
        segments = sorted(
            [(ls * bb, base + rs * bb, n * bb) for ls, rs, n in runs],
            key=itemgetter(1),
        )
        nbytes = bb * sum(map(itemgetter(2), runs))
        fd = src.fd
        if fd is None:
            raise OSError("peer region closed")
        if self._threads < 2 or nbytes < PARALLEL_MIN_BYTES:
            self._copy(fd, segments)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self._threads - 1, thread_name_prefix="p2p_kv-copy"
            )
        first, *rest = split_segments(segments, self._threads)
        futures: list[Future[None]] = []
        try:
            # Inside the try: a submit that fails (interpreter shutdown)
            # must still wait for the parts already running.
            futures.extend(self._pool.submit(self._copy, fd, part) for part in rest)
            self._copy(fd, first)
        finally:
            # Even on an error here: no thread may still write our slots
            # once the load is reported.
            wait(futures)
        for future in futures:
            future.result()

    def _copy(self, fd: int, segments: list[tuple[int, int, int]]) -> None:
        """One ``preadv`` per stretch of the peer's file (up to IOV_MAX
        destinations each): blocks the peer holds side by side cost one
        system call however scattered our slots are."""
        dst, count, i = self._mv, len(segments), 0
        while i < count:
            d, start, n = segments[i]
            bufs, end, j = [dst[d : d + n]], start + n, i + 1
            stop = min(count, i + _IOV_MAX)
            while j < stop:
                d, s, n = segments[j]
                if s != end:
                    break
                bufs.append(dst[d : d + n])
                end += n
                j += 1
            if os.preadv(fd, bufs, start) != end - start:
                self._copy_each(fd, segments[i:j])  # a short read: find out
            i = j

    def _copy_each(self, fd: int, segments: list[tuple[int, int, int]]) -> None:
        dst = self._mv
        for d, s, n in segments:
            while n:
                got = os.preadv(fd, [dst[d : d + n]], s)
                if got <= 0:
                    raise OSError(f"short read at offset {s}: the peer's file shrank")
                d, s, n = d + got, s + got, n - got

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def shared_region(nbytes: int) -> np.ndarray:
    """Zeroed bytes in a memfd, as vLLM keeps its primary tier in a shared
    file: a peer on this host can then read them without NIXL. The fd stays
    open for the life of the mapping (same-host peers open it through
    ``/proc``); both go when the array does."""
    fd = os.memfd_create("p2p_kv-region", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapped, os.close, fd)
    return np.frombuffer(mapped, dtype=np.uint8)
