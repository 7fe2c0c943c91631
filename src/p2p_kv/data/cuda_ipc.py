"""Same-host READs into GPU memory, and from a peer's GPU memory.

The CUDA half of :mod:`p2p_kv.data.shm_copy`. Into GPU memory, a peer's host
region (its shared file, mapped read-only) is registered with CUDA once and
each load is a DMA at the pinned host-to-device rate, where UCX's software
path reaches about 1% of it. A producer whose region is in GPU memory
offers a CUDA IPC handle instead, and a consumer whose region is in GPU
memory too opens it and copies GPU to GPU: a load of 256 scattered 2 MiB
blocks reaches 0.74x of one contiguous copy, where UCX's cuda_ipc (one
descriptor a block) reaches 0.55x (``docs/benchmarks.md``).

The copies call the CUDA runtime torch already loaded (found in
``/proc/self/maps``; never a second one) through ctypes: torch has no
batched copy, and an allocation opened through CUDA IPC is an address, not
a tensor. A CUDA IPC offer is proved exactly like a shared file
(:func:`~p2p_kv.data.offer.check_peer`), and the copier reads any
:class:`~p2p_kv.data.offer.Source`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from p2p_kv.data.offer import CudaIpcRegion, Source, check_peer
from p2p_kv.data.plan import WritePlan
from p2p_kv.data.procfs import boot_id, loaded_library, process_dir

__all__ = [
    "BATCH_MIN_RUNS",
    "BATCH_STREAMS",
    "CopyInFlight",
    "CudaCopier",
    "CudaIpcMapping",
    "batch_arity",
    "batch_slices",
    "export_cuda_region",
]


#: cudaHostRegisterReadOnly: the peer's pages are mapped read-only here.
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


class CopyInFlight:
    """An asynchronous copy into GPU memory: done when its event is. A
    :class:`~p2p_kv.data.transfer.Transfer`."""

    #: A copy given up on still writes the caller's slots: it is waited for.
    detaches: Final = False

    def __init__(self, event: Any) -> None:
        self._event: Any = event

    def state(self, post: bool = True) -> str:
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
    on the H200 host 256 scattered 64 KiB blocks move at 30.7 GB/s against
    14.3 with a call a run, 2 MiB ones at 54.6 against 51.9 (the contiguous
    limit)."""
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


#: ``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL``
_POINTER_DEVICE_ORDINAL = 9


def _driver_call(name: str) -> Any:
    """A CUDA driver function of the driver torch loaded, or OSError."""
    path = loaded_library("libcuda")
    if path is None:
        raise OSError("no CUDA driver loaded to call")
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError) as exc:
        raise OSError(f"no {name} in {path}") from exc


def _device_ordinal(addr: int) -> int:
    """The GPU (as this process numbers them) whose memory holds ``addr``."""
    ordinal = ctypes.c_int(-1)
    rc = _driver_call("cuPointerGetAttribute")(
        ctypes.byref(ordinal),
        ctypes.c_int(_POINTER_DEVICE_ORDINAL),
        ctypes.c_uint64(addr),
    )
    if rc:
        raise OSError(f"cuPointerGetAttribute failed: CUDA error {rc}")
    return ordinal.value


def _address_range(addr: int) -> tuple[int, int]:
    """``(base, size)`` of the CUDA allocation that holds ``addr`` (on the
    current device's context), or OSError if the driver cannot say."""
    address_range = _driver_call("cuMemGetAddressRange_v2")
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = address_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr))
    if rc:
        raise OSError(f"cuMemGetAddressRange failed: CUDA error {rc}")
    return base.value, size.value


def export_cuda_region(addr: int, nbytes: int, device: int) -> CudaIpcRegion:
    """Our GPU region as a CUDA IPC offer, or OSError saying why CUDA cannot
    export it (no runtime to call; memory from ``cuMemCreate``, as PyTorch's
    expandable segments make): such a region is read through NIXL."""
    import torch

    lib = _cudart()
    if lib is None:
        raise OSError("no CUDA runtime loaded to call")
    if not boot_id():
        raise OSError("no boot id: same-host peers cannot be told apart")
    handle = _IpcHandle()
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(torch.cuda.device(device))
        except RuntimeError as exc:  # no such GPU here: torch raises
            raise OSError(f"cannot use cuda:{device}: {exc}") from exc
        base, size = _address_range(addr)
        if addr + nbytes > base + size:
            raise OSError("the region spans allocations: one handle cannot cover it")
        rc = lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base))
        if rc:
            raise OSError(f"cudaIpcGetMemHandle failed: CUDA error {rc}")
    return CudaIpcRegion(boot_id(), os.getpid(), bytes(handle), addr - base, nbytes)


