"""A hostile party on the network, in its own process.

Run as ``python -m tests.support.attacker '<json>'`` with ``{"attack": ...,
"target": "host:port", ...}``; it prints one JSON line of what it did and
exits. It speaks our framing by hand (:mod:`tests.support.wire`), never
through a Session, so it can send what no honest peer would. Attacks:

``flood``
    ``n`` connections, each sending a Hello that cannot prove the secret
    (``hello: false``: nothing at all), opened as fast as the victim
    accepts, held ``hold_s``, then closed.
``half_open``
    ``n`` connections that stop mid-frame: a partial length prefix, or a
    prefix promising more than is sent; held ``hold_s``.
``oversize``
    ``n`` connections, each sending one length prefix no frame may have
    before the handshake (0, past the largest greeting, 4 GiB - 1), held
    until the victim closes it.
``bad_region``
    Against a victim without a secret: ``n`` full handshakes, each sending
    a Region whose NIXL metadata names an agent that is not UTF-8 (the
    victim loads it before it can check the name).
``garbage``
    ``n`` connections, each sending ``frames`` undecodable frames and
    frames whose seal cannot check.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import Any

from p2p_kv.control import parse_peer
from p2p_kv.handshake import SEALED, Identity, make_hello
from p2p_kv.protocol import Hello, HelloAck, Region, decode, encode
from tests.support.wire import RawConn, framed, standalone_identity


def identity(name: str, block_bytes: int, secret: bytes | None) -> Identity:
    return standalone_identity(name, block_bytes, 8, secret)


def _connect(target: str) -> socket.socket | None:
    host, port = parse_peer(target)
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def flood(cfg: dict[str, Any]) -> dict[str, Any]:
    secret = bytes.fromhex(cfg["secret"]) if cfg.get("secret") else None
    me = identity("flood", cfg.get("block_bytes", 4096), secret)
    hello = (
        framed(encode(make_hello(me, os.urandom(16))))
        if cfg.get("hello", True)
        else b""
    )
    socks, failed = [], 0
    for _ in range(cfg["n"]):
        sock = _connect(cfg["target"])
        if sock is None:
            failed += 1
            continue
        if hello:
            with contextlib.suppress(OSError):
                sock.sendall(hello)
        socks.append(sock)
    time.sleep(cfg.get("hold_s", 0.0))
    for sock in socks:
        sock.close()
    return {"opened": len(socks), "failed": failed}


def half_open(cfg: dict[str, Any]) -> dict[str, Any]:
    socks = []
    for i in range(cfg["n"]):
        sock = _connect(cfg["target"])
        if sock is None:
            continue
        with contextlib.suppress(OSError):
            if i % 2:
                sock.sendall(b"\x00\x00")  # half a length prefix
            else:
                sock.sendall((16 * 1024).to_bytes(4, "big") + b"x" * 100)
        socks.append(sock)
    time.sleep(cfg.get("hold_s", 0.0))
    for sock in socks:
        sock.close()
    return {"opened": len(socks)}


def oversize(cfg: dict[str, Any]) -> dict[str, Any]:
    """Each prefix on its own connection, held until the victim closes it
    (so it is read, not merely evicted for a newer one)."""
    sizes = [0, 2 * 1024 * 1024, 2**32 - 1]
    sent = closed = 0
    for i in range(cfg["n"]):
        sock = _connect(cfg["target"])
        if sock is None:
            continue
        try:
            sock.sendall(sizes[i % len(sizes)].to_bytes(4, "big") + b"\x00" * 64)
            sent += 1
            sock.settimeout(5.0)
            # Whatever it says first, then an orderly close, or a reset (it
            # closed with our bytes unread).
            while sock.recv(4096):
                pass
            closed += 1
        except ConnectionResetError:
            closed += 1
        except OSError:
            pass
        sock.close()
    return {"sent": sent, "closed_by_victim": closed}


def bad_region(cfg: dict[str, Any]) -> dict[str, Any]:
    """Full handshakes without a secret, each ending in a Region whose NIXL
    metadata names a non-UTF-8 agent."""
    import msgspec

    from p2p_kv.data import NixlDataTransport
    from p2p_kv.data.shm_copy import shared_region

    block = cfg.get("block_bytes", 4096)
    name = "mallory-AAAAAAAA"
    plane = NixlDataTransport(shared_region(8 * block), block, name=name)
    try:
        info = plane.local_region()
    finally:
        plane.close()
    assert name.encode() in info.agent_metadata
    sent = 0
    for i in range(cfg["n"]):
        bad = b"mallory-" + bytes([0xFF, 0xFE]) + i.to_bytes(6, "big")
        region = msgspec.structs.replace(
            info,
            agent_metadata=info.agent_metadata.replace(name.encode(), bad),
            shm=None,
        )
        me = identity(f"mallory-{i}", block, None)
        me = Identity(**{**me.__dict__, "region": msgspec.msgpack.encode(region)})
        try:
            conn = RawConn(cfg["target"])
        except OSError:
            continue
        try:
            conn.send(encode(make_hello(me, os.urandom(16))))
            if not any(isinstance(decode(f), Hello) for f in conn.frames(5.0)):
                continue
            conn.send(encode(HelloAck(mac=b"")))  # no secret: no proof
            conn.frames(5.0)  # their HelloAck, then their Region
            conn.send(encode(Region(region=me.region)))
            conn.frames(0.05)
            sent += 1
        except OSError:
            pass
        finally:
            conn.close()
    return {"sent": sent}


def garbage(cfg: dict[str, Any]) -> dict[str, Any]:
    sent = 0
    per = cfg.get("frames", 100)
    for _ in range(cfg["n"]):
        sock = _connect(cfg["target"])
        if sock is None:
            continue
        junk = b"".join(
            framed(b"\xc1junk" if j % 2 else bytes([SEALED]) + os.urandom(40))
            for j in range(per)
        )
        with contextlib.suppress(OSError):
            sock.sendall(junk)
            sent += per
        time.sleep(0.01)
        sock.close()
    return {"sent": sent}


ATTACKS = {
    "flood": flood,
    "half_open": half_open,
    "oversize": oversize,
    "bad_region": bad_region,
    "garbage": garbage,
}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    t0 = time.monotonic()
    out = ATTACKS[cfg["attack"]](cfg)
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
