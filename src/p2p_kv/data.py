"""NIXL data transport: moves KV blocks between peers, one-sided.

A READ from a peer on the same host whose region lives in a shared file is
a plain copy instead (``p2p_kv.same_host``), with the same contract. Any
other READ lands in staging first (``p2p_kv.staging``): NIXL cannot stop
one it has posted.

This module is deliberately thin. The sans-IO session decides *what* to move
(which of our blocks go into which of the peer's slots, and when); this file
only turns that decision into NIXL descriptor lists, posts them, and reports
completions and notifications back. It holds no protocol state.

Four things here exist because NIXL's defaults are wrong for us (see
``shared/notes/nixl.md``), and they are handled in code so that a user never
has to set an environment variable:

* No progress thread. NIXL's Python wrapper starts UCX's progress thread
  with a zero poll delay, which spins a whole core even when idle (and cuts
  throughput 2-4x on a small machine). We run without it: the initiator
  progresses UCX whenever it posts or checks a transfer
  (``post_write``/``poll_completions``) and the receiver whenever it drains
  notifications (``poll_notifs``). An idle transport costs no CPU at all.
* UCX error handling ``none`` instead of NIXL's ``peer``. Measured here on
  loopback (CMA data, TCP wire-up and notifications): with ``peer``, no
  WRITE completes at the initiator until the *receiver* next progresses UCX
  (a first transfer never completes if the receiver is not polling; later
  ones that carry a notification take as long as the receiver's poll
  interval: 5.6 ms for a 5 ms poll instead of 7-17 us), and a process that
  wrote to a peer that then died sometimes aborts at exit on a UCX
  assertion. With ``none`` a WRITE without a notification never needs the
  receiver, and once the receiver has polled at least once on a connection
  about 255 WRITEs with notifications complete before its unread
  notifications stall the next one; a dead peer is still reported (the post
  fails with ``NIXL_ERR_REMOTE_DISCONNECT``). ``none`` is also the only mode
  UCX accepts when ``UCX_TLS`` leaves only shared-memory transports
  (``sm,self``). ``peer`` stays available as an option.
* NIXL's Python logger prints INFO lines to *stdout*, which is where vLLM
  and our CLI print results. We raise it to WARNING unless the user asked
  for a level with ``NIXL_LOG_LEVEL``.
* Defaults that work on loopback with nothing set: we leave ``UCX_TLS``
  alone, so UCX moves data with CMA (``process_vm_writev``) and uses TCP on
  ``lo`` only for its own wire-up and notifications; that measured best on
  one host. A CMA write is done inside the post call, so ``post_write``
  returns only after the bytes have been copied.

Everything NIXL-specific is imported lazily inside :class:`NixlDataTransport`,
so ``import p2p_kv.data`` (the pure helpers and :class:`RegionInfo`) works
on machines without NIXL.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol, TypeAlias, runtime_checkable

import msgspec
import numpy as np
import numpy.typing as npt

from p2p_kv.plan import (
    Indices,
    WritePlan,
    as_int_list,
    check_mapping,
    plan_write,
)
from p2p_kv.ratelog import PeerLog
from p2p_kv.same_host import HostCopier, PeerMapping, ShmRegion, find_backing
from p2p_kv.same_host_cuda import (
    CopyInFlight,
    CudaCopier,
    CudaIpcMapping,
    CudaIpcRegion,
    export_cuda_region,
)
from p2p_kv.staging import DEFAULT_READ_STAGING_BYTES, StagingMemory, StagingPool

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

# Under vllm.p2p_kv: vLLM's logging setup shows it with the rest of the tier.
logger = logging.getLogger("vllm.p2p_kv.data")

MEM_DRAM: Final = "DRAM"
MEM_VRAM: Final = "VRAM"
_MEM_KINDS: Final = (MEM_DRAM, MEM_VRAM)

_UCX_ERROR_MODES: Final = ("none", "peer")
# "none": WRITEs complete without the receiver's help (see module docstring).
DEFAULT_UCX_ERROR_HANDLING_MODE: Final = "none"

# UCX transports that can carry active messages with peer-failure detection.
# When UCX_TLS names none of them, only "none" error handling can start.
_UCX_PEER_CAPABLE_TLS: Final = frozenset(
    {
        "all",
        "tcp",
        "ib",
        "rc",
        "rc_v",
        "rc_x",
        "rc_verbs",
        "rc_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
        "ud",
        "ud_v",
        "ud_x",
        "ud_verbs",
        "ud_mlx5",
        "srd",
    }
)

# How long, by default, a transfer given up on may take to reach a terminal
# state before it is released outright (cancel polls for it; remove_peer and
# close block on it). Loopback CMA writes finish inside the post call, so
# this only matters for a peer that stopped answering on a network
# transport.
DEFAULT_DRAIN_TIMEOUT_S: Final = 1.0


def drain_timeout_for(abort_ack_s: float) -> float:
    """The drain bound for a session whose abort-ack deadline is
    ``abort_ack_s``: a transfer given up on must be reported before the
    session's own timer for it runs out, or that timer takes the peer for
    unhealthy and ends the session (every load on it failed, with an
    ``abort_ack_timeout_s`` of 1 s or less)."""
    return min(DEFAULT_DRAIN_TIMEOUT_S, abort_ack_s / 2)


# --------------------------------------------------------------------------
# Wire description of a registered region
# --------------------------------------------------------------------------


class RegionInfo(msgspec.Struct, frozen=True):
    """What a peer needs to write into our region, sent in the handshake.

    Plain fields only, so it encodes with msgspec like every other control
    message (no pickle). ``base_addr`` is a raw address in the *owner's*
    address space: it is meaningful only to NIXL on the writing side,
    which pairs it with the memory keys carried in ``agent_metadata``.
    """

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_kind: str
    device_id: int
    #: The shared file behind a host region, for same-host peers to map
    #: (``p2p_kv.same_host``); None when there is none or it is turned off.
    shm: ShmRegion | None = None
    #: A GPU region's CUDA IPC export, for same-host GPU peers to open.
    cuda_ipc: CudaIpcRegion | None = None

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


# --------------------------------------------------------------------------
# Pure helpers (no NIXL): region description, coalescing, descriptors
# --------------------------------------------------------------------------


@runtime_checkable
class TensorLike(Protocol):
    """The slice of ``torch.Tensor`` we use, so tests need neither torch nor CUDA."""

    @property
    def device(self) -> Any: ...

    def data_ptr(self) -> int: ...

    def is_contiguous(self) -> bool: ...

    def numel(self) -> int: ...

    def element_size(self) -> int: ...


Region: TypeAlias = "memoryview | bytearray | mmap.mmap | npt.NDArray[Any] | TensorLike"


class RegionSpan(NamedTuple):
    """One registrable span of memory: what NIXL's registration wants."""

    addr: int
    nbytes: int
    mem_kind: str
    device_id: int


def describe_region(region: Region) -> RegionSpan:
    """Reduce a region object to (address, length, memory kind, device).

    One function decides DRAM vs VRAM so that registration and descriptor
    building share one code path for both, and so the decision is testable
    without CUDA (a fake tensor-like object is enough).

    Tensor-likes are recognised by duck typing (``data_ptr`` + ``device``)
    before the buffer protocol, because a CUDA tensor has no host buffer and
    a CPU tensor does not export one either. Everything else must export a
    C-contiguous buffer (memoryview of any shape, bytearray, mmap, numpy);
    a 2-D memoryview such as the one vLLM hands a tier is taken as raw bytes.
    """
    if isinstance(region, TensorLike) and not isinstance(region, np.ndarray):
        return _describe_tensor(region)
    try:
        view = memoryview(region)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(
            f"cannot register {type(region).__name__}: need a buffer "
            "(memoryview, bytearray, mmap, numpy array) or a torch tensor"
        ) from exc
    if not view.c_contiguous:
        raise ValueError("region must be C-contiguous: one span is registered")
    if view.nbytes == 0:
        raise ValueError("region is empty")
    # np.frombuffer takes read-only and multi-dimensional buffers alike and
    # gives the address without copying; ctypes.from_buffer would demand a
    # writable buffer.
    flat = np.frombuffer(view.cast("B") if view.ndim != 1 else view, dtype=np.uint8)
    return RegionSpan(int(flat.ctypes.data), int(view.nbytes), MEM_DRAM, 0)


