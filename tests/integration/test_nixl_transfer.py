"""Real NIXL agents in two processes, writing over UCX on loopback.

Two long-lived worker processes (a producer and a consumer) each own one
:class:`NixlDataTransport` per block size. They exchange ``RegionInfo`` as
msgspec-encoded bytes through the parent, exactly as the handshake will,
and the parent drives them with commands over pipes. The parent tracks what
every consumer slot must hold (a CRC per block) and compares the whole
consumer region after each step, so a write that lands in the wrong slot
fails as surely as one that does not land.

Nothing here is skipped when NIXL is missing: the workers import it, and
their failure is reported as a test failure.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
from tests.support.sockets import TCP_ONLY

from p2p_kv.data import RegionInfo

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = (4 * KIB, 64 * KIB, 2 * MIB)
COUNTS = (1, 7, 64)
PRODUCER_BLOCKS = 80
CONSUMER_BLOCKS = 150
STEP_TIMEOUT_S = 20.0

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------


def _make_region(kind: str, nbytes: int, bs: int) -> tuple[Any, np.ndarray[Any, Any]]:
    """A region of the given flavour plus a numpy view of its bytes."""
    if kind == "memoryview2d":  # what vLLM hands a tier
        buf = bytearray(nbytes)
        return memoryview(buf).cast("B", (nbytes // bs, bs)), np.frombuffer(
            buf, np.uint8
        )
    if kind == "torch":
        import torch

        t = torch.zeros(nbytes, dtype=torch.uint8)
        return t, t.numpy()
    arr = np.zeros(nbytes, dtype=np.uint8)
    return arr, arr


def _worker(
    conn: mpc.Connection, role: str, layout: dict[int, tuple[str, int]]
) -> None:
    try:
        from p2p_kv.data import NixlDataTransport

        transports: dict[int, NixlDataTransport] = {}
        views: dict[int, np.ndarray[Any, Any]] = {}
        regions: list[Any] = []
        for bs, (kind, nblocks) in layout.items():
            region, view = _make_region(kind, bs * nblocks, bs)
            regions.append(region)
            transports[bs] = NixlDataTransport(region, bs, name=role)
            views[bs] = view.reshape(nblocks, bs)
        conn.send(
            (
                "ready",
                {
                    bs: msgspec.msgpack.encode(t.local_region())
                    for bs, t in transports.items()
                },
            )
        )
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return

    def crcs(bs: int) -> list[int]:
        return [zlib.crc32(row.data) for row in views[bs]]

    def fill(bs: int, seed: int) -> list[int]:
        v = views[bs]
        rng = np.random.default_rng(seed)
        v[:] = rng.integers(0, 256, size=v.shape, dtype=np.uint8)
        return crcs(bs)

    def add_peer(bs: int, wire: bytes) -> str:
        info = msgspec.msgpack.decode(wire, type=RegionInfo)
        transports[bs].add_peer(info)
        return info.agent_name

    def write(
        bs: int, peer: str, src: list[int], dst: list[int], notif: bytes
    ) -> tuple[bool, float, int]:
        t = transports[bs]
        start = time.perf_counter()
        tid = t.post_write(peer, src, dst, notif)
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            for done, ok in t.poll_completions():
                assert done == tid, (done, tid)
                return ok, time.perf_counter() - start, t.in_flight()
        raise TimeoutError(f"transfer {tid} did not complete")

    def read(
        bs: int, peer: str, remote: list[int], local: list[int]
    ) -> tuple[bool, int]:
        """One-sided READ from the peer; the peer's process does nothing."""
        t = transports[bs]
        tid = t.post_read(peer, remote, local)
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            for done, ok in t.poll_completions():
                assert done == tid, (done, tid)
                return ok, t.in_flight()
        raise TimeoutError(f"read {tid} did not complete")

    def wait_notif(bs: int, expected: bytes) -> list[tuple[str, bytes]]:
        t = transports[bs]
        seen: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            seen.extend(t.poll_notifs())
            if any(msg == expected for _, msg in seen):
                return seen
            time.sleep(0.0001)
        raise TimeoutError(f"notification {expected!r} never came; saw {seen}")

    def post_and(
        bs: int, peer: str, src: list[int], dst: list[int], action: str
    ) -> tuple[int, list[tuple[int, bool]], int]:
        """Post, then cancel / drop the peer at once; collect what is reported."""
        t = transports[bs]
        tid = t.post_write(peer, src, dst, b"")
        if action == "cancel":
            t.cancel(tid)
        elif action == "remove_peer":
            t.remove_peer(peer)
        reported: list[tuple[int, bool]] = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            reported.extend(t.poll_completions())
            if t.in_flight() == 0:
                break
        reported.extend(t.poll_completions())  # nothing may come twice
        return tid, reported, t.in_flight()

    def set_prep_max(n: int) -> int:
        """Regions above ``n`` blocks build descriptors per transfer."""
        from p2p_kv.data import remote_agents as peers

        old = peers.PREP_MAX_BLOCKS
        peers.PREP_MAX_BLOCKS = n  # type: ignore[misc]
        return old

    handlers: dict[str, Callable[..., Any]] = {
        "set_prep_max": set_prep_max,
        "crcs": crcs,
        "post_and": post_and,
        "fill": fill,
        "add_peer": add_peer,
        "remove_peer": lambda bs, name: transports[bs].remove_peer(name),
        "peers": lambda bs: transports[bs].peers(),
        "write": write,
        "read": read,
        "post_read": lambda bs, *a: transports[bs].post_read(*a),
        "post_write": lambda bs, *a: transports[bs].post_write(*a),
        "in_flight": lambda bs: transports[bs].in_flight(),
        "wait_notif": wait_notif,
        "poll_notifs": lambda bs: transports[bs].poll_notifs(),
    }
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            for t in transports.values():
                t.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[msg[0]](*msg[1:])))
        except Exception as exc:
            conn.send(("exc", type(exc).__name__, str(exc), traceback.format_exc()))


# ---------------------------------------------------------------------------
# Parent-side handles
# ---------------------------------------------------------------------------


class WorkerError(Exception):
    def __init__(self, kind: str, message: str, tb: str) -> None:
        super().__init__(f"{kind}: {message}\n{tb}")
        self.kind = kind
        self.message = message


