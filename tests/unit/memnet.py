"""In-memory wiring of several LoadManagers, for tests of the pure core.

Frames go through the real codec (encode -> bytes -> decode), writes and
reads copy bytes between per-engine regions (a read of a slot the producer
no longer pins copies poison, so a load that trusts it shows wrong bytes), and a test controls time, delivery order,
drops and link cuts. Nothing here sleeps or opens a socket.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from p2p_kv.node.manager import JobResult, LoadManager
from p2p_kv.node.membership import Membership, parse_peers
from p2p_kv.node.roles import Roles
from p2p_kv.peer import Limits, PinResult, Timeouts
from p2p_kv.peer.events import (
    BadConnection,
    BadFrame,
    Cancel,
    Closed,
    Dial,
    Direction,
    Hangup,
    NotSent,
    PostRead,
    PostWrite,
    RegionKnown,
    RuntimeEvent,
    SealRefused,
    Trusted,
)
from p2p_kv.peer.handshake import Identity

BLOCK = 16
NBLOCKS = 64
#: Deadlines short enough that randomized tests see them all fire.
FAST_TIMEOUTS = Timeouts(
    handshake_s=1.0,
    heartbeat_interval_s=0.3,
    lookup_s=0.6,
    fetch_floor_s=0.6,
    abort_ack_s=0.6,
    pin_ttl_s=1.5,
    parked_wait_s=1.5,
)
POISON = b"\xee" * BLOCK


def identity(name: str, **over: object) -> Identity:
    fields: dict[str, object] = dict(
        engine_id=name,
        hash_algo="sha256_cbor",
        hash_seed="0",
        canonical_hashes=(b"c1", b"c2"),
        layout="test-layout",
        block_bytes=BLOCK,
        num_blocks=NBLOCKS,
        region=name.encode(),
    )
    fields.update(over)
    return Identity(**fields)  # type: ignore[arg-type]


def key(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()[:8] + b"\0\0\0\0"


def payload(k: bytes) -> bytes:
    return hashlib.sha256(b"kv" + k).digest()[:BLOCK]


class FakePinner:
    """The producer engine's primary tier: key -> slot, with pin jobs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def pin(self, label: str, keys: Sequence[bytes]) -> PinResult:
        hits = [k in self.engine.primary for k in keys]
        hit_keys = [k for k in keys if k in self.engine.primary]
        pins = []
        if hit_keys:
            job = self.engine.new_job()
            slots = [self.engine.primary[k] for k in hit_keys]
            for s in slots:
                self.engine.pin_count[s] = self.engine.pin_count.get(s, 0) + 1
            self.engine.pin_jobs[job] = slots
            pins.append((job, hit_keys, slots))
        return PinResult(hits, pins)


