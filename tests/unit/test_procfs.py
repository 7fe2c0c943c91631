"""What ``/proc`` proves: which process holds the far end of a connection,
which CUDA runtime is loaded, and who holds a file; and the sweep of files
left in shared memory by engines that have exited (:mod:`p2p_kv.data.shm_file`)."""

from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from p2p_kv.data import shm_file as shm
from p2p_kv.data.procfs import (
    holders,
    holds_connection,
    loaded_library,
    process_dir,
    process_uids,
    sees_every_process,
    shm_devices,
    socket_inode,
)
from tests.support.sockets import tcp_connection


def _holds(pid: int, inode: str) -> bool:
    with process_dir(pid) as proc:
        return holds_connection(proc, inode)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_far_end_proves_which_process_we_talk_to(host: str) -> None:
    listener, ours, far = tcp_connection(host)
    try:
        inode = socket_inode(ours.fileno())
        assert inode is not None
        assert _holds(os.getpid(), inode)
        assert not _holds(2**22 + 1, inode)  # no such process
        child = subprocess.Popen(["sleep", "30"])
        try:
            assert not _holds(child.pid, inode)  # not its socket
        finally:
            child.kill()
            child.wait()
        far.close()  # the far end gone: nothing proves anything
        assert not _holds(os.getpid(), inode)
    finally:
        for sock in (listener, ours, far):
            sock.close()


def test_a_listener_on_the_same_port_is_no_proof() -> None:
    """A socket listening on the port we dialled, on another address, does
    not hold our connection: a peer cannot name such a process as itself."""
    listener, ours, far = tcp_connection("127.0.0.1")
    port = listener.getsockname()[1]
    try:
        other = socket.socket(socket.AF_INET6)
        other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        other.bind(("::1", port))
        other.listen()
        child_conn = socket_inode(ours.fileno())
        assert child_conn is not None
        far.close()  # only the same-port listener is left here
        assert not _holds(os.getpid(), child_conn)
        other.close()
    finally:
        for sock in (listener, ours, far):
            sock.close()


def test_the_cuda_runtime_is_found_among_what_is_loaded() -> None:
    """CUDA copies bind the runtime torch already loaded, whatever the wheel
    named it; nothing loaded, nothing found (the copier then uses torch)."""
    maps = "\n".join(
        [
            "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/libc.so.6",
            "7f10-7f20 r-xp 00000000 08:01 124 /x/nvidia/cu13/lib/libcudart.so.13",
            "7f20-7f30 rw-p 00000000 00:00 0 ",
            "7f30-7f40 r-xp 00000000 08:01 125 /t/lib/libcudart-d0da41ae.so.12",
        ]
    )
    assert loaded_library("libcudart", maps) == "/x/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_library("libcudart", maps.split("\n", 2)[2]) == (
        "/t/lib/libcudart-d0da41ae.so.12"
    )
    assert (
        loaded_library("libcudart", "7f00-7f10 r-xp 0 08:01 9 /l/libcudartx.so") is None
    )
    assert loaded_library("libcudart", "") is None
    # This process: libc is mapped, a CUDA runtime is not (no torch.cuda).
    assert loaded_library("libc") is not None


def test_a_proof_is_of_the_process_it_began_with() -> None:
    """Pids are reused: a proof made of lookups by pid (the connection, the
    file, the uid) could mix the peer with a process given its pid after it
    exited. Made through one ``/proc/<pid>`` fd, every lookup after the exit
    fails instead of answering for whoever has the pid now."""
    listener, ours, far = tcp_connection("127.0.0.1")
    inode = socket_inode(ours.fileno())
    assert inode is not None
    child = subprocess.Popen(["sleep", "30"], pass_fds=[far.fileno()])
    try:
        with process_dir(child.pid) as proc:
            assert holds_connection(proc, inode)
            assert process_uids(proc) == (os.getuid(), os.geteuid())
            child.kill()
            child.wait()
            assert not holds_connection(proc, inode)
            assert process_uids(proc) is None
            with pytest.raises(OSError):
                os.open("fd/0", os.O_RDONLY, dir_fd=proc)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for sock in (listener, ours, far):
            sock.close()
    assert holds_connection(None, inode) is False
    assert process_uids(None) is None


def test_shm_devices_are_the_hosts() -> None:
    assert shm_devices() is shm_devices()  # that one is the host's: made once


# -- who holds a file; the sweep of engines' leftovers -----------------------

#: A child that holds a file as asked (argv: path, how), says so, and waits.
_HOLDER = """
import mmap, os, sys, time
path, how = sys.argv[1:]
fd = os.open(path, os.O_RDONLY if how == "read" else os.O_RDWR)
if how == "map":
    m = mmap.mmap(fd, 4096)
    os.close(fd)  # held by the mapping alone
print("ready", flush=True)
time.sleep(60)
"""


Holder = Callable[[Path, str], "subprocess.Popen[str]"]


