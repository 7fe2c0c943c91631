"""The control plane over IPv4, IPv6 and host names (real ZeroMQ and NIXL,
two peers in one process; the data plane is the same as in test_transport)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

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
    from p2p_kv.procfs import holds_connection, process_dir

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
        with process_dir(os.getpid()) as proc:
            assert holds_connection(proc, inode)
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


def _dead_addresses(n: int) -> list[str]:
    """``n`` loopback ports nothing listens on (bound, then closed)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("max_peers", [8, 2000])
def test_requests_naming_hundreds_of_peers_never_take_the_step_down(
    max_peers: int,
) -> None:
    """Clients choose the peers in ``kv_transfer_params``. 600 requests
    naming distinct addresses made 1,800 ZeroMQ sockets, past the 1023 a
    context holds: the dial raised out of the engine's step. Now the
    dials stop at ``max_peers`` (8: the rest recompute, counted); and with
    the bound set past what the context holds (2000, beside the config's
    own bound), a dial that cannot get a socket fails alone. Either way,
    once those sessions time out, a real peer still serves a load."""
    # Handshakes outlive the dialling steps (600 failed dials log 600 lines:
    # with 0.3 s, a slow host timed every handshake out before the count).
    fast = Timeouts(heartbeat_interval_s=0.2, handshake_s=1.5)
    producer = StandalonePeer(16, BLOCK, engine_id="p-many", timeouts=fast)
    consumer = StandalonePeer(16, BLOCK, engine_id="c-many", timeouts=fast)
    consumer.manager.max_peers = max_peers
    keys = [make_key(i) for i in range(2)]
    producer.fill(keys, [1, 2])
    stop = threading.Event()
    server = threading.Thread(target=producer.serve_until, args=(stop,), daemon=True)
    server.start()
    try:
        dead = _dead_addresses(600)
        for i, peer in enumerate(dead):
            consumer.open(f"many-{i}", peer, f"kv-{i}")
        dialled = [s for s in consumer.manager.sessions() if s.peer in dead]
        assert 0 < len(dialled) <= min(max_peers, 600)
        if max_peers == 8:
            assert consumer.manager.dials_refused == 600 - 8
        consumer.runtime.flush()
        for _ in range(3):  # the dials: none may raise out of the step
            consumer.step(wait=False)
        for i in range(len(dead)):
            consumer.runtime.end_request(f"many-{i}")
        # The handshakes time out and their sockets close; then a real peer
        # is dialled and serves.
        outcome = None
        end = time.monotonic() + 20
        while outcome is None and time.monotonic() < end:
            consumer.step(wait=True)
            if not any(s.peer in dead for s in consumer.manager.sessions()):
                outcome = consumer.fetch(producer.address, "kv-real", keys, [5, 6])
                break
        assert outcome is not None, "the dead peers' sessions never ended"
        assert outcome.hits == 2 and outcome.ok, outcome
        assert bytes(consumer.block(5)) == bytes(producer.block(1))
    finally:
        stop.set()
        server.join(5)
        consumer.close()
        producer.close()


@pytest.mark.parametrize("peer", ["localhost:65536", "h:0", ":80", "[]:80", "h:x"])
def test_a_peer_address_libzmq_would_retry_forever_is_refused(peer: str) -> None:
    """libzmq takes such an address and retries it silently: the load
    fell back only at the handshake's deadline, with nothing said."""
    from p2p_kv.control import parse_peer

    with pytest.raises(ValueError, match="peer address"):
        parse_peer(peer)


