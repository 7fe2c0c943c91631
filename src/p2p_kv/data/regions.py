"""What a region is, on the wire and here: pure, importable without NIXL.

:class:`RegionInfo` is what a peer needs to move blocks into and out of our
region, sent in the handshake; :func:`describe_region` reduces whatever
object a region came as to the span NIXL registers; :func:`build_descs`
does the address arithmetic of a transfer's descriptors. A peer's region
is checked twice before NIXL sees it: its geometry against ours
(:func:`check_geometry`) and its NIXL metadata, byte by byte
(:func:`check_peer_metadata`), since NIXL trusts what it loads.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, Protocol, TypeAlias, runtime_checkable

import msgspec
import numpy as np
import numpy.typing as npt

from p2p_kv.data.offer import CudaIpcRegion, ShmRegion, Source

__all__ = [
    "MAX_PEER_BACKENDS",
    "MEM_DRAM",
    "MEM_KINDS",
    "MEM_VRAM",
    "Peer",
    "Region",
    "RegionInfo",
    "RegionSpan",
    "TensorLike",
    "build_descs",
    "check_geometry",
    "check_peer_metadata",
    "describe_region",
    "shown",
]

MEM_DRAM: Final = "DRAM"
MEM_VRAM: Final = "VRAM"
MEM_KINDS: Final = (MEM_DRAM, MEM_VRAM)

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
    #: (``p2p_kv.data.shm_copy``); None when there is none or it is turned off.
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


def shown(text: str | bytes, most: int = 80) -> str:
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
        raise ValueError(f"peer metadata names agent {shown(raw)}: not UTF-8") from None
    if name != info.agent_name:
        raise ValueError(
            f"peer metadata names agent {shown(name)}, "
            f"but RegionInfo says {shown(info.agent_name)}"
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
            f"(it runs {sorted(shown(c) for c in conns)})"
        )
    if f.take(b"") != b"MemSection":
        raise ValueError("peer metadata lacks its memory section")
    nixl_mem = _NIXL_MEM_TYPES.get(info.mem_kind)
    if nixl_mem is None:
        raise ValueError(f"peer memory kind {shown(info.mem_kind)} is not DRAM or VRAM")
    mem_type = struct.pack("=i", nixl_mem)
    want = (info.base_addr, info.region_bytes, info.device_id)
    sections: set[bytes] = set()
    for _ in range(f.count(b"nixlSecElms")):
        backend = f.take(b"bknd")
        if backend not in conns or backend in sections:
            raise ValueError(
                f"peer metadata has a memory section for backend {shown(backend)}"
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


def check_geometry(info: RegionInfo, ours: str, block_bytes: int) -> None:
    """Refuse (ValueError) a peer's region that cannot be ours to move
    blocks with: our own agent ``ours``, another block size, or a span
    that is empty or leaves the address space."""
    if info.agent_name == ours:
        raise ValueError("cannot add ourselves as a peer")
    if not info.agent_name:
        raise ValueError("peer RegionInfo has an empty agent name")
    if info.mem_kind not in MEM_KINDS:
        raise ValueError(f"peer memory kind {info.mem_kind!r} is not DRAM or VRAM")
    if info.block_bytes != block_bytes:
        raise ValueError(
            f"peer block size {info.block_bytes} differs from ours "
            f"({block_bytes}): blocks would not line up"
        )
    if info.num_blocks <= 0:
        raise ValueError(f"peer region has {info.num_blocks} blocks")
    if info.base_addr <= 0 or info.device_id < 0:
        raise ValueError("peer region has a bad address or device id")
    if info.base_addr + info.region_bytes > 1 << 64:
        raise ValueError("peer region ends past the 64-bit address space")
    if not info.agent_metadata:
        raise ValueError("peer RegionInfo carries no NIXL metadata")


@dataclass(eq=False)
class Peer:
    """What a transport holds of one peer."""

    info: RegionInfo
    #: Prepared per-block list of the peer's region (made at first use).
    prepped: Any = None
    prep_failed: bool = False
    #: The peer's region opened here: its READs are our copies.
    mapping: Source | None = None
    map_tried: bool = False
