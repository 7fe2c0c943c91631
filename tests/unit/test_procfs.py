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
    process_uid,
    shm_devices,
    socket_inode,
)
from tests.support.sockets import tcp_connection


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_far_end_proves_which_process_we_talk_to(host: str) -> None:
    listener, ours, far = tcp_connection(host)
    try:
        inode = socket_inode(ours.fileno())
        assert inode is not None
        assert holds_connection(os.getpid(), inode)
        assert not holds_connection(2**22 + 1, inode)  # no such process
        child = subprocess.Popen(["sleep", "30"])
        try:
            assert not holds_connection(child.pid, inode)  # not its socket
        finally:
            child.kill()
            child.wait()
        far.close()  # the far end gone: nothing proves anything
        assert not holds_connection(os.getpid(), inode)
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
        assert not holds_connection(os.getpid(), child_conn)
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


def test_a_process_uid_is_read_fresh_every_time() -> None:
    """Pids are reused: a uid remembered for a pid would vouch for whatever
    process has that pid next (the same-host region check reads it)."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_uid(child.pid) == os.getuid()
    finally:
        child.kill()
        child.wait()
    assert process_uid(child.pid) is None
    assert shm_devices() is shm_devices()  # that one is the host's: made once