def _describe_tensor(tensor: TensorLike) -> RegionSpan:
    if not tensor.is_contiguous():
        raise ValueError("tensor region must be contiguous: one span is registered")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if nbytes == 0:
        raise ValueError("region is empty")
    device = tensor.device
    dev_type = str(getattr(device, "type", device))
    if dev_type == "cpu":
        # NIXL's own tensor path uses device id 0 for host memory.
        return RegionSpan(int(tensor.data_ptr()), nbytes, MEM_DRAM, 0)
    if dev_type == "cuda":
        index = getattr(device, "index", None)
        if index is None:
            raise ValueError("CUDA tensor without a device index")
        return RegionSpan(int(tensor.data_ptr()), nbytes, MEM_VRAM, int(index))
    raise ValueError(f"unsupported tensor device type {dev_type!r} (cpu or cuda)")


def build_descs(
    base_addr: int,
    block_bytes: int,
    device_id: int,
    starts: list[int] | npt.NDArray[np.int64],
    counts: list[int] | npt.NDArray[np.int64],
) -> list[tuple[int, int, int]] | npt.NDArray[np.uint64]:
    """(address, length, device) per run: NIXL's transfer descriptor form.

    Python lists give a list of tuples, numpy arrays an ``N x 3`` uint64
    array; NIXL takes both, and each is the fast form at its size. Kept
    apart from the class so the address arithmetic (which, if wrong, would
    silently overwrite someone else's slot) is tested without NIXL.
    """
    if isinstance(starts, list) and isinstance(counts, list):
        return [
            (base_addr + s * block_bytes, c * block_bytes, device_id)
            for s, c in zip(starts, counts, strict=True)
        ]
    st = np.asarray(starts, dtype=np.uint64)
    ct = np.asarray(counts, dtype=np.uint64)
    out = np.empty((st.size, 3), dtype=np.uint64)
    bb = np.uint64(block_bytes)
    out[:, 0] = np.uint64(base_addr) + st * bb
    out[:, 1] = ct * bb
    out[:, 2] = np.uint64(device_id)
    return out


def ucx_tls_allows_peer_mode(ucx_tls: str | None) -> bool:
    """Whether UCX can start a worker in ``peer`` mode under ``UCX_TLS``.

    ``peer`` mode needs an active-message transport with a peer-failure
    handler; shared-memory transports (``sm``, ``self``, ``cma``, ``posix``,
    ``sysv``) have none, so ``UCX_TLS=sm,self`` makes UCX refuse the worker
    with an error that names nothing we can act on.
    """
    if not ucx_tls:
        return True
    names = [t.strip().lower() for t in ucx_tls.split(",") if t.strip()]
    if not names or names[0].startswith("^"):
        # "^x,y" excludes transports from the default set, which keeps tcp.
        return True
    for name in names:
        base = name.split(":", 1)[0]
        if base in _UCX_PEER_CAPABLE_TLS or base.startswith(("rc", "dc", "ud")):
            return True
    return False


def check_ucx_error_handling_mode(mode: str, ucx_tls: str | None) -> str:
    """Validate a requested UCX error-handling mode before UCX sees it.

    Raises a ValueError that says why, instead of NIXL's bare
    ``NIXL_ERR_BACKEND``, when ``peer`` cannot start under ``UCX_TLS``.
    """
    if mode not in _UCX_ERROR_MODES:
        raise ValueError(
            f"ucx_error_handling_mode must be one of {_UCX_ERROR_MODES}, got {mode!r}"
        )
    if mode == "peer" and not ucx_tls_allows_peer_mode(ucx_tls):
        raise ValueError(
            f"UCX cannot use error-handling mode 'peer' with UCX_TLS={ucx_tls!r}: "
            "shared-memory transports have no peer-failure handler; use 'none'"
        )
    return mode


# --------------------------------------------------------------------------
# A peer's NIXL metadata, checked before NIXL reads it
# --------------------------------------------------------------------------

# NIXL's serialization (``nixlSerDes``): an intro, then fields, each a tag,
# the value's length (a native size_t), the value and a ``|``.
_SERDES_INTRO: Final = b"nixlSerDes|"
_SIZE_T: Final = struct.Struct("=Q")
#: ``nixl_mem_t``, a native int, by our memory kind.
_NIXL_MEM_TYPES: Final = {MEM_DRAM: 0, MEM_VRAM: 1}
#: ``nixlBasicDesc``: address, length, device id (the rest of a
#: descriptor's value is the backend's key to the memory).
_BASIC_DESC: Final = struct.Struct("=QQQ")
#: Connections, and memory sections, one agent's metadata may list: one per
#: backend it runs.
MAX_PEER_BACKENDS: Final = 8


def _shown(text: str | bytes, most: int = 80) -> str:
    """A peer's string for an error message: quoted, cut to ``most``."""
    cut = text[:most]
    return repr(cut) + ("..." if len(text) > most else "")


class _Fields:
    """Reads a NIXL serialization's fields in order; any deviation raises
    ValueError."""

    def __init__(self, blob: bytes) -> None:
        if not blob.startswith(_SERDES_INTRO):
            raise ValueError("peer metadata is not NIXL agent metadata")
        self.blob = blob
        self.at = len(_SERDES_INTRO)

    def take(self, tag: bytes) -> bytes:
        blob, at = self.blob, self.at
        start = at + len(tag) + _SIZE_T.size
        if start > len(blob) or blob[at : at + len(tag)] != tag:
            raise ValueError(f"peer metadata lacks its {tag.decode()!r} field")
        (size,) = _SIZE_T.unpack_from(blob, at + len(tag))
        end = start + size
        if end >= len(blob) or blob[end] != ord("|"):
            raise ValueError(f"peer metadata's {tag.decode()!r} field is cut short")
        self.at = end + 1
        return blob[start:end]

    def count(self, tag: bytes) -> int:
        value = self.take(tag)
        if len(value) != _SIZE_T.size:
            raise ValueError(f"peer metadata's {tag.decode()!r} is no count")
        n: int = _SIZE_T.unpack(value)[0]
        if not 1 <= n <= MAX_PEER_BACKENDS:
            raise ValueError(f"peer metadata lists {n} {tag.decode()!r}")
        return n


