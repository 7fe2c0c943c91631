"""Fault injection around the real transports, for tests and benchmarks.

The runtime reaches the network only through two objects,
``TierRuntime.control`` (a :class:`~p2p_kv.control.transport.ControlTransport`) and
``TierRuntime.data`` (a :class:`~p2p_kv.data.NixlDataTransport`), so the
injectors here are wrappers put in their place: no seam in ``src/`` is
needed, and whatever survives the injector still crosses real TCP and
real NIXL. Faults are drawn from a seeded RNG so a failing run can be
replayed, and every injected fault is counted, so a test can tell "the
code coped" from "the fault never happened".

Control plane (:class:`FaultyControl`): drop, delay (with jitter),
duplicate and reorder frames in either direction, optionally only for some
message types; :meth:`FaultyControl.cut` kills one connection the way a
dead TCP link would look to the runtime.

Data plane (:class:`FaultyData`): fail a post before anything moves (NIXL
refused it), fail a completion after the bytes landed (the peer can never
know whether they did), stall a post (the write is held and really posted
later, so deadlines, aborts and peer loss meet a write still in flight).

Processes: :func:`kill_peer` SIGKILLs and returns the kill time.
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from p2p_kv.control.transport import Inbound
from p2p_kv.protocol import ProtocolError, decode

#: A reordered frame waits this long at most for a later one to overtake it.
REORDER_HOLD_S = 0.02

__all__ = [
    "ControlFaults",
    "DataFaults",
    "FaultyControl",
    "FaultyData",
    "install",
    "kill_peer",
]


def _tag(frame: bytes) -> str:
    try:
        msg = decode(frame)
    except ProtocolError:
        return "?"
    return str(type(msg).__struct_config__.tag)


@dataclass
class ControlFaults:
    """Probabilities are per frame; ``only`` limits them to message tags
    (``"lookup"``, ``"transfer_done"``, ...), so a handshake can be spared
    while requests suffer. ``direction``: ``"in"``, ``"out"`` or ``"both"``."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay_s: float = 0.0
    jitter_s: float = 0.0
    #: share of frames that get ``delay_s`` (+ jitter); 1.0: all of them
    delay_p: float = 1.0
    direction: str = "both"
    only: frozenset[str] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControlFaults:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("only") is not None:
            kw["only"] = frozenset(kw["only"])
        return cls(**kw)

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder or self.delay_s)


