"""Cost of the LoadManager poll loop, per engine step.

One *step* is what the runtime does every engine step, timed as one unit:
``flush``, ``take_events``, ``take_frames`` (its messages encoded),
``tick``, ``get_finished_jobs``, ``serve`` (only when
``has_lookups_to_serve``) and ``end_step``. Routing what a step returned
(its frames to the peer's ``receive_frame``), engine calls such as
``submit_load`` and the data plane are outside the timed region.

Cases, all on one consumer engine wired in memory to 1 or 16 producer
engines through the real codec (no sockets, a virtual clock that advances
1 us per step, so no heartbeat or deadline is due while timing):

* ``in flight``: 0, 10 or 1,000 loads whose Fetch was posted and whose
  write is held by the producer (not yet completed), spread evenly over the
  sessions. Nothing arrives while timing: the pure polling cost.
* ``churn``: 10 or 1,000 loads in flight over 1 or 16 sessions, and every
  step one TransferDone arrives, one request finishes and one new load is
  submitted (the work a step has to move stays the same; only what sits in
  flight beside it changes).
* ``idle after 10k``: after 10,000 requests were probed, loaded, finished
  and cleaned up (every structure back to zero), on the consumer and on a
  producer. Must match the fresh idle case: the loop may not grow with
  requests ever served.

Target (from the issue): an idle step under 5 us; the cost grows with the
active work of the step, not with the number of peers, loads merely in
flight, or requests served before. Reported: median and p99 ns per step
(each step timed alone with ``perf_counter_ns``, whose own cost is shown as
``timer``), as a table (rich if installed) or ``--json``. ``--check`` exits
1 when an idle median misses the target.

Run: ``python benchmarks/step.py [--json] [--steps N] [--check]``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2p_kv.node.manager import Answer, JobResult, LoadManager
from p2p_kv.node.roles import Roles, Source
from p2p_kv.peer import Limits, PinResult, Timeouts
from p2p_kv.peer.events import Cancel, Closed, Dial, PostWrite, RuntimeEvent
from p2p_kv.peer.handshake import Identity

TARGET_IDLE_NS = 5_000
BLOCK_BYTES = 16
NUM_BLOCKS = 1 << 20
DT = 1e-6  # virtual seconds per step
LIMITS = Limits(max_serves=1 << 20, max_pinned_blocks=1 << 22)

# ---------------------------------------------------------------------------
# in-memory wiring (a few lines in the spirit of tests/unit/memnet.py)
# ---------------------------------------------------------------------------


def identity(name: str) -> Identity:
    return Identity(
        engine_id=name,
        hash_algo="sha256_cbor",
        hash_seed="0",
        canonical_hashes=(b"c1", b"c2"),
        layout="bench-layout",
        block_bytes=BLOCK_BYTES,
        num_blocks=NUM_BLOCKS,
        region=name.encode(),
    )


def key(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()[:12]


class Pinner:
    """A producer's primary tier that holds every key: each lookup batch
    becomes one pin job."""

    def __init__(self, ids: Callable[[], int]) -> None:
        self.ids = ids
        self.pins = 0

    def pin(self, label: str, keys: Sequence[bytes]) -> PinResult:
        job = self.ids()
        self.pins += 1
        return PinResult([True] * len(keys), [(job, list(keys), [0] * len(keys))])


@dataclass
class Output:
    events: list[tuple[str, RuntimeEvent]]
    outgoing: list[tuple[str, list[bytes]]]
    finished: list[JobResult]


@dataclass
class Cluster:
    """One consumer (``c``) and ``n`` producers (``p<i>:1``)."""

    n: int
    now: float = 0.0
    hold_writes: bool = True
    managers: dict[str, LoadManager] = field(default_factory=dict)
    pinners: dict[str, Pinner] = field(default_factory=dict)
    routes: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    #: writes posted and not completed: (producer, peer, write id, request)
    held: list[tuple[str, str, int, str]] = field(default_factory=list)
    finished: dict[str, list[JobResult]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = itertools.count(1_000_000_000).__next__
        nonces = itertools.count(1)
        timeouts = Timeouts()
        for name in ["c", *self.producers]:
            # The write path: its loads stay in flight while their writes
            # are held (a READ would end inside its post).
            self.managers[name] = LoadManager(
                identity(name),
                nonces=lambda: next(nonces).to_bytes(16, "big"),
                timeouts=timeouts,
                limits=LIMITS,
                reads=False,
            )
            self.pinners[name] = Pinner(ids)
            self.finished[name] = []

    @property
    def producers(self) -> list[str]:
        return [f"p{i}:1" for i in range(self.n)]

    @property
    def consumer(self) -> LoadManager:
        return self.managers["c"]

    def poll(self, name: str, now: float) -> Output:
        """THE step: exactly what the runtime calls each engine step."""
        m = self.managers[name]
        m.loads.flush(now)
        events = m.take_events()
        outgoing = m.take_frames(now)
        m.tick(now)
        finished = m.get_finished_jobs(now)
        if m.has_lookups_to_serve:
            m.serve(self.pinners[name], now)
        m.end_step(now)
        return Output(events, outgoing, finished)

    def route(self, name: str, out: Output) -> None:
        """The transports and the data plane: not part of the timed step."""
        m = self.managers[name]
        for peer, event in out.events:
            if isinstance(event, Dial):
                inbound = self.managers[peer].peers.on_inbound(self.now)
                self.routes[(name, peer)] = (peer, inbound)
                self.routes[(peer, inbound)] = (name, peer)
        for peer, frames in out.outgoing:
            dst = self.routes.get((name, peer))
            if dst is None:
                continue
            for frame in frames:
                self.managers[dst[0]].receive_frame(dst[1], frame, self.now)
        for peer, event in out.events:
            match event:
                case PostWrite(ref, _, _, notif) if self.hold_writes:
                    req = notif.decode().split(":", 1)[0]
                    self.held.append((name, peer, ref.ident, req))
                case PostWrite(ref):
                    m.on_write_done(peer, ref.ident, True, self.now)
                case Cancel(ref):
                    gone = (name, peer, ref.ident)
                    self.held = [h for h in self.held if h[:3] != gone]
                case Closed():
                    m.on_invalidated(peer, self.now)
        self.finished[name].extend(out.finished)

    def pump(self, done: Callable[[], bool], max_rounds: int = 100) -> None:
        for _ in range(max_rounds):
            if done():
                return
            self.now += DT
            for name in self.managers:
                self.route(name, self.poll(name, self.now))
        if not done():
            raise RuntimeError("cluster did not settle")

    def complete_write(self, index: int = 0) -> str:
        """Finish a held write; returns its producer."""
        name, peer, write_id, _ = self.held.pop(index)
        self.managers[name].on_write_done(peer, write_id, True, self.now)
        return name

    def total_state(self) -> int:
        return sum(sum(m.state_report().values()) for m in self.managers.values())


# ---------------------------------------------------------------------------
# driving requests
# ---------------------------------------------------------------------------


@dataclass
class Requests:
    cl: Cluster
    counter: itertools.count[int] = field(default_factory=itertools.count)
    jobs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def probe(self, n: int) -> list[str]:
        """Register ``n`` consumer requests round-robin over the producers
        and run their lookups to a HIT (the producers pin the blocks)."""
        c, now = self.cl.consumer, self.cl.now
        reqs = []
        for _ in range(n):
            i = next(self.counter)
            req = f"r{i}"
            peer = self.cl.producers[i % self.cl.n]
            c.on_new_request(req, Roles(Source(req, peer, probe=True)), now)
            assert c.lookup(req, key(i)) is Answer.RETRY
            reqs.append(req)

        def answered() -> bool:
            return all(c.lookup(r, key(int(r[1:]))) is Answer.HIT for r in reqs)

        self.cl.pump(answered)
        return reqs

    def load(self, req: str) -> int:
        job = next(self.jobs)
        i = int(req[1:])
        self.cl.consumer.submit_load(job, req, [key(i)], [i % NUM_BLOCKS], self.cl.now)
        return job

    def start_loads(self, n: int) -> list[tuple[str, int]]:
        """``n`` loads whose Fetch reached the producer and whose write is
        held: in flight."""
        before = len(self.cl.held)
        started = [(req, self.load(req)) for req in self.probe(n)]
        self.cl.pump(lambda: len(self.cl.held) == before + n)
        return started

    def serve_many(self, total: int, batch: int = 1000) -> None:
        """Probe, load, finish and clean up ``total`` requests."""
        cl = self.cl
        cl.hold_writes = False
        c = cl.consumer
        for _ in range(0, total, batch):
            jobs = dict(self.start_loads_unheld(batch))

            def loaded(want: frozenset[int] = frozenset(jobs.values())) -> bool:
                return want <= {r.job_id for r in cl.finished["c"]}

            cl.pump(loaded)
            for req in jobs:
                c.on_request_finished(req, cl.now)
            cl.pump(lambda: cl.total_state() == 0)
            for results in cl.finished.values():
                results.clear()
        cl.hold_writes = True

    def start_loads_unheld(self, n: int) -> list[tuple[str, int]]:
        return [(req, self.load(req)) for req in self.probe(n)]


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    engine: str
    sessions: int
    in_flight: int
    served_before: int
    steps: int
    median_ns: float
    p99_ns: float
    idle: bool

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def timed_steps(
    cl: Cluster,
    name: str,
    steps: int,
    before: Callable[[int], None] | None = None,
    after: Callable[[int], None] | None = None,
) -> list[int]:
    samples = []
    clock = time.perf_counter_ns
    gc.collect()
    for i in range(steps):
        if before is not None:
            before(i)
        cl.now += DT
        now = cl.now
        t0 = clock()
        out = cl.poll(name, now)
        t1 = clock()
        samples.append(t1 - t0)
        cl.route(name, out)
        if after is not None:
            after(i)
    return samples


def summarize(samples: list[int]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), float(p99)


def timer_overhead(n: int = 20_000) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = clock()
        t1 = clock()
        samples.append(t1 - t0)
    return statistics.median(samples)


def connected(sessions: int) -> tuple[Cluster, Requests]:
    """A cluster whose consumer has a ready session to every producer."""
    cl = Cluster(sessions)
    rq = Requests(cl)
    rq.serve_many(sessions, batch=sessions)  # opens (and warms) every session
    ready = [s for s in cl.consumer.sessions() if s.link.ready]
    assert len(ready) == sessions, "sessions did not come up"
    return cl, rq


def case_in_flight(sessions: int, in_flight: int, steps: int) -> Row:
    cl, rq = connected(sessions)
    rq.start_loads(in_flight)
    report = cl.consumer.state_report()
    assert report["loads"] == in_flight and report["fenced_slots"] == in_flight
    median, p99 = summarize(timed_steps(cl, "c", steps))
    assert cl.consumer.state_report()["loads"] == in_flight
    return Row(
        f"{in_flight} in flight" if in_flight else "idle",
        "consumer",
        sessions,
        in_flight,
        0,
        steps,
        median,
        p99,
        in_flight == 0,
    )


def case_churn(sessions: int, in_flight: int, steps: int) -> Row:
    cl, rq = connected(sessions)
    rq.start_loads(in_flight)
    pool = rq.probe(steps)  # pinned, ready to load one per step
    c = cl.consumer
    done_before = len(cl.finished["c"])
    landed: list[str] = []

    def before(i: int) -> None:
        # The data plane finishes the oldest write; its producer steps and
        # its TransferDone reaches the consumer. A new load is submitted.
        landed.append(cl.held[0][3])
        producer = cl.complete_write(0)
        cl.route(producer, cl.poll(producer, cl.now))
        rq.load(pool[i])

    def after(i: int) -> None:
        # The engine finishes the request whose load just completed; the
        # producers take the new Fetch (and the Abort) and post the write.
        c.on_request_finished(landed.pop(), cl.now)
        for name in cl.producers:
            cl.route(name, cl.poll(name, cl.now))

    median, p99 = summarize(timed_steps(cl, "c", steps, before, after))
    assert len(cl.finished["c"]) - done_before >= steps - 2
    assert all(r.success for r in cl.finished["c"][done_before:])
    assert c.state_report()["loads"] >= in_flight - 2
    return Row(
        f"churn, {in_flight} in flight",
        "consumer",
        sessions,
        in_flight,
        0,
        steps,
        median,
        p99,
        False,
    )


def case_idle_after(sessions: int, served: int, steps: int) -> list[Row]:
    cl, rq = connected(sessions)
    rq.serve_many(served)
    leftover = {
        name: {k: v for k, v in m.state_report().items() if v}
        for name, m in cl.managers.items()
    }
    assert not any(leftover.values()), f"state left after serving: {leftover}"
    rows = []
    for name, engine in (("c", "consumer"), ("p0:1", "producer")):
        median, p99 = summarize(timed_steps(cl, name, steps))
        rows.append(
            Row(
                f"idle after {served // 1000}k served",
                engine,
                sessions,
                0,
                served,
                steps,
                median,
                p99,
                True,
            )
        )
    return rows


def run(steps: int) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    churn_steps = max(500, steps // 10)
    for sessions in (1, 16):
        for in_flight in (0, 10, 1000):
            rows.append(case_in_flight(sessions, in_flight, steps))
    for sessions in (1, 16):
        for in_flight in (10, 1000):
            rows.append(case_churn(sessions, in_flight, churn_steps))
    for sessions in (1, 16):
        rows.extend(case_idle_after(sessions, 10_000, steps))
    meta = {
        "target_idle_ns": TARGET_IDLE_NS,
        "timer_overhead_ns": timer_overhead(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "steps": steps,
        "churn_steps": churn_steps,
    }
    return rows, meta


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------

HEADERS = ("case", "engine", "sessions", "median ns", "p99 ns")


def cells(row: Row) -> tuple[str, ...]:
    mark = ""
    if row.idle:
        mark = " ok" if row.median_ns < TARGET_IDLE_NS else " MISS"
    return (
        row.case,
        row.engine,
        str(row.sessions),
        f"{row.median_ns:,.0f}{mark}",
        f"{row.p99_ns:,.0f}",
    )


def print_table(rows: list[Row], meta: dict[str, Any]) -> None:
    title = f"LoadManager step cost (target: idle median < {TARGET_IDLE_NS:,} ns)"
    caption = (
        f"{meta['steps']:,} steps/case ({meta['churn_steps']:,} churn); "
        f"perf_counter_ns itself: {meta['timer_overhead_ns']:.0f} ns"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        data = [HEADERS, *(cells(r) for r in rows)]
        widths = [max(len(line[i]) for line in data) for i in range(len(HEADERS))]
        print(title)
        print(caption)
        for n, line in enumerate(data):
            print(
                "  ".join(
                    c.rjust(w) if i >= 2 else c.ljust(w)
                    for i, (c, w) in enumerate(zip(line, widths, strict=True))
                )
            )
            if n == 0:
                print("  ".join("-" * w for w in widths))
        return
    table = Table(title=title, caption=caption)
    for i, h in enumerate(HEADERS):
        table.add_column(h, justify="right" if i >= 2 else "left")
    for row in rows:
        table.add_row(*cells(row))
    Console(width=max(90, Console().width)).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--steps", type=int, default=20_000, help="steps per case")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if an idle median misses"
    )
    args = parser.parse_args(argv)
    rows, meta = run(args.steps)
    if args.json:
        print(json.dumps({"meta": meta, "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        print_table(rows, meta)
    missed = [r for r in rows if r.idle and r.median_ns >= TARGET_IDLE_NS]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