@dataclass
class Worker:
    proc: Any
    conn: mpc.Connection
    infos: dict[int, bytes] = field(default_factory=dict)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def result(self) -> Any:
        if not self.conn.poll(STEP_TIMEOUT_S + 10):
            raise TimeoutError("worker did not answer")
        reply = self.conn.recv()
        if reply[0] == "exc":
            raise WorkerError(reply[1], reply[2], reply[3])
        assert reply[0] == "ok", reply
        return reply[1]

    def call(self, *msg: Any) -> Any:
        self.send(*msg)
        return self.result()

    def name(self, bs: int) -> str:
        return msgspec.msgpack.decode(self.infos[bs], type=RegionInfo).agent_name


def _start(ctx: Any, role: str, layout: dict[int, tuple[str, int]]) -> Worker:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, role, layout), daemon=True)
    proc.start()
    child.close()
    return Worker(proc, parent)


def _ready(w: Worker) -> None:
    if not w.conn.poll(60):
        raise TimeoutError("worker did not start")
    reply = w.conn.recv()
    if reply[0] != "ready":
        pytest.fail(f"worker failed to start (is nixl installed?):\n{reply[1]}")
    w.infos = reply[1]


@dataclass
class Pair:
    producer: Worker
    consumer: Worker
    src_crcs: dict[int, list[int]]
    # What each consumer slot must hold, per block size.
    expected: dict[int, list[int]]

    def transfer(
        self, bs: int, src: list[int], dst: list[int], notif: bytes
    ) -> tuple[bool, float, list[tuple[str, bytes]]]:
        """Producer WRITEs; consumer polls notifications meanwhile."""
        self.consumer.send("wait_notif", bs, notif)
        ok, seconds, left = self.producer.call(
            "write", bs, self.consumer.name(bs), src, dst, notif
        )
        seen = self.consumer.result()
        assert left == 0
        if ok:
            for s, d in zip(src, dst, strict=True):
                self.expected[bs][d] = self.src_crcs[bs][s]
        return ok, seconds, seen

    def read(self, bs: int, src: list[int], dst: list[int]) -> bool:
        """Consumer READs the producer's ``src`` blocks into its ``dst``."""
        ok, left = self.consumer.call("read", bs, self.producer.name(bs), src, dst)
        assert left == 0
        if ok:
            for s, d in zip(src, dst, strict=True):
                self.expected[bs][d] = self.src_crcs[bs][s]
        return bool(ok)

    def check_consumer(self, bs: int) -> None:
        got = self.consumer.call("crcs", bs)
        bad = [
            i
            for i, (g, e) in enumerate(zip(got, self.expected[bs], strict=True))
            if g != e
        ]
        assert not bad, f"consumer slots with wrong bytes ({bs} B blocks): {bad[:10]}"


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    ctx = mp.get_context("spawn")
    kinds = {4 * KIB: "torch", 64 * KIB: "numpy", 2 * MIB: "numpy"}
    producer = _start(
        ctx, "producer", {bs: (kinds[bs], PRODUCER_BLOCKS) for bs in BLOCK_SIZES}
    )
    consumer = _start(
        ctx,
        "consumer",
        {
            4 * KIB: ("numpy", CONSUMER_BLOCKS),
            64 * KIB: ("memoryview2d", CONSUMER_BLOCKS),
            2 * MIB: ("numpy", CONSUMER_BLOCKS),
        },
    )
    try:
        _ready(producer)
        _ready(consumer)
        src_crcs: dict[int, list[int]] = {}
        expected: dict[int, list[int]] = {}
        for bs in BLOCK_SIZES:
            producer.call("add_peer", bs, consumer.infos[bs])
            consumer.call("add_peer", bs, producer.infos[bs])
            src_crcs[bs] = producer.call("fill", bs, bs)
            expected[bs] = consumer.call("crcs", bs)
        assert len(set(src_crcs[4 * KIB])) == PRODUCER_BLOCKS, "blocks must differ"
        yield Pair(producer, consumer, src_crcs, expected)
    finally:
        exit_codes = []
        for w in (producer, consumer):
            try:
                if w.proc.is_alive():
                    w.call("exit")
            except Exception:
                pass
            w.proc.join(10)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            exit_codes.append(w.proc.exitcode)
    # A clean exit matters: with UCX error handling "peer", a process that
    # wrote to a peer that then died could abort on a UCX assertion here.
    assert exit_codes == [0, 0], f"workers exited with {exit_codes}"


def _mapping(count: int, seed: int) -> tuple[list[int], list[int]]:
    """Scattered destination slots (no two adjacent), shuffled sources."""
    rng = np.random.default_rng(seed)
    dst = rng.permutation(np.arange(1, CONSUMER_BLOCKS, 2))[:count]
    src = rng.permutation(PRODUCER_BLOCKS)[:count]
    return [int(x) for x in src], [int(x) for x in dst]


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_nixl_is_installed() -> None:
    """Fail loudly (never skip) where the data plane cannot run."""
    from nixl._api import nixl_agent  # noqa: F401


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("bs", BLOCK_SIZES, ids=lambda b: f"{b // KIB}KiB")
def test_write_scattered_blocks(pair: Pair, bs: int, count: int) -> None:
    src, dst = _mapping(count, seed=bs + count)
    notif = f"done-{bs}-{count}".encode()
    ok, _, seen = pair.transfer(bs, src, dst, notif)
    assert ok
    assert (pair.producer.name(bs), notif) in seen
    pair.check_consumer(bs)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("bs", BLOCK_SIZES, ids=lambda b: f"{b // KIB}KiB")
def test_read_scattered_blocks(pair: Pair, bs: int, count: int) -> None:
    src, dst = _mapping(count, seed=7 * bs + count)
    assert pair.read(bs, src, dst)
    pair.check_consumer(bs)


def test_read_coalesced_runs(pair: Pair) -> None:
    bs = 64 * KIB
    assert pair.read(bs, [*range(30, 46), 3], [*range(60, 76), 90])
    pair.check_consumer(bs)


