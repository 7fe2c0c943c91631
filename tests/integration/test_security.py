"""Hostile peers on real sockets.

``tests/unit/test_hostile.py`` proves each refusal inside the sans-IO core;
this file proves the same promises hold on the wire, where an attacker is
not a well-behaved Session but raw frames built by hand on a TCP socket:

* without the shared secret nothing can be looked up, fetched or aborted,
  before or after a (failed) handshake, and a victim's load in flight at the
  same producer is untouched;
* with the secret, one peer still cannot complete or abort another peer's
  transfer, nor (as a producer) complete a new generation with a reply for
  an old one;
* slot indexes outside the registered region are refused before any NIXL
  call, on both sides of the protocol;
* oversized frames are dropped; a pickle is a ProtocolError and is never
  unpickled.

The producer is a :mod:`tests.support.agent` process with a secret; the
victim consumer is a StandalonePeer in this process; the attacker is raw
sockets plus, where it needs one to pass the handshake, a real NIXL agent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import select
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from tests.support.faults import DataFaults, FaultyData, install
from tests.support.procs import PeerProc
from tests.support.wire import RawConn, standalone_identity

from p2p_kv.data import NixlDataTransport
from p2p_kv.node.manager import Answer
from p2p_kv.peer import Timeouts
from p2p_kv.peer.handshake import (
    SEALED,
    FrameKeys,
    Identity,
    frame_keys,
    handshake_mac,
    make_hello,
)
from p2p_kv.protocol import (
    MAX_FRAME_BYTES,
    Abort,
    AbortAck,
    Error,
    Fetch,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    ProtocolError,
    Region,
    TransferDone,
    decode,
    encode,
)
from p2p_kv.runtime.standalone import StandalonePeer, block_pattern, make_key

pytestmark = pytest.mark.timeout(120)

SECRET = b"p2p_kv-test-secret"
BLOCK = 16 * 1024
PRODUCER_BLOCKS = 48
VICTIM_BLOCKS = 32
KEYS = [make_key(i) for i in range(8)]
TIMEOUTS = {"heartbeat_interval_s": 0.5, "parked_wait_s": 1.0}


def identity(name: str, num_blocks: int, region: bytes = b"") -> Identity:
    return standalone_identity(name, BLOCK, num_blocks, SECRET, region)


def crc_ok(peer: StandalonePeer, keys: list[bytes], slots: list[int]) -> bool:
    return all(
        zlib.crc32(memoryview(peer.block(s)))
        == zlib.crc32(memoryview(block_pattern(k, BLOCK)))
        for k, s in zip(keys, slots, strict=True)
    )


class Raw:
    """A peer that is only a socket: frames are whatever we build. Once it
    has greeted a peer under a secret it seals what it sends after the
    handshake and opens what it gets, as a real peer does. Bound
    (``bind=True``), it plays a producer that the victim dials: it takes
    the first connection that comes."""

    def __init__(self, addr: str, *, bind: bool = False) -> None:
        self.listener: socket.socket | None = None
        self.conn: RawConn | None = None
        if bind:
            host = addr.rpartition(":")[0]
            self.listener = socket.create_server((host, 0))
            self.port = self.listener.getsockname()[1]
            self.address = f"{host}:{self.port}"
        else:
            self.conn = RawConn(addr)
        self.hello: Hello | None = None
        self.peer_hello: Hello | None = None
        self.keys: FrameKeys | None = None
        #: every frame that arrived, as it came on the wire
        self.wire: list[bytes] = []

    def _ready(self, timeout: float) -> RawConn | None:
        if self.conn is None and self.listener is not None:
            readable, _, _ = select.select([self.listener], [], [], timeout)
            if readable:
                sock, _ = self.listener.accept()
                self.conn = RawConn.of(sock)
        return self.conn

    def send(self, msg: Message | bytes) -> None:
        frame = msg if isinstance(msg, bytes) else encode(msg)
        if self.keys is not None and not isinstance(msg, bytes | Hello | HelloAck):
            frame = self.keys.seal(frame)
        conn = self._ready(5.0)
        assert conn is not None, "nobody dialled us"
        conn.send(frame)

    def recv(self, timeout: float = 1.0, until: type | None = None) -> list[Message]:
        """Everything that arrives within ``timeout`` (or up to ``until``)."""
        out: list[Message] = []
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            conn = self._ready(left)
            if conn is None:
                break
            frames = conn.frames(left)
            if not frames:
                break
            for frame in frames:
                self.wire.append(frame)
                if frame[:1] == bytes([SEALED]):
                    if self.keys is None:
                        continue  # not ours to open (a relay's view)
                    frame = self.keys.open(frame)
                out.append(decode(frame))
            if until is not None and any(isinstance(m, until) for m in out):
                break
        return out

    def step_until(self, v: StandalonePeer | None, kind: type) -> Any:
        """Step ``v`` (if any) until a message of ``kind`` reaches us."""
        for _ in range(200):
            if v is not None:
                v.step(wait=False)
            found = [m for m in self.recv(0.01) if isinstance(m, kind)]
            if found:
                return found[0]
        raise AssertionError(f"no {kind.__name__} came")

    def accept(self, v: StandalonePeer, me: Identity) -> None:
        """As a bound producer: step the dialling victim until its Hello
        arrives, then answer with our Hello and an HMAC under SECRET."""
        theirs = self.step_until(v, Hello)
        self.hello = make_hello(me, os.urandom(16))
        self.send(self.hello)
        self.greet(me, theirs, SECRET)

    def greet(self, me: Identity, theirs: Hello, secret: bytes | None) -> None:
        """Our proof and our region, under ``secret``, to a peer whose Hello
        is ``theirs`` (ours sent already): from here on frames are sealed,
        the Region's first (its seal encrypts it)."""
        assert self.hello is not None
        self.peer_hello = theirs
        self.send(HelloAck(mac=handshake_mac(secret, self.hello, theirs)))
        self.keys = frame_keys(secret, self.hello, theirs)
        self.send(Region(region=me.region))

    def next_lookup(self, v: StandalonePeer) -> Lookup:
        """Step the victim until its next Lookup reaches us."""
        for _ in range(200):
            v.step(wait=False)
            lookup = next((x for x in self.recv(0.01) if isinstance(x, Lookup)), None)
            if lookup is not None:
                return lookup
        raise AssertionError("the victim sent no Lookup")

    def handshake(self, me: Identity, secret: bytes | None) -> list[Message]:
        """Hello, their Hello, HelloAck with an HMAC under ``secret``."""
        self.hello = make_hello(me, os.urandom(16))
        self.send(self.hello)  # both ends greet at once
        got = self.recv(5, until=Hello)
        theirs = [m for m in got if isinstance(m, Hello)]
        assert theirs, got
        self.greet(me, theirs[0], secret)
        return got + self.recv(0.5)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.listener is not None:
            self.listener.close()


