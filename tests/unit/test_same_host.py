"""Same-host READs without NIXL: finding a region's shared file, mapping a
peer's, refusing the wrong one, copying runs."""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from p2p_kv.data import plan_write
from p2p_kv.same_host import (
    PARALLEL_MIN_BYTES,
    HostCopier,
    PeerMapping,
    ShmRegion,
    boot_id,
    find_backing,
    holds_listener,
    split_segments,
)
from p2p_kv.standalone import shared_region

BB = 4096


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A port this process listens on, as a peer's control socket does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_the_listener_proves_which_process_we_dialled(port: int) -> None:
    assert holds_listener(os.getpid(), port)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))  # bound, not listening
        assert not holds_listener(os.getpid(), other.getsockname()[1])
    assert not holds_listener(2**22 + 1, port)  # no such process


def test_shared_region_is_found_with_an_open_fd() -> None:
    region = shared_region(64 * BB)
    found = find_backing(_addr(region) + 8 * BB, 16 * BB)
    assert found is not None
    assert found.pid == os.getpid() and found.boot_id == boot_id()
    assert found.offset == 8 * BB and found.length == 16 * BB
    st = os.stat(f"/proc/self/fd/{found.fd}")
    assert (st.st_dev, st.st_ino) == (found.dev, found.ino)


def test_anonymous_or_private_memory_has_no_backing() -> None:
    assert find_backing(_addr(np.zeros(64 * BB, dtype=np.uint8)), 64 * BB) is None
    fd = os.memfd_create("private")
    try:
        os.ftruncate(fd, 4 * BB)
        private = mmap.mmap(fd, 4 * BB, flags=mmap.MAP_PRIVATE)
        view = np.frombuffer(private, dtype=np.uint8)
        assert find_backing(_addr(view), 4 * BB) is None
        del view
        private.close()
    finally:
        os.close(fd)


def test_region_running_past_its_mapping_has_no_backing() -> None:
    region = shared_region(4 * BB)
    assert find_backing(_addr(region), 5 * BB) is None


def test_peer_mapping_reads_the_owners_bytes_read_only(port: int) -> None:
    region = shared_region(32 * BB)
    region[:] = np.arange(region.size, dtype=np.uint64).astype(np.uint8)
    info = find_backing(_addr(region) + 3 * BB, 20 * BB)
    assert info is not None
    peer = PeerMapping(info, port)
    try:
        assert np.array_equal(peer.view, region[3 * BB : 23 * BB])
        with pytest.raises((TypeError, ValueError)):
            peer.view[0] = 1  # a read-only map: we cannot write the owner's memory
        region[3 * BB] ^= 0xFF  # shared: the owner's later writes show
        assert peer.view[0] == region[3 * BB]
    finally:
        peer.close()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"boot_id": "another-boot"}, "another host"),
        ({"ino": 1}, "not the peer's region"),
        ({"length": 1 << 40}, "region ends at"),
        ({"offset": -1}, "bad region span"),
        ({"pid": 1}, "not the peer we dialled"),
    ],
)
def test_a_wrong_description_is_refused_saying_why(
    change: dict[str, object], why: str, port: int
) -> None:
    region = shared_region(8 * BB)
    info = find_backing(_addr(region), 8 * BB)
    assert info is not None
    fields = {f: getattr(info, f) for f in ShmRegion.__struct_fields__}
    with pytest.raises(ValueError, match=why):
        PeerMapping(ShmRegion(**{**fields, **change}), port)  # type: ignore[arg-type]


def test_a_port_nobody_listens_on_is_refused(port: int) -> None:
    region = shared_region(8 * BB)
    info = find_backing(_addr(region), 8 * BB)
    assert info is not None
    with socket.socket() as idle:
        idle.bind(("127.0.0.1", 0))
        with pytest.raises(ValueError, match="not the peer we dialled"):
            PeerMapping(info, idle.getsockname()[1])


def test_a_closed_fd_is_an_os_error(port: int) -> None:
    region = shared_region(8 * BB)
    info = find_backing(_addr(region), 8 * BB)
    assert info is not None
    fields = {f: getattr(info, f) for f in ShmRegion.__struct_fields__}
    with pytest.raises(OSError):
        PeerMapping(ShmRegion(**{**fields, "fd": 2**20}), port)  # type: ignore[arg-type]


def test_host_copier_moves_exactly_the_mapped_runs(port: int) -> None:
    src = shared_region(16 * BB)
    src[:] = np.repeat(np.arange(16, dtype=np.uint8) + 1, BB)
    info = find_backing(_addr(src), src.size)
    assert info is not None
    dst = np.zeros(16 * BB, dtype=np.uint8)
    peer = PeerMapping(info, port)
    try:
        local, remote = [0, 1, 2, 9, 5], [7, 8, 9, 3, 15]
        HostCopier(_addr(dst), dst.size, BB).copy(
            peer, plan_write(local, remote, 16, 16).runs()
        )
        rows = dst.reshape(16, BB)
        for lb, rb in zip(local, remote, strict=True):
            assert (rows[lb] == rb + 1).all()
        untouched = set(range(16)) - set(local)
        assert all((rows[b] == 0).all() for b in untouched)
    finally:
        peer.close()


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_split_covers_every_byte_once_in_balanced_parts(parts: int) -> None:
    segments = [(0, 100, 10), (50, 0, 7), (200, 300, 1), (400, 10, 25)]
    chunks = split_segments(segments, parts)
    assert 1 <= len(chunks) <= parts
    flat = [(d + i, s + i) for chunk in chunks for d, s, n in chunk for i in range(n)]
    want = [(d + i, s + i) for d, s, n in segments for i in range(n)]
    assert flat == want
    sizes = [sum(n for _, _, n in chunk) for chunk in chunks]
    assert max(sizes) - min(sizes) <= -(-sum(sizes) // parts)


def test_threaded_copy_of_a_large_load_is_byte_exact(port: int) -> None:
    """Above PARALLEL_MIN_BYTES the runs are cut across threads: every
    destination block gets its source block, whole, and nothing else."""
    bb, n = 256 * 1024, 2 * PARALLEL_MIN_BYTES // (256 * 1024)
    src = shared_region(n * bb)
    src[:] = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8)
    info = find_backing(_addr(src), src.size)
    assert info is not None
    dst = np.zeros(2 * n * bb, dtype=np.uint8)
    peer = PeerMapping(info, port)
    copier = HostCopier(_addr(dst), dst.size, bb, threads=3)
    try:
        remote = list(range(n))[::-1]
        local = [2 * i for i in range(n)]
        copier.copy(peer, plan_write(local, remote, 2 * n, n).runs())
        assert copier._pool is not None  # the threads did take part
        rows, srows = dst.reshape(2 * n, bb), src.reshape(n, bb)
        for lb, rb in zip(local, remote, strict=True):
            assert np.array_equal(rows[lb], srows[rb])
        assert not rows[1::2].any()
    finally:
        copier.close()
        peer.close()