def test_out_of_range_read_raises_before_anything_moves(pair: Pair) -> None:
    bs = 4 * KIB
    before = pair.consumer.call("crcs", bs)
    peer = pair.producer.name(bs)
    with pytest.raises(WorkerError) as err:
        pair.consumer.call("post_read", bs, peer, [PRODUCER_BLOCKS], [0])
    assert err.value.kind == "ValueError" and str(PRODUCER_BLOCKS) in err.value.message
    with pytest.raises(WorkerError) as err:
        pair.consumer.call("post_read", bs, peer, [0], [CONSUMER_BLOCKS])
    assert err.value.kind == "ValueError" and str(CONSUMER_BLOCKS) in err.value.message
    assert pair.consumer.call("in_flight", bs) == 0
    assert pair.consumer.call("crcs", bs) == before


def test_unprepared_descriptors_for_large_regions(pair: Pair) -> None:
    """Past PREP_MAX_BLOCKS each transfer builds coalesced descriptors
    itself: the same bytes land, both ways."""
    bs = 64 * KIB
    old = [w.call("set_prep_max", 0) for w in (pair.producer, pair.consumer)]
    try:
        ok, _, _ = pair.transfer(bs, [*range(50, 54), 9], [*range(80, 84), 11], b"u")
        assert ok
        assert pair.read(bs, [60, 61, 62, 5], [40, 41, 42, 100])
        pair.check_consumer(bs)
    finally:
        for w, n in zip((pair.producer, pair.consumer), old, strict=True):
            w.call("set_prep_max", n)


def test_write_coalesced_runs(pair: Pair) -> None:
    """Runs on both sides travel as one descriptor each; bytes still land right."""
    bs = 64 * KIB
    src = [*range(10, 26), *range(40, 44), 70]
    dst = [*range(100, 116), *range(2, 6), 0]
    ok, _, _ = pair.transfer(bs, src, dst, b"runs")
    assert ok
    pair.check_consumer(bs)


def test_out_of_range_dst_raises_before_anything_moves(pair: Pair) -> None:
    bs = 4 * KIB
    before = pair.consumer.call("crcs", bs)
    peer = pair.consumer.name(bs)
    with pytest.raises(WorkerError) as err:
        pair.producer.call("post_write", bs, peer, [0, 1], [3, CONSUMER_BLOCKS], b"bad")
    assert err.value.kind == "ValueError"
    assert f"dst block index {CONSUMER_BLOCKS}" in err.value.message
    with pytest.raises(WorkerError) as err:
        pair.producer.call("post_write", bs, peer, [PRODUCER_BLOCKS], [0], b"bad")
    assert err.value.kind == "ValueError"
    assert f"src block index {PRODUCER_BLOCKS}" in err.value.message
    assert pair.producer.call("in_flight", bs) == 0
    time.sleep(0.05)
    assert pair.consumer.call("poll_notifs", bs) == []
    assert pair.consumer.call("crcs", bs) == before


def test_unknown_peer_raises(pair: Pair) -> None:
    with pytest.raises(WorkerError) as err:
        pair.producer.call("post_write", 4 * KIB, "nobody", [0], [0], b"")
    assert err.value.kind == "KeyError"


def test_remove_peer_then_add_again(pair: Pair) -> None:
    bs = 64 * KIB
    producer_name = pair.producer.name(bs)
    consumer_name = pair.consumer.name(bs)
    # Consumer drops the producer while nothing is in flight, then re-adds it.
    pair.consumer.call("remove_peer", bs, producer_name)
    assert pair.consumer.call("peers", bs) == []
    pair.consumer.call("remove_peer", bs, producer_name)  # idempotent
    pair.consumer.call("add_peer", bs, pair.producer.infos[bs])
    pair.consumer.call("add_peer", bs, pair.producer.infos[bs])  # idempotent
    assert pair.consumer.call("peers", bs) == [producer_name]
    ok, _, _ = pair.transfer(bs, [1, 2, 3], [20, 22, 24], b"after-consumer-readd")
    assert ok
    pair.check_consumer(bs)
    # Producer drops the consumer: writes to it are refused until re-added.
    pair.producer.call("remove_peer", bs, consumer_name)
    with pytest.raises(WorkerError) as err:
        pair.producer.call("post_write", bs, consumer_name, [0], [0], b"")
    assert err.value.kind == "KeyError"
    pair.producer.call("add_peer", bs, pair.consumer.infos[bs])
    ok, _, _ = pair.transfer(bs, [5], [30], b"after-producer-readd")
    assert ok
    pair.check_consumer(bs)


def test_idle_transport_uses_no_cpu(pair: Pair) -> None:
    """No spinning progress thread: an idle process stays near 0% CPU."""
    # Let any connection wire-up settle first.
    pair.transfer(4 * KIB, [0], [1], b"warm")
    procs = [psutil.Process(w.proc.pid) for w in (pair.producer, pair.consumer)]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    t0 = time.monotonic()
    time.sleep(1.0)
    elapsed = time.monotonic() - t0
    after = [sum(p.cpu_times()[:2]) for p in procs]
    for role, b, a in zip(("producer", "consumer"), before, after, strict=True):
        share = (a - b) / elapsed
        assert share < 0.05, f"idle {role} used {share:.1%} of a core"


def test_write_completes_while_receiver_is_not_polling(pair: Pair) -> None:
    """With error handling "none" a WRITE needs nothing from the receiver.

    The consumer sits blocked on its pipe (no NIXL call at all) while the
    producer writes; the notification waits for the consumer's next poll.
    (The connection is wired up by earlier tests; about 255 unread
    notifications would stall further WRITEs.)
    """
    bs = 64 * KIB
    notif = b"nobody-polling"
    ok, seconds, left = pair.producer.call(
        "write", bs, pair.consumer.name(bs), [7, 8], [60, 62], notif
    )
    assert ok and left == 0
    assert seconds < 1.0
    pair.expected[bs][60] = pair.src_crcs[bs][7]
    pair.expected[bs][62] = pair.src_crcs[bs][8]
    pair.check_consumer(bs)
    seen = pair.consumer.call("wait_notif", bs, notif)
    assert (pair.producer.name(bs), notif) in seen


