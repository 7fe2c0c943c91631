"""Same-host READs without NIXL: finding a region's shared file, mapping a
peer's, refusing the wrong one, copying runs."""

from __future__ import annotations

import mmap
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_kv.data.offer import ShmRegion
from p2p_kv.data.plan import plan_write
from p2p_kv.data.procfs import boot_id, socket_inode
from p2p_kv.data.shm_copy import (
    PARALLEL_MIN_BYTES,
    HostCopier,
    PeerMapping,
    find_backing,
    split_segments,
)
from p2p_kv.runtime.standalone import shared_region

BB = 4096


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


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


def test_peer_mapping_reads_the_owners_bytes_read_only(conn: str) -> None:
    """The map a GPU consumer registers with CUDA (host copies read the fd)."""
    region = shared_region(32 * BB)
    region[:] = np.arange(region.size, dtype=np.uint64).astype(np.uint8)
    info = find_backing(_addr(region) + 3 * BB, 20 * BB)
    assert info is not None
    peer = PeerMapping(info, conn)
    try:
        assert peer.view.size == 0  # nothing mapped until asked
        peer.map()
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
        ({"pid": 1}, "not the peer we talk to"),
    ],
)
def test_a_wrong_description_is_refused_saying_why(
    change: dict[str, object], why: str, conn: str
) -> None:
    region = shared_region(8 * BB)
    info = find_backing(_addr(region), 8 * BB)
    assert info is not None
    fields = {f: getattr(info, f) for f in ShmRegion.__struct_fields__}
    with pytest.raises(ValueError, match=why):
        PeerMapping(ShmRegion(**{**fields, **change}), conn)  # type: ignore[arg-type]


def test_an_unconnected_socket_proves_nothing() -> None:
    region = shared_region(8 * BB)
    info = find_backing(_addr(region), 8 * BB)
    assert info is not None
    with socket.socket() as idle:
        idle.bind(("127.0.0.1", 0))
        inode = socket_inode(idle.fileno())
        assert inode is not None
        with pytest.raises(ValueError, match="not the peer we talk to"):
            PeerMapping(info, inode)


def test_a_closed_fd_is_an_os_error(conn: str) -> None:
    region = shared_region(8 * BB)
    info = find_backing(_addr(region), 8 * BB)
    assert info is not None
    fields = {f: getattr(info, f) for f in ShmRegion.__struct_fields__}
    with pytest.raises(OSError):
        PeerMapping(ShmRegion(**{**fields, "fd": 2**20}), conn)  # type: ignore[arg-type]


def _numbered(conn: str) -> tuple[PeerMapping, np.ndarray, np.ndarray]:
    """A peer's 16-block region whose block i holds byte i + 1 (kept alive
    by the caller), opened, and a zeroed destination."""
    src = shared_region(16 * BB)
    src[:] = np.repeat(np.arange(16, dtype=np.uint8) + 1, BB)
    info = find_backing(_addr(src), src.size)
    assert info is not None
    return PeerMapping(info, conn), src, np.zeros(16 * BB, dtype=np.uint8)


def test_host_copier_moves_exactly_the_mapped_runs(conn: str) -> None:
    peer, _src, dst = _numbered(conn)
    try:
        local, remote = [0, 1, 2, 9, 5], [7, 8, 9, 3, 15]
        HostCopier(_addr(dst), dst.size, BB).copy(
            peer, plan_write(local, remote, 16, 16)
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


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    parts=st.integers(1, 9),
)
def test_split_of_any_segments_covers_every_byte_once(
    sizes: list[int], parts: int
) -> None:
    # Cuts land inside segments, on their edges, and in runs of small ones.
    segments, d = [], 0
    for i, n in enumerate(sizes):
        segments.append((d, 1000 * i, n))
        d += n + 1
    chunks = split_segments(segments, parts)
    assert 1 <= len(chunks) <= parts
    assert all(n > 0 for chunk in chunks for _, _, n in chunk)
    flat = [(d + i, s + i) for chunk in chunks for d, s, n in chunk for i in range(n)]
    assert flat == [(d + i, s + i) for d, s, n in segments for i in range(n)]
    share = -(-sum(sizes) // parts)
    assert all(sum(n for _, _, n in chunk) <= share for chunk in chunks)


def test_threaded_copy_of_a_large_load_is_byte_exact(conn: str) -> None:
    """Above PARALLEL_MIN_BYTES the runs are cut across threads: every
    destination block gets its source block, whole, and nothing else."""
    bb, n = 256 * 1024, 2 * PARALLEL_MIN_BYTES // (256 * 1024)
    src = shared_region(n * bb)
    src[:] = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8)
    info = find_backing(_addr(src), src.size)
    assert info is not None
    dst = np.zeros(2 * n * bb, dtype=np.uint8)
    peer = PeerMapping(info, conn)
    copier = HostCopier(_addr(dst), dst.size, bb, threads=3)
    try:
        remote = list(range(n))[::-1]
        local = [2 * i for i in range(n)]
        copier.copy(peer, plan_write(local, remote, 2 * n, n))
        assert copier._pool is not None  # the threads did take part
        rows, srows = dst.reshape(2 * n, bb), src.reshape(n, bb)
        for lb, rb in zip(local, remote, strict=True):
            assert np.array_equal(rows[lb], srows[rb])
        assert not rows[1::2].any()
    finally:
        copier.close()
        peer.close()


