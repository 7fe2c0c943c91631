"""Raw control-plane connections for tests: our framing by hand, no session.

An attacker or a misbehaving peer is not a well-behaved Session: these
speak the wire format (a 4-byte big-endian length, then the frame) on a
plain blocking socket, so a test can send exactly the bytes it means,
malformed ones included.
"""

from __future__ import annotations

import socket
import time

from p2p_kv.control.transport import HEADER, parse_peer
from p2p_kv.peer.handshake import Identity
from p2p_kv.runtime.standalone import canonical_hashes


def standalone_identity(
    name: str,
    block_bytes: int,
    num_blocks: int,
    secret: bytes | None,
    region: bytes = b"",
) -> Identity:
    """An identity a StandalonePeer (layout ``standalone``, hash seed 0)
    accepts at the handshake, for a party that speaks the wire by hand."""
    return Identity(
        engine_id=name,
        hash_algo="sha256",
        hash_seed="0",
        canonical_hashes=canonical_hashes("0"),
        layout="standalone",
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        region=region,
        secret=secret,
    )


def framed(frame: bytes) -> bytes:
    """``frame`` as it goes on the wire."""
    return len(frame).to_bytes(HEADER, "big") + frame


class RawConn:
    """One TCP connection to a peer's control port."""

    def __init__(self, peer: str, timeout_s: float = 5.0) -> None:
        host, port = parse_peer(peer)
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    @classmethod
    def of(cls, sock: socket.socket) -> RawConn:
        """A connection we accepted."""
        conn = cls.__new__(cls)
        conn.sock, conn._buf = sock, b""
        return conn

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(framed(f) for f in frames))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames(self, timeout_s: float = 2.0, want: int = 1) -> list[bytes]:
        """Frames received within ``timeout_s``, returning as soon as
        ``want`` have come (fewer if the peer closed or time ran out)."""
        out: list[bytes] = []
        end = time.monotonic() + timeout_s
        while len(out) < want:
            out.extend(self._parse())
            if len(out) >= want:
                break
            left = end - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except (TimeoutError, OSError):
                break
            if not chunk:
                out.extend(self._parse())
                break
            self._buf += chunk
        return out

    def _parse(self) -> list[bytes]:
        out = []
        while len(self._buf) >= HEADER:
            size = int.from_bytes(self._buf[:HEADER], "big")
            if len(self._buf) < HEADER + size:
                break
            out.append(self._buf[HEADER : HEADER + size])
            self._buf = self._buf[HEADER + size :]
        return out

    def closed_by_peer(self, timeout_s: float = 2.0) -> bool:
        """Whether the peer closes the connection within ``timeout_s``
        (whatever it sends first is read and dropped)."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                if not self.sock.recv(1 << 20):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()