@pytest.mark.parametrize("action", ["none", "cancel", "remove_peer"])
def test_every_transfer_is_reported_exactly_once(pair: Pair, action: str) -> None:
    bs = 4 * KIB
    peer = pair.consumer.name(bs)
    tid, reported, left = pair.producer.call(
        "post_and", bs, peer, [10, 11], [70, 71], action
    )
    assert [r[0] for r in reported] == [tid]
    assert left == 0
    if action == "remove_peer":
        assert pair.producer.call("peers", bs) == []
        pair.producer.call("add_peer", bs, pair.consumer.infos[bs])
    if reported[0][1]:
        pair.expected[bs][70] = pair.src_crcs[bs][10]
        pair.expected[bs][71] = pair.src_crcs[bs][11]
    pair.check_consumer(bs)


def test_dead_peer_fails_the_transfer_not_the_process(pair: Pair) -> None:
    """A consumer that dies turns later WRITEs into failed completions."""
    bs = 4 * KIB
    victim = _start(mp.get_context("spawn"), "victim", {bs: ("numpy", 16)})
    try:
        _ready(victim)
        name = victim.name(bs)
        pair.producer.call("add_peer", bs, victim.infos[bs])
        ok, _, _ = pair.producer.call("write", bs, name, [0], [3], b"alive")
        assert ok
        victim.proc.kill()
        victim.proc.join(10)
        ok, _, left = pair.producer.call("write", bs, name, [1], [4], b"dead")
        assert not ok
        assert left == 0
        pair.producer.call("remove_peer", bs, name)
    finally:
        if victim.proc.is_alive():
            victim.proc.kill()
    # The producer keeps serving everyone else.
    ok, _, _ = pair.transfer(bs, [2], [5], b"still-serving")
    assert ok
    pair.check_consumer(bs)


# ---------------------------------------------------------------------------
# Same-host copies: the data plane maps a peer's shared region itself
# ---------------------------------------------------------------------------


def _read_all(t: Any, agent: str, remote: list[int], local: list[int]) -> bool:
    tid = t.post_read(agent, remote, local)
    end = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < end:
        for done, ok in t.poll_completions():
            assert done == tid
            return bool(ok)
    raise AssertionError("READ not reported")


def test_same_host_copy_only_from_the_process_we_talk_to() -> None:
    """A peer's region is opened for copies only when the pid it names holds
    the far end of our control connection; with another connection's far
    end held elsewhere, or none (an inbound session), its READs go through
    NIXL. Both movers land the same bytes."""
    import socket
    import subprocess

    from p2p_kv.data import NixlDataTransport
    from p2p_kv.data.procfs import socket_inode
    from p2p_kv.runtime.standalone import shared_region

    bs, n = 4 * KIB, 32
    src = shared_region(n * bs)
    src[:] = np.random.default_rng(5).integers(0, 256, src.size, dtype=np.uint8)
    rows = src.reshape(n, bs)
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        ours = stack.enter_context(socket.socket())
        ours.connect(listener.getsockname())
        far = stack.enter_context(listener.accept()[0])  # we play the producer
        # A connection whose far end another process holds.
        elsewhere = stack.enter_context(socket.socket())
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen()
        nc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import socket,sys,time;"
                "s=socket.create_connection(('127.0.0.1',int(sys.argv[1])));"
                "time.sleep(30)",
                str(elsewhere.getsockname()[1]),
            ]
        )
        stack.callback(nc.wait)
        stack.callback(nc.kill)
        theirs = stack.enter_context(elsewhere.accept()[0])
        assert far.fileno() > 0
        producer = stack.enter_context(NixlDataTransport(src, bs, name="sh-prod"))
        info = producer.local_region()
        assert info.shm is not None and info.shm.length == n * bs
        conns = {
            "inbound": None,
            "impostor": socket_inode(theirs.fileno()),  # far end: the child
            "ours": socket_inode(ours.fileno()),
        }
        for case, conn in conns.items():
            dst = shared_region(n * bs)
            c = stack.enter_context(NixlDataTransport(dst, bs, name=f"sh-{case}"))
            c.add_peer(info, conn_inode=conn)
            assert c.same_host_peers == (case == "ours"), case
            remote, local = [3, 4, 5, 20, 9], [0, 1, 2, 30, 11]
            assert _read_all(c, info.agent_name, remote, local)
            assert c.local_reads == (case == "ours"), case
            got = dst.reshape(n, bs)
            for r, ll in zip(remote, local, strict=True):
                assert np.array_equal(got[ll], rows[r]), (case, r, ll)
            c.remove_peer(info.agent_name)
            assert c.same_host_peers == 0


# ---------------------------------------------------------------------------
# READs given up on while they run: staging (p2p_kv.data.staged)
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _tcp_pair(
    monkeypatch: pytest.MonkeyPatch, bs: int, n: int, staging: int, tag: str
) -> Iterator[tuple[Any, Any, Any, Any]]:
    """A producer and a consumer over UCX's TCP transport, where a READ
    needs the peer's progress: a peer that makes no NIXL call (a stalled
    engine) leaves our READs running for as long as we like."""
    from p2p_kv.data import NixlDataTransport

    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    src = np.random.default_rng(5).integers(1, 256, n * bs, dtype=np.uint8)
    dst = np.zeros(n * bs, dtype=np.uint8)
    with (
        NixlDataTransport(src, bs, name=f"{tag}-prod", same_host=False) as prod,
        NixlDataTransport(
            dst,
            bs,
            name=f"{tag}-cons",
            same_host=False,
            drain_timeout_s=0.3,
            read_staging_bytes=staging,
        ) as cons,
    ):
        cons.add_peer(prod.local_region())
        prod.add_peer(cons.local_region())
        yield prod, cons, src.reshape(n, bs), dst.reshape(n, bs)