def check_peer_metadata(info: RegionInfo, backends: Sequence[str]) -> None:
    """Refuse (ValueError) ``info.agent_metadata`` unless it is NIXL agent
    metadata of exactly the region ``info`` describes: agent
    ``info.agent_name``, connections for distinct backends, one of them
    ours, and per backend one section of ``info.mem_kind`` holding one
    descriptor, the region ``[base_addr, base_addr + region_bytes)`` on
    ``device_id`` with a key. Nothing may follow.

    Checked here because NIXL trusts what it loads and cleans up after
    itself only in part. Metadata it refuses while loading memory sections
    leaves that agent's UCX endpoint behind, out of reach of
    ``remove_remote_agent``, and the name taken for good (its real owner
    can never be loaded); metadata it refuses earlier leaves connections
    that only ``remove_remote_agent`` drops; a memory type it does not
    know crashes the process. What is left unchecked are the backends' own
    bytes (a UCX worker address, a memory key): only UCX reads them, and
    it does not check them either (one flipped bit in an address's header
    aborts the process), so only a peer that proved the shared secret can
    be trusted with them.

    The format is NIXL's (1.5): a NIXL that changes it has every peer
    refused here, which the integration tests show at once.
    """
    f = _Fields(info.agent_metadata)
    raw = f.take(b"Agent")
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        raise ValueError(
            f"peer metadata names agent {_shown(raw)}: not UTF-8"
        ) from None
    if name != info.agent_name:
        raise ValueError(
            f"peer metadata names agent {_shown(name)}, "
            f"but RegionInfo says {_shown(info.agent_name)}"
        )
    conns: set[bytes] = set()
    for _ in range(f.count(b"Conns")):
        backend = f.take(b"t")
        if not backend or not f.take(b"c") or backend in conns:
            raise ValueError("peer metadata has an empty or repeated connection")
        conns.add(backend)
    if not {b.encode() for b in backends} & conns:
        raise ValueError(
            f"peer runs none of our NIXL backends {sorted(backends)} "
            f"(it runs {sorted(_shown(c) for c in conns)})"
        )
    if f.take(b"") != b"MemSection":
        raise ValueError("peer metadata lacks its memory section")
    nixl_mem = _NIXL_MEM_TYPES.get(info.mem_kind)
    if nixl_mem is None:
        raise ValueError(
            f"peer memory kind {_shown(info.mem_kind)} is not DRAM or VRAM"
        )
    mem_type = struct.pack("=i", nixl_mem)
    want = (info.base_addr, info.region_bytes, info.device_id)
    sections: set[bytes] = set()
    for _ in range(f.count(b"nixlSecElms")):
        backend = f.take(b"bknd")
        if backend not in conns or backend in sections:
            raise ValueError(
                f"peer metadata has a memory section for backend {_shown(backend)}"
                " that it has no connection for, or has twice"
            )
        sections.add(backend)
        if f.take(b"nixlDList") != b"nixlSDList" or f.take(b"t") != mem_type:
            raise ValueError(f"peer metadata's region is not {info.mem_kind}")
        if f.count(b"n") != 1:
            raise ValueError("peer metadata registers more than one region")
        desc = f.take(b"")
        if len(desc) <= _BASIC_DESC.size or _BASIC_DESC.unpack_from(desc) != want:
            raise ValueError(
                "peer metadata's region is not the one its RegionInfo describes"
            )
    if f.at != len(info.agent_metadata):
        raise ValueError("peer metadata has bytes past its end")


# --------------------------------------------------------------------------
# The transport
# --------------------------------------------------------------------------


#: Regions of up to this many blocks (each side) get one prepared per-block
#: descriptor list, made once: a transfer then names blocks by index and
#: NIXL skips re-validating descriptors, which halves a one-block transfer's
#: cost (23 -> 11 us here). NIXL merges adjacent blocks itself. Larger
#: regions build coalesced descriptors per transfer instead.
PREP_MAX_BLOCKS: Final = 1 << 17


@dataclass
class _Peer:
    info: RegionInfo
    #: Prepared per-block list of the peer's region (made at first use).
    prepped: Any = None
    prep_failed: bool = False
    #: The peer's region mapped here: its READs are local copies.
    mapping: PeerMapping | CudaIpcMapping | None = None
    map_tried: bool = False


#: Blocks in another GPU's memory are copied here only when a load has this
#: many runs or more; fewer go through NIXL's cuda_ipc, which posts them
#: faster. On the lent H200 pair (GPU to GPU), 256 scattered runs: 241 GB/s
#: copied against 209 through NIXL (2 MiB blocks), 27.5 against 14.5 (64
#: KiB); 16 runs: 83 against 103, 4.2 against 6.1; one run: 315 against 345.
IPC_MIN_RUNS: Final = 64


def _may_copy(
    mapping: PeerMapping | CudaIpcMapping, local: Indices, remote: Indices
) -> bool:
    """Whether our own copy could beat NIXL for this load, known before
    planning it: from a host region always (NIXL's host-to-GPU path is a
    software copy, and CMA is slower than ``preadv``), and from a region on
    our own GPU (see :attr:`CudaIpcMapping.same_gpu`); from another GPU
    only for :data:`IPC_MIN_RUNS` blocks or more that are not one run on
    both sides (planning 256 blocks cost 100 us there, a third of a 16 MiB
    load, and one run is NIXL's fastest case). The plan's run count
    decides the rest (:func:`_copy_always`)."""
    if _copy_always(mapping):
        return True
    n = len(local)
    if n < IPC_MIN_RUNS or len(remote) != n:
        return False  # (a mismatch is refused, with its reason, below)
    if not local[-1] - local[0] == n - 1 == remote[-1] - remote[0]:
        return True
    # The ends say one run; a shuffled middle has the same ends (a few us
    # to be sure, against the plan's 100).
    return not (_consecutive(local) and _consecutive(remote))


def _consecutive(blocks: Indices) -> bool:
    first = int(blocks[0])
    return list(map(int, blocks)) == list(range(first, first + len(blocks)))


def _copy_always(mapping: PeerMapping | CudaIpcMapping) -> bool:
    """Whether every load from ``mapping`` is our copy, whatever its runs."""
    return isinstance(mapping, PeerMapping) or mapping.same_gpu


@dataclass
class _Xfer:
    handle: Any  # nixl_xfer_handle, CopyInFlight or _StagedRead
    peer: str
    #: Given up on (cancelled): released once it ends or at this time,
    #: whichever comes first (see NixlDataTransport.cancel).
    give_up_at: float | None = None


#: Staging bytes of transports closed while READs into them still ran
#: (see close).
_KEPT_STAGING: list[Any] = []


#: Pieces of one staged READ in flight at once: one is posted (and the one
#: before copied out) while another runs, instead of each waiting for the
#: last.
PIECES_IN_FLIGHT = 2

#: One peer's staged READs, running or given up on, hold at most this share
#: of the staging the other peers leave (pieces are this share over
#: :data:`PIECES_IN_FLIGHT`). A peer that stalls mid-READ, alive and
#: connected, keeps its READs' staging until it resumes or dies (UCX does
#: not end them); with no share, one such READ held all of it, and every
#: other peer's READs waited out their deadlines for as long as the stall
#: lasted. A share of the whole pool would let two stalled peers take it
#: all; of what is left, k stalled peers leave about 1/2**k of it to the
#: rest (one block at least each: 32 blocks last 6 stalled peers).
PEER_STAGING_SHARE = 0.5


@dataclass(eq=False)
class _Piece:
    """One piece of a staged READ: the peer's blocks for ``local[lo:lo +
    stage.size]``, landing in staging blocks ``stage``."""

    handle: Any
    stage: npt.NDArray[np.int64]
    lo: int
    state: str


@dataclass(eq=False)
class _StagedRead:
    """A READ landing in staging (``p2p_kv.staging``) in pieces, up to
    :data:`PIECES_IN_FLIGHT` at once; ``posted`` blocks of ``local`` have
    gone to pieces so far."""

    peer: _Peer
    local: npt.NDArray[np.int64]
    remote: npt.NDArray[np.int64]
    posted: int = 0
    pieces: list[_Piece] = field(default_factory=list)


@dataclass(eq=False)
class _Zombie:
    """A staged READ given up on while UCX still runs it: its staging blocks
    stay taken until UCX ends it (``lost``: until close, when its state can
    no longer be read)."""

    handle: Any
    stage: npt.NDArray[np.int64]
    peer: str
    lost: bool = False
    #: UCX failed it with the peer's endpoint (remote disconnect): its
    #: staging returns once the peer's agent is dropped, after which
    #: nothing of that peer's can land (see ``_drop_agent``).
    gone: bool = False


def _disconnected(exc: BaseException) -> bool:
    """NIXL's "the peer's endpoint is gone" (``nixlRemoteDisconnectError``):
    the transfer is over, failed, not in an unknown state."""
    return type(exc).__name__ == "nixlRemoteDisconnectError"


def _load_nixl() -> tuple[Any, Any, Any]:
    """Import NIXL on first use and quiet its stdout logger.

    Lazy so that the pure helpers import without NIXL. The logger level is
    lowered only when the user did not choose one with ``NIXL_LOG_LEVEL``.
    """
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl._bindings import nixlXferDList

    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger = logging.getLogger("nixl")
        if nixl_logger.level < logging.WARNING:
            nixl_logger.setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixlXferDList


class NixlDataTransport:
    """Registers one region once; WRITEs its blocks into peers' regions and
    READs peers' blocks into it.

    Not a thread: UCX progresses only inside our calls. The initiator learns
    of finished transfers from :meth:`poll_completions`; the receiver reads
    notifications with :meth:`poll_notifs` and must call it regularly (every
    engine step is plenty): with the default ``none`` error-handling mode
    WRITEs complete without the receiver, but only until about 255 of its
    notifications are unread; with ``peer`` every WRITE waits for it.
    Calls are serialised by an internal lock, so the owner may call from
    more than one thread (for example, post from a worker thread so the
    copy does not stall a scheduler step).

    Every transfer id returned by :meth:`post_write` or :meth:`post_read`
    is reported exactly once by :meth:`poll_completions`, whatever happens
    to it (success, NIXL error, :meth:`cancel`, :meth:`remove_peer`), so a
    caller that keys state by transfer id never leaks it. Only :meth:`close`
    drops pending reports.
    """

    def __init__(
        self,
        region: Region,
        block_bytes: int,
        *,
        name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        ucx_error_handling_mode: str = DEFAULT_UCX_ERROR_HANDLING_MODE,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        same_host: bool = True,
        read_staging_bytes: int = DEFAULT_READ_STAGING_BYTES,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        span = describe_region(region)
        if span.nbytes % block_bytes:
            raise ValueError(
                f"region of {span.nbytes} bytes is not a whole number of "
                f"{block_bytes}-byte blocks"
            )
        if not backends:
            raise ValueError("at least one NIXL backend is needed")
        self._backends = tuple(backends)
        # Keep the region object alive as long as NIXL may touch its memory.
        self._region_obj: Region | None = region
        self._span = span
        self._block_bytes = block_bytes
        self._num_blocks = span.nbytes // block_bytes
        # The uuid suffix keeps names unique across restarts: a peer that
        # still holds our previous incarnation's metadata must not mistake
        # the new agent for it.
        self._name = f"{name or 'p2p_kv'}-{uuid.uuid4().hex}"
        self._lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, _Xfer] = {}
        self._done: list[tuple[int, bool]] = []
        #: transfers reported failed that were still running when given up
        #: on: their bytes may yet land (see take_unstopped)
        self._unstopped: set[int] = set()
        #: agents whose data plane broke under their session (see
        #: take_faulted)
        self._faulted: set[str] = set()
        self._ids = itertools.count(1)
        self._closed = False
        #: Lines a peer's input or behaviour causes: one per kind per
        #: interval, whoever sends them (held under ``_lock``).
        self._plog = PeerLog(logger=logger)
        self._reg_descs: Any = None
        self._agent: Any = None
        self._local_prepped: Any = None
        self._drain_timeout_s = drain_timeout_s
        self._same_host = same_host
        self._shm: ShmRegion | None = None
        self._cuda_ipc: CudaIpcRegion | None = None
        if same_host and span.mem_kind == MEM_DRAM:
            try:
                self._shm = find_backing(span.addr, span.nbytes)
            except OSError as exc:
                logger.info("not offering same-host reads: %s", exc)
        elif same_host:
            try:
                self._cuda_ipc = export_cuda_region(
                    span.addr, span.nbytes, span.device_id
                )
            except OSError as exc:
                logger.info("not offering same-host GPU reads: %s", exc)
        self._copier: HostCopier | CudaCopier | None = None
        #: READs done as same-host copies (the rest went through NIXL)
        self.local_reads = 0
        if read_staging_bytes < 0:
            raise ValueError(f"read_staging_bytes is negative: {read_staging_bytes}")
        #: Staging is made at the first READ that needs it: an engine whose
        #: peers are all copied from on this host never holds it. (Made at
        #: start, its 64 MiB coincided with 16 s stalls of an idle `vllm
        #: serve` pair in about half of test_serve_metrics' runs: not
        #: explained, gone when made lazily.)
        #: No more than the region: one peer's READs use half of it at most,
        #: and an operator's ``read_staging_mib`` larger than the KV cache
        #: (a typo, GiB for MiB) failed every staged READ at its first
        #: allocation instead.
        self._stage_bytes = min(read_staging_bytes, span.nbytes)
        #: Staging that could not be made is tried again at each READ (the
        #: memory may free), but said once.
        self._stage_error = ""
        self._stage_mem: StagingMemory | None = None
        self._stage_pool: StagingPool | None = None
        self._stage_descs: Any = None
        self._stage_prepped: Any = None
        self._zombies: list[_Zombie] = []
        #: Peers removed while zombies of theirs run: their agent stays
        #: loaded (a zombie's state cannot be read once it is invalidated).
        self._retiring: dict[str, _Peer] = {}

        ucx_mode = check_ucx_error_handling_mode(
            ucx_error_handling_mode, os.environ.get("UCX_TLS")
        )
        # Descriptor lists are built with the binding's constructor directly:
        # the wrapper's type sniffing (get_xfer_descs) costs about 2 us per
        # list, a quarter of a one-block WRITE.
        nixl_agent, nixl_agent_config, xfer_dlist = _load_nixl()
        self._xfer_dlist: Any = xfer_dlist
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
        )
        self._agent = nixl_agent(self._name, config)
        try:
            for backend in backends:
                self._create_backend(backend, ucx_mode)
            self._reg_descs = self._agent.register_memory(
                [(span.addr, span.nbytes, span.device_id, "")], span.mem_kind
            )
            # Metadata must be taken after registration: it carries the keys
            # a peer needs to write into the region.
            self._metadata: bytes = bytes(self._agent.get_agent_metadata())
        except BaseException:
            self._agent = None
            raise

    def _setup_staging(self) -> None:
        """Staging beside the region, registered after the metadata was
        taken: only we address it, so peers get no key to it."""
        span = self._span
        mem = StagingMemory(
            max(1, self._stage_bytes // self._block_bytes),
            self._block_bytes,
            span.addr,
            span.nbytes,
            cuda_region=self._region_obj if span.mem_kind == MEM_VRAM else None,
        )
        self._stage_descs = self._agent.register_memory(
            [(mem.addr, mem.nbytes, mem.device_id, "")], span.mem_kind
        )
        self._stage_mem = mem
        self._stage_pool = StagingPool(mem.num_blocks)

    def _create_backend(self, backend: str, ucx_mode: str) -> None:
        params = {}
        if backend == "UCX":
            params["ucx_error_handling_mode"] = ucx_mode
        self._agent.create_backend(backend, params)

    # -- introspection ----------------------------------------------------

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def local_region(self) -> RegionInfo:
        return RegionInfo(
            agent_name=self._name,
            agent_metadata=self._metadata,
            base_addr=self._span.addr,
            num_blocks=self._num_blocks,
            block_bytes=self._block_bytes,
            mem_kind=self._span.mem_kind,
            device_id=self._span.device_id,
            shm=self._shm,
            cuda_ipc=self._cuda_ipc,
        )

    @property
    def same_host_peers(self) -> int:
        """Peers whose region we mapped (their READs skip NIXL)."""
        with self._lock:
            return sum(p.mapping is not None for p in self._peers.values())

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def in_flight(self) -> int:
        """Transfers posted whose completion has not been returned yet."""
        with self._lock:
            return len(self._inflight) + len(self._done)

    def given_up(self, transfer_id: int) -> bool:
        """Whether a transfer still running was given up on (:meth:`cancel`):
        its report is owed, but nobody waits for it."""
        with self._lock:
            xfer = self._inflight.get(transfer_id)
            return xfer is not None and xfer.give_up_at is not None

    def settling(self) -> bool:
        """READs given up on that UCX may still end (their staging, and a
        removed peer's agent, wait for it): :meth:`poll_completions` frees
        what ended, and must be called for them while nothing else is in
        flight. Not part of :meth:`in_flight`: they are no work of the
        engine's, which may sleep meanwhile."""
        with self._lock:
            return any(not (z.lost or z.gone) for z in self._zombies)

    # -- peers --------------------------------------------------------------

    def add_peer(self, info: RegionInfo, conn_inode: str | None = None) -> None:
        """Load a peer's NIXL metadata so we can write into its region.

        ``conn_inode``: the socket inode of our TCP connection to the peer
        (our outbound session). Only then may a same-host peer's region be
        opened for copies, once the pid it names proves to hold the far end.

        Idempotent per agent name: the same info again is a no-op (but for
        same-host copies, if now we have the connection). A different info
        under a known name is refused: the known one serves a live session,
        and only a peer passing off another's name would send it.

        Any ``info`` refused raises ValueError (a peer's input: its session
        ends, nothing else does), and leaves nothing of it loaded in NIXL.
        Its metadata is checked whole before NIXL reads it
        (:func:`check_peer_metadata`).
        """
        self._check_geometry(info)
        with self._lock:
            self._check_open()
            back = self._retiring.get(info.agent_name)
            if back is not None and back.info == info:
                # Removed while a READ of ours from it still ran (a stalled
                # peer that came back): its agent never left.
                del self._retiring[info.agent_name]
                self._peers[info.agent_name] = back
                back.map_tried = False
            known = self._peers.get(info.agent_name) or back
            if known is not None:
                if known.info == info:
                    self._maybe_map(known, conn_inode)
                    return
                raise ValueError(
                    f"agent {_shown(info.agent_name)} is known here with another "
                    "region: refusing the second"
                )
            check_peer_metadata(info, self._backends)
            self._load(info)
            peer = self._peers[info.agent_name] = _Peer(info)
            try:
                self._maybe_map(peer, conn_inode)
            except BaseException:
                # Nothing of a peer we do not keep stays loaded.
                del self._peers[info.agent_name]
                self._unmap(peer)
                self._invalidate(info.agent_name)
                raise
            if info.mem_kind != self._span.mem_kind and peer.mapping is None:
                self._plog.warning(
                    "mixed_memory",
                    info.agent_name,
                    "holds %s and we hold %s: UCX moves host<->GPU data "
                    "between processes through a slow software path",
                    info.mem_kind,
                    self._span.mem_kind,
                )

    def _load(self, info: RegionInfo) -> None:
        """Load a peer's checked metadata into NIXL; when it raises
        (ValueError), nothing of the metadata stays loaded."""
        name = info.agent_name
        try:
            loaded = self._agent.add_remote_agent(info.agent_metadata)
        except Exception as exc:
            # NIXL keeps the connections it made before failing, under the
            # name in the metadata (checked to be ``name``, unknown here).
            self._invalidate(name)
            raise ValueError(
                f"NIXL refused the metadata of agent {_shown(name)}: {exc}"
            ) from exc
        raw = loaded if isinstance(loaded, bytes) else str(loaded).encode()
        try:
            loaded_name = raw.decode()
        except UnicodeDecodeError:
            self._invalidate(raw)
            raise ValueError(
                f"NIXL loaded peer metadata as agent {_shown(raw)}: not UTF-8"
            ) from None
        if loaded_name == name:
            return
        # NIXL read another name than check_peer_metadata did (a format it
        # does not know): whatever that name held here is the sender's now.
        gone = self._retiring.pop(loaded_name, None)
        if gone is not None:
            # Its zombies' states are unreadable from now on.
            for z in self._zombies:
                z.lost = z.lost or z.peer == loaded_name
            self._drop_agent(loaded_name, gone)
        elif loaded_name in self._peers:
            # Its metadata may now be the sender's: fence the known peer's
            # transfers and drop it (its session's loads fail and
            # recompute) rather than trust it. Its session must end too: a
            # new one loads its agent again.
            self._remove_peer_locked(loaded_name)
            self._faulted.add(loaded_name)
        elif loaded_name != self._name:
            self._invalidate(loaded_name)
        raise ValueError(
            f"peer metadata names agent {_shown(loaded_name)}, "
            f"but RegionInfo says {_shown(name)}"
        )

    def prove_peer(self, agent_name: str, conn_inode: str) -> None:
        """Our connection to a known peer is now named (``conn_inode``):
        open its region for same-host copies if it offers one and the
        proof holds (once per peer)."""
        with self._lock:
            peer = self._peers.get(agent_name)
            if peer is not None:
                self._maybe_map(peer, conn_inode)

    def _maybe_map(self, peer: _Peer, conn: str | None) -> None:
        # GPU memory is copied only into GPU memory: a GPU-to-host copy
        # would block the engine's thread, where NIXL's READ does not.
        offer = peer.info.shm or (
            peer.info.cuda_ipc if self._span.mem_kind == MEM_VRAM else None
        )
        if not self._same_host or offer is None or conn is None or peer.map_tried:
            return
        peer.map_tried = True
        self._map(peer, offer, conn)

    def _map(self, peer: _Peer, offer: ShmRegion | CudaIpcRegion, conn: str) -> None:
        """Open a same-host peer's region for local copies; on any failure
        its READs stay on NIXL, which is always correct."""
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
            mapping = (
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
            if self._copier is None:
                span = self._span
                self._copier = (
                    HostCopier(span.addr, span.nbytes, self._block_bytes)
                    if span.mem_kind == MEM_DRAM
                    else CudaCopier(self._region_obj, self._block_bytes)
                )
            self._copier.register(mapping)
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

    def _unmap(self, peer: _Peer) -> None:
        """After every copy from the peer has ended."""
        if peer.mapping is not None:
            if self._copier is not None:
                self._copier.unregister(peer.mapping)
            peer.mapping.close()
            peer.mapping = None

    def _check_geometry(self, info: RegionInfo) -> None:
        if info.agent_name == self._name:
            raise ValueError("cannot add ourselves as a peer")
        if not info.agent_name:
            raise ValueError("peer RegionInfo has an empty agent name")
        if info.mem_kind not in _MEM_KINDS:
            raise ValueError(f"peer memory kind {info.mem_kind!r} is not DRAM or VRAM")
        if info.block_bytes != self._block_bytes:
            raise ValueError(
                f"peer block size {info.block_bytes} differs from ours "
                f"({self._block_bytes}): blocks would not line up"
            )
        if info.num_blocks <= 0:
            raise ValueError(f"peer region has {info.num_blocks} blocks")
        if info.base_addr <= 0 or info.device_id < 0:
            raise ValueError("peer region has a bad address or device id")
        if info.base_addr + info.region_bytes > 1 << 64:
            raise ValueError("peer region ends past the 64-bit address space")
        if not info.agent_metadata:
            raise ValueError("peer RegionInfo carries no NIXL metadata")

    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer; when this returns, no write of ours to it can land.

        In-flight transfers to the peer are drained (bounded wait) or
        cancelled, their handles released, and each is reported as failed
        unless it had already completed; then the peer's agent is
        invalidated, which also drops the UCX endpoints.

        Called by a consumer to drop a producer, it releases the producer's
        metadata and connection on our side. It cannot stop a *live*
        producer's one-sided writes into our memory (with CMA those need no
        cooperation from us); slots are safe to reuse once the producer is
        known dead or has acknowledged. A staged READ of ours still running
        is not stopped either: it keeps its staging, and the peer's agent
        stays loaded until UCX ends it (``p2p_kv.staging``).
        """
        with self._lock:
            if self._closed:
                return
            self._remove_peer_locked(agent_name)

    def _remove_peer_locked(self, agent_name: str) -> None:
        tids = [tid for tid, x in self._inflight.items() if x.peer == agent_name]
        self._give_up(tids, wait=True)
        peer = self._peers.pop(agent_name, None)
        if peer is not None:
            self._unmap(peer)
            if any(
                z.peer == agent_name and not (z.lost or z.gone) for z in self._zombies
            ):
                self._retiring[agent_name] = peer  # until its zombies end
            else:
                self._drop_agent(agent_name, peer)

    def _release_prepped(self, peer: _Peer) -> None:
        if peer.prepped is not None:
            self._release(peer.prepped, peer.info.agent_name)
            peer.prepped = None

    def _prepare(self, peer: _Peer) -> tuple[Any, Any] | None:
        """Both sides' prepared per-block lists, made once; None where the
        regions are too large or NIXL would not prepare them."""
        info = peer.info
        if peer.prep_failed or max(self._num_blocks, info.num_blocks) > PREP_MAX_BLOCKS:
            return None
        if peer.prepped is not None and self._local_prepped is not None:
            return self._local_prepped, peer.prepped
        agent = self._agent
        try:
            if self._local_prepped is None:
                self._local_prepped = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT",
                    self._block_list(
                        self._span.addr, self._num_blocks, self._span.device_id
                    ),
                    self._span.mem_kind,
                )
            peer.prepped = agent.prep_xfer_dlist(
                info.agent_name,
                self._block_list(info.base_addr, info.num_blocks, info.device_id),
                info.mem_kind,
            )
        except Exception as exc:
            if self._plog.warning(
                "prepare",
                info.agent_name,
                "preparing descriptors failed (%s); building them per transfer instead",
                exc,
            ):
                logger.debug("prepare failure detail", exc_info=True)
            peer.prep_failed = True
            return None
        return self._local_prepped, peer.prepped

    def _block_list(self, base: int, num_blocks: int, device: int) -> Any:
        starts = np.arange(num_blocks, dtype=np.int64)
        return build_descs(
            base, self._block_bytes, device, starts, np.ones_like(starts)
        )

    def _invalidate(self, agent_name: str | bytes) -> None:
        """Drop whatever NIXL holds under ``agent_name`` (bytes: a name that
        is not UTF-8); nothing held is no error."""
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:
            self._plog.warning(
                "invalidate", str(agent_name), "invalidating its agent failed: %s", exc
            )

    # -- transfers ----------------------------------------------------------

    def post_write(
        self,
        agent_name: str,
        src_blocks: Indices,
        dst_blocks: Indices,
        notif: bytes = b"",
    ) -> int:
        """WRITE our ``src_blocks[i]`` into the peer's ``dst_blocks[i]``.

        Raises only for caller mistakes (unknown peer, bad index, wrong
        notification type), before any NIXL call. A failure inside NIXL is
        not raised: it becomes a ``(tid, False)`` completion, so the caller
        has one failure path (a dead peer shows up this way). ``notif`` is
        delivered to the peer's :meth:`poll_notifs` after the data has
        landed.

        Over CMA (one host, DRAM) UCX copies the bytes inside this call, so
        it returns after about ``bytes / (4-10 GB/s)``: 0.1 s for 512 MiB.
        Callers on a latency-critical thread should post from another one.
        """
        return self._post("WRITE", agent_name, src_blocks, dst_blocks, notif)

    def post_read(
        self, agent_name: str, remote_blocks: Indices, local_blocks: Indices
    ) -> int:
        """READ the peer's ``remote_blocks[i]`` into our ``local_blocks[i]``.

        The consumer's side of a one-sided load: the peer's process does
        nothing, so the load costs no producer step and no round trip.
        Same contract as :meth:`post_write` (caller mistakes raise before
        any NIXL call; everything else is one completion), and the same
        fence: once its completion is reported nothing more lands locally.
        """
        return self._post("READ", agent_name, local_blocks, remote_blocks, b"")

    def _post(
        self,
        op: str,
        agent_name: str,
        local_blocks: Indices,
        remote_blocks: Indices,
        notif: bytes,
    ) -> int:
        if not isinstance(notif, bytes):
            raise TypeError("notif must be bytes")
        with self._lock:
            self._check_open()
            peer = self._peers.get(agent_name)
            if peer is None:
                raise KeyError(f"unknown peer {agent_name!r}: add_peer first")
            info = peer.info
            plan: WritePlan | None = None
            mapping = peer.mapping if op == "READ" else None
            if mapping is not None and _may_copy(mapping, local_blocks, remote_blocks):
                plan = plan_write(
                    local_blocks, remote_blocks, self._num_blocks, info.num_blocks
                )
                if _copy_always(mapping) or len(plan.counts) >= IPC_MIN_RUNS:
                    return self._copy(peer, plan)
            if op == "READ" and self._stage_bytes and mapping is None:
                return self._post_staged(peer, local_blocks, remote_blocks)
            # Every index is checked (range, duplicates) before any NIXL
            # call; prepared lists need no coalescing plan (NIXL merges),
            # but a plan made already is not made twice.
            prepped = self._prepare(peer) if plan is None else None
            if prepped is not None:
                local = as_int_list("src_blocks", local_blocks)
                remote = as_int_list("dst_blocks", remote_blocks)
                check_mapping(local, remote, self._num_blocks, info.num_blocks)
            elif plan is None:
                plan = plan_write(
                    local_blocks, remote_blocks, self._num_blocks, info.num_blocks
                )
            tid = next(self._ids)
            handle = None
            try:
                agent = self._agent
                if prepped is not None:
                    handle = agent.make_prepped_xfer(
                        op, prepped[0], local, prepped[1], remote, notif
                    )
                else:
                    assert plan is not None
                    handle = agent.initialize_xfer(
                        op,
                        self._descs(plan.src_starts, plan.counts, None),
                        self._descs(plan.dst_starts, plan.counts, info),
                        agent_name,
                        notif,
                    )
                state = agent.transfer(handle)
            except Exception as exc:
                # A dead or removed peer lands here: an expected event, so
                # one line, with the traceback only at debug level.
                if self._plog.warning(
                    "post",
                    agent_name,
                    "%s of %d blocks failed to post: %s",
                    op,
                    len(local_blocks),
                    exc,
                ):
                    logger.debug("post failure detail", exc_info=True)
                if handle is not None:
                    # Maybe posted in part: NIXL cancels the descriptors it
                    # posted when one fails, which does not stop them. A
                    # WRITE is reported unstopped (its consumer may not
                    # reuse the slots on our word), and the session ends.
                    self._release(handle, agent_name)
                    self._faulted.add(agent_name)
                    if op == "WRITE":
                        self._unstopped.add(tid)
                self._done.append((tid, False))
                return tid
            if state == "PROC":
                self._inflight[tid] = _Xfer(handle, agent_name)
            else:
                self._release(handle, agent_name)
                self._done.append((tid, state == "DONE"))
            return tid

    def _post_staged(
        self, peer: _Peer, local_blocks: Indices, remote_blocks: Indices
    ) -> int:
        """A READ through staging (``p2p_kv.staging``); same contract."""
        local = as_int_list("src_blocks", local_blocks)
        remote = as_int_list("dst_blocks", remote_blocks)
        check_mapping(local, remote, self._num_blocks, peer.info.num_blocks)
        tid = next(self._ids)
        if self._stage_pool is None:
            try:
                self._setup_staging()
            except Exception as exc:
                # No READ may land in place instead: this one fails (the
                # request recomputes) and the next tries again.
                if str(exc) != self._stage_error:
                    self._stage_error = str(exc)
                    logger.warning(
                        "cannot make %d bytes of read staging (staged READs "
                        "recompute until it can be made; lower "
                        "read_staging_mib, or 0 to READ in place): %s",
                        self._stage_bytes,
                        exc,
                    )
                self._done.append((tid, False))
                return tid
        read = _StagedRead(
            peer, np.asarray(local, dtype=np.int64), np.asarray(remote, np.int64)
        )
        state = self._state(read, peer.info.agent_name)
        if state == "PROC":
            self._inflight[tid] = _Xfer(read, peer.info.agent_name)
        else:
            self._bury(read)  # what a check that raised left running
            self._done.append((tid, state == "DONE"))
        return tid

    def _advance(self, read: _StagedRead, post: bool = True) -> str:
        """Copy out the pieces that landed and post the next ones: "PROC"
        while pieces run or wait for free staging, then "DONE" or "ERR"
        (the pieces still running are then buried). ``post`` False: a READ
        being given up on, whose next pieces must not start.

        A check that raises is raised: the piece's fate is then unknown,
        and the caller's release buries it (its staging is not reused)."""
        pool, mem = self._stage_pool, self._stage_mem
        assert pool is not None and mem is not None
        while True:
            for piece in list(read.pieces):
                if piece.state == "PROC":
                    piece.state = str(self._agent.check_xfer_state(piece.handle))
                    if piece.state == "PROC":
                        continue
                read.pieces.remove(piece)
                self._release(piece.handle, read.peer.info.agent_name)
                try:
                    if piece.state != "DONE":
                        self._bury(read)
                        return "ERR"
                    end = piece.lo + piece.stage.size
                    mem.copy_out(piece.stage, read.local[piece.lo : end])
                except Exception as exc:
                    if self._plog.warning(
                        "copy_out",
                        read.peer.info.agent_name,
                        "copying a READ out of staging failed: %s",
                        exc,
                    ):
                        logger.debug("copy-out failure detail", exc_info=True)
                    self._bury(read)
                    return "ERR"
                finally:
                    pool.give(piece.stage)
            left = int(read.local.size) - read.posted
            if not left:
                return "PROC" if read.pieces else "DONE"
            if not post or len(read.pieces) >= PIECES_IN_FLIGHT:
                return "PROC"
            mine = self._staging_held(read)
            # A share of what the other peers leave, not of the whole pool:
            # two stalled peers with half each took all of it.
            share = max(1, int((pool.free + mine) * PEER_STAGING_SHARE))
            most = max(1, share // PIECES_IN_FLIGHT)
            stage = pool.take(min(left, most, share - mine))
            if not stage.size:
                return "PROC"  # the peer's share or the pool is taken: wait
            lo, handle = read.posted, None
            try:
                handle = self._stage_xfer(
                    read.peer, stage, read.remote[lo : lo + stage.size]
                )
                state = str(self._agent.transfer(handle))
            except Exception as exc:
                if self._plog.warning(
                    "post",
                    read.peer.info.agent_name,
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
                    name = read.peer.info.agent_name
                    self._zombies.append(_Zombie(handle, stage, name, gone=True))
                    self._faulted.add(name)
                self._bury(read)
                return "ERR"
            read.pieces.append(_Piece(handle, stage, lo, state))
            read.posted += int(stage.size)

    def _staging_held(self, read: _StagedRead) -> int:
        """Staging blocks held by ``read``'s peer: its READs' pieces running
        (``read``'s included, posted before it is tracked) and given up on."""
        name = read.peer.info.agent_name
        # Only READs that may still run: the lost ones keep their blocks
        # until close and the gone ones until the peer's agent is dropped
        # (which a new session that takes the agent back defers), and
        # charged to the peer they stopped its staged READs for good.
        held = sum(
            int(z.stage.size)
            for z in self._zombies
            if z.peer == name and not (z.lost or z.gone)
        )
        reads = {id(x.handle): x.handle for x in self._inflight.values()}
        reads[id(read)] = read
        return held + sum(
            int(p.stage.size)
            for r in reads.values()
            if isinstance(r, _StagedRead) and r.peer is read.peer
            for p in r.pieces
        )

    def _stage_xfer(
        self, peer: _Peer, stage: npt.NDArray[np.int64], remote: npt.NDArray[np.int64]
    ) -> Any:
        """A READ of the peer's ``remote`` blocks into staging ``stage``."""
        mem = self._stage_mem
        assert mem is not None
        agent, info = self._agent, peer.info
        prepped = self._prepare(peer)
        if prepped is not None:
            if self._stage_prepped is None:
                self._stage_prepped = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT",
                    self._block_list(mem.addr, mem.num_blocks, mem.device_id),
                    self._span.mem_kind,
                )
            return agent.make_prepped_xfer(
                "READ",
                self._stage_prepped,
                stage.tolist(),
                prepped[1],
                remote.tolist(),
                b"",
            )
        plan = plan_write(stage, remote, mem.num_blocks, info.num_blocks)
        local = build_descs(
            mem.addr, self._block_bytes, mem.device_id, plan.src_starts, plan.counts
        )
        return agent.initialize_xfer(
            "READ",
            self._xfer_dlist(agent.nixl_mems[self._span.mem_kind], local),
            self._descs(plan.dst_starts, plan.counts, info),
            info.agent_name,
            b"",
        )

    def _bury(self, read: _StagedRead) -> None:
        """A staged READ given up on: its pieces in flight become zombies."""
        for piece in read.pieces:
            self._zombies.append(
                _Zombie(piece.handle, piece.stage, read.peer.info.agent_name)
            )
        read.pieces.clear()

    def _settle(self) -> None:
        """Free the staging of zombies UCX has ended, and drop the agents of
        removed peers that have none left."""
        pool = self._stage_pool
        assert pool is not None
        live: list[_Zombie] = []
        for z in self._zombies:
            if not (z.lost or z.gone):
                try:
                    state = str(self._agent.check_xfer_state(z.handle))
                except Exception as exc:
                    # Either way the peer's endpoint is no use to its
                    # session any more: it ends, and the agent is dropped.
                    self._faulted.add(z.peer)
                    if _disconnected(exc):
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
                    self._release(z.handle, z.peer)
                    pool.give(z.stage)
                    continue
            live.append(z)
        self._zombies = live
        busy = {z.peer for z in live if not (z.lost or z.gone)}
        for name in [n for n in self._retiring if n not in busy]:
            self._drop_agent(name, self._retiring.pop(name))

    def _drop_agent(self, name: str, peer: _Peer) -> None:
        self._release_prepped(peer)
        self._invalidate(name)
        # Nothing of that peer's can land now: READs UCX failed with its
        # endpoint give their staging back.
        pool, kept = self._stage_pool, []
        for z in self._zombies:
            if z.gone and z.peer == name and pool is not None:
                self._release(z.handle, name)
                pool.give(z.stage)
            else:
                kept.append(z)
        self._zombies = kept

    def staging_blocks(self) -> tuple[int, int, int]:
        """Staging blocks: (all, free, held by READs given up on)."""
        with self._lock:
            pool = self._stage_pool
            if pool is None:
                return 0, 0, 0
            return pool.size, pool.free, sum(int(z.stage.size) for z in self._zombies)

    def _copy(self, peer: _Peer, plan: WritePlan) -> int:
        """A READ as a same-host copy; the same contract as a NIXL one."""
        assert peer.mapping is not None and self._copier is not None
        tid = next(self._ids)
        self.local_reads += 1
        try:
            handle = self._copier.copy(peer.mapping, plan)
        except Exception as exc:
            self._plog.warning(
                "same_host_copy", peer.info.agent_name, "same-host copy failed: %s", exc
            )
            self._done.append((tid, False))
            return tid
        if handle is None:
            self._done.append((tid, True))
        else:
            self._inflight[tid] = _Xfer(handle, peer.info.agent_name)
        return tid

    def _descs(self, starts: Any, counts: Any, peer: RegionInfo | None) -> Any:
        """Coalesced descriptors of runs, ours (``peer`` None) or a peer's."""
        agent = self._agent
        if peer is None:
            base, device, kind = (
                self._span.addr,
                self._span.device_id,
                self._span.mem_kind,
            )
        else:
            base, device, kind = peer.base_addr, peer.device_id, peer.mem_kind
        descs = build_descs(base, self._block_bytes, device, starts, counts)
        return self._xfer_dlist(agent.nixl_mems[kind], descs)

    def poll_completions(self) -> list[tuple[int, bool]]:
        """``(transfer id, ok)`` for every transfer that ended since last call.

        Costs one status check per in-flight transfer (each check also
        progresses UCX); finished handles are released here.
        """
        with self._lock:
            if self._closed:
                return []
            out = self._done
            self._done = []
            if self._inflight:
                now = time.monotonic()
                finished: list[int] = []
                for tid, xfer in self._inflight.items():
                    ok = self._ended(tid, xfer, now)
                    if ok is not None:
                        out.append((tid, ok))
                        finished.append(tid)
                for tid in finished:
                    del self._inflight[tid]
            if self._zombies:
                self._settle()
            return out

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received, as ``(sender agent name, payload)``.

        Also the receiver's only source of UCX progress (there is no
        progress thread): notifications are read off the wire only here, and
        a sender's WRITEs stall once about 255 of them are unread (in
        ``peer`` error-handling mode, every WRITE waits for this call).
        """
        with self._lock:
            if self._closed:
                return []
            try:
                notifs: dict[Any, list[bytes]] = self._agent.get_new_notifs()
            except UnicodeDecodeError as exc:
                # A sender names itself, and anyone holding our metadata can
                # send: NIXL's binding fails the whole batch on a name that
                # is not UTF-8 (the batch is gone by then). No agent of ours
                # has such a name, and our caller must not fail for it.
                self._plog.warning(
                    "notif_name",
                    repr(exc.object[:80]),
                    "notifications from an agent whose name is not UTF-8 "
                    "were dropped, with any that came with them",
                )
                return []
            out: list[tuple[str, bytes]] = []
            for sender, msgs in notifs.items():
                name = sender.decode() if isinstance(sender, bytes) else str(sender)
                out.extend((name, bytes(m)) for m in msgs)
            return out

    def take_faulted(self) -> set[str]:
        """Agents whose data plane broke under their session (since the
        last call): a READ of theirs failed with the endpoint, or cannot be
        checked, or cancelled partly posted; or another peer's metadata
        took their name. The session must end: its READs would fail (or
        stall) for as long as it lived, and only a removed agent gives back
        the staging such READs hold. A new session loads the agent again."""
        with self._lock:
            out, self._faulted = self._faulted, set()
            return out

    def take_unstopped(self) -> set[int]:
        """Transfers reported failed (since the last call) that were still
        running when given up on. Releasing a NIXL handle does not stop its
        bytes: over TCP a WRITE to a peer that stalled lands once the peer
        progresses again (measured: all 64 blocks of a cancelled 4 MiB WRITE
        landed). A producer must not tell its consumer that such a WRITE
        is over; only the consumer dropping our agent fences it."""
        with self._lock:
            out, self._unstopped = self._unstopped, set()
            return out

    def cancel(self, *transfer_ids: int, wait: bool = False) -> None:
        """Give up on these transfers; no-op for one already finished.

        Each is still reported once by :meth:`poll_completions`: as ``ok``
        if it had in fact completed, as failed otherwise. A staged READ
        ends at once: it keeps its staging, not the caller's slots, until
        UCX ends it. Any other is reported when it ends, or failed and
        unstopped (:meth:`take_unstopped`) when the drain bound passes
        while it still runs; releasing it then does not stop it (over TCP
        it lands when a stalled peer resumes).

        The caller's thread does not wait for that unless ``wait`` (a
        fence before the caller reuses the slots at once): a WRITE to a
        stalled consumer, or an in-place READ from a stalled producer, held
        the engine's thread for the whole bound (1 s) when a request was
        aborted. Polling meanwhile keeps checking them, which also gives
        UCX the progress that lets most of them end.
        """
        with self._lock:
            self._give_up([t for t in transfer_ids if t in self._inflight], wait)

    def close(self) -> None:
        """Release every handle, peer and registration; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._agent is None:
                return
            try:
                self._give_up(list(self._inflight), wait=True)
                self._done.clear()
                running = [z for z in self._zombies if not z.gone]
                if running and self._stage_mem is not None:
                    # UCX may still write into their staging until the agent
                    # is gone, and we cannot know when that is: it is kept
                    # for the life of the process (at most the pool). Those
                    # failed with their peer's endpoint cannot: their agents
                    # are dropped below, before the staging is freed.
                    _KEPT_STAGING.append(self._stage_mem.buffer)
                for z in self._zombies:
                    self._release(z.handle, z.peer)
                self._zombies.clear()
                for name, peer in [*self._peers.items(), *self._retiring.items()]:
                    self._unmap(peer)
                    self._drop_agent(name, peer)
                self._peers.clear()
                self._retiring.clear()
                for prepped in (self._local_prepped, self._stage_prepped):
                    if prepped is not None:
                        self._release(prepped, None)
                self._local_prepped = self._stage_prepped = None
                if self._copier is not None:
                    self._copier.close()
                    self._copier = None
                for descs in (self._reg_descs, self._stage_descs):
                    if descs is None:
                        continue
                    try:
                        self._agent.deregister_memory(descs)
                    except Exception:
                        logger.warning(
                            "deregistering NIXL memory failed", exc_info=True
                        )
                self._reg_descs = self._stage_descs = None
            finally:
                self._agent = None
                self._region_obj = None
                self._stage_mem = None

    def __enter__(self) -> NixlDataTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("NixlDataTransport is closed")

    def _state(self, handle: Any, peer: str, post: bool = True) -> str:
        """A transfer with ``peer``: "PROC", "DONE" or "ERR"."""
        # Never raises: a caller holding completions it already took would
        # lose them (a CUDA error is sticky; the copy is then reported
        # failed, and its release waits on it as far as CUDA still can).
        try:
            if isinstance(handle, _StagedRead):
                return self._advance(handle, post)
            if isinstance(handle, CopyInFlight):
                return handle.state()
            return str(self._agent.check_xfer_state(handle))
        except Exception as exc:
            if self._plog.warning("check", peer, "checking a transfer failed: %s", exc):
                logger.debug("check failure detail", exc_info=True)
            return "ERR"

    def _release(self, handle: Any, peer: str | None) -> None:
        """Release a transfer's handle (``peer``: whose; None: our own)."""
        if isinstance(handle, _StagedRead):
            self._bury(handle)
            return
        try:
            handle.release()
        except Exception as exc:
            # The wrapper keeps a handle it could not release and retries at
            # agent teardown; nothing more we can do here.
            if peer is None:
                logger.warning("releasing a NIXL handle failed", exc_info=True)
            elif self._plog.warning(
                "release", peer, "releasing a NIXL transfer handle failed: %s", exc
            ):
                logger.debug("release failure detail", exc_info=True)

    def _ended(self, tid: int, xfer: _Xfer, now: float) -> bool | None:
        """Whether a tracked transfer succeeded, once it has ended (its
        handle then released); None while it runs.

        One given up on ends when UCX ends it, since a completed or failed
        request can no longer write, or at its drain bound: then its
        handle is released, which makes UCX cancel and free its requests
        but does not stop bytes already on their way (:meth:`take_unstopped`).
        """
        given_up = xfer.give_up_at is not None
        # Given up on: a staged READ's next pieces are not started (they
        # would only become zombies holding staging).
        state = self._state(xfer.handle, xfer.peer, post=not given_up)
        if state != "PROC" or (given_up and isinstance(xfer.handle, _StagedRead)):
            # A staged READ is not waited for: its staging, not the
            # engine's slots, holds what may still land.
            self._release(xfer.handle, xfer.peer)
            return state == "DONE"
        if xfer.give_up_at is None or now < xfer.give_up_at:
            return None
        self._plog.warning(
            "drain",
            xfer.peer,
            "transfer %d still running after %.1fs: cancelling",
            tid,
            self._drain_timeout_s,
        )
        self._release(xfer.handle, xfer.peer)
        self._unstopped.add(tid)
        return False

    def _give_up(self, tids: list[int], wait: bool) -> None:
        """Give tracked transfers up: each is reported (into ``_done``) once
        it has ended or met its drain bound (:meth:`_ended`). ``wait``: a
        fence, until then, with progress (which turns most cancellations
        on loopback into plain completions)."""
        now = time.monotonic()
        for tid in tids:
            xfer = self._inflight.get(tid)
            if xfer is not None and xfer.give_up_at is None:
                xfer.give_up_at = now + self._drain_timeout_s
        while True:
            now = time.monotonic()
            for tid in tids:
                xfer = self._inflight.get(tid)
                if xfer is not None and (ok := self._ended(tid, xfer, now)) is not None:
                    del self._inflight[tid]
                    self._done.append((tid, ok))
            if not wait or not any(t in self._inflight for t in tids):
                return
            time.sleep(0.0002)