@dataclass
class Engine:
    name: str
    manager: LoadManager
    region: bytearray = field(default_factory=lambda: bytearray(BLOCK * NBLOCKS))
    primary: dict[bytes, int] = field(default_factory=dict)
    pin_jobs: dict[int, list[int]] = field(default_factory=dict)
    pin_count: dict[int, int] = field(default_factory=dict)
    results: dict[int, list[JobResult]] = field(default_factory=dict)
    submitted: set[int] = field(default_factory=set)
    job_counter: int = 0
    #: consumer slot -> load job that owns it until the job's result
    slot_owner: dict[int, int] = field(default_factory=dict)
    #: load job -> (keys, slots) to check when it reports success
    expect: dict[int, tuple[list[bytes], list[int]]] = field(default_factory=dict)
    #: successful loads whose slots did not hold their keys' bytes
    wrong_bytes: list[str] = field(default_factory=list)

    def new_job(self) -> int:
        self.job_counter += 1
        job = self.job_counter * 100 + (ord(self.name[0]) % 100)
        self.submitted.add(job)
        return job

    def store(
        self,
        job: int,
        req: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> None:
        """A store job of a producer request: its slots hold the keys'
        blocks and, as in vLLM, stay held (a peer may READ them) until the
        job's result comes back."""
        for k, s in zip(keys, slots, strict=True):
            self.region[s * BLOCK : (s + 1) * BLOCK] = payload(k)
        self.pin_jobs[job] = list(slots)
        for s in slots:
            self.pin_count[s] = self.pin_count.get(s, 0) + 1
        self.manager.submit_store(job, req, keys, slots, now)

    def put(self, k: bytes, slot: int) -> None:
        self.primary[k] = slot
        self.region[slot * BLOCK : (slot + 1) * BLOCK] = payload(k)

    def block(self, slot: int) -> bytes:
        return bytes(self.region[slot * BLOCK : (slot + 1) * BLOCK])

    def collect(self, now: float) -> list[JobResult]:
        out = self.manager.get_finished_jobs(now)
        for r in out:
            self.results.setdefault(r.job_id, []).append(r)
            keys, slots = self.expect.pop(r.job_id, ([], []))
            if r.success:
                for k, s in zip(keys, slots, strict=True):
                    if self.block(s) != payload(k):
                        self.wrong_bytes.append(f"{self.name} job {r.job_id} slot {s}")
            for s in [s for s, j in self.slot_owner.items() if j == r.job_id]:
                del self.slot_owner[s]
            slots = self.pin_jobs.pop(r.job_id, None)
            for s in slots or ():
                self.pin_count[s] -= 1
                if not self.pin_count[s]:
                    del self.pin_count[s]
        return out


@dataclass
class Link:
    a: tuple[str, str]  # (engine, peer key at that engine)
    b: tuple[str, str]
    up: bool = True


class Net:
    def __init__(
        self,
        names: Sequence[str] = ("a", "b"),
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        identities: dict[str, Identity] | None = None,
        reads: bool = True,
        fleet: bool = False,
    ) -> None:
        """``fleet``: every engine's ``peers`` key lists them all (the
        directory is on)."""
        self.now = 0.0
        self._nonces = itertools.count(1)
        self.engines: dict[str, Engine] = {}
        for n in names:
            me = (identities or {}).get(n) or identity(n)
            mgr = LoadManager(
                me,
                nonces=lambda: next(self._nonces).to_bytes(16, "big"),
                timeouts=timeouts,
                limits=limits,
                reads=reads,
                membership=self._fleet(names) if fleet else None,
            )
            self.engines[n] = Engine(n, mgr)
        self.links: list[Link] = []
        self.queue: list[tuple[str, str, bytes]] = []  # (engine, peer key, frame)
        self.writes: list[tuple[str, str, PostWrite]] = []
        self.reads: list[tuple[str, str, PostRead]] = []
        #: Leave posted writes and reads in flight until complete_writes().
        self.hold_writes = False
        #: cancelled writes cannot be stopped (see Cancel in _carry)
        self.unstoppable_writes = False
        #: writes that landed in a slot no in-flight job owned (fence broken)
        self.violations: list[str] = []
        #: what the edge said (bad frames, refused seals, messages not
        #: sent): a well-behaved peer causes none, so each fails the test
        #: unless the test sends bad frames itself (``strict = False``)
        self.said: list[tuple[str, str, RuntimeEvent]] = []
        self.strict = True
        #: what each engine's edge told its runtime of its connections
        #: (Trusted, RegionKnown, Hangup), in order
        self.edge: list[tuple[str, str, RuntimeEvent]] = []

    def addr(self, name: str) -> str:
        return f"{name}:1"

    def _fleet(self, names: Sequence[str]) -> Membership:
        """A ``peers`` key naming every engine, each name resolved to
        itself (as the runtime's resolver hands addresses in)."""
        membership = Membership(parse_peers([self.addr(n) for n in names]))
        for entry in membership.names:
            membership.update(entry, [entry.host])
        return membership

    def roles(self, src: str, kv_id: str, probe: bool = True) -> Roles:
        leg = "remote_kv_source" if probe else "remote_prefiller"
        return Roles.parse(
            {leg: {"kv_request_id": kv_id, "remote_host": src, "remote_port": 1}}
        )

    def _other(self, engine: str, peer: str) -> tuple[str, str] | None:
        for link in reversed(self.links):  # the newest: a redial's
            if link.a == (engine, peer):
                return link.b if link.up else None
            if link.b == (engine, peer):
                return link.a if link.up else None
        return None

    def _link(self, engine: str, peer: str) -> Link | None:
        for link in reversed(self.links):  # the newest: a redial's
            if (engine, peer) in (link.a, link.b):
                return link
        return None

    def step(self, deliver: bool = True) -> None:
        """One round: every engine flushes, its output is queued, and (when
        ``deliver``) everything queued is delivered in order."""
        for name, eng in self.engines.items():
            m = eng.manager
            m.loads.flush(self.now)
            closed: list[str] = []
            while events := m.take_events():
                for peer, event in events:
                    self._carry(name, peer, event, closed)
            for peer, frames in m.take_frames(self.now):
                for frame in frames:
                    self.queue.append((name, peer, frame))
            for peer, event in m.take_events():  # what sending ended
                self._carry(name, peer, event, closed)
            for peer in closed:
                # The data plane invalidates the peer agent: drop its writes
                # and our reads from it (they end failed).
                self.writes = [
                    w for w in self.writes if not (w[0] == name and w[1] == peer)
                ]
                for r in [r for r in self.reads if r[:2] == (name, peer)]:
                    self.reads.remove(r)
                    m.on_read_done(peer, r[2].ref.ident, False, self.now)
                other = self._other(name, peer)
                self.writes = [
                    w for w in self.writes if not (other and (w[0], w[1]) == other)
                ]
                link = self._link(name, peer)
                if link is not None and link.up:
                    link.up = False
                    if other is not None:
                        self.engines[other[0]].manager.connection_lost(
                            other[1], "closed", self.now
                        )
                m.on_invalidated(peer, self.now)
        if deliver:
            self.deliver_all()
        if not self.hold_writes:
            self.complete_writes()
        for eng in self.engines.values():
            eng.manager.tick(self.now)
            eng.manager.end_step(self.now)

    def _carry(
        self,
        name: str,
        peer: str,
        event: RuntimeEvent,
        closed: list[str],
    ) -> None:
        """Do what one of engine ``name``'s events asks, as the runtime
        does; closed sessions are handled after the step's messages."""
        m = self.engines[name].manager
        match event:
            case Dial():
                target = peer.split(":")[0]
                if target in self.engines:
                    inbound = self.engines[target].manager.peers.on_inbound(self.now)
                    self.links.append(Link((name, peer), (target, inbound)))
                else:
                    m.connection_lost(peer, "unreachable", self.now)
            case Cancel(ref) if ref.direction is Direction.WRITE:
                if self.unstoppable_writes:
                    # Given up on but still running (NIXL over TCP to a
                    # stalled peer): it stays, and may land later.
                    m.on_write_unstoppable(peer, ref.ident)
                    return
                self.writes = [
                    w for w in self.writes if not (w[0] == name and w[2].ref == ref)
                ]
                m.on_write_done(peer, ref.ident, False, self.now)
            case Cancel():
                # A cancelled read still ends once, at complete_writes (as
                # NIXL reports it): until then it may land, so it stays.
                pass
            case PostRead():
                self.reads.append((name, peer, event))
            case PostWrite():
                self.writes.append((name, peer, event))
            case Closed():
                closed.append(peer)
            case Trusted() | RegionKnown() | Hangup():
                # memnet's data plane needs no agent and its links no trust;
                # a hung-up connection's frames were dropped unread
                self.edge.append((name, peer, event))
            case BadFrame() | BadConnection() | SealRefused() | NotSent():
                self.said.append((name, peer, event))
                assert not self.strict, f"{name} <- {peer}: {event}"

    def deliver_all(self) -> None:
        queue, self.queue = self.queue, []
        for item in queue:
            self.deliver(item)

    def deliver(self, item: tuple[str, str, bytes]) -> None:
        name, peer, frame = item
        other = self._other(name, peer)
        if other is None:
            return
        # As the runtime hands it in: before its session is ready a peer
        # may send only a greeting (a well-behaved one never sends more, so
        # a refusal here fails the test, at the event it causes).
        self.engines[other[0]].manager.receive_frame(other[1], frame, self.now)

    def complete_writes(self, ok: bool = True) -> None:
        """End every transfer in flight: writes and reads."""
        reads, self.reads = self.reads, []
        for name, peer, read in reads:
            dst = self.engines[name]
            other = self._other(name, peer)
            for d in read.local:
                if dst.slot_owner.get(d) != read.ref.ident:
                    self.violations.append(
                        f"{name} read into slot {d} owned by "
                        f"{dst.slot_owner.get(d)}, not job {read.ref.ident}"
                    )
            if other is None or not ok:
                dst.manager.on_read_done(peer, read.ref.ident, False, self.now)
                continue
            src = self.engines[other[0]]
            for s, d in zip(read.remote, read.local, strict=True):
                pinned = src.pin_count.get(s, 0) > 0
                data = src.block(s) if pinned else POISON
                dst.region[d * BLOCK : (d + 1) * BLOCK] = data
            dst.manager.on_read_done(peer, read.ref.ident, True, self.now)
        writes, self.writes = self.writes, []
        for name, peer, order in writes:
            other = self._other(name, peer)
            if other is None:
                continue
            src, dst = self.engines[name], self.engines[other[0]]
            job = int(order.notif.rsplit(b":", 1)[1])
            for d in order.dst:
                if dst.slot_owner.get(d) != job:
                    self.violations.append(
                        f"{name}->{other[0]} write into slot {d} owned by "
                        f"{dst.slot_owner.get(d)}, not job {job}"
                    )
            if ok:
                for s, d in zip(order.src, order.dst, strict=True):
                    dst.region[d * BLOCK : (d + 1) * BLOCK] = src.block(s)
            src.manager.on_write_done(peer, order.ref.ident, ok, self.now)

    def serve(self) -> None:
        for eng in self.engines.values():
            eng.manager.serve(FakePinner(eng), self.now)

    def run(self, rounds: int = 6) -> None:
        for _ in range(rounds):
            self.step()
            self.serve()

    def advance(self, dt: float) -> None:
        self.now += dt

    def settle(self, seconds: float, dt: float) -> None:
        """Let everything in flight land and every deadline pass: engines
        step, serve and collect their results every ``dt``."""
        self.hold_writes = False
        for _ in range(round(seconds / dt)):
            self.advance(dt)
            self.step()
            self.serve()
            for eng in self.engines.values():
                eng.collect(self.now)

    def cut(self, a: str, b: str) -> None:
        """Kill the connection between engines a and b (both sides notice)."""
        for link in self.links:
            if {link.a[0], link.b[0]} == {a, b} and link.up:
                link.up = False
                self.engines[link.a[0]].manager.connection_lost(
                    link.a[1], "cut", self.now
                )
                self.engines[link.b[0]].manager.connection_lost(
                    link.b[1], "cut", self.now
                )