@contextlib.contextmanager
def _patched(agent: Any, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    """A real NIXL agent's method ``name`` replaced by ``fn`` for the block,
    then deleted so that the class's method shows again. Not
    ``monkeypatch``: it restores by setting the bound method on the
    instance, a reference cycle through the agent, which then outlives
    its transport's close() and is torn down by the collector later, at
    whatever moment a collection happens to run (in the middle of a later
    test, with other agents alive)."""
    setattr(agent, name, fn)
    try:
        yield
    finally:
        delattr(agent, name)


def _completions(prod: Any, cons: Any) -> list[tuple[int, bool]]:
    """The consumer's first completions, the producer progressing."""
    end = time.monotonic() + STEP_TIMEOUT_S
    done: list[tuple[int, bool]] = []
    while not done and time.monotonic() < end:
        prod.poll_notifs()
        done = cons.poll_completions()
    return done


def _reported_alone(t: Any) -> list[tuple[int, bool]]:
    """``t``'s first completions, polled while its peer stays stalled."""
    end = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < end:
        if done := t.poll_completions():
            return list(done)
        time.sleep(0.005)
    return []


def _progress(*transports: Any, rounds: int = 100) -> None:
    """The stalled peer wakes up: everyone progresses UCX a while."""
    for _ in range(rounds):
        for t in transports:
            t.poll_notifs()
            t.poll_completions()
        time.sleep(0.005)


@pytest.mark.parametrize("how", ["cancel", "remove_peer"])
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in_place"])
def test_a_read_given_up_on_while_it_runs_lands_only_in_staging(
    monkeypatch: pytest.MonkeyPatch, how: str, staged: bool
) -> None:
    """A READ is not stopped by NIXL: over TCP its reply lands when the
    peer progresses again, after we reported it failed and the engine
    reused its slots. Staged (the default), it lands in staging, which
    stays taken until UCX ends the READ; in place (read_staging_bytes 0,
    the opt-out) it writes the reused slots: what the knob trades."""
    bs, n = 64 * KIB, 16
    staging = 8 * bs if staged else 0
    with _tcp_pair(monkeypatch, bs, n, staging, f"hole-{how}") as (prod, cons, _, got):
        tid = cons.post_read(prod.agent_name, [0, 1, 2, 3], [4, 5, 6, 7])
        time.sleep(0.3)
        assert cons.poll_completions() == [] and cons.in_flight() == 1
        t0 = time.monotonic()
        if how == "cancel":
            cons.cancel(tid)
        else:
            cons.remove_peer(prod.agent_name)  # what a dead session's fence does
        took = time.monotonic() - t0
        if staged or how == "cancel":
            # The caller does not wait: a staged READ ends at once (the
            # engine's slots are not what it can write), an in-place one
            # is reported failed (and unstopped) at its drain bound.
            assert took < 0.1, took
        reported = cons.poll_completions()
        if not staged and how == "cancel":
            assert reported == []
            reported = _reported_alone(cons)
            assert cons.take_unstopped() == {tid}
        assert reported == [(tid, False)]
        if staged:
            assert cons.staging_blocks() == (8, 4, 4)
            if how == "remove_peer":
                assert cons.peers() == []
        _progress(prod, cons)
        landed = [s for s in (4, 5, 6, 7) if got[s].any()]
        if staged:
            assert landed == [], f"a failed READ wrote slots {landed} afterwards"
            # It ended: its staging is free, the removed peer's agent gone.
            assert cons.staging_blocks() == (8, 8, 0)
            assert cons._peers.retiring == {}
        else:
            assert landed == [4, 5, 6, 7]


def test_closing_after_a_dead_peers_reads_frees_the_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """READs that failed with their peer's endpoint (it closed mid-READ)
    cannot land once its agent is dropped, which close does: their
    staging was still kept for the life of the process, as for READs that
    may still run."""
    from p2p_kv.data import NixlDataTransport, staged

    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    bs, n = 64 * KIB, 16
    src = np.ones(n * bs, dtype=np.uint8)
    dst = np.zeros(n * bs, dtype=np.uint8)
    prod = NixlDataTransport(src, bs, name="dead-prod", same_host=False)
    cons = NixlDataTransport(
        dst, bs, name="dead-cons", same_host=False, read_staging_bytes=8 * bs
    )
    kept = len(staged._KEPT_STAGING)
    try:
        cons.add_peer(prod.local_region())
        cons.post_read(prod.agent_name, list(range(10)), list(range(10)))
        time.sleep(0.2)
        cons.poll_completions()
        prod.close()
        end = time.monotonic() + STEP_TIMEOUT_S
        while not cons._staging.zombies or not all(
            z.gone for z in cons._staging.zombies
        ):
            assert time.monotonic() < end, [
                (z.gone, z.lost) for z in cons._staging.zombies
            ]
            cons.poll_completions()
            time.sleep(0.01)
    finally:
        cons.close()
        prod.close()
    assert len(staged._KEPT_STAGING) == kept


def test_staging_larger_than_the_region_is_the_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``read_staging_mib`` given in the wrong unit (a PiB): staging is
    made the region's size, and a staged READ loads; it was allocated as
    asked, and every staged READ failed to recompute."""
    bs, n = 4 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 1 << 50, "huge") as (prod, cons, src, got):
        tid = cons.post_read(prod.agent_name, [0, 1, 5], [2, 3, 9])
        assert _completions(prod, cons) == [(tid, True)]
        assert np.array_equal(got[[2, 3, 9]], src[[0, 1, 5]])
        assert cons.staging_blocks() == (n, n, 0)


def test_staging_that_cannot_be_made_fails_reads_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Memory short at the first staged READ: each READ fails (to
    recompute) and tries again, the log says why once, not per READ."""
    from p2p_kv.data import staged

    def short(*_: object, **__: object) -> None:
        raise MemoryError("no room for staging")

    bs, n = 4 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 4 * bs, "short") as (prod, cons, src, got):
        monkeypatch.setattr(staged, "StagingMemory", short)
        with caplog.at_level("WARNING", logger="p2p_kv.data"):
            tids = [cons.post_read(prod.agent_name, [i], [i]) for i in range(3)]
        assert cons.poll_completions() == [(t, False) for t in tids]
        said = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
        assert len(said) == 1 and "no room for staging" in said[0], said
        monkeypatch.undo()  # the memory freed: the next READ makes it
        tid = cons.post_read(prod.agent_name, [7], [7])
        assert _completions(prod, cons) == [(tid, True)]
        assert np.array_equal(got[7], src[7])


