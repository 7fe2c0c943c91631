"""What a same-host peer offers of its region, the proof that it is its to
offer, and what a copier reads once we opened it.

Two engines on one host may copy each other's blocks themselves instead of
going through NIXL: a host region lives in a shared file
(:class:`ShmRegion`, opened by :mod:`p2p_kv.data.shm_copy`), a GPU region
is exported with CUDA IPC (:class:`CudaIpcRegion`, opened by
:mod:`p2p_kv.data.cuda_ipc`). Both kinds of offer are proved the same way
(:func:`check_peer`) and both opened regions are a :class:`Source` to the
copiers, so neither module needs the other: they meet here.

Access control is the kernel's: opening ``/proc/<pid>/fd/<n>`` needs the
same ptrace-read permission over the producer that CMA already needs. And
a peer cannot make us its deputy: the pid it names must hold the far end
of our TCP connection to it, so it can only point us at its own memory
(else a peer could have us copy another process's memory into our cache
and then look those blocks up).
"""

from __future__ import annotations

from typing import Protocol, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from p2p_kv.data.plan import WritePlan
from p2p_kv.data.procfs import boot_id, holds_connection
from p2p_kv.data.transfer import Transfer

__all__ = [
    "Copier",
    "CudaIpcRegion",
    "Offer",
    "ShmRegion",
    "Source",
    "check_peer",
]


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


#: A peer's offer of its region, carried in its ``RegionInfo``.
Offer: TypeAlias = ShmRegion | CudaIpcRegion


def check_peer(info: Offer, conn_inode: str, proc: int | None) -> None:
    """Refuse a region offer unless its pid (``proc``, its
    :func:`~p2p_kv.data.procfs.process_dir`) is the peer at the far end of our
    connection ``conn_inode``, on this boot of this host."""
    if info.boot_id != boot_id():
        raise ValueError("peer is on another host (boot id differs)")
    if info.length <= 0 or info.offset < 0:
        raise ValueError(f"bad region span {info.offset}+{info.length}")
    if not holds_connection(proc, conn_inode):
        raise ValueError(
            f"pid {info.pid} does not hold the far end of our connection: "
            "not the peer we talk to (or in another network namespace)"
        )


class Source(Protocol):
    """A peer's region, proved and opened here: what a copier reads from.

    Opening proves the offer (:func:`check_peer`); :meth:`map` makes it
    addressable, and is left to the copier, which knows the device."""

    @property
    def info(self) -> Offer:
        """The offer it was opened from."""
        ...

    @property
    def addr(self) -> int:
        """Its first byte in our address space once mapped (0 before)."""
        ...

    @property
    def view(self) -> npt.NDArray[np.uint8]:
        """Its bytes as host memory once mapped; empty where they are not
        host memory (a GPU region)."""
        ...

    @property
    def on_gpu(self) -> bool:
        """Whether the region is GPU memory (opened through CUDA IPC)."""
        ...

    @property
    def copy_always(self) -> bool:
        """Whether our copy beats NIXL for every load from it, whatever its
        runs (otherwise only for many runs: see ``p2p_kv.data.local``)."""
        ...

    def map(self) -> None: ...

    def close(self) -> None:
        """After every copy from it has ended."""
        ...


class Copier(Protocol):
    """Copies a peer's blocks into our region from a :class:`Source`."""

    def register(self, src: Source) -> None:
        """Get ready to copy from ``src``; raise (OSError) if this copier
        cannot, and the peer's READs stay on NIXL."""
        ...

    def unregister(self, src: Source) -> None: ...

    def copy(self, src: Source, plan: WritePlan) -> Transfer | None:
        """The plan's runs (ours from ``src_starts``, theirs from
        ``dst_starts``): done when it returns (None), or a transfer in
        flight."""
        ...

    def close(self) -> None: ...