def test_a_flooding_peer_cannot_hold_the_poll() -> None:
    """A peer sending faster than we read kept one poll draining (5.5 s,
    1.7 M frames): a poll takes a bounded batch per socket, and says that
    more is waiting so that the next one does not wait."""
    import zmq

    from p2p_kv.control import MAX_FRAMES_PER_POLL, ControlTransport, zmq_endpoint

    ctl = ControlTransport("127.0.0.1", 0, heartbeat_s=1.0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    try:
        sock.connect(zmq_endpoint("127.0.0.1", ctl.port))
        sent = 3 * MAX_FRAMES_PER_POLL
        for i in range(sent):
            sock.send(i.to_bytes(8, "little"))
        got: list[int] = []
        end = time.monotonic() + 10.0
        while len(got) < sent and time.monotonic() < end:
            batch = ctl.poll(0.05)
            assert len(batch) <= MAX_FRAMES_PER_POLL
            got.extend(int.from_bytes(b.frame, "little") for b in batch)
        assert got == list(range(sent))
    finally:
        sock.close()
        ctl.close()


def test_one_poll_holds_a_bounded_number_of_bytes() -> None:
    """Frames of up to 4 MiB, from anyone who reaches the port: one poll
    held up to 4,096 of them (16 GiB) before any was looked at. A poll
    takes at most MAX_BYTES_PER_POLL (and one frame more), the rest the
    next; and libzmq queues at most RCV_HWM frames per connection."""
    import zmq

    from p2p_kv.control import (
        MAX_BYTES_PER_POLL,
        RCV_HWM,
        ControlTransport,
        zmq_endpoint,
    )
    from p2p_kv.protocol import MAX_FRAME_BYTES

    ctl = ControlTransport("127.0.0.1", 0, heartbeat_s=1.0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert ctl._router.getsockopt(zmq.RCVHWM) == RCV_HWM
        sock.connect(zmq_endpoint("127.0.0.1", ctl.port))
        sent = 2 * MAX_BYTES_PER_POLL // MAX_FRAME_BYTES + 4
        for i in range(sent):
            sock.send(i.to_bytes(8, "little") * (MAX_FRAME_BYTES // 8))
        got: list[int] = []
        end = time.monotonic() + 20.0
        while len(got) < sent and time.monotonic() < end:
            batch = ctl.poll(0.05)
            assert (
                sum(len(b.frame) for b in batch) < MAX_BYTES_PER_POLL + MAX_FRAME_BYTES
            )
            got.extend(int.from_bytes(b.frame[:8], "little") for b in batch)
        assert got == list(range(sent))
    finally:
        sock.close()
        ctl.close()


def test_a_flood_on_the_port_does_not_starve_the_peers_we_dialled() -> None:
    """One poll's byte budget was spent on the port's connections first:
    a flood of 4 MiB frames there (anyone may send them) left a peer we
    dialled unread, its replies and heartbeats waiting, poll after poll.
    The peers we dialled are read first, each to a share of the budget."""
    import zmq

    from p2p_kv.control import ControlTransport, zmq_endpoint
    from p2p_kv.protocol import MAX_FRAME_BYTES

    ours = ControlTransport("127.0.0.1", 0, heartbeat_s=1.0)
    theirs = ControlTransport("127.0.0.1", 0, heartbeat_s=1.0)
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    try:
        ours.connect(theirs.address)
        assert ours.send(theirs.address, [b"hello"])
        end = time.monotonic() + 5.0
        inbound: list[Any] = []
        while not inbound and time.monotonic() < end:
            inbound = [x for x in theirs.poll(0.05) if x.frame == b"hello"]
        assert inbound, "the dial never arrived"
        flood.connect(zmq_endpoint("127.0.0.1", ours.port))
        for _ in range(40):  # 160 MiB, queued at our port
            flood.send(b"\x00" * (MAX_FRAME_BYTES - 64))
        time.sleep(1.0)
        assert theirs.send(inbound[0].conn, [b"reply"])
        time.sleep(0.2)
        batch = ours.poll(0.05)
        assert any(x.frame == b"reply" for x in batch), "the reply waited"
    finally:
        flood.close()
        ours.close()
        theirs.close()


def test_a_dial_that_gets_through_on_libzmq_s_retry_is_not_lost() -> None:
    """A dial nothing accepted yet ends its session (libzmq would retry
    quietly, and the request waited out the handshake); but a peer that
    comes up moments later is connected by libzmq's own retry, and when
    one poll reads both events the connection must not be reported lost."""
    from p2p_kv.control import ControlTransport

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dialler = ControlTransport("127.0.0.1", 0)
    peer = f"127.0.0.1:{port}"
    listener = None
    try:
        dialler.connect(peer)
        time.sleep(0.05)  # refused: libzmq retries in 100 ms
        listener = ControlTransport("127.0.0.1", port)  # the peer comes up
        time.sleep(0.4)  # one long engine step: both events wait
        got = dialler.poll(0)
        assert not [i for i in got if i.lost], [(i.conn, i.why) for i in got]
        assert dialler.connection_inode(peer) is not None
    finally:
        dialler.close()
        if listener is not None:
            listener.close()


@pytest.mark.parametrize(
    ("host", "port", "says"),
    [
        ("no-such-host.invalid", 0, "cannot resolve the host 'no-such-host.invalid'"),
        ("127.0.0.1", 65537, "control port 65537 is not in 0..65535"),
        ("127.0.0.1", -1, "control port -1 is not in 0..65535"),
    ],
)
def test_a_bad_bind_address_is_refused_naming_it(
    host: str, port: int, says: str
) -> None:
    """An unresolvable host raised a bare ``gaierror`` naming neither host
    nor key; a port past 65535 was bound modulo 65536 (65537: port 1) while
    peers were told the port nobody can dial."""
    from p2p_kv.control import ControlTransport

    with pytest.raises(ValueError, match=says):
        ControlTransport(host, port)


def test_a_failed_bind_names_what_to_fix() -> None:
    """Every failed bind said "pick a free port", also for a host that is
    not an address of this machine."""
    from p2p_kv.control import ControlTransport

    with pytest.raises(OSError, match="set the tier's 'host' key"):
        ControlTransport("192.0.2.1", 0)  # TEST-NET-1: not ours
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="pick a free port"):
            ControlTransport("127.0.0.1", s.getsockname()[1])


def test_a_peer_whose_bind_fails_closes_its_data_plane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The NIXL agent (and UCX's thread) made before the bind was left to
    the collector, alive for as long as the caller kept the exception."""
    import p2p_kv.standalone
    from p2p_kv.data import NixlDataTransport

    made: list[NixlDataTransport] = []

    class Recorded(NixlDataTransport):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(p2p_kv.standalone, "NixlDataTransport", Recorded)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="pick a free port"):
            StandalonePeer(4, 4096, engine_id="bind-fails", port=s.getsockname()[1])
    (data,) = made
    assert data._agent is None, "the failed peer's NIXL agent is still open"


def test_closing_a_control_transport_twice_does_nothing() -> None:
    """The second call raised KeyError (its socket already unregistered)
    from a ``finally`` of the doctor's or a benchmark's."""
    from p2p_kv.control import ControlTransport

    control = ControlTransport("127.0.0.1", 0)
    control.close()
    control.close()


def test_an_ipv6_host_may_be_written_in_brackets() -> None:
    from p2p_kv.control import ControlTransport

    control = ControlTransport("[::1]", 0)
    try:
        assert control.address == f"[::1]:{control.port}"
    finally:
        control.close()