def test_a_removed_peer_that_comes_back_while_its_read_runs_is_taken_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stalled producer's session is dropped and it reconnects with the
    same region while our READ from it still runs: its agent was kept for
    that READ, so it is taken back as it was, and serves new READs."""
    bs, n = 4 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 4 * bs, "back") as (prod, cons, src, got):
        tid = cons.post_read(prod.agent_name, [0, 1], [2, 3])
        cons.remove_peer(prod.agent_name)
        assert cons.poll_completions() == [(tid, False)]
        assert list(cons._peers.retiring) == [prod.agent_name]
        cons.add_peer(prod.local_region())
        assert cons.peers() == [prod.agent_name] and cons._peers.retiring == {}
        tid = cons.post_read(prod.agent_name, [5], [9])
        assert _completions(prod, cons) == [(tid, True)]
        assert np.array_equal(got[9], src[5])
        assert not got[2].any() and not got[3].any()
        _progress(prod, cons, rounds=20)
        assert cons.staging_blocks() == (4, 4, 0)


def test_a_read_larger_than_staging_moves_in_pieces_and_waits_for_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """13 scattered blocks through 3 staging blocks, while a READ given up
    on holds one of them: the new READ goes in pieces of what is free and
    its bytes all land where they belong."""
    bs, n = 4 * KIB, 32
    with _tcp_pair(monkeypatch, bs, n, 3 * bs, "pieces") as (prod, cons, src, got):
        stuck = cons.post_read(prod.agent_name, [31], [31])
        cons.cancel(stuck)
        assert cons.poll_completions() == [(stuck, False)]
        assert cons.staging_blocks() == (3, 2, 1)
        local = [0, 2, 3, 4, 9, 10, 11, 12, 20, 17, 15, 1, 30]
        remote = [5, 6, 7, 8, 1, 2, 3, 4, 28, 27, 26, 25, 0]
        tid = cons.post_read(prod.agent_name, remote, local)
        assert _completions(prod, cons) == [(tid, True)]
        for ll, r in zip(local, remote, strict=True):
            assert np.array_equal(got[ll], src[r]), (ll, r)
        assert not got[31].any()
        assert cons.staging_blocks() == (3, 3, 0)


def test_a_staged_read_that_lands_inside_its_posts_ends_in_one_pass() -> None:
    """On one host UCX's CMA moves each piece inside its post. Once every
    piece in flight has landed and is being copied out, the READ waits for
    the oldest copy and goes on posting, rather than returning to wait for a
    wake-up a piece: a READ of more pieces than may be in flight is reported
    by the first poll after its post, every byte in its slot."""
    from p2p_kv.data import NixlDataTransport, staged

    bs, n = 256 * KIB, 160  # 40 MiB: ten 4 MiB pieces and the tapered tail
    assert n * bs > staged.PIECES_IN_FLIGHT * staged.PIECE_BYTES
    src = np.random.default_rng(11).integers(1, 256, n * bs, dtype=np.uint8)
    dst = np.zeros(2 * n * bs, dtype=np.uint8)
    with (
        NixlDataTransport(src, bs, name="cma-prod", same_host=False) as prod,
        NixlDataTransport(dst, bs, name="cma-cons", same_host=False) as cons,
    ):
        cons.add_peer(prod.local_region())
        prod.add_peer(cons.local_region())
        remote, local = list(range(n)), list(range(0, 2 * n, 2))
        tid = cons.post_read(prod.agent_name, remote, local)
        assert cons.poll_completions() == [(tid, True)]
        got, want = dst.reshape(2 * n, bs), src.reshape(n, bs)
        assert np.array_equal(got[local], want[remote])
        assert not got[1::2].any()


def test_a_staged_read_given_up_on_starts_no_more_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelling checked the READ's state the way polling does, which
    posts its next pieces once the first ones landed: a load being given
    up on started new READs that at once held the whole staging pool."""
    bs, n = 4 * KIB, 64
    with _tcp_pair(monkeypatch, bs, n, 8 * bs, "nomore") as (prod, cons, _, _):
        tid = cons.post_read(prod.agent_name, list(range(20)), list(range(30, 50)))
        for _ in range(50):  # the two pieces land; we do not look at them
            prod.poll_notifs()
            cons.poll_notifs()  # UCX progress, no completion taken
            time.sleep(0.002)
        cons.cancel(tid)
        assert cons.poll_completions() == [(tid, False)]
        # The two pieces had landed; none was started after them.
        assert cons.staging_blocks() == (8, 8, 0)


def test_stalled_peers_leave_staging_to_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each peer's READs take at most half of the staging the other peers
    leave. Two producers stalled mid-READ (alive, no NIXL call) took half
    of the whole pool each, and every READ from any other peer waited out
    its deadline for as long as they stalled; now they hold 4 and 2 of 8
    blocks, and a third peer's READ moves through the rest."""
    from p2p_kv.data import NixlDataTransport

    monkeypatch.setenv("UCX_TLS", TCP_ONLY)  # a READ needs the peer's progress
    bs, n = 4 * KIB, 16
    rng = np.random.default_rng(9)
    srcs = [rng.integers(1, 256, n * bs, dtype=np.uint8) for _ in range(3)]
    got = np.zeros(4 * n * bs, dtype=np.uint8)
    with contextlib.ExitStack() as stack:
        prods = [
            stack.enter_context(
                NixlDataTransport(src, bs, name=f"stall{i}-prod", same_host=False)
            )
            for i, src in enumerate(srcs)
        ]
        cons = stack.enter_context(
            NixlDataTransport(
                got, bs, name="stall-cons", same_host=False, read_staging_bytes=8 * bs
            )
        )
        for prod in prods:
            cons.add_peer(prod.local_region())
        stalled = [
            cons.post_read(
                prods[i].agent_name, list(range(n)), [*range(i * n, (i + 1) * n)]
            )
            for i in (0, 1)
        ]
        time.sleep(0.1)
        assert cons.poll_completions() == []
        assert cons.staging_blocks()[1] == 2, "the stalled peers took it all"
        tid = cons.post_read(prods[2].agent_name, [3, 1, 4, 5, 9], [*range(32, 37)])
        assert _completions(prods[2], cons) == [(tid, True)]
        rows = got.reshape(-1, bs)
        for dst, src in zip(range(32, 37), [3, 1, 4, 5, 9], strict=True):
            assert np.array_equal(rows[dst], srcs[2].reshape(-1, bs)[src])
        cons.cancel(*stalled)
        assert sorted(cons.poll_completions()) == [(t, False) for t in stalled]