@pytest.fixture(scope="module")
def producer() -> Iterator[PeerProc]:
    p = PeerProc(
        {
            "engine_id": "guarded",
            "num_blocks": PRODUCER_BLOCKS,
            "block_bytes": BLOCK,
            "fill": len(KEYS),
            "secret": SECRET.hex(),
            "timeouts": TIMEOUTS,
        }
    )
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def victim() -> Iterator[tuple[StandalonePeer, FaultyData]]:
    v = StandalonePeer(
        VICTIM_BLOCKS,
        BLOCK,
        engine_id=f"victim-{os.getpid()}-{time.monotonic_ns()}",
        secret=SECRET,
        timeouts=Timeouts(**TIMEOUTS),
    )
    _, data = install(v.runtime)
    try:
        yield v, data
    finally:
        v.close()


@pytest.fixture
def attacker_nixl() -> Iterator[NixlDataTransport]:
    region = np.zeros(8 * BLOCK, dtype=np.uint8)
    t = NixlDataTransport(region, BLOCK, name="mallory")
    try:
        yield t
    finally:
        t.close()


def producer_report(p: PeerProc) -> dict[str, Any]:
    return dict(p.call("report"))


def start_load(
    v: StandalonePeer, peer: str, kv: str, slots: list[int]
) -> tuple[str, int, int]:
    """Open a request at ``peer``, look KEYS up, submit the load; returns
    (engine request id, generation, job id) with the load in flight."""
    m, rt = v.manager, v.runtime
    req = f"{kv}-req-{time.monotonic_ns()}"
    v.open(req, peer, kv)
    end = time.monotonic() + 5
    while Answer.RETRY in (ans := [m.lookup(req, k) for k in KEYS]):
        assert time.monotonic() < end, "lookups unanswered"
        rt.flush()
        v.step()
    assert ans == [Answer.HIT] * len(KEYS), ans
    record = m.requests.by_id.get(req)
    assert record is not None and record.consumer is not None
    gen = record.consumer.gen
    job = time.monotonic_ns() % (1 << 40)
    m.submit_load(job, req, KEYS, slots, rt.clock())
    rt.pump()
    return req, gen, job