@pytest.fixture
def holder() -> Iterator[Holder]:
    children: list[subprocess.Popen[str]] = []

    def start(path: Path, how: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path), how],
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def _file(path: Path, size: int = 1 << 16) -> tuple[int, int]:
    path.write_bytes(b"\0" * size)
    st = path.stat()
    return st.st_dev, st.st_ino


def test_holders_sees_fds_and_mappings(tmp_path: Path, holder: Holder) -> None:
    """A file is held while some process has it open, or only mapped (its fd
    closed); once that process is gone, nothing holds it."""
    assert sees_every_process(), (
        "/proc here does not list every process (a container's own PID "
        "namespace, or hidepid): run the tests where it does, as CI and a "
        "vLLM host do"
    )
    opened, mapped, free = (tmp_path / n for n in ("opened", "mapped", "free"))
    files = {_file(p): p.name for p in (opened, mapped, free)}
    by_fd = holder(opened, "write")
    holder(mapped, "map")
    held, _ = holders(files)  # a protected init may hide: held still holds
    assert held == {_key(opened), _key(mapped)}
    by_fd.kill()
    by_fd.wait()
    held, _ = holders(files)
    assert held == {_key(mapped)}


def _key(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_sweep_removes_only_files_nobody_holds(
    tmp_path: Path, holder: Holder, caplog: pytest.LogCaptureFixture
) -> None:
    """Files left by exited engines go, each with one line naming it and its
    size; a file some live process holds (open for writing, for reading, or
    only mapped) stays, as do other names, links and other users' files."""
    dead = tmp_path / "vllm_offload_dead.mmap"
    _file(dead, 3 << 20)
    for how in ("write", "read", "map"):
        path = tmp_path / f"vllm_offload_live-{how}.mmap"
        _file(path)
        holder(path, how)
    _file(tmp_path / "vllm_offload_other.txt")
    _file(tmp_path / "psm_0123abcd")
    (tmp_path / "vllm_offload_link.mmap").symlink_to(tmp_path / "psm_0123abcd")
    if os.geteuid() == 0:
        foreign = tmp_path / "vllm_offload_foreign.mmap"
        _file(foreign)
        os.chown(foreign, 65534, 65534)
    before = _names(tmp_path)
    with caplog.at_level(logging.INFO, logger="vllm.p2p_kv.data.shm_file"):
        removed = shm.sweep(str(tmp_path))
    assert removed == [(str(dead), 3 << 20)]
    assert _names(tmp_path) == before - {dead.name}
    lines = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert lines == [
        f"p2p_kv: removed {dead} (3.0 MiB), left by an engine that has exited: "
        "no process holds it"
    ]
    assert shm.sweep(str(tmp_path)) == []  # the rest is all held or not ours


def test_without_leases_proc_is_the_proof(
    tmp_path: Path, holder: Holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel grants no lease, ``/proc`` decides: a file goes only
    if every process can be inspected and none holds it; a process whose
    fds may not be read, or a /proc that does not list every process,
    leaves every file in place."""
    monkeypatch.setattr(shm, "_remove_if_unused", lambda path, key: None)
    dead = tmp_path / "vllm_offload_dead.mmap"
    live = tmp_path / "vllm_offload_live.mmap"
    _file(dead)
    _file(live)
    holder(live, "map")
    names = {dead.name: _key(dead), live.name: _key(live)}

    monkeypatch.setattr(shm, "sees_every_process", lambda: False)
    assert shm.sweep(str(tmp_path)) == []
    monkeypatch.setattr(shm, "sees_every_process", lambda: True)
    monkeypatch.setattr(shm, "holders", lambda files: ({names[live.name]}, [1]))
    assert shm.sweep(str(tmp_path)) == []
    assert _names(tmp_path) == set(names)
    monkeypatch.setattr(shm, "holders", lambda files: (holders(files)[0], []))
    assert shm.sweep(str(tmp_path)) == [(str(dead), 1 << 16)]
    assert _names(tmp_path) == {live.name}


def test_the_name_goes_only_while_it_names_our_file(tmp_path: Path) -> None:
    """The name goes only while it names the file we hold; a file made
    under that name since (another engine's) stays."""
    path = tmp_path / "vllm_offload_e.mmap"
    _file(path)
    fd = os.open(path, os.O_RDWR)
    try:
        region = mmap.mmap(fd, 4096)
        path.unlink()
        _file(path)  # the name is now another file's
        assert not shm.names_file(str(path), fd)
        assert not shm.release_name(str(path), fd)
        assert path.exists()
        region.close()
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDWR)
    try:
        assert shm.names_file(str(path), fd)
        assert shm.release_name(str(path), fd)
        assert not path.exists()
        assert os.fstat(fd).st_nlink == 0  # the memory lives while held
        assert not shm.release_name(str(path), fd)
    finally:
        os.close(fd)