def test_a_peer_that_dies_during_a_staged_read_gives_its_staging_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL raises (remote disconnect) for a READ whose peer died instead
    of reporting it failed, and such a READ was kept as one in an unknown
    state: its staging stayed taken for the life of the process, and with
    the whole pool taken, every later READ through NIXL, from any peer,
    waited out its deadline. It comes back once the peer is removed."""
    from p2p_kv.data import NixlDataTransport

    monkeypatch.setenv("UCX_TLS", TCP_ONLY)  # a READ needs the peer's progress
    bs = 4 * KIB
    victim = _start(mp.get_context("spawn"), "dies", {bs: ("numpy", 16)})
    dst = np.zeros(32 * bs, dtype=np.uint8)
    try:
        _ready(victim)
        with NixlDataTransport(
            dst,
            bs,
            name="dies-cons",
            same_host=False,
            drain_timeout_s=0.3,
            read_staging_bytes=8 * bs,
        ) as cons:
            info = msgspec.msgpack.decode(victim.infos[bs], type=RegionInfo)
            cons.add_peer(info)
            tid = cons.post_read(info.agent_name, list(range(16)), list(range(16, 32)))
            time.sleep(0.2)  # the victim makes no NIXL call: the READ waits
            # It holds the peer's share of the staging (half), no more.
            assert cons.poll_completions() == [] and cons.staging_blocks()[1] == 4
            victim.proc.kill()
            victim.proc.join(10)
            done: list[tuple[int, bool]] = []
            end = time.monotonic() + STEP_TIMEOUT_S
            while not done and time.monotonic() < end:
                done = cons.poll_completions()
                time.sleep(0.005)
            assert done == [(tid, False)]
            for _ in range(20):
                cons.poll_completions()
            # Kept until the dead peer's agent is dropped: after that nothing
            # of its can land, whatever UCX still held.
            assert cons.staging_blocks()[1] == 4
            cons.remove_peer(info.agent_name)
            end = time.monotonic() + STEP_TIMEOUT_S
            while cons.staging_blocks() != (8, 8, 0) and time.monotonic() < end:
                cons.poll_completions()
                time.sleep(0.005)
            assert cons.staging_blocks() == (8, 8, 0)
    finally:
        if victim.proc.is_alive():
            victim.proc.kill()


def test_a_piece_whose_post_fails_keeps_its_staging_until_its_peer_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL posts a piece a descriptor at a time and, when one fails,
    cancels the posted ones and raises: cancelled, not stopped. Its staging
    went straight back to the pool, where another READ took it and the
    late bytes reached that READ's slots. It is kept until the peer's agent
    is dropped, and the peer is reported faulted so its session ends."""
    bs, n = 4 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 4 * bs, "postfail") as (prod, cons, src, got):
        agent, real = cons._agent, cons._agent.transfer

        def posted_in_part(handle: Any) -> Any:
            real(handle)  # some descriptors went out...
            raise RuntimeError("NIXL_ERR_BACKEND: posting a descriptor failed")

        with _patched(agent, "transfer", posted_in_part):
            for _ in range(2):
                tid = cons.post_read(prod.agent_name, [0, 1], [2, 3])
                assert cons.poll_completions() == [(tid, False)]
        # Their first pieces, a block each: the peer's whole share (half),
        # yet not charged to it (they stop nothing now).
        assert cons.staging_blocks() == (4, 2, 2)
        assert cons.take_faulted() == {prod.agent_name}
        assert cons.take_faulted() == set()  # reported once
        # Another READ meanwhile moves through the rest of the pool.
        tid = cons.post_read(prod.agent_name, [5, 6, 7], [9, 10, 11])
        assert _completions(prod, cons) == [(tid, True)]
        for ll, r in zip([9, 10, 11], [5, 6, 7], strict=True):
            assert np.array_equal(got[ll], src[r])
        _progress(prod, cons, rounds=20)
        assert cons.staging_blocks() == (4, 2, 2)
        cons.remove_peer(prod.agent_name)  # the session's end drops it
        assert cons.staging_blocks() == (4, 4, 0)


def test_a_write_whose_post_fails_is_reported_unstopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A WRITE posted in part and cancelled by NIXL (one descriptor failed)
    is not stopped: the producer must not tell its consumer the slots are
    free (unstopped: the session ends instead)."""
    bs, n = 4 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 0, "wfail") as (prod, cons, _, _):
        agent, real = prod._agent, prod._agent.transfer

        def posted_in_part(handle: Any) -> Any:
            real(handle)
            raise RuntimeError("NIXL_ERR_BACKEND: posting a descriptor failed")

        with _patched(agent, "transfer", posted_in_part):
            tid = prod.post_write(cons.agent_name, [0, 1], [2, 3], b"w")
        assert prod.poll_completions() == [(tid, False)]
        assert prod.take_unstopped() == {tid}
        assert prod.take_faulted() == {cons.agent_name}


def test_a_read_that_cannot_be_checked_does_not_stop_its_peers_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A READ given up on whose state NIXL can no longer report (an error
    other than the endpoint's loss) keeps its staging until close. Charged
    to its peer's half of the pool, two such made every later staged READ
    from that peer post nothing and wait out its deadline, a new session's
    too (the peer keeps its agent name)."""
    bs, n = 4 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 4 * bs, "lost") as (prod, cons, src, got):
        tid = cons.post_read(prod.agent_name, [0, 1], [2, 3])  # prod stalls
        cons.cancel(tid)
        assert cons.poll_completions() == [(tid, False)]
        agent = cons._agent

        def unreadable(handle: Any) -> Any:
            raise RuntimeError("NIXL_ERR_BACKEND")

        with _patched(agent, "check_xfer_state", unreadable):
            cons.poll_completions()
        assert cons.staging_blocks() == (4, 2, 2)
        tid = cons.post_read(prod.agent_name, [5, 6], [9, 10])
        assert _completions(prod, cons) == [(tid, True)]
        assert np.array_equal(got[9], src[5]) and np.array_equal(got[10], src[6])
        assert cons.take_faulted() == {prod.agent_name}  # its session ends