def wait_result(v: StandalonePeer, job: int, timeout: float = 5.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if job in v.results:  # stepped elsewhere meanwhile
            return v.results.pop(job)
        v.step()
    raise AssertionError(f"job {job} never finished")


@contextlib.contextmanager
def stepping(v: StandalonePeer) -> Iterator[None]:
    """Step ``v`` on a thread, as an engine steps, while the test acts
    elsewhere (and touches ``v`` only after): an engine nobody steps sends
    no heartbeats, and its peers rightly drop it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            v.step(wait=False)
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def finish(v: StandalonePeer, req: str) -> None:
    v.runtime.end_request(req)
    v.runtime.pump()


def settle(v: StandalonePeer, p: PeerProc | None = None) -> None:
    end = time.monotonic() + 5
    while True:
        v.step()
        mine = {k: n for k, n in v.manager.state_report().items() if n}
        theirs: dict[str, Any] = {}
        if p is not None:
            r = producer_report(p)
            theirs = {k: n for k, n in r["state"].items() if n}
            if r["pinned"]:
                theirs["pinned"] = r["pinned"]
        if not mine and not theirs:
            return
        assert time.monotonic() < end, f"left: victim {mine}, producer {theirs}"
        time.sleep(0.02)


# ---------------------------------------------------------------------------
# no secret
# ---------------------------------------------------------------------------


def test_without_the_secret_nothing_is_looked_up_fetched_or_aborted(
    producer: PeerProc, victim: tuple[StandalonePeer, FaultyData]
) -> None:
    v, vdata = victim
    before = producer_report(producer)
    # The victim's load is in flight (its transfer stalled) at the producer.
    vdata.faults = DataFaults(stall_s=0.5, stall_p=1.0)
    producer.call("faults", control=None, data={"stall_s": 0.5, "stall_p": 1.0})
    req, gen, job = start_load(v, producer.address, "victim-kv", list(range(8)))
    with stepping(v):
        # 1. no handshake at all: every request-scoped message refused by
        # its tag, unparsed and unanswered, and its connection ended
        for msg in (
            Lookup("victim-kv", gen, 1, KEYS),
            Fetch("victim-kv", gen, job, KEYS, list(range(8))),
            Abort("victim-kv", gen),
        ):
            raw = Raw(producer.address)
            raw.send(msg)
            got = raw.recv(1.0)
            assert not any(isinstance(m, Error | LookupResp | AbortAck) for m in got)
            raw.close()
        # 2. a handshake under the wrong secret, then the same again
        raw = Raw(producer.address)
        got = raw.handshake(identity("mallory", 8), b"not-the-secret")
        assert any(isinstance(m, Goodbye) and "auth" in m.reason for m in got), got
        for msg in (Lookup("victim-kv", gen, 2, KEYS), Abort("victim-kv", gen)):
            raw.send(msg)
        late = raw.recv(0.5)
        assert not any(isinstance(m, LookupResp | AbortAck) for m in late), late
        raw.close()
        # 3. a consumer without the secret misses everything
        nosecret = StandalonePeer(8, BLOCK, engine_id=f"nosecret-{os.getpid()}")
        try:
            out = nosecret.fetch(producer.address, "ns", KEYS[:2], [0, 1])
            assert (out.hits, out.ok) == (0, False), out
            assert any(r == "auth" for (_, r) in nosecret.manager.refusals)
        finally:
            nosecret.close()
    # The victim's load was untouched: it completes, byte-exact.
    result = wait_result(v, job)
    assert result.success, result
    assert crc_ok(v, KEYS, list(range(8)))
    finish(v, req)
    vdata.faults = DataFaults()
    producer.call("faults", control=None, data={})
    after = producer_report(producer)
    assert after["protocol_errors"].get("before_handshake", 0) >= (
        before["protocol_errors"].get("before_handshake", 0) + 3
    ), after["protocol_errors"]
    refusals = {r for (_, r, _) in after["refusals"]}
    assert "auth" in refusals
    settle(v, producer)


def test_a_relay_between_two_engines_gets_no_session_and_no_region(
    producer: PeerProc, victim: tuple[StandalonePeer, FaultyData]
) -> None:
    """Mallory has no secret but dials two engines and hands each one the
    other's Hello and proof: each proof covers both hellos, so it checks.
    That used to leave Mallory a proven session at both, to look up, fetch
    and abort in; and every Hello carried its engine's data-plane region
    (the NIXL keys to its KV memory) before any proof. Now the regions
    travel only after the proofs, encrypted, and every frame after the
    handshake is sealed: a relay can pass frames on, never speak itself."""
    v, _ = victim
    before = producer_report(producer)
    to_r, to_v = Raw(producer.address), Raw(v.address)

    try:
        for raw in (to_r, to_v):
            raw.send(Heartbeat(seq=1))  # a first frame: the listener greets
        hello_r, hello_v = to_r.step_until(None, Hello), to_v.step_until(v, Hello)
        to_r.send(hello_v)
        to_v.send(hello_r)
        ack_r, ack_v = to_r.step_until(None, HelloAck), to_v.step_until(v, HelloAck)
        to_r.send(ack_v)  # each proof covers (V's hello, R's hello): it checks
        to_v.send(ack_r)
        for _ in range(50):  # their regions, if any, reach Mallory now
            v.step(wait=False)
            to_r.recv(0.01)
            to_v.recv(0.01)
        # Whatever came is sealed and says nothing of either region.
        for raw, name in ((to_r, "guarded"), (to_v, v.runtime.data.agent_name)):
            late = raw.wire[2:]  # after its Hello and HelloAck
            assert late and all(f[:1] == bytes([SEALED]) for f in late), raw.wire
            assert not any(name.encode() in f for f in late)
        # Mallory now speaks on her own: her session never became ready
        # (no region), so her frames are refused by their tags, unread.
        to_r.send(Lookup("relayed", 1, 1, KEYS))
        to_r.send(Abort("relayed", 1))
        replies = to_r.recv(1.0)
        assert not any(isinstance(m, LookupResp | AbortAck) for m in replies)
        after = producer_report(producer)
        early = after["protocol_errors"].get("before_handshake", 0)
        assert early >= before["protocol_errors"].get("before_handshake", 0) + 2
    finally:
        to_r.close()
        to_v.close()
    settle(v, producer)


def test_a_peer_we_refuse_and_hang_up_on_hears_why(
    victim: tuple[StandalonePeer, FaultyData], caplog: pytest.LogCaptureFixture
) -> None:
    """We dial a producer whose proof fails: our Goodbye saying why reaches
    it although we drop the connection in the same step (sockets close
    with no linger), so the operator there reads the reason, not just a
    disconnect; ours reads it at WARNING, naming the peer."""
    v, _ = victim
    srv = Raw("127.0.0.1:0", bind=True)
    caplog.set_level(logging.WARNING, logger="vllm.p2p_kv")
    try:
        v.open("refused-req", srv.address, "refused")
        assert v.manager.lookup("refused-req", KEYS[0]) is Answer.RETRY
        v.runtime.flush()
        theirs = srv.step_until(v, Hello)
        srv.hello = make_hello(identity("wrong", 8), os.urandom(16))
        srv.send(srv.hello)
        srv.send(HelloAck(mac=handshake_mac(b"not-the-secret", srv.hello, theirs)))
        bye = srv.step_until(v, Goodbye)
        assert "auth" in bye.reason, bye
        v.runtime.end_request("refused-req")
        v.runtime.pump()
        lines = [r for r in caplog.records if "handshake refused" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        assert lines[0].levelno == logging.WARNING
        assert srv.address in lines[0].getMessage() and "auth" in lines[0].getMessage()
    finally:
        srv.close()


def test_connections_past_max_inbound_peers_are_refused_without_locking_out_the_fleet(
    victim: tuple[StandalonePeer, FaultyData],
) -> None:
    """Every per-peer bound holds per session, and any party may connect:
    one opening many connections multiplied every bound (six held six times
    the waiting-fetch bound). Past ``max_inbound_peers`` connections that
    finished the handshake are refused, and of those still handshaking the
    oldest is dropped, so a party without the secret cannot hold the slots
    against the fleet; a refused connection's later frames are dropped
    unread, counted once."""
    v, _ = victim
    v.manager.settings.max_inbound = 1
    v.fill(KEYS[:2], [3, 4])
    first = Raw(v.address)
    second = mallory = None
    consumer = StandalonePeer(
        8, BLOCK, engine_id="fleet", secret=SECRET, timeouts=Timeouts(**TIMEOUTS)
    )
    try:
        first.step_until(v, Hello)  # a connection is greeted once accepted
        second = Raw(v.address)
        bye = first.step_until(v, Goodbye)
        assert "still handshaking" in bye.reason, bye
        assert first.conn is not None and first.conn.closed_by_peer(2.0)
        refusals = v.manager.refusals
        assert refusals[("other", "too_many_handshaking")] == 1
        # A fleet member gets in (the second connection, still greeting,
        # makes way) and loads.
        stop = threading.Event()
        server = threading.Thread(target=v.serve_until, args=(stop,), daemon=True)
        server.start()
        try:
            out = consumer.fetch(v.address, "fleet-kv", KEYS[:2], [0, 1])
        finally:
            stop.set()
            server.join(5)
        assert out.ok and out.hits == 2, out
        assert bytes(consumer.block(1)) == bytes(v.block(4))
        assert refusals[("other", "too_many_handshaking")] == 2
        # One more with the secret is past the bound once it is proven.
        me = identity("mallory", 8)
        mallory = Raw(v.address)
        mallory.hello = make_hello(me, os.urandom(16))
        mallory.send(mallory.hello)
        mallory.greet(me, mallory.step_until(v, Hello), SECRET)
        bye = mallory.step_until(v, Goodbye)
        assert "peers connected" in bye.reason, bye
        assert refusals[("other", "too_many_inbound")] == 1
        ready = [s for s in v.manager.sessions() if s.link.ready]
        assert len(ready) == 1 and ready[0].peer.startswith("in:")
    finally:
        for raw in (first, second, mallory):
            if raw is not None:
                raw.close()
        consumer.close()


# ---------------------------------------------------------------------------
# with the secret: other peers' transfers and other generations
# ---------------------------------------------------------------------------


def test_a_peer_cannot_abort_or_complete_another_peers_transfer(
    producer: PeerProc,
    victim: tuple[StandalonePeer, FaultyData],
    attacker_nixl: NixlDataTransport,
) -> None:
    v, vdata = victim
    region = msgspec.msgpack.encode(attacker_nixl.local_region())
    me = identity("mallory", attacker_nixl.num_blocks, region)
    vdata.faults = DataFaults(stall_s=1.5, stall_p=1.0)
    producer.call("faults", control=None, data={"stall_s": 1.5, "stall_p": 1.0})
    req, gen, job = start_load(v, producer.address, "victim-kv2", list(range(8)))
    t_submit = time.monotonic()
    # Mallory, authenticated at the producer, aborts and re-fetches the
    # victim's (req, gen) there...
    at_producer = Raw(producer.address)
    at_producer.handshake(me, SECRET)
    at_producer.send(Abort("victim-kv2", gen))
    at_producer.send(Fetch("victim-kv2", gen, job, KEYS[:1], [0]))
    # ...and, dialling the victim, tells it the transfer is done (and acked).
    at_victim = Raw(v.address)
    mine = make_hello(me, os.urandom(16))
    at_victim.send(mine)
    theirs = at_victim.step_until(v, Hello)
    at_victim.hello = mine
    at_victim.greet(me, theirs, SECRET)
    for msg in (
        TransferDone("victim-kv2", gen, job, True),
        AbortAck("victim-kv2", gen),
        TransferDone("victim-kv2", gen, job, False, "forged"),
    ):
        at_victim.send(msg)

    def stale() -> int:
        return sum(
            s.link.counters.protocol_errors.get("stale_transfer_done", 0)
            for s in [*v.manager.sessions(), *v.manager.retired_sessions]
        )

    end = time.monotonic() + 1.0
    while stale() < 2 and time.monotonic() < end:
        v.step(wait=False)
    assert stale() >= 2, "the forged TransferDones were not refused and counted"
    assert job not in v.results, "a forged frame ended the victim's load"
    result = wait_result(v, job)
    elapsed = time.monotonic() - t_submit
    assert result.success, result
    assert crc_ok(v, KEYS, list(range(8)))
    assert elapsed >= 1.4  # it waited for its own stalled transfer
    # Mallory's fetch at the producer got nothing of the victim's blocks.
    replies = at_producer.recv(1.5)
    assert not [m for m in replies if isinstance(m, TransferDone) and m.ok], replies
    assert not attacker_nixl.poll_notifs()
    finish(v, req)
    vdata.faults = DataFaults()
    producer.call("faults", control=None, data={})
    at_producer.close()
    at_victim.close()
    settle(v, producer)


def test_a_reply_for_an_old_generation_does_not_complete_the_new_one(
    victim: tuple[StandalonePeer, FaultyData],
    attacker_nixl: NixlDataTransport,
) -> None:
    """Mallory as the producer (authenticated): the victim reuses one
    ``kv_request_id``; Mallory answers the second use's fetch with the
    first use's generation. Only the right generation may end the load."""
    v, _ = victim
    region = msgspec.msgpack.encode(attacker_nixl.local_region())
    me = identity("mallory-prod", attacker_nixl.num_blocks, region)
    srv = Raw("127.0.0.1:0", bind=True)
    gens: list[int] = []
    jobs: list[int] = []
    try:
        for use in range(2):
            m, rt = v.manager, v.runtime
            req = f"reuse-{use}"
            v.open(req, srv.address, "same-kv")
            assert m.lookup(req, KEYS[0]) is Answer.RETRY
            rt.flush()
            if use == 0:
                srv.ident = None
                srv.accept(v, me)
            lookup = srv.next_lookup(v)
            gens.append(lookup.gen)
            srv.send(LookupResp(lookup.req, lookup.gen, lookup.seq, [True]))
            for _ in range(50):
                v.step(wait=False)
                if m.lookup(req, KEYS[0]) is Answer.HIT:
                    break
            job = 900 + use
            jobs.append(job)
            m.submit_load(job, req, [KEYS[0]], [3], rt.clock())
            rt.pump()
            fetch = None
            for _ in range(200):
                v.step(wait=False)
                fetch = next((x for x in srv.recv(0.01) if isinstance(x, Fetch)), None)
                if fetch is not None:
                    break
            assert fetch is not None and fetch.gen == gens[-1]
            if use == 0:
                srv.send(TransferDone(fetch.req, fetch.gen, job, False, "no"))
                r = wait_result(v, job)
                assert not r.success
                finish(v, req)
                continue
            # second use: first the old generation's "done", then the real one
            assert gens[1] != gens[0]
            srv.send(TransferDone("same-kv", gens[0], job, True))
            srv.send(TransferDone("same-kv", gens[0], jobs[0], True))
            for _ in range(30):
                v.step(wait=False)
                assert job not in v.results, "an old generation's reply ended it"
                time.sleep(0.005)
            srv.send(TransferDone("same-kv", gens[1], job, False, "the real one"))
            r = wait_result(v, job)
            assert not r.success  # ended by its own generation's reply only
            finish(v, req)
        errors = {
            k: n
            for s in [*v.manager.sessions(), *v.manager.retired_sessions]
            for k, n in s.link.counters.protocol_errors.items()
        }
        assert errors.get("stale_transfer_done", 0) >= 1, errors
    finally:
        srv.close()


# ---------------------------------------------------------------------------
# slots outside the region
# ---------------------------------------------------------------------------


def test_out_of_range_slots_are_refused_before_any_nixl_call(
    producer: PeerProc, attacker_nixl: NixlDataTransport
) -> None:
    region = msgspec.msgpack.encode(attacker_nixl.local_region())
    me = identity("mallory-slots", attacker_nixl.num_blocks, region)
    raw = Raw(producer.address)
    raw.handshake(me, SECRET)
    before = producer_report(producer)["faults"]["data"]
    n = attacker_nixl.num_blocks
    for i, bad in enumerate(([0, 1, n], [n + 100], [2**40 - 1])):
        keys = KEYS[: len(bad)]
        raw.send(Lookup(f"oob-{i}", 1, 1, keys))
        resp = [m for m in raw.recv(1.0, until=LookupResp) if isinstance(m, LookupResp)]
        assert resp and all(resp[0].hits), resp
        raw.send(Fetch(f"oob-{i}", 1, 50 + i, keys, bad))
        got = raw.recv(1.0, until=TransferDone)
        assert any(isinstance(m, Error) and m.code == "slot_out_of_range" for m in got)
        done = [m for m in got if isinstance(m, TransferDone)]
        assert done and not done[0].ok, got
        raw.send(Abort(f"oob-{i}", 1))
    after = producer_report(producer)
    # no post reached NIXL at all (not even one refused inside the transport)
    assert after["faults"]["data"]["posts"] == before["posts"]
    assert after["session_errors"].get("slot_out_of_range", 0) >= 3
    raw.close()


def test_producer_offering_slots_outside_its_region_is_refused(
    victim: tuple[StandalonePeer, FaultyData],
    attacker_nixl: NixlDataTransport,
) -> None:
    """Where the protocol lets a consumer READ what the producer offers
    (``LookupResp.slots``), the offer is checked against the producer's
    registered region before any NIXL call."""
    v, vdata = victim
    n = attacker_nixl.num_blocks
    region = msgspec.msgpack.encode(attacker_nixl.local_region())
    me = identity("mallory-offer", n, region)
    srv = Raw("127.0.0.1:0", bind=True)
    try:
        m, rt = v.manager, v.runtime
        v.open("offer-req", srv.address, "offer")
        keys = KEYS[:3]
        assert Answer.RETRY in [m.lookup("offer-req", k) for k in keys]
        rt.flush()
        srv.accept(v, me)
        lookup = srv.next_lookup(v)
        slots = [0, n, n + 7][: len(lookup.keys)]
        srv.send(
            LookupResp(
                lookup.req,
                lookup.gen,
                lookup.seq,
                [True] * len(lookup.keys),
                slots=slots,
                ttl_ms=10_000,
            )
        )
        posts_before = vdata.counts.posts
        answers = []
        end = time.monotonic() + 5
        while time.monotonic() < end:  # by time: a busy machine is slow
            v.step(wait=False)
            answers = [m.lookup("offer-req", k) for k in keys]
            if Answer.RETRY not in answers:
                break
            time.sleep(0.001)
        hits = [k for k, a in zip(keys, answers, strict=True) if a is Answer.HIT]
        if hits:
            m.submit_load(77, "offer-req", hits, list(range(len(hits))), rt.clock())
            rt.pump()
            for _ in range(50):
                v.step(wait=False)
                srv.recv(0.005)
                if 77 in v.results:
                    break
        assert vdata.counts.posts == posts_before, "a read reached NIXL"
        errors = {
            k: c
            for s in [*m.sessions(), *m.retired_sessions]
            for k, c in s.link.counters.protocol_errors.items()
        }
        assert errors.get("offer_out_of_range", 0) >= 1, errors
        rt.end_request("offer-req")
        rt.pump()
    finally:
        srv.close()


# ---------------------------------------------------------------------------
# frames: size and pickle
# ---------------------------------------------------------------------------


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_flood_of_bad_frames_is_counted_each_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anyone who reaches the port can send undecodable frames: one warning
    each let a party without the secret flood the engine's log (20,000
    frames, 20,000 lines). Before the handshake the first ends its
    connection (an honest greeting always decodes); each is counted, and
    the log says so once an interval."""
    peer = StandalonePeer(4, 4096, engine_id=f"flood-{os.getpid()}")
    raws: list[Raw] = []
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv"):
            for _ in range(100):
                raw = Raw(peer.address)
                raws.append(raw)
                for _ in range(5):
                    raw.send(b"\xc1junk")
                peer.step(wait=False)
            end = time.monotonic() + 10
            while time.monotonic() < end:
                peer.step(wait=False)
                counted = peer.manager.protocol_errors.get("decode", 0)
                if counted >= 100:
                    break
        assert counted == 100  # one a connection: the rest go unread
        assert all(r.conn is not None and r.conn.closed_by_peer(2.0) for r in raws)
        lines = [r for r in caplog.records if "bad frame" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    finally:
        for raw in raws:
            raw.close()
        peer.close()


def test_a_deeply_nested_frame_is_a_bad_frame_not_an_engine_crash() -> None:
    """1 KB of nested arrays, even in a field the decoder skips, made
    msgspec raise RecursionError, which nothing caught: from anyone who
    reaches the port, secret or not, out of the engine's step."""
    peer = StandalonePeer(4, BLOCK, engine_id=f"deep-{os.getpid()}", secret=SECRET)
    raws = [Raw(peer.address) for _ in range(3)]  # one each: the first ends it
    enc = msgspec.msgpack.Encoder()
    try:
        for raw, tag in zip(raws, ("heartbeat", "hello", "lookup"), strict=True):
            raw.send(b"\x93" + enc.encode(tag) + b"\x01" + b"\x91" * 5000 + b"\x01")
        end = time.monotonic() + 10
        while peer.manager.protocol_errors.get("decode", 0) < 3:
            assert time.monotonic() < end, peer.manager.protocol_errors
            peer.step(wait=False)
    finally:
        for raw in raws:
            raw.close()
        peer.close()


