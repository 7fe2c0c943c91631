"""What ``/proc`` proves: which process holds the far end of a connection,
and which CUDA runtime is loaded."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from p2p_kv.procfs import (
    holds_connection,
    loaded_library,
    process_dir,
    process_uids,
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
