"""The control plane over IPv4, IPv6 and host names (real TCP and NIXL,
two peers in one process; the data plane is the same as in test_transport),
and the transport's own bounds on what a peer's frames make it read."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import msgspec
import nixl._api  # noqa: F401  (fail, not skip, without NIXL)
import pytest
from tests.support.wire import RawConn

from p2p_kv.peer import Timeouts
from p2p_kv.runtime.standalone import StandalonePeer, make_key

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
    """The dialling side names its connection's socket once it connects
    (the same-host proof asks whether the peer's pid holds its far end);
    the far end is the listener's process."""
    from p2p_kv.control.transport import ControlTransport
    from p2p_kv.data.procfs import holds_connection, process_dir

    server = ControlTransport(host, 0)
    client = ControlTransport("127.0.0.1", 0)
    try:
        client.connect(server.address)
        inode = None
        for _ in range(200):
            client.poll(0.01)
            server.poll(0.0)
            inode = client.connection_inode(server.address)
            if inode is not None:
                break
        assert inode is not None, "the connection was never named"
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
    """Our connection may be named after the peer's first frames: the
    session then comes up with the peer on NIXL, and
    the next frame after the connection is named makes the proof. The
    runtime retries it whatever the peer offers (it once retried only
    shared files, so a GPU producer met this way stayed on NIXL for good);
    the data plane decides what it opens: a shared file, but no GPU memory
    into our host region."""
    from p2p_kv import data as data_mod
    from p2p_kv.data.offer import CudaIpcRegion
    from p2p_kv.data.procfs import boot_id

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
    """Clients choose the peers in ``kv_transfer_params``: 600 requests
    naming distinct addresses must not take the engine's step down. The
    dials stop at ``max_peers`` (8: the rest recompute, counted); with the
    bound past them (2000), each dial holds a descriptor and one that
    cannot get one fails alone. Either way, once those sessions time out,
    a real peer still serves a load."""
    # Handshakes outlive the dialling steps (600 failed dials log 600 lines:
    # with 0.3 s, a slow host timed every handshake out before the count).
    fast = Timeouts(heartbeat_interval_s=0.2, handshake_s=1.5)
    producer = StandalonePeer(16, BLOCK, engine_id="p-many", timeouts=fast)
    consumer = StandalonePeer(16, BLOCK, engine_id="c-many", timeouts=fast)
    consumer.manager.settings.max_peers = max_peers
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
def test_a_peer_address_that_is_not_host_port_is_refused(peer: str) -> None:
    from p2p_kv.control.transport import parse_peer

    with pytest.raises(ValueError, match="peer address"):
        parse_peer(peer)


def _accepted(ctl: Any, end_s: float = 5.0) -> str:
    """The name of the next connection ``ctl`` accepts."""
    end = time.monotonic() + end_s
    while time.monotonic() < end:
        for x in ctl.poll(0.05):
            if x.new:
                return str(x.conn)
    raise AssertionError("no connection arrived")


def test_a_flooding_peer_cannot_hold_the_poll() -> None:
    """A peer sending faster than we read must not keep one poll draining:
    a poll takes a bounded batch per connection, and the next poll does
    not wait while frames are left buffered."""
    from p2p_kv.control.transport import MAX_FRAMES_PER_POLL, ControlTransport

    ctl = ControlTransport("127.0.0.1", 0)
    raw = RawConn(ctl.address)
    try:
        conn = _accepted(ctl)
        ctl.trust(conn)
        sent = 3 * MAX_FRAMES_PER_POLL
        raw.send(*(i.to_bytes(8, "little") for i in range(sent)))
        got: list[int] = []
        end = time.monotonic() + 10.0
        while len(got) < sent and time.monotonic() < end:
            batch = ctl.poll(5.0)  # never waits while frames are buffered
            assert len(batch) <= MAX_FRAMES_PER_POLL
            got.extend(int.from_bytes(b.frame, "little") for b in batch)
        assert got == list(range(sent))
    finally:
        raw.close()
        ctl.close()


def test_one_poll_holds_a_bounded_number_of_bytes() -> None:
    """Frames of up to 4 MiB from a proven peer: a poll reads at most
    MAX_BYTES_PER_POLL (and one frame more), the rest the next."""
    from p2p_kv.control.transport import MAX_BYTES_PER_POLL, ControlTransport
    from p2p_kv.protocol import MAX_FRAME_BYTES

    ctl = ControlTransport("127.0.0.1", 0)
    raw = RawConn(ctl.address)
    stop = threading.Event()
    sent = 2 * MAX_BYTES_PER_POLL // MAX_FRAME_BYTES + 4

    def flood() -> None:
        for i in range(sent):
            if stop.is_set():
                return
            raw.send(i.to_bytes(8, "little") * (MAX_FRAME_BYTES // 8))

    sender = threading.Thread(target=flood, daemon=True)
    try:
        conn = _accepted(ctl)
        ctl.trust(conn)
        sender.start()
        time.sleep(0.5)
        got: list[int] = []
        end = time.monotonic() + 30.0
        while len(got) < sent and time.monotonic() < end:
            batch = ctl.poll(0.05)
            assert (
                sum(len(b.frame) for b in batch) < MAX_BYTES_PER_POLL + MAX_FRAME_BYTES
            )
            got.extend(int.from_bytes(b.frame[:8], "little") for b in batch)
        assert got == list(range(sent))
    finally:
        stop.set()
        raw.close()
        if sender.is_alive():
            sender.join(5)
        ctl.close()


def test_a_flood_on_the_port_does_not_starve_the_peers_we_dialled() -> None:
    """The peers we dialled are read first, each to a share of the poll's
    byte budget: a flood of 4 MiB frames on our port (from a peer that
    proved itself) must not leave a reply from a peer we dialled unread."""
    from p2p_kv.control.transport import ControlTransport
    from p2p_kv.protocol import MAX_FRAME_BYTES

    ours = ControlTransport("127.0.0.1", 0)
    theirs = ControlTransport("127.0.0.1", 0)
    flood = RawConn(ours.address)
    stop = threading.Event()

    def send_flood() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                flood.send(b"\x00" * (MAX_FRAME_BYTES - 64))

    sender = threading.Thread(target=send_flood, daemon=True)
    try:
        ours.trust(_accepted(ours))
        ours.connect(theirs.address)
        assert ours.send(theirs.address, [b"hello"]) == ""
        conn = ""
        end = time.monotonic() + 5.0
        while not conn and time.monotonic() < end:
            ours.poll(0.01)  # our dial completes, and its frame leaves, here
            conn = next((x.conn for x in theirs.poll(0.01) if x.frame == b"hello"), "")
        assert conn, "the dial never arrived"
        sender.start()
        time.sleep(0.5)
        assert theirs.send(conn, [b"reply"]) == ""
        time.sleep(0.2)
        batch = ours.poll(0.05)
        assert any(x.frame == b"reply" for x in batch), "the reply waited"
    finally:
        stop.set()
        flood.close()
        if sender.is_alive():
            sender.join(5)
        ours.close()
        theirs.close()


def test_a_dial_nothing_accepts_is_lost_at_once_saying_so() -> None:
    """A dial to a port where nothing listens ends at once, said to be
    refused (not a lost connection, nor a name that did not resolve), so
    its requests recompute without waiting out the handshake."""
    from p2p_kv.control.transport import REFUSED, ControlTransport

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dialler = ControlTransport("127.0.0.1", 0)
    peer = f"127.0.0.1:{port}"
    try:
        dialler.connect(peer)
        t0 = time.monotonic()
        lost = []
        while not lost and time.monotonic() - t0 < 2.0:
            lost = [i for i in dialler.poll(0.05) if i.lost]
        assert [(i.conn, REFUSED in i.why) for i in lost] == [(peer, True)], lost
        assert time.monotonic() - t0 < 0.5
        assert not dialler.connected(peer)
    finally:
        dialler.close()


def test_a_name_that_does_not_resolve_is_lost_saying_so() -> None:
    """Resolving runs off the engine's thread, and a name nobody knows ends
    the dial with its own reason."""
    from p2p_kv.control.transport import ControlTransport

    dialler = ControlTransport("127.0.0.1", 0)
    peer = "no-such-host.invalid:5800"
    try:
        t0 = time.monotonic()
        dialler.connect(peer)
        assert time.monotonic() - t0 < 0.05, "connect() resolved on our thread"
        lost = []
        while not lost and time.monotonic() - t0 < 10.0:
            lost = [i for i in dialler.poll(0.05) if i.lost]
        assert len(lost) == 1 and "cannot resolve the host 'no-such-host.invalid'" in (
            lost[0].why
        ), lost
    finally:
        dialler.close()


def test_frames_queued_before_a_name_resolves_arrive_in_order() -> None:
    from p2p_kv.control.transport import ControlTransport

    server = ControlTransport("127.0.0.1", 0)
    dialler = ControlTransport("127.0.0.1", 0)
    peer = f"localhost:{server.port}"
    try:
        dialler.connect(peer)
        for i in range(3):
            assert dialler.send(peer, [bytes([i]) * (i + 1)]) == ""
        got: list[bytes] = []
        end = time.monotonic() + 5.0
        while len(got) < 3 and time.monotonic() < end:
            dialler.poll(0.01)
            got += [x.frame for x in server.poll(0.01) if x.frame]
        assert got == [b"\x00", b"\x01\x01", b"\x02\x02\x02"]
        assert dialler.connected(peer)
    finally:
        dialler.close()
        server.close()


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
    from p2p_kv.control.transport import ControlTransport

    with pytest.raises(ValueError, match=says):
        ControlTransport(host, port)


def test_a_failed_bind_names_what_to_fix() -> None:
    """Every failed bind said "pick a free port", also for a host that is
    not an address of this machine."""
    from p2p_kv.control.transport import ControlTransport

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
    import p2p_kv.runtime.stack
    from p2p_kv.data import NixlDataTransport

    made: list[NixlDataTransport] = []

    class Recorded(NixlDataTransport):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(p2p_kv.runtime.stack, "NixlDataTransport", Recorded)
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
    from p2p_kv.control.transport import ControlTransport

    control = ControlTransport("127.0.0.1", 0)
    control.close()
    control.close()


def test_an_ipv6_host_may_be_written_in_brackets() -> None:
    from p2p_kv.control.transport import ControlTransport

    control = ControlTransport("[::1]", 0)
    try:
        assert control.address == f"[::1]:{control.port}"
    finally:
        control.close()


def test_a_source_that_is_no_p2p_kv_peer_recomputes_at_once_counted_by_why() -> None:
    """A request naming a port nothing listens on, a port another protocol
    serves (an engine's API port, the usual mistake), or a name that does
    not resolve: each recomputes well inside ``lookup_timeout_s``, never
    waiting for the client, and is counted by reason, so an alert sees a
    router that sends requests to a wrong address. The one that answered in
    HTTP is not taken for an attack."""
    # What an engine's API server (uvicorn) answers to bytes that are no
    # HTTP request: a 400 at once.
    http_server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = http_server.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(
                        b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain"
                        b"\r\ncontent-length: 24\r\n\r\nInvalid HTTP request."
                    )

    threading.Thread(target=answer, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    lookup_s = 3.0
    peer = StandalonePeer(
        16,
        BLOCK,
        engine_id=f"misdial-{os.getpid()}",
        timeouts=Timeouts(lookup_s=lookup_s),
    )
    sources = {
        f"127.0.0.1:{closed_port}": "refused",
        f"127.0.0.1:{http_server.getsockname()[1]}": "not_p2p_kv",
        "no-such-host.invalid:5800": "unresolvable",
    }
    try:
        for i, (source, reason) in enumerate(sources.items()):
            t0 = time.monotonic()
            out = peer.fetch(source, f"kv-{i}", [make_key(i)], [i], timeout_s=10.0)
            took = time.monotonic() - t0
            assert out.hits == 0 and not out.ok, out
            assert took < lookup_s, (source, took)
            assert peer.manager.dial_failures.get(reason) == 1, (
                source,
                peer.manager.dial_failures,
            )
        assert "framing" not in peer.manager.protocol_errors
    finally:
        peer.close()
        http_server.close()


def test_a_peer_restarted_under_its_address_is_counted_and_its_old_blocks_miss() -> (
    None
):
    """A pod restarted under the same address (a router's index still names
    what the old one held): the new engine answers the dial, the request's
    blocks miss at once, and the restart is counted
    (``dial_failures{reason="restarted"}``), so an alert can tell a router
    whose view of the fleet is stale."""
    consumer = StandalonePeer(16, BLOCK, engine_id=f"restart-c-{os.getpid()}")
    first = StandalonePeer(16, BLOCK, engine_id=f"restart-p1-{os.getpid()}")
    port = int(first.address.rpartition(":")[2])
    keys = [make_key(i) for i in range(4)]
    try:
        first.fill(keys, list(range(4)))
        stop = threading.Event()

        def serve(p: StandalonePeer) -> None:
            while not stop.is_set():
                p.step()

        t = threading.Thread(target=serve, args=(first,), daemon=True)
        t.start()
        out = consumer.fetch(first.address, "kv-1", keys, list(range(4)))
        assert out.ok and out.hits == 4, out
        stop.set()
        t.join()
        first.close()
        second = StandalonePeer(
            16, BLOCK, engine_id=f"restart-p2-{os.getpid()}", port=port
        )
        stop.clear()
        t = threading.Thread(target=serve, args=(second,), daemon=True)
        t.start()
        try:
            # The consumer sees its session end, and waits out its
            # reconnect backoff (its requests meanwhile recompute).
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                consumer.step()
            t0 = time.monotonic()
            out = consumer.fetch(second.address, "kv-1", keys, list(range(4, 8)))
            assert out.hits == 0, out
            assert time.monotonic() - t0 < 2.0
            assert consumer.manager.dial_failures.get("restarted") == 1
        finally:
            stop.set()
            t.join()
            second.close()
    finally:
        consumer.close()
