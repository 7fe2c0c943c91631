"""The control plane over IPv4, IPv6 and host names (real ZeroMQ and NIXL,
two peers in one process; the data plane is the same as in test_transport)."""

from __future__ import annotations

import os
import socket
import threading

import msgspec
import nixl._api  # noqa: F401  (fail, not skip, without NIXL)
import pytest

from p2p_kv.session import Timeouts
from p2p_kv.standalone import StandalonePeer, make_key

BLOCK = 4096


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_fetch_over_each_address_family(host: str) -> None:
    if host == "::1":
        # The sandbox may have no IPv6 loopback; that is the machine, not us.
        assert _has_ipv6_loopback(), "this machine has no IPv6 loopback (::1)"
    producer = StandalonePeer(
        16,
        BLOCK,
        engine_id=f"p-{host}",
        host=host,
        timeouts=Timeouts(heartbeat_interval_s=0.2),
    )
    consumer = StandalonePeer(
        16, BLOCK, engine_id=f"c-{host}", timeouts=Timeouts(heartbeat_interval_s=0.2)
    )
    keys = [make_key(i) for i in range(4)]
    producer.fill(keys, [1, 3, 5, 7])
    stop = threading.Event()
    server = threading.Thread(target=producer.serve_until, args=(stop,), daemon=True)
    server.start()
    try:
        peer = producer.address
        if host == "localhost":
            peer = f"localhost:{producer.runtime.control.port}"
        outcome = consumer.fetch(peer, "kv-addr", keys, [0, 2, 4, 6])
        assert outcome.hits == 4 and outcome.ok, outcome
        for src, dst in zip([1, 3, 5, 7], [0, 2, 4, 6], strict=True):
            assert bytes(consumer.block(dst)) == bytes(producer.block(src))
        # The producer proved, over this family, that it holds the far end
        # of the consumer's first connection: the load was a same-host copy.
        assert consumer.runtime.data.local_reads == 1
    finally:
        stop.set()
        server.join(5)
        consumer.close()
        producer.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_our_connection_names_its_socket_from_the_first_poll(host: str) -> None:
    """The dialling side learns its connection's socket from ZeroMQ's
    monitor, attached before connecting (on loopback the connection can be
    up before connect() returns); the far end is the listener's process."""
    from p2p_kv.control import ControlTransport
    from p2p_kv.procfs import holds_connection

    server = ControlTransport(host, 0, heartbeat_s=0.5)
    client = ControlTransport("127.0.0.1", 0, heartbeat_s=0.5)
    try:
        client.connect(server.address)
        inode = None
        for _ in range(200):
            client.poll(0.01)
            server.poll(0.0)
            inode = client.connection_inode(server.address)
            if inode is not None:
                break
        assert inode is not None, "CONNECTED never reported"
        assert holds_connection(os.getpid(), inode)
        client.close_conn(server.address)
        assert client.connection_inode(server.address) is None
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("offer", ["shm", "cuda_ipc"])
def test_a_peer_whose_connection_is_named_late_proves_itself_then(
    offer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeroMQ may report our connection (its CONNECTED event) after the
    peer's first frames: the session comes up with the peer on NIXL, and
    the next frame after the connection is named makes the proof. The
    runtime retries it whatever the peer offers (it once retried only
    shared files, so a GPU producer met this way stayed on NIXL for good);
    the data plane decides what it opens: a shared file, but no GPU memory
    into our host region."""
    from p2p_kv import data as data_mod
    from p2p_kv.procfs import boot_id
    from p2p_kv.same_host_cuda import CudaIpcRegion

    real = data_mod.NixlDataTransport.local_region

    def gpu_offer(self: data_mod.NixlDataTransport) -> data_mod.RegionInfo:
        info = real(self)
        ipc = CudaIpcRegion(boot_id(), os.getpid(), b"h" * 64, 0, info.region_bytes)
        return msgspec.structs.replace(info, shm=None, cuda_ipc=ipc)

    if offer == "cuda_ipc":
        monkeypatch.setattr(data_mod.NixlDataTransport, "local_region", gpu_offer)
    producer = StandalonePeer(16, BLOCK, engine_id=f"p-late-{offer}")
    monkeypatch.setattr(data_mod.NixlDataTransport, "local_region", real)
    consumer = StandalonePeer(16, BLOCK, engine_id=f"c-late-{offer}")
    keys = [make_key(i) for i in range(4)]
    producer.fill(keys, [1, 3, 5, 7])
    control = consumer.runtime.control
    named = control.connection_inode
    late = {"on": True}
    control.connection_inode = lambda peer: None if late["on"] else named(peer)  # type: ignore[method-assign]
    data = consumer.runtime.data
    proofs: list[str] = []
    prove = data.prove_peer

    def record(agent: str, conn: str) -> None:
        proofs.append(agent)
        prove(agent, conn)

    data.prove_peer = record  # type: ignore[method-assign]
    stop = threading.Event()
    server = threading.Thread(target=producer.serve_until, args=(stop,), daemon=True)
    server.start()
    try:
        first = consumer.fetch(producer.address, "kv-late-1", keys, [0, 2, 4, 6])
        assert first.ok, first
        assert data.local_reads == 0 and data.same_host_peers == 0  # via NIXL
        assert proofs == []
        late["on"] = False
        second = consumer.fetch(producer.address, "kv-late-2", keys, [8, 10, 12, 14])
        assert second.ok, second
        assert proofs == [producer.runtime.data.agent_name]
        opened = offer == "shm"  # a host consumer opens no GPU memory
        assert data.same_host_peers == int(opened) and data.local_reads == int(opened)
        for src, dst in zip([1, 3, 5, 7], [8, 10, 12, 14], strict=True):
            assert bytes(consumer.block(dst)) == bytes(producer.block(src))
    finally:
        stop.set()
        server.join(5)
        consumer.close()
        producer.close()