def test_a_region_passed_off_under_another_peers_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A RegionInfo is the sender's word. One naming a known agent with
    other contents must not replace that agent (another session's).
    Metadata naming a known agent under a new name is refused before NIXL
    reads it, so the known agent keeps its state and its session; should
    NIXL ever load it (a format the check does not know), the known agent
    is fenced and dropped, never left half-invalidated."""
    from p2p_kv.data import NixlDataTransport
    from p2p_kv.data import remote_agents as peers

    bs, n = 4 * KIB, 16
    bufs = [
        np.random.default_rng(i).integers(0, 256, n * bs, np.uint8) for i in range(3)
    ]
    with (
        NixlDataTransport(bufs[0], bs, name="pass-a", same_host=False) as a,
        NixlDataTransport(bufs[1], bs, name="pass-b", same_host=False) as b,
        NixlDataTransport(bufs[2], bs, name="pass-c", same_host=False) as c,
    ):
        ia, ib = a.local_region(), b.local_region()
        c.add_peer(ia)
        c.add_peer(ib)
        with pytest.raises(ValueError, match="another region"):
            c.add_peer(msgspec.structs.replace(ib, agent_name=ia.agent_name))
        assert sorted(c.peers()) == sorted([ia.agent_name, ib.agent_name])
        assert c.take_faulted() == set()  # a kept nothing of the sender's
        assert _read_all(c, ia.agent_name, [1], [2])
        # a's metadata under a new name: refused before NIXL saw it, so a
        # keeps its NIXL state and its session.
        with pytest.raises(ValueError, match="names agent"):
            c.add_peer(msgspec.structs.replace(ia, agent_name="pass-x"))
        assert sorted(c.peers()) == sorted([ia.agent_name, ib.agent_name])
        assert c.take_faulted() == set()
        assert _read_all(c, ia.agent_name, [5], [6])
        # Loaded anyway: a's NIXL state may now be the sender's, so a is
        # dropped (fenced), and its session must end too (its READs found
        # no peer for as long as it lived): a new one loads a's agent again.
        monkeypatch.setattr(peers, "check_peer_metadata", lambda *_: None)
        with pytest.raises(ValueError, match="names agent"):
            c.add_peer(msgspec.structs.replace(ia, agent_name="pass-x"))
        assert c.peers() == [ib.agent_name]
        assert c.take_faulted() == {ia.agent_name}
        monkeypatch.undo()
        c.add_peer(ia)
        assert _read_all(c, ia.agent_name, [6], [7])
        assert np.array_equal(bufs[2].reshape(n, bs)[7], bufs[0].reshape(n, bs)[6])
        assert _read_all(c, ib.agent_name, [3], [4])
        got = bufs[2].reshape(n, bs)
        assert np.array_equal(got[2], bufs[0].reshape(n, bs)[1])
        assert np.array_equal(got[4], bufs[1].reshape(n, bs)[3])
        assert np.array_equal(got[6], bufs[0].reshape(n, bs)[5])


def test_a_copy_whose_check_raises_is_reported_failed_and_nothing_is_lost() -> None:
    """A CUDA error is sticky: the check of a GPU copy in flight raises
    (simulated here: no GPU in CI). The completions taken before it in the
    same call used to be lost with the exception."""
    from p2p_kv.data import NixlDataTransport
    from p2p_kv.data.cuda_ipc import CopyInFlight

    class BrokenEvent:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access")

        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access")

    bs = 4 * KIB
    with NixlDataTransport(np.zeros(4 * bs, np.uint8), bs, name="broken") as t:
        t._ledger.report(100, True)
        t._ledger.track(101, CopyInFlight(BrokenEvent()), "somebody")
        assert sorted(t.poll_completions()) == [(100, True), (101, False)]
        assert t.in_flight() == 0


def test_a_write_cancelled_while_it_runs_is_reported_unstopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over TCP a WRITE to a consumer that makes no NIXL call stays
    running; cancelled, it is reported failed, yet its bytes land once the
    consumer progresses again. So it is also reported unstopped: the
    producer must not tell the consumer it is over (see the session)."""
    bs, n = 64 * KIB, 16
    with _tcp_pair(monkeypatch, bs, n, 0, "unstopped") as (prod, cons, src, got):
        warm = prod.post_write(cons.agent_name, [0], [0], b"warm")
        assert _completions(cons, prod) == [(warm, True)]
        got[:] = 0
        tid = prod.post_write(cons.agent_name, list(range(n)), list(range(n)), b"x")
        time.sleep(0.3)
        assert prod.poll_completions() == [] and prod.in_flight() == 1
        t0 = time.monotonic()
        prod.cancel(tid)
        assert time.monotonic() - t0 < 0.1, "the producer's thread waited it out"
        assert _reported_alone(prod) == [(tid, False)]
        assert time.monotonic() - t0 >= 1.0  # its drain bound (the default)
        assert prod.take_unstopped() == {tid}
        assert prod.take_unstopped() == set()  # reported once
        _progress(cons, prod)
        landed = [b for b in range(n) if np.array_equal(got[b], src[b])]
        assert landed == list(range(n)), landed  # what the report warns of


@pytest.mark.parametrize("wait", [False, True], ids=["given-up", "fenced"])
def test_stuck_transfers_cancelled_together_cost_one_drain(
    monkeypatch: pytest.MonkeyPatch, wait: bool
) -> None:
    """Three READs stuck on a peer that makes no NIXL call (over TCP a READ
    needs its progress), cancelled together: a fence (``wait``) waits one
    drain for all three (one call each used to wait three); a plain
    cancel does not wait at all (it held the engine's thread a drain when
    a request was aborted), and polling reports all three at its bound."""
    from p2p_kv.data import NixlDataTransport

    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    bs, n, drain = 4 * KIB, 16, 0.4
    src = np.ones(n * bs, dtype=np.uint8)
    with (
        NixlDataTransport(src, bs, name="drain-prod", same_host=False) as prod,
        NixlDataTransport(
            np.zeros(n * bs, np.uint8),
            bs,
            name="drain-cons",
            same_host=False,
            drain_timeout_s=drain,
            read_staging_bytes=0,  # staged READs are not drained at all
        ) as cons,
    ):
        cons.add_peer(prod.local_region())
        tids = [cons.post_read(prod.agent_name, [i], [i]) for i in range(3)]
        assert cons.in_flight() == 3
        t0 = time.monotonic()
        cons.cancel(*tids, wait=wait)
        took = time.monotonic() - t0
        if wait:
            assert drain <= took < 2 * drain, took
            reported = cons.poll_completions()
        else:
            assert took < 0.1, took
            reported = _reported_alone(cons)
            took = time.monotonic() - t0
            assert drain <= took < 3 * drain, took
        assert sorted(reported) == [(t, False) for t in tids]
        assert cons.take_unstopped() == set(tids)
