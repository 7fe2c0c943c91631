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
``tiny_frames``
    For ``seconds``: ``conns`` connections at once, spread over ``addrs``
    source addresses (127.0.0.2 on), each greeting with another secret,
    then streaming 5-byte frames that do not decode until the victim
    closes it; then another in its place.
``churn``
    For ``seconds``: ``threads`` loops, spread over ``addrs`` source
    addresses, each opening connections as fast as the victim takes them
    (a Hello with another secret on each, no pacing), keeping the newest
    ``keep`` open.
``lookup_churn``
    A party that holds the secret: ``cycles`` times, a full handshake,
    then ``lookups`` Lookups of ``copies`` copies of one key the victim
    holds, then the connection dropped without a Goodbye and dialled
    again.
``linger``
    For ``seconds``: ``n`` loops, each a handshake whose proof fails; once
    the victim refused it and closed its end, the connection writes on as
    fast as it can, then another.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from p2p_kv.control.transport import parse_peer
from p2p_kv.peer.handshake import SEALED, Identity, make_hello
from p2p_kv.protocol import Hello, HelloAck, Region, decode, encode
from tests.support.wire import RawConn, framed, standalone_identity


def identity(name: str, block_bytes: int, secret: bytes | None) -> Identity:
    return standalone_identity(name, block_bytes, 8, secret)


def _connect(target: str, source: str | None = None) -> socket.socket | None:
    host, port = parse_peer(target)
    try:
        sock = socket.create_connection(
            (host, port), timeout=5, source_address=(source, 0) if source else None
        )
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


def _source(i: int, addrs: int) -> str:
    """The i-th attacking connection's source address: 127.0.0.2 on (the
    fleet member under test dials from 127.0.0.1)."""
    return f"127.0.0.{2 + i % addrs}"


def _wrong_hello(cfg: dict[str, Any]) -> bytes:
    me = identity("intruder", cfg.get("block_bytes", 4096), b"not-the-secret")
    return framed(encode(make_hello(me, os.urandom(16))))


