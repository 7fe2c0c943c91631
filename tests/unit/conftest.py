"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2p_kv.data.procfs import socket_inode
from tests.support.sockets import tcp_connection


@pytest.fixture(scope="module")
def conn() -> Iterator[str]:
    """Socket inode of a connection whose far end this process holds, as a
    peer holds the far end of our control connection."""
    sockets = tcp_connection("127.0.0.1")
    try:
        inode = socket_inode(sockets[1].fileno())
        assert inode is not None
        yield inode
    finally:
        for sock in sockets:
            sock.close()