def test_a_shrunk_file_fails_the_copy_instead_of_killing_us(conn: str) -> None:
    """Host copies read the peer's file, never a map of it: a peer that
    truncates its file after we opened it costs us a failed load (a map
    would raise SIGBUS, which no Python code survives)."""
    fd = os.memfd_create("shrinks", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8 * BB)
        mapped = mmap.mmap(fd, 8 * BB)
        src = np.frombuffer(mapped, dtype=np.uint8)
        src[:] = 9
        info = find_backing(_addr(src), src.size)
        assert info is not None
        peer = PeerMapping(info, conn)
        dst = np.zeros(8 * BB, dtype=np.uint8)
        copier = HostCopier(_addr(dst), dst.size, BB, threads=1)
        copier.copy(peer, plan_write(range(8), range(8), 8, 8))
        assert (dst == 9).all()
        os.ftruncate(fd, 2 * BB)
        with pytest.raises(OSError, match="shrank"):
            copier.copy(peer, plan_write([0, 1], [4, 5], 8, 8))
        peer.close()
        del src
        mapped.close()
    finally:
        os.close(fd)


def test_a_file_outside_shared_memory_is_refused(conn: str, tmp_path: Path) -> None:
    """Only tmpfs-backed files (``/dev/shm``, memfds): a read from a FUSE or
    network file could stall the engine."""
    path = tmp_path / "region"
    path.write_bytes(bytes(8 * BB))
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 8 * BB)
        view = np.frombuffer(mapped, dtype=np.uint8)
        info = find_backing(_addr(view), view.size)
        assert info is not None
        with pytest.raises(ValueError, match="not in shared memory"):
            PeerMapping(info, conn)
        del view
        mapped.close()


def test_blocks_side_by_side_at_the_peer_take_one_read_each_stretch(
    conn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Source blocks 2..5 and 9..10 are two stretches of the peer's file:
    two reads, into six scattered slots, byte for byte."""
    peer, _src, dst = _numbered(conn)
    calls: list[int] = []
    real = os.preadv

    def counted(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append(len(bufs))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counted)
    try:
        local, remote = [15, 1, 7, 3, 11, 0], [2, 3, 4, 5, 9, 10]
        HostCopier(_addr(dst), dst.size, BB, threads=1).copy(
            peer, plan_write(local, remote, 16, 16)
        )
        assert calls == [4, 2]
        rows = dst.reshape(16, BB)
        for lb, rb in zip(local, remote, strict=True):
            assert (rows[lb] == rb + 1).all()
    finally:
        peer.close()


def test_a_region_that_is_not_a_regular_file_is_refused_without_opening_it(
    tmp_path: Path,
) -> None:
    """The peer names any descriptor it holds. A FIFO with no writer (held
    through ``O_PATH``) blocked our open of it for good, on the engine's
    thread; a device would have been opened with our rights. Its handle is
    checked first, and nothing but a regular file is opened."""
    import threading

    fifo = Path("/dev/shm") / f"p2p_kv-test-fifo-{os.getpid()}"
    os.mkfifo(fifo, 0o600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ours = socket.create_connection(listener.getsockname())
    far, _ = listener.accept()
    held = os.open(fifo, os.O_PATH)
    try:
        st = os.stat(fifo)
        inode = socket_inode(ours.fileno())
        assert inode is not None
        info = ShmRegion(boot_id(), os.getpid(), held, st.st_dev, st.st_ino, 0, BB)
        out: dict[str, BaseException | None] = {}

        def open_it() -> None:
            try:
                PeerMapping(info, inode).close()
                out["error"] = None
            except BaseException as exc:
                out["error"] = exc

        opener = threading.Thread(target=open_it, daemon=True)
        opener.start()
        opener.join(5)
        assert not opener.is_alive(), "the open of a FIFO blocked"
        assert isinstance(out["error"], ValueError), out
        assert "not a regular file" in str(out["error"])
    finally:
        os.close(held)
        fifo.unlink()
        for sock in (ours, far, listener):
            sock.close()


@pytest.mark.parametrize("setuid", [False, True], ids=["dropped", "setuid"])
def test_a_peer_cannot_have_us_read_a_file_it_may_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setuid: bool
) -> None:
    """We reopen the peer's fd through ``/proc`` with our own rights. An
    unprivileged peer holding an ``O_PATH`` fd to a root-only file (which
    needs no read permission) offered it as its region, and a root engine
    read the file for it. The file must be the peer's own (or the peer
    root, which reads anything anyway)."""
    import time

    from p2p_kv.data import shm_copy

    path = Path("/dev/shm") / f"p2p_kv-test-secret-{os.getpid()}"
    path.write_bytes(b"S" * BB)
    path.chmod(0o600)
    st = os.stat(path)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            fd = os.open(path, os.O_PATH)
            _far, _ = listener.accept()
            os.write(ready_w, f"{fd}\n".encode())
            time.sleep(10)
        finally:
            os._exit(0)
    try:
        address = listener.getsockname()
        listener.close()
        ours = socket.create_connection(address)
        fd = int(os.read(ready_r, 64))
        inode = socket_inode(ours.fileno())
        assert inode is not None
        if setuid:
            # The handle passed on to a setuid-root program (su at its
            # prompt): root in effect, for a user who may not read the file.
            other = st.st_uid + 1
            monkeypatch.setattr(shm_copy, "process_uids", lambda _pid: (other, 0))
        elif os.geteuid() != 0:
            # Not root here: the peer keeps our uid, so stand in for the
            # uid it would have dropped to.
            other = os.getuid() + 1
            monkeypatch.setattr(shm_copy, "process_uids", lambda _pid: (other, other))
        info = ShmRegion(boot_id(), pid, fd, st.st_dev, st.st_ino, 0, BB)
        with pytest.raises(ValueError, match="not a file of its own"):
            PeerMapping(info, inode)
        ours.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        path.unlink()