@dataclass
class FaultCounts:
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    delayed: int = 0
    cuts: int = 0
    failed_posts: int = 0
    failed_completions: int = 0
    stalled_posts: int = 0
    posts: int = 0  # posts that reached the real NIXL transport
    refused_posts: int = 0  # of those, refused by it (raised) before NIXL

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class FaultyControl:
    """A :class:`~p2p_kv.control.transport.ControlTransport` with faults in between.

    Everything not overridden here goes to the real transport. Delayed
    frames are released by the next :meth:`send` or :meth:`poll`, and
    :meth:`poll` never waits past the next release, so a delay costs its
    length and no more even while the runtime idles on the sockets.
    """

    def __init__(
        self,
        inner: Any,
        faults: ControlFaults | None = None,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inner = inner
        self.faults = faults or ControlFaults()
        self.counts = FaultCounts()
        self._rng = random.Random(seed)
        self._clock = clock
        self._seq = itertools.count()
        self._out: list[tuple[float, int, str, bytes]] = []
        self._in: list[tuple[float, int, str, bytes]] = []
        # reorder: (since, frame), sent after the next frame on the conn
        self._held_out: dict[str, tuple[float, bytes]] = {}
        self._held_in: dict[str, tuple[float, bytes]] = {}
        self._lost: list[str] = []
        self._dead: set[str] = set()  # cut inbound conns: blackholed
        self._announced: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    # -- faults -----------------------------------------------------------

    def _hit(self, frame: bytes, direction: str) -> bool:
        f = self.faults
        if not f.active or f.direction not in ("both", direction):
            return False
        return f.only is None or _tag(frame) in f.only

    def _mangle(
        self, conn: str, frames: list[bytes], direction: str
    ) -> list[tuple[float, bytes]]:
        """(release time, frame) for each frame that goes on, in order."""
        f, rng, now = self.faults, self._rng, self._clock()
        held = self._held_out if direction == "out" else self._held_in
        out: list[tuple[float, bytes]] = []
        for frame in frames:
            if not self._hit(frame, direction):
                out.append((now, frame))
                continue
            if rng.random() < f.drop:
                self.counts.dropped += 1
                continue
            due = now
            if f.delay_s and rng.random() < f.delay_p:
                due += f.delay_s + rng.uniform(0, f.jitter_s)
                self.counts.delayed += 1
            if conn not in held and rng.random() < f.reorder:
                held[conn] = (now, frame)  # goes out after the next frame
                self.counts.reordered += 1
                continue
            copies = 2 if rng.random() < f.duplicate else 1
            self.counts.duplicated += copies - 1
            out.extend((due, frame) for _ in range(copies))
            late = held.pop(conn, None)
            if late is not None:
                out.append((due, late[1]))
        return out

    def _overdue(self, direction: str) -> list[tuple[str, bytes]]:
        """Reordered frames no later frame came to overtake: they go now
        (a reorder must not turn into a drop)."""
        held = self._held_out if direction == "out" else self._held_in
        limit = self._clock() - REORDER_HOLD_S
        late = [(c, fr) for c, (t, fr) in held.items() if t <= limit]
        for conn, _ in late:
            del held[conn]
        return late

    def cut(self, conn: str) -> None:
        """The connection dies: frames in flight on it are lost, the runtime
        is told it is lost, and an outbound one is really closed (the peer
        sees its TCP connection go; the runtime redials later)."""
        self.counts.cuts += 1
        self._out = [x for x in self._out if x[2] != conn]
        self._in = [x for x in self._in if x[2] != conn]
        heapq.heapify(self._out)
        heapq.heapify(self._in)
        self._held_out.pop(conn, None)
        self._held_in.pop(conn, None)
        if conn.startswith("in:"):
            self._dead.add(conn)
        else:
            self._inner.close_conn(conn)
        self._lost.append(conn)

    def connections(self) -> list[str]:
        """Outbound connections and inbound ones seen so far."""
        outbound = [c for c in self._inner._conns if not c.startswith("in:")]
        return [*outbound, *sorted(self._announced - self._dead)]

    # -- the transport's interface --------------------------------------------

    def send(self, conn: str, frames: list[bytes]) -> str:
        self._release_out()
        if conn in self._dead:
            return ""  # into the void, as on a dead link
        mangled = self._mangle(conn, frames, "out")
        now = self._clock()
        why = ""
        now_frames: list[bytes] = []
        for due, frame in mangled:
            if due <= now and not any(c == conn for _, _, c, _ in self._out):
                now_frames.append(frame)
            else:  # keep order behind frames already delayed
                heapq.heappush(self._out, (due, next(self._seq), conn, frame))
        if now_frames:
            why = self._inner.send(conn, now_frames)
        return why

    def _release_out(self) -> None:
        now = self._clock()
        for conn, frame in self._overdue("out"):
            heapq.heappush(self._out, (now, next(self._seq), conn, frame))
        while self._out and self._out[0][0] <= now:
            _, _, conn, frame = heapq.heappop(self._out)
            if conn not in self._dead:
                self._inner.send(conn, [frame])

    def _next_due(self) -> float:
        due = [q[0][0] for q in (self._out, self._in) if q]
        due += [t + REORDER_HOLD_S for t, _ in self._held_out.values()]
        due += [t + REORDER_HOLD_S for t, _ in self._held_in.values()]
        return min(due) if due else float("inf")

    def poll(self, timeout_s: float) -> list[Inbound]:
        self._release_out()
        now = self._clock()
        if self._lost:
            timeout_s = 0.0
        timeout_s = max(0.0, min(timeout_s, self._next_due() - now))
        got = self._inner.poll(timeout_s)
        self._release_out()
        out: list[Inbound] = [Inbound(c, b"", lost=True, why="cut") for c in self._lost]
        self._lost.clear()
        for item in got:
            if item.conn in self._dead:
                continue
            if item.lost or item.new:
                if item.new:
                    self._announced.add(item.conn)
                out.append(item)
                continue
            for due, frame in self._mangle(item.conn, [item.frame], "in"):
                heapq.heappush(self._in, (due, next(self._seq), item.conn, frame))
        now = self._clock()
        for conn, frame in self._overdue("in"):
            heapq.heappush(self._in, (now, next(self._seq), conn, frame))
        while self._in and self._in[0][0] <= now:
            _, _, conn, frame = heapq.heappop(self._in)
            if conn in self._dead:
                continue
            out.append(Inbound(conn, frame))
        return out

    def close_conn(self, conn: str) -> None:
        self._out = [x for x in self._out if x[2] != conn]
        heapq.heapify(self._out)
        self._inner.close_conn(conn)


# ---------------------------------------------------------------------------
# data plane
# ---------------------------------------------------------------------------


@dataclass
class DataFaults:
    """``fail_post``: refused by NIXL, nothing written. ``fail_completion``:
    written, reported failed. ``stall_p`` of posts are held ``stall_s``
    before they are really posted."""

    fail_post: float = 0.0
    fail_completion: float = 0.0
    stall_s: float = 0.0
    stall_p: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataFaults:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class _Held:
    due: float
    op: str  # "write" | "read"
    agent: str
    args: tuple[Any, ...]


@dataclass
class FaultyData:
    """A :class:`~p2p_kv.data.NixlDataTransport` with faults in between.

    Transfer ids handed out here are our own; each one is still reported
    exactly once by :meth:`poll_completions`, whatever the fault, which is
    the contract the runtime relies on. WRITEs (producer) and READs
    (consumer) suffer the same faults.
    """

    inner: Any
    faults: DataFaults = field(default_factory=DataFaults)
    seed: int = 0
    clock: Callable[[], float] = time.monotonic
    counts: FaultCounts = field(default_factory=FaultCounts)
    #: called with the op ("write" / "read") when a post is stalled: a test
    #: in another process learns that a transfer is now in flight
    on_stall: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._ids = itertools.count(1)
        self._held: dict[int, _Held] = {}
        self._real: dict[int, int] = {}  # inner tid -> our tid
        self._done: list[tuple[int, bool]] = []
        self._spoil: set[int] = set()  # our tids whose success we report failed
        self._unstopped: set[int] = set()  # our tids the inner one could not stop

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def post_write(
        self, agent_name: str, src_blocks: Any, dst_blocks: Any, notif: bytes = b""
    ) -> int:
        return self._submit("write", agent_name, (src_blocks, dst_blocks, notif))

    def post_read(self, agent_name: str, remote_blocks: Any, local_blocks: Any) -> int:
        return self._submit("read", agent_name, (remote_blocks, local_blocks))

    def _submit(self, op: str, agent: str, args: tuple[Any, ...]) -> int:
        tid = next(self._ids)
        f, rng = self.faults, self._rng
        if f.fail_post and rng.random() < f.fail_post:
            self.counts.failed_posts += 1
            self._done.append((tid, False))
            return tid
        if f.stall_p and rng.random() < f.stall_p:
            self.counts.stalled_posts += 1
            self._held[tid] = _Held(self.clock() + f.stall_s, op, agent, args)
            if self.on_stall is not None:
                self.on_stall(op)
            return tid
        self._post(tid, op, agent, args)
        return tid

    def _post(self, tid: int, op: str, agent: str, args: tuple[Any, ...]) -> None:
        self.counts.posts += 1
        try:
            if op == "write":
                real = self.inner.post_write(agent, *args)
            else:
                real = self.inner.post_read(agent, *args)
        except Exception:
            self.counts.refused_posts += 1
            raise
        self._real[real] = tid
        if self.faults.fail_completion and self._rng.random() < (
            self.faults.fail_completion
        ):
            self._spoil.add(tid)

    def _release_due(self) -> None:
        now = self.clock()
        for tid, h in list(self._held.items()):
            if h.due <= now:
                del self._held[tid]
                try:
                    self._post(tid, h.op, h.agent, h.args)
                except Exception:  # peer removed meanwhile: a failed transfer
                    self._done.append((tid, False))

    def poll_completions(self) -> list[tuple[int, bool]]:
        self._release_due()
        out, self._done = self._done, []
        done = self.inner.poll_completions()
        stuck = self.inner.take_unstopped()
        for real, ok in done:
            tid = self._real.pop(real, None)
            if tid is None:
                continue
            if real in stuck:
                self._unstopped.add(tid)
            if tid in self._spoil:
                self._spoil.discard(tid)
                if ok:
                    self.counts.failed_completions += 1
                ok = False
            out.append((tid, ok))
        return out

    def in_flight(self) -> int:
        return int(self.inner.in_flight()) + len(self._held) + len(self._done)

    def settling(self) -> bool:
        return bool(self.inner.settling())

    def given_up(self, transfer_id: int) -> bool:
        return any(
            self.inner.given_up(r)
            for r, tid in self._real.items()
            if tid == transfer_id
        )

    def take_unstopped(self) -> set[int]:
        out, self._unstopped = self._unstopped, set()
        return out

    def take_faulted(self) -> set[str]:
        return set(self.inner.take_faulted())

    def cancel(self, *transfer_ids: int, wait: bool = False) -> None:
        real_ids: list[int] = []
        for transfer_id in transfer_ids:
            if self._held.pop(transfer_id, None) is not None:
                self._done.append((transfer_id, False))
                continue
            real_ids.extend(r for r, tid in self._real.items() if tid == transfer_id)
        if real_ids:
            self.inner.cancel(*real_ids, wait=wait)

    def remove_peer(self, agent_name: str) -> None:
        for tid, h in list(self._held.items()):
            if h.agent == agent_name:  # never posted: the fence holds
                del self._held[tid]
                self._done.append((tid, False))
        self.inner.remove_peer(agent_name)

    def handles(self) -> int:
        """Transfers this wrapper still tracks (all zero at rest)."""
        return len(self._held) + len(self._real) + len(self._done) + len(self._spoil)

    def close(self) -> None:
        self._held.clear()
        self.inner.close()


def install(
    runtime: Any,
    control: ControlFaults | None = None,
    data: DataFaults | None = None,
    *,
    seed: int = 0,
) -> tuple[FaultyControl, FaultyData]:
    """Put both injectors into a :class:`~p2p_kv.runtime.tier_runtime.TierRuntime`
    (before it has posted anything); returns them for tuning and counts."""
    fc = FaultyControl(runtime.control, control, seed=seed)
    fd = FaultyData(runtime.data, data or DataFaults(), seed=seed + 1)
    runtime.control = fc
    runtime.data = fd
    return fc, fd


def kill_peer(pid: int) -> float:
    """SIGKILL a peer process; returns ``time.monotonic()`` of the kill
    (the same clock in every process on the machine)."""
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()
