"""Same-host READs: copy straight out of a peer's shared-memory region.

Two engines on one host reach each other's host memory through NIXL's UCX
backend with CMA (``process_vm_readv``): about 4.4 GB/s for large loads here
against 11.5 GB/s for a plain memcpy, and into GPU memory UCX falls back to
a software path at about 1% of a pinned ``cudaMemcpy`` (``shared/notes``).
But a vLLM engine's primary tier already lives in a shared file
(``SharedOffloadRegion`` maps ``/dev/shm/vllm_offload_*``), and a
:class:`~p2p_kv.standalone.StandalonePeer` puts its region in a memfd. So a
producer can tell a consumer on the same host *which open file* backs its
region, and the consumer opens it read-only and copies the blocks itself:
``preadv`` into host memory (in parallel for large loads), a DMA from
CUDA-registered pages into GPU memory.

A producer whose region is in GPU memory offers a CUDA IPC handle instead,
and a consumer whose region is in GPU memory too opens it and copies GPU to
GPU with one batched copy a load: scattered blocks move at 0.84x of a
contiguous copy, where UCX's cuda_ipc (one descriptor a block) reached
0.55x (``docs/benchmarks.md``).

Nothing about the protocol changes: these are the READ path's READs (the
producer pins, the consumer copies inside the pin window, then Releases),
done by a different mover. NIXL stays for everything else: other hosts, the
write path, GPU memory into host memory, and any peer whose region cannot
be opened (another pid or network namespace, a closed file, a changed
inode, an allocation CUDA cannot export).

Access control is the kernel's: opening ``/proc/<pid>/fd/<n>`` needs the
same ptrace-read permission over the producer that CMA already needs. The
map is read-only, so a consumer cannot write into the producer's memory.
And a peer cannot make us its deputy: the pid it names must hold the far
end of our TCP connection to it, so it can only point us at its own files
(else a peer could have us copy another process's memory into our cache
and then look those blocks up). Host copies read the file with ``preadv``
rather than through a map, so a peer that shrinks its file fails our
load instead of killing us with SIGBUS.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from p2p_kv.plan import WritePlan
from p2p_kv.procfs import (
    boot_id,
    holds_connection,
    loaded_library,
    mapping_of,
    shm_devices,
)

__all__ = [
    "CopyInFlight",
    "CudaCopier",
    "CudaIpcMapping",
    "CudaIpcRegion",
    "HostCopier",
    "PeerMapping",
    "ShmRegion",
    "export_cuda_region",
    "find_backing",
    "host_buffer",
]

log = logging.getLogger("vllm.p2p_kv.same_host")


class ShmRegion(msgspec.Struct, frozen=True):
    """Where a region lives in its owner's open files: enough for a process
    on the same boot of the same host to map it, and to check it mapped
    the right file (``dev``/``ino``) before trusting a byte."""

    boot_id: str
    pid: int
    fd: int
    dev: int
    ino: int
    offset: int  # file offset of the region's first byte
    length: int


class CudaIpcRegion(msgspec.Struct, frozen=True):
    """A GPU region exported with CUDA IPC: a same-host peer opens the
    allocation behind ``handle`` and reads ``[offset, offset + length)`` of
    it with the copy engines, GPU to GPU over NVLink where there is one."""

    boot_id: str
    pid: int
    handle: bytes  # cudaIpcMemHandle_t
    offset: int  # the region's start in the allocation
    length: int


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


def _check_peer(info: ShmRegion | CudaIpcRegion, conn_inode: str) -> None:
    """Refuse a region offer unless its pid is the peer at the far end of
    our connection ``conn_inode``, on this boot of this host."""
    if info.boot_id != boot_id():
        raise ValueError("peer is on another host (boot id differs)")
    if info.length <= 0 or info.offset < 0:
        raise ValueError(f"bad region span {info.offset}+{info.length}")
    if not holds_connection(info.pid, conn_inode):
        raise ValueError(
            f"pid {info.pid} does not hold the far end of our connection: "
            "not the peer we talk to (or in another network namespace)"
        )


class PeerMapping:
    """A peer's region, opened read-only through its owner's fd.

    Host copies read it with ``preadv`` on that fd, never through a map:
    should the peer shrink its file, a read comes up short and the load
    fails, where a load from a mapping would kill us with SIGBUS. A GPU
    consumer maps it (:meth:`map`) for CUDA to pin and DMA from; pinned
    pages stay valid even if the file shrinks."""

    def __init__(self, info: ShmRegion, conn_inode: str) -> None:
        """Open the region of the peer at the far end of our TCP
        connection ``conn_inode``, or raise ``ValueError``/``OSError``
        saying why not."""
        _check_peer(info, conn_inode)
        fd = os.open(f"/proc/{info.pid}/fd/{info.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (info.dev, info.ino):
                raise ValueError(
                    f"/proc/{info.pid}/fd/{info.fd} is not the peer's region "
                    "(another pid namespace, or the pid or fd was reused)"
                )
            if st.st_dev not in shm_devices():
                raise ValueError("peer's region is not in shared memory (tmpfs)")
            if st.st_size < info.offset + info.length:
                raise ValueError(
                    f"peer's file holds {st.st_size} bytes, region ends at "
                    f"{info.offset + info.length}"
                )
        except BaseException:
            os.close(fd)
            raise
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
    together they cover every byte exactly once."""
    total = sum(n for _, _, n in segments)
    share = max(1, -(-total // max(1, parts)))
    out: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for d, s, n in segments:
        while n:
            take = min(n, room)
            out[-1].append((d, s, take))
            d, s, n, room = d + take, s + take, n - take, room - take
            if room == 0 and len(out) < parts:
                out.append([])
                room = share
    return [chunk for chunk in out if chunk]


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

    def register(self, src: PeerMapping | CudaIpcMapping) -> None:
        """Nothing to do for host memory; GPU memory is NIXL's to read."""
        if not isinstance(src, PeerMapping):
            raise OSError("a host region does not copy from a peer's GPU memory")

    def unregister(self, src: PeerMapping | CudaIpcMapping) -> None:
        """Nothing to do for host memory."""

    def copy(self, src: PeerMapping | CudaIpcMapping, plan: WritePlan) -> None:
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
        futures = [self._pool.submit(self._copy, fd, part) for part in rest]
        try:
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


#: cudaHostRegisterReadOnly: the peer's pages are mapped read-only here.
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


class CopyInFlight:
    """An asynchronous copy into GPU memory: done when its event is."""

    def __init__(self, event: Any) -> None:
        self._event: Any = event

    def state(self) -> str:
        return "DONE" if self._event is None or self._event.query() else "PROC"

    def release(self) -> None:
        """A DMA cannot be cancelled: wait for it, so nothing lands after."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


#: ``cudaMemcpyDefault``: the direction follows from the pointers (unified
#: addressing), host to GPU or GPU to GPU alike.
_DEFAULT = 4

#: ``cudaMemcpySrcAccessOrderStream``: a source is read when its copy runs
#: in stream order (our pins keep it valid until the event says done).
_SRC_ORDER_STREAM = 1

#: A large batch is split over this many streams, each of at least
#: :data:`BATCH_MIN_RUNS` runs: the GPU runs one stream's copies one after
#: another, several streams' side by side on its copy engines. 256
#: scattered runs GPU to GPU on the H200 host, against one contiguous copy:
#: 2 MiB blocks 0.91x on one stream, 0.95x on two, 0.98x on four (0.97x on
#: eight); 256 KiB 0.59x, 0.72x, 0.81x (0.71x on eight); 64 KiB 0.35-0.37x
#: however split. Host to GPU: 0.98x on one, 1.00x on four.
BATCH_STREAMS = 4
BATCH_MIN_RUNS = 32


def batch_slices(runs: int, streams: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of a batch's runs, one per stream used: as many
    streams as give each at least :data:`BATCH_MIN_RUNS` runs (one at
    least), sizes differing by one at most."""
    k = max(1, min(streams, runs // BATCH_MIN_RUNS))
    return [(i * runs // k, (i + 1) * runs // k) for i in range(k)]


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded, or None (never a second one)."""
    path = loaded_library("libcudart")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _memcpy_async(lib: ctypes.CDLL | None) -> Any:
    """``cudaMemcpyAsync``, or None. A direct call costs about 5 us a copy
    where torch's slice-and-copy costs 14-35."""
    fn = getattr(lib, "cudaMemcpyAsync", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    fn.restype = ctypes.c_int
    return fn


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes``; zeroed location hints mean none (they
    only matter for managed memory)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def batch_arity(runtime_version: int) -> int:
    """Arguments of ``cudaMemcpyBatchAsync`` in this runtime: 9 in CUDA
    12.8-12.9 (with ``failIdx``), 8 from 13.0, 0 where it does not exist."""
    if runtime_version >= 13000:
        return 8
    if runtime_version >= 12080:
        return 9
    return 0


def _memcpy_batch(lib: ctypes.CDLL | None) -> Any:
    """``cudaMemcpyBatchAsync`` typed for this runtime, or None: one call
    queues every run of a load (0.16 ms for 256 against 1.0 ms for 256
    ``cudaMemcpyAsync``), and the copy engine then runs them back to back:
    on the H200 host 256 scattered 64 KiB blocks went from 14.3 to 30.7
    GB/s, 2 MiB ones from 51.9 to 54.6 (the contiguous limit)."""
    fn = getattr(lib, "cudaMemcpyBatchAsync", None) if lib is not None else None
    get_version = getattr(lib, "cudaRuntimeGetVersion", None)
    if fn is None or get_version is None:
        return None
    version = ctypes.c_int(0)
    if get_version(ctypes.byref(version)) != 0:
        return None
    arity = batch_arity(version.value)
    if arity == 0:
        return None
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ctypes.c_size_t, ptr, ptr, ctypes.c_size_t]
    fn.argtypes += [ptr] * (arity - 7)  # (failIdx,) stream
    fn.restype = ctypes.c_int
    return fn


#: ``sizeof(cudaIpcMemHandle_t)``
_IPC_HANDLE_BYTES = 64

#: ``cudaIpcMemLazyEnablePeerAccess``
_IPC_LAZY_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    """Opaque bytes, NULs included: copy it whole (``bytes(handle)``,
    ``from_buffer_copy``); its ``reserved`` field would stop at a NUL."""

    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def export_cuda_region(addr: int, nbytes: int, device: int) -> CudaIpcRegion:
    """Our GPU region as a CUDA IPC offer, or OSError saying why CUDA cannot
    export it (no runtime to call; memory from ``cuMemCreate``, as PyTorch's
    expandable segments make): such a region is read through NIXL."""
    import torch

    lib = _cudart()
    path = loaded_library("libcuda")
    if lib is None or path is None:
        raise OSError("no CUDA runtime and driver loaded to call")
    if not boot_id():
        raise OSError("no boot id: same-host peers cannot be told apart")
    try:
        address_range = ctypes.CDLL(path).cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        raise OSError(f"no cuMemGetAddressRange_v2 in {path}") from exc
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    handle = _IpcHandle()
    with torch.cuda.device(device):
        rc = address_range(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)
        )
        if rc:
            raise OSError(f"cuMemGetAddressRange failed: CUDA error {rc}")
        if addr + nbytes > base.value + size.value:
            raise OSError("the region spans allocations: one handle cannot cover it")
        rc = lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base.value))
        if rc:
            raise OSError(f"cudaIpcGetMemHandle failed: CUDA error {rc}")
    return CudaIpcRegion(
        boot_id(), os.getpid(), bytes(handle), addr - base.value, nbytes
    )


class CudaIpcMapping:
    """A same-host peer's GPU region, opened through its CUDA IPC handle.

    The proof is the host path's (the pid holds the far end of our
    connection), though a handle is not bound to a pid as an fd under
    ``/proc/<pid>`` is: a peer could pass on another engine's handle. That
    gains it nothing: holding the handle it can read that memory itself,
    and any peer can serve us wrong bytes for its keys anyway (what the
    hash-seed check and the shared secret are for). Opening waits for
    :meth:`map`, called by the copier on its device."""

    def __init__(self, info: CudaIpcRegion, conn_inode: str) -> None:
        _check_peer(info, conn_inode)
        if len(info.handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {_IPC_HANDLE_BYTES} bytes")
        self.info = info
        self.addr = 0
        self._base = 0
        self._lib = _cudart()
        if self._lib is None:
            raise OSError("no CUDA runtime loaded here to open the peer's memory")

    def map(self) -> None:
        """Open the handle on the current device (peer access as needed)."""
        if self._base or self._lib is None:
            return
        ptr = ctypes.c_void_p(0)
        handle = _IpcHandle.from_buffer_copy(self.info.handle)
        rc = self._lib.cudaIpcOpenMemHandle(
            ctypes.byref(ptr), handle, ctypes.c_uint(_IPC_LAZY_PEER_ACCESS)
        )
        if rc != 0 or not ptr.value:
            raise OSError(f"cudaIpcOpenMemHandle failed: CUDA error {rc}")
        self._base = ptr.value
        self.addr = self._base + self.info.offset

    def close(self) -> None:
        """After every copy from it has ended."""
        if self._base and self._lib is not None:
            self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(self._base))
        self._base = self.addr = 0


class CudaCopier:
    """Copies a peer's blocks into our GPU region, from its GPU region
    (opened through CUDA IPC) or its mapped host region. A host region's
    pages are registered with CUDA once (page-locked, read-only), so each
    run is one DMA at the pinned host-to-device rate. Copies are queued on
    a side stream and finished by a CUDA event. Host registration that
    fails refuses the mapping (the peer stays on NIXL): a pageable copy
    would read through the map, which a shrinking file turns into SIGBUS;
    pinned pages outlive a truncation.

    How runs are queued (:attr:`mode`), best first: ``batch``, one
    ``cudaMemcpyBatchAsync`` for a whole load (CUDA 12.8 and later);
    ``per_run``, one ``cudaMemcpyAsync`` per run; ``torch``, torch's
    slice-and-copy, where no CUDA runtime is found to call (a torch linked
    statically against it)."""

    def __init__(self, region: Any, block_bytes: int) -> None:
        import torch

        self._torch: Any = torch
        self._dst = region.view(torch.uint8).reshape(-1)
        self._device = region.device
        self._streams = [
            torch.cuda.Stream(device=region.device)  # type: ignore[no-untyped-call]
            for _ in range(BATCH_STREAMS)
        ]
        self._bb = block_bytes
        self._src: dict[int, Any] = {}  # id(mapping) -> source tensor
        self._registered: set[int] = set()
        self._dst_addr = int(self._dst.data_ptr())
        lib = _cudart()
        self._memcpy = _memcpy_async(lib)
        self._batch = _memcpy_batch(lib)
        self.mode = "batch" if self._batch else "per_run" if self._memcpy else "torch"

    def register(self, src: PeerMapping | CudaIpcMapping) -> None:
        torch = self._torch
        if isinstance(src, CudaIpcMapping):
            if self.mode == "torch":
                raise OSError("torch's copies cannot read a peer's GPU memory")
            with torch.cuda.device(self._device):
                src.map()
            return
        cudart = torch.cuda.cudart()
        src.map()
        with torch.cuda.device(self._device):
            rc = cudart.cudaHostRegister(
                src.addr, src.info.length, _CUDA_HOST_REGISTER_READ_ONLY
            )
        if rc != cudart.cudaError.success:
            raise OSError(f"cudaHostRegister of the peer's region failed: {rc}")
        self._registered.add(id(src))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only source: never written
            self._src[id(src)] = torch.frombuffer(src.view, dtype=torch.uint8)

    def unregister(self, src: PeerMapping | CudaIpcMapping) -> None:
        self._src.pop(id(src), None)
        if id(src) in self._registered:
            self._registered.discard(id(src))
            self._torch.cuda.cudart().cudaHostUnregister(src.addr)

    def close(self) -> None:
        """Copies end by their events, which the transport has waited for."""

    def copy(self, src: PeerMapping | CudaIpcMapping, plan: WritePlan) -> CopyInFlight:
        torch = self._torch
        with torch.cuda.stream(self._streams[0]):
            try:
                if self._batch is not None and len(plan.counts) > 1:
                    self._queue_batch(src.addr, plan)
                elif self._memcpy is not None:
                    self._queue_direct(src.addr, plan.runs())
                else:
                    self._queue_torch(self._src[id(src)], plan.runs())
            except BaseException:
                # The caller fails the load and may reuse its slots at once:
                # nothing queued before the error may land after it.
                for stream in self._streams:
                    stream.synchronize()
                raise
            event = torch.cuda.Event()
            event.record(self._streams[0])
        return CopyInFlight(event)

    def _queue_batch(self, src_addr: int, plan: WritePlan) -> None:
        """The runs in one call per stream, up to :data:`BATCH_STREAMS`
        streams of at least :data:`BATCH_MIN_RUNS` runs each, the first
        stream waiting for the others. The pointer arrays are read inside
        each call; the sources, in stream order (pinned)."""
        bb = np.uint64(self._bb)
        dsts = np.uint64(self._dst_addr) + np.asarray(plan.src_starts, np.uint64) * bb
        srcs = np.uint64(src_addr) + np.asarray(plan.dst_starts, np.uint64) * bb
        sizes = np.asarray(plan.counts, np.uint64) * bb
        attrs = _MemcpyAttributes(_SRC_ORDER_STREAM)
        first = ctypes.c_size_t(0)  # attrs[0] applies from copy 0 on
        fail = ctypes.c_size_t(0)
        extra = [ctypes.addressof(fail)] if len(self._batch.argtypes) == 9 else []
        main = self._streams[0]
        slices = batch_slices(len(sizes), len(self._streams))
        for stream, (lo, hi) in zip(self._streams, slices, strict=False):
            rc = self._batch(
                dsts[lo:].ctypes.data,
                srcs[lo:].ctypes.data,
                sizes[lo:].ctypes.data,
                hi - lo,
                ctypes.addressof(attrs),
                ctypes.addressof(first),
                1,
                *extra,
                stream.cuda_stream,
            )
            if rc != 0:
                raise OSError(f"cudaMemcpyBatchAsync failed: CUDA error {rc}")
            if stream is not main:
                main.wait_stream(stream)

    def _queue_direct(self, src_addr: int, runs: list[tuple[int, int, int]]) -> None:
        """One ``cudaMemcpyAsync`` per run on our side stream (the current
        device is the region's, set by ``torch.cuda.stream``)."""
        memcpy, bb, dst = self._memcpy, self._bb, self._dst_addr
        stream = self._streams[0].cuda_stream
        for ls, rs, n in runs:
            rc = memcpy(dst + ls * bb, src_addr + rs * bb, n * bb, _DEFAULT, stream)
            if rc != 0:
                raise OSError(f"cudaMemcpyAsync failed: CUDA error {rc}")

    def _queue_torch(self, view: Any, runs: list[tuple[int, int, int]]) -> None:
        """torch's slice-and-copy, one per run, on our side stream."""
        bb, dst = self._bb, self._dst
        for ls, rs, n in runs:
            dst[ls * bb : (ls + n) * bb].copy_(
                view[rs * bb : (rs + n) * bb], non_blocking=True
            )