def tiny_frames(cfg: dict[str, Any]) -> dict[str, Any]:
    hello, end = _wrong_hello(cfg), time.monotonic() + cfg["seconds"]
    tiny = framed(b"\xc1") * 2048  # 5 bytes each, none decodes
    counts = {"connections": 0, "bytes": 0}
    lock = threading.Lock()

    def one(i: int) -> None:
        while time.monotonic() < end:
            sock = _connect(cfg["target"], _source(i, cfg.get("addrs", 1)))
            if sock is None:
                time.sleep(0.01)
                continue
            sent = 0
            try:
                sock.sendall(hello)
                while time.monotonic() < end:
                    sock.sendall(tiny)
                    sent += len(tiny)
            except OSError:
                pass
            finally:
                sock.close()
            with lock:
                counts["connections"] += 1
                counts["bytes"] += sent

    threads = [
        threading.Thread(target=one, args=(i,), daemon=True)
        for i in range(cfg["conns"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg["seconds"] + 10)
    return counts


def churn(cfg: dict[str, Any]) -> dict[str, Any]:
    hello, end = _wrong_hello(cfg), time.monotonic() + cfg["seconds"]
    host, port = parse_peer(cfg["target"])
    keep = cfg.get("keep", 256)
    counts = {"opened": 0, "failed": 0}
    lock = threading.Lock()

    def one(i: int) -> None:
        held: list[socket.socket] = []
        source = _source(i, cfg.get("addrs", 1))
        opened = failed = 0
        while time.monotonic() < end:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            try:
                sock.bind((source, 0))
                sock.settimeout(0.2)
                sock.connect((host, port))
                sock.send(hello)
            except OSError:
                failed += 1
                sock.close()
                continue
            opened += 1
            held.append(sock)
            if len(held) > keep:
                held.pop(0).close()
        for sock in held:
            sock.close()
        with lock:
            counts["opened"] += opened
            counts["failed"] += failed

    threads = [
        threading.Thread(target=one, args=(i,), daemon=True)
        for i in range(cfg.get("threads", 4))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg["seconds"] + 10)
    return counts


def lookup_churn(cfg: dict[str, Any]) -> dict[str, Any]:
    import msgspec

    from p2p_kv.data import NixlDataTransport
    from p2p_kv.data.shm_copy import shared_region
    from p2p_kv.peer.handshake import frame_keys, handshake_mac
    from p2p_kv.protocol import Lookup
    from p2p_kv.runtime.standalone import make_key

    secret = bytes.fromhex(cfg["secret"])
    block = cfg.get("block_bytes", 4096)
    # A real region: the victim loads the NIXL metadata of a peer that
    # proved the secret, and refuses the handshake over one it cannot.
    plane = NixlDataTransport(shared_region(8 * block), block, name="churner")
    me = identity("churner", block, secret)
    me = Identity(
        **{**me.__dict__, "region": msgspec.msgpack.encode(plane.local_region())}
    )
    keys = [make_key(cfg.get("key", 0))] * cfg["copies"]
    cycles = sent = 0
    for c in range(cfg["cycles"]):
        try:
            conn = RawConn(cfg["target"])
        except OSError:
            continue
        try:
            mine = make_hello(me, os.urandom(16))
            conn.send(encode(mine))
            theirs = next(
                (m for f in conn.frames(5.0) if isinstance(m := decode(f), Hello)),
                None,
            )
            if theirs is None:
                continue
            conn.send(encode(HelloAck(mac=handshake_mac(secret, mine, theirs))))
            sealer = frame_keys(secret, mine, theirs)
            assert sealer is not None
            conn.send(sealer.seal(encode(Region(region=me.region))))
            conn.frames(0.2, want=3)  # their HelloAck and Region
            for j in range(cfg["lookups"]):
                msg = Lookup(req=f"churn-{c}-{j}", gen=1, seq=1, keys=keys)
                conn.send(sealer.seal(encode(msg)))
                sent += 1
            # Held until the victim read them (a reset drops what it has
            # not read).
            time.sleep(cfg.get("hold_s", 0.1))
            cycles += 1
        except OSError:
            pass
        finally:
            conn.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0"
            )
            conn.close()  # a reset: no Goodbye
    plane.close()
    return {"cycles": cycles, "lookups": sent}


def linger(cfg: dict[str, Any]) -> dict[str, Any]:
    me = identity("intruder", cfg.get("block_bytes", 4096), b"not-the-secret")
    end = time.monotonic() + cfg["seconds"]
    junk = b"\0" * (1 << 20)
    counts = {"bytes": 0, "refused": 0}
    lock = threading.Lock()

    def one(i: int) -> None:
        sent = refused = 0
        while time.monotonic() < end:
            try:
                conn = RawConn(cfg["target"])
            except OSError:
                time.sleep(0.01)
                continue
            try:
                mine = make_hello(me, os.urandom(16))
                conn.send(encode(mine))
                if not any(isinstance(decode(f), Hello) for f in conn.frames(5.0)):
                    continue
                conn.send(encode(HelloAck(mac=b"\0" * 32)))  # a proof that fails
                if not conn.closed_by_peer(5.0):  # refused: Goodbye, then its end
                    continue
                refused += 1
                while time.monotonic() < end:
                    sent += conn.sock.send(junk)
            except OSError:
                pass
            finally:
                conn.close()
        with lock:
            counts["bytes"] += sent
            counts["refused"] += refused

    threads = [
        threading.Thread(target=one, args=(i,), daemon=True) for i in range(cfg["n"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg["seconds"] + 10)
    return counts


ATTACKS = {
    "tiny_frames": tiny_frames,
    "churn": churn,
    "lookup_churn": lookup_churn,
    "linger": linger,
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