class CudaIpcMapping:
    """A same-host peer's GPU region, opened through its CUDA IPC handle.

    The proof is the host path's (the pid holds the far end of our
    connection), though a handle is not bound to a pid as an fd under
    ``/proc/<pid>`` is: a peer could pass on another engine's handle. That
    gains it nothing: holding the handle it can read that memory itself,
    and any peer can serve us wrong bytes for its keys anyway (what the
    hash-seed check and the shared secret are for). Opening waits for
    :meth:`map`, called by the copier on its device. A
    :class:`~p2p_kv.data.offer.Source`."""

    on_gpu: Final = True
    #: Never host memory.
    view: Final[npt.NDArray[np.uint8]] = np.empty(0, dtype=np.uint8)

    def __init__(self, info: CudaIpcRegion, conn_inode: str) -> None:
        with process_dir(info.pid) as proc:
            check_peer(info, conn_inode, proc)
        if len(info.handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {_IPC_HANDLE_BYTES} bytes")
        self.info = info
        self.addr = 0
        #: Whether the peer's memory is on the GPU we opened it on (two
        #: engines sharing one GPU): UCX's cuda_ipc READs between two
        #: processes on one GPU crawl (0.7 GB/s on an H200), so every load
        #: from such a peer is our copy, however few its runs.
        self.same_gpu = False
        self._base = 0
        self._lib = _cudart()
        if self._lib is None:
            raise OSError("no CUDA runtime loaded here to open the peer's memory")

    @property
    def copy_always(self) -> bool:
        """On our own GPU, yes (:attr:`same_gpu`); from another, only many
        runs beat NIXL's cuda_ipc."""
        return self.same_gpu

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
        try:
            # The handle opens one allocation, which the peer's offset and
            # length must stay inside: past its end lies whatever we
            # allocated next, and a copy from there would put our own
            # private memory into the KV cache we serve.
            base, size = _address_range(ptr.value)
            end = self.info.offset + self.info.length
            if base != ptr.value or end > size:
                raise ValueError(
                    f"the peer's region ends {end} bytes into the "
                    f"{size}-byte allocation its handle opens"
                )
        except BaseException:
            self._lib.cudaIpcCloseMemHandle(ptr)
            raise
        self._base = ptr.value
        self.addr = self._base + self.info.offset
        current = ctypes.c_int(-1)
        try:
            if self._lib.cudaGetDevice(ctypes.byref(current)) == 0:
                self.same_gpu = _device_ordinal(self._base) == current.value
        except OSError:
            pass  # unknown: the run-count rule alone decides, as across GPUs

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
        #: one event per side stream, recorded when its share of a batch is
        #: queued and waited for by the first stream; reused, since a wait
        #: takes the event's record as of the call (``wait_stream`` made a
        #: new event each time)
        self._joins = [
            torch.cuda.Event()  # type: ignore[no-untyped-call]
            for _ in self._streams[1:]
        ]
        #: recorded on the caller's current stream before a copy is queued
        #: and waited for by every side stream (reused, as the joins are)
        self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._bb = block_bytes
        #: id(host mapping) -> its pages as a tensor, for each host region
        #: registered with CUDA (and only those)
        self._src: dict[int, Any] = {}
        self._dst_addr = int(self._dst.data_ptr())
        lib = _cudart()
        self._memcpy = _memcpy_async(lib)
        self._batch = _memcpy_batch(lib)

    @property
    def mode(self) -> str:
        """How runs are queued: ``batch``, ``per_run`` or ``torch``."""
        return "batch" if self._batch else "per_run" if self._memcpy else "torch"

    def register(self, src: Source) -> None:
        torch = self._torch
        if src.on_gpu:
            if self.mode == "torch":
                raise OSError("torch's copies cannot read a peer's GPU memory")
            with torch.cuda.device(self._device):
                src.map()
            return
        cudart = torch.cuda.cudart()
        src.map()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only source: never written
            pages = torch.frombuffer(src.view, dtype=torch.uint8)
        with torch.cuda.device(self._device):
            rc = cudart.cudaHostRegister(
                src.addr, src.info.length, _CUDA_HOST_REGISTER_READ_ONLY
            )
        if rc != cudart.cudaError.success:
            raise OSError(f"cudaHostRegister of the peer's region failed: {rc}")
        self._src[id(src)] = pages

    def unregister(self, src: Source) -> None:
        if self._src.pop(id(src), None) is not None:
            self._torch.cuda.cudart().cudaHostUnregister(src.addr)

    def close(self) -> None:
        """Copies end by their events, which the transport has waited for."""

    def copy(self, src: Source, plan: WritePlan) -> CopyInFlight:
        """Queue the plan's runs and return at once. The CUDA calls name
        their streams, so only torch's own copies switch the current
        stream (a switch cost tens of microseconds ahead of the first
        copy)."""
        torch = self._torch
        main = self._streams[0]
        # Work already queued on the caller's stream may still write the
        # destination slots (a zeroing of blocks freed and given to this
        # load, a kernel of the step that used them): the copy goes after
        # it, as vLLM's own loads do, or it lands first and is overwritten.
        self._ready.record(torch.cuda.current_stream(self._device))
        for stream in self._streams:
            stream.wait_event(self._ready)
        try:
            if self._batch is None and self._memcpy is None:
                with torch.cuda.stream(main):
                    self._queue_torch(self._src[id(src)], plan.runs())
            elif torch.cuda.current_device() == self._device.index:
                self._queue_cudart(src.addr, plan)
            else:  # a caller on another device: the runtime wants ours
                with torch.cuda.device(self._device.index):
                    self._queue_cudart(src.addr, plan)
        except BaseException:
            # The caller fails the load and may reuse its slots at once:
            # nothing queued before the error may land after it.
            for stream in self._streams:
                stream.synchronize()
            raise
        event = torch.cuda.Event()
        event.record(main)
        return CopyInFlight(event)

    def _queue_cudart(self, src_addr: int, plan: WritePlan) -> None:
        if self._batch is not None and len(plan.counts) > 1:
            self._queue_batch(src_addr, plan)
        else:
            self._queue_direct(src_addr, plan.runs())

    def _queue_batch(self, src_addr: int, plan: WritePlan) -> None:
        """The runs in one call per stream, up to :data:`BATCH_STREAMS`
        streams of at least :data:`BATCH_MIN_RUNS` runs each, the first
        stream waiting for the others. The pointer arrays are read inside
        each call; the sources, in stream order (pinned)."""
        bb = np.uint64(self._bb)
        dsts = np.asarray(plan.src_starts, np.uint64) * bb + np.uint64(self._dst_addr)
        srcs = np.asarray(plan.dst_starts, np.uint64) * bb + np.uint64(src_addr)
        sizes = np.asarray(plan.counts, np.uint64) * bb
        attrs = _MemcpyAttributes(_SRC_ORDER_STREAM)
        first = ctypes.c_size_t(0)  # attrs[0] applies from copy 0 on
        fail = ctypes.c_size_t(0)
        extra = [ctypes.addressof(fail)] if len(self._batch.argtypes) == 9 else []
        main = self._streams[0]
        dst0, src0, size0 = (a.ctypes.data for a in (dsts, srcs, sizes))
        for i, (lo, hi) in enumerate(batch_slices(len(sizes), len(self._streams))):
            stream = self._streams[i]
            rc = self._batch(
                dst0 + 8 * lo,
                src0 + 8 * lo,
                size0 + 8 * lo,
                hi - lo,
                ctypes.addressof(attrs),
                ctypes.addressof(first),
                1,
                *extra,
                stream.cuda_stream,
            )
            if rc != 0:
                raise OSError(f"cudaMemcpyBatchAsync failed: CUDA error {rc}")
            if i:
                join = self._joins[i - 1]
                join.record(stream)
                main.wait_event(join)

    def _queue_direct(self, src_addr: int, runs: list[tuple[int, int, int]]) -> None:
        """One ``cudaMemcpyAsync`` per run on our side stream."""
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