def test_a_party_without_the_secret_costs_a_session_and_a_line_at_most(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A party without the secret greets, then sends frames that fail
    their seal. The first ends the session and its connection; the rest
    are dropped unread, and such refusals are logged once an interval (the
    refusals metric counts each)."""
    peer = StandalonePeer(4, BLOCK, engine_id=f"seal-{os.getpid()}", secret=SECRET)
    mallory = identity("mallory", 8)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.p2p_kv"):
            for _ in range(2):  # two connections
                raw = Raw(peer.address)
                hello = make_hello(mallory, os.urandom(16))
                raw.send(hello)
                for again in range(2):  # the second time on a refused connection
                    with contextlib.suppress(OSError):  # it may be closed by now
                        if again:
                            raw.send(hello)  # greeting anew opens no session
                        for _ in range(300):
                            raw.send(bytes([SEALED]) + os.urandom(40))
                    time.sleep(0.3)
                    for _ in range(20):
                        peer.step(wait=False)
                raw.close()
        m = peer.manager
        auth = sum(n for (_, why), n in m.refusals.items() if why == "auth")
        assert auth == 2, m.refusals
        sessions = [*m.retired_sessions, *m.sessions()]
        assert len(sessions) == 2, [s.link.close_reason for s in sessions]
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1, lines
    finally:
        peer.close()


def test_before_the_handshake_a_large_frame_is_refused_unparsed() -> None:
    """A connection that has not finished its handshake may send only a
    greeting. A frame longer than any greeting (a Fetch of 65,536 keys,
    2.4 MB) ends its connection by its length alone, nothing of it read
    past the first 16 KiB; a short frame that is not a greeting is refused
    by its tag, unparsed, and ends its connection too; a handshake on a new
    one goes through."""
    peer = StandalonePeer(4, BLOCK, engine_id=f"early-{os.getpid()}")
    keys = [i.to_bytes(4, "big") * 8 for i in range(65_536)]
    big, small = Raw(peer.address), Raw(peer.address)
    try:
        with contextlib.suppress(OSError):  # closed under the send
            big.send(encode(Fetch("r", 1, 2, keys, list(range(65_536)))))
        assert big.conn is not None
        end = time.monotonic() + 10
        while not big.conn.closed_by_peer(0.01):
            assert time.monotonic() < end, "the connection outlived its frame"
            peer.step(wait=False)
        small.send(encode(Lookup("r", 1, 1, [b"k"])))
        m = peer.manager
        while m.protocol_errors.get("before_handshake", 0) < 1:
            assert time.monotonic() < end, m.protocol_errors
            peer.step(wait=False)
        assert m.protocol_errors.get("framing", 0) == 1, m.protocol_errors
        got = small.recv(0.3)
        assert not any(isinstance(x, Error) for x in got), got
        # It ended its connection (an honest peer greets first) ...
        assert small.conn is not None and small.conn.closed_by_peer(2.0)
        # ... and a handshake on a new one goes through.
        small.close()
        small = Raw(peer.address)
        got = small.recv(1.0, until=Hello)
        end = time.monotonic() + 10
        while not m.sessions():
            assert time.monotonic() < end
            peer.step(wait=False)
        (session,) = m.sessions()
        me = dataclasses.replace(identity("late", 8, b"region"), secret=None)
        small.hello = make_hello(me, os.urandom(16))
        small.send(small.hello)
        got += small.recv(1.0, until=Hello)
        small.greet(me, next(x for x in got if isinstance(x, Hello)), None)
        end = time.monotonic() + 10
        while not (session.link.ready or session.link.closed):
            assert time.monotonic() < end, session.link
            peer.step(wait=False)
        # Ready: the runtime then refuses our made-up region, no sooner.
        assert session.link.ready or "data-plane region" in session.link.close_reason
    finally:
        big.close()
        small.close()
        peer.close()


def test_a_goodbye_cannot_write_lines_into_our_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain Goodbye is taken before any proof, and its reason became
    the logged close reason as it came: newlines and all, any party could
    write forged lines into the engine's log."""
    peer = StandalonePeer(4, 4096, engine_id=f"bye-{os.getpid()}")
    raw = Raw(peer.address)
    forged = "ok\n2099-01-01 ERROR p2p_kv: forged line"
    try:
        with caplog.at_level(logging.INFO, logger="vllm.p2p_kv"):
            raw.send(encode(Goodbye(reason=forged)))
            end = time.monotonic() + 10
            while not peer.manager.retired_sessions and time.monotonic() < end:
                peer.step(wait=False)
        (gone,) = peer.manager.retired_sessions
        assert "forged line" in gone.link.close_reason
        said = [r.getMessage() for r in caplog.records if "closed" in r.getMessage()]
        assert said and all("\n" not in line for line in said), said
    finally:
        raw.close()
        peer.close()


def test_oversized_frames_are_dropped_and_pickles_never_loaded(
    producer: PeerProc, victim: tuple[StandalonePeer, FaultyData], tmp_path: Path
) -> None:
    v, _ = victim
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Boom(str(marker)))
    with pytest.raises(ProtocolError):
        decode(payload)
    before = producer_report(producer)
    raw = Raw(producer.address)
    raw.send(payload)  # before any handshake
    raw.send(encode(Lookup("r", 1, 1, [b"k"])) + payload)  # smuggled behind a frame
    with contextlib.suppress(OSError):  # the producer hangs up on it
        raw.send(b"\x00" * (MAX_FRAME_BYTES + 1))  # longer than any frame
    time.sleep(0.5)
    after = producer_report(producer)

    def refused(report: dict[str, Any]) -> int:
        # Before the handshake a frame whose tag is not a greeting's is
        # refused as such; one longer than any frame ends the connection.
        errors = report["protocol_errors"]
        return int(
            errors.get("decode", 0)
            + errors.get("before_handshake", 0)
            + errors.get("framing", 0)
        )

    # The first frame that breaks the handshake ends the connection: what
    # was smuggled behind it is never read.
    assert refused(after) >= refused(before) + 1, after["protocol_errors"]
    assert raw.conn is not None and raw.conn.closed_by_peer(2.0)
    raw.close()
    assert not marker.exists(), "a pickle was loaded"
    # the producer goes on serving
    out = v.fetch(producer.address, "after-junk", KEYS, list(range(8)))
    assert (out.hits, out.ok) == (len(KEYS), True), out
    assert crc_ok(v, KEYS, list(range(8)))
    report = producer_report(producer)
    assert report["max_step_s"] < 0.5
    assert report["rss"] < before["rss"] + 64 * 2**20
    settle(v, producer)
