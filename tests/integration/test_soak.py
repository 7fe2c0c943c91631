"""Soak: thousands of requests against real peers, under faults.

Two producers (:mod:`tests.support.agent` processes, real TCP + NIXL on
loopback) and a consumer in this process, driven the way vLLM's scheduler
drives the tier, with eight requests in flight at once. Along the way:
requests finished mid-load (random aborts), ``kv_request_id`` values drawn
from a small pool (reuse) and engine request ids recycled, lookups that
partly miss, control frames dropped, delayed, duplicated and reordered on
both sides, connections cut, data-plane posts and completions failed and
stalled, and one producer SIGKILLed and restarted on the same port halfway.

Afterwards: every job had exactly one result; every load that reported
success holds its keys' exact bytes (CRC per block); every per-request
structure (``state_report``), the failed-ID set, fenced slots, parked
stores, the runtime's transfer table and the NIXL transfer handles are
zero on every peer; and the consumer's RSS did not grow beyond noise.

``P2P_KV_SOAK_REQUESTS`` sets how many requests must reach a load job
(1,000 in CI; the issue's run is 10,000: ``P2P_KV_SOAK_REQUESTS=10000
pytest tests/integration/test_soak.py``). Requests that miss outright (a
missing key, or a producer in reconnect backoff after the restart) come on
top and are counted apart.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import pytest
from tests.support.faults import ControlFaults, DataFaults, install
from tests.support.procs import PeerProc

from p2p_kv.adapter.engines import free_port
from p2p_kv.node.manager import Answer, JobResult
from p2p_kv.peer import Timeouts
from p2p_kv.runtime.standalone import StandalonePeer, block_pattern, make_key

REQUESTS = int(os.environ.get("P2P_KV_SOAK_REQUESTS", "1000"))
pytestmark = pytest.mark.timeout(max(240, REQUESTS // 10))

BLOCK = 16 * 1024
FILL = 64
LANES = 8
PER_LANE = 8
KV_POOL = 24
STAGING_BLOCKS = 6
TIMEOUTS = {
    "heartbeat_interval_s": 0.2,
    "lookup_s": 0.5,
    "fetch_floor_s": 0.5,
    "abort_ack_s": 0.5,
    "pin_ttl_s": 2.0,
}
CONTROL = {"drop": 0.002, "duplicate": 0.003, "reorder": 0.003}
CONTROL_DELAY = {"delay_s": 0.002, "jitter_s": 0.004, "delay_p": 0.05}
DATA = {"fail_post": 0.003, "fail_completion": 0.003, "stall_s": 0.05, "stall_p": 0.03}


def producer(name: str, port: int, seed: int) -> PeerProc:
    return PeerProc(
        {
            "engine_id": name,
            "port": port,
            "num_blocks": FILL + 16,
            "block_bytes": BLOCK,
            "fill": FILL,
            "timeouts": TIMEOUTS,
            "control_faults": {**CONTROL, **CONTROL_DELAY},
            "data_faults": DATA,
            "seed": seed,
        }
    )


CRC = {
    k: zlib.crc32(memoryview(block_pattern(make_key(k), BLOCK))) for k in range(FILL)
}


@dataclass
class Lane:
    """One request slot of the engine: a request and its KV slots."""

    index: int
    req: str = ""
    keys: list[int] = field(default_factory=list)
    job: int | None = None
    finished: bool = False
    abort_after: int | None = None  # steps after submit; None: no abort
    steps: int = 0
    started: float = 0.0
    #: after a miss the engine recomputes for a while before its next request
    busy_until: float = 0.0

    @property
    def slots(self) -> list[int]:
        return list(range(self.index * PER_LANE, (self.index + 1) * PER_LANE))


class Soak:
    def __init__(self, consumer: StandalonePeer, addrs: list[str], seed: int) -> None:
        self.c = consumer
        self.addrs = addrs
        self.rng = random.Random(seed)
        self.lanes = [Lane(i) for i in range(LANES)]
        self.started = 0
        self.done = 0
        self.jobs = 0
        # Jobs awaiting their one result; the soak keeps no per-job history,
        # so its own memory stays flat and the RSS check measures the tier.
        self.pending: set[int] = set()
        self.results = 0
        self.tally: Counter[str] = Counter()
        self.bad: list[str] = []

    def start(self, lane: Lane) -> None:
        self.started += 1
        lane.req = f"L{lane.index}-{self.started % 3}"  # engine ids recycled
        kv = f"kv-{self.rng.randrange(KV_POOL)}"  # orchestrator ids reused
        peer = self.rng.choice(self.addrs)
        n = self.rng.randint(1, PER_LANE)
        lane.keys = [
            self.rng.randrange(FILL) if self.rng.random() < 0.9 else 10_000 + i
            for i in range(n)
        ]
        lane.keys = list(dict.fromkeys(lane.keys))
        lane.job, lane.finished, lane.steps = None, False, 0
        lane.abort_after = self.rng.randrange(3) if self.rng.random() < 0.1 else None
        lane.started = time.monotonic()
        self.c.open(lane.req, peer, kv)

    def finish(self, lane: Lane) -> None:
        if not lane.finished:
            lane.finished = True
            self.c.runtime.end_request(lane.req)

    def advance(self, lane: Lane) -> None:
        m, rt = self.c.manager, self.c.runtime
        if lane.job is None:
            answers = [m.lookup(lane.req, make_key(k)) for k in lane.keys]
            if Answer.RETRY in answers:
                return
            hits = [i for i, a in enumerate(answers) if a is Answer.HIT]
            if not hits:
                self.tally["all_miss"] += 1
                self.finish(lane)
                self.done += 1
                lane.req = ""
                lane.busy_until = time.monotonic() + 0.02
                return
            self.jobs += 1
            lane.job = self.jobs
            lane.keys = [lane.keys[i] for i in hits]
            self.pending.add(lane.job)
            m.submit_load(
                lane.job,
                lane.req,
                [make_key(k) for k in lane.keys],
                lane.slots[: len(lane.keys)],
                rt.clock(),
            )
            if lane.abort_after == 0:  # vLLM finishes it in the same step
                lane.abort_after = None
                self.tally["aborted_mid_load"] += 1
                self.finish(lane)
            return
        lane.steps += 1
        if lane.abort_after is not None and lane.steps >= lane.abort_after:
            lane.abort_after = None
            self.tally["aborted_mid_load"] += 1
            self.finish(lane)

    def on_result(self, r: JobResult) -> None:
        self.c.results.pop(r.job_id, None)  # StandalonePeer keeps them all
        if r.job_id not in self.pending:
            self.bad.append(f"job {r.job_id}: a second result (or never submitted)")
            return
        self.pending.discard(r.job_id)
        self.results += 1
        lane = next((ln for ln in self.lanes if ln.job == r.job_id), None)
        if lane is None:
            self.bad.append(f"result for unknown job {r.job_id}")
            return
        if r.success:
            self.tally["ok"] += 1
            rows = np.asarray(self.c.region).reshape(-1, BLOCK)
            for k, s in zip(lane.keys, lane.slots, strict=False):
                if zlib.crc32(memoryview(rows[s])) != CRC[k]:
                    self.bad.append(f"job {r.job_id}: slot {s} lacks key {k}'s bytes")
        else:
            self.tally["failed"] += 1
        # the slots are free again: poison them so a late write would show
        np.asarray(self.c.region).reshape(-1, BLOCK)[lane.slots] = 0xAB
        self.finish(lane)
        self.done += 1
        lane.req, lane.job = "", None

    def step(self) -> None:
        rt = self.c.runtime
        for lane in self.lanes:
            if (
                not lane.req
                and self.jobs < REQUESTS
                and time.monotonic() >= lane.busy_until
            ):
                self.start(lane)
            elif lane.req:
                self.advance(lane)
        rt.flush()
        for r in self.c.step():
            self.on_result(r)


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


@pytest.fixture(params=["same_host", "staged"])
def peers(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[StandalonePeer, list[PeerProc]]]:
    """``same_host``: the default read path, our own copies out of the
    producers' regions. ``staged``: every READ through NIXL into 6 blocks
    of read staging, so the lanes' loads (up to 8 blocks) move in pieces,
    wait for staging, and leave zombies when given up on."""
    procs: list[PeerProc] = []
    staged = request.param == "staged"
    consumer = StandalonePeer(
        LANES * PER_LANE,
        BLOCK,
        engine_id=f"soak-c-{os.getpid()}",
        timeouts=Timeouts(**TIMEOUTS),
        same_host=not staged,
        read_staging_bytes=STAGING_BLOCKS * BLOCK if staged else 0,
    )
    try:
        procs = [producer(f"soak-p{i}", free_port(), seed=i) for i in range(2)]
        yield consumer, procs
    finally:
        for p in procs:
            p.stop()
        consumer.close()


def settle(s: Soak, procs: list[PeerProc], within: float = 10.0) -> dict[str, Any]:
    """Step until nothing is left anywhere; the residue if something is."""
    c, rt = s.c, s.c.runtime
    end = time.monotonic() + within
    while True:
        for r in c.step():
            s.on_result(r)
        mine = {k: v for k, v in c.manager.state_report().items() if v}
        data = rt.data
        left: dict[str, Any] = {}
        if mine:
            left["consumer"] = mine
        size, free, held = data.inner.staging_blocks()
        if free != size or held:
            left["staging"] = (size, free, held)
        if rt.transfers_in_flight or data.inner.in_flight() or data.handles():
            left["consumer_xfers"] = (
                rt.transfers_in_flight,
                data.inner.in_flight(),
                data.handles(),
            )
        for p in procs:
            r = p.call("report")
            theirs = {k: v for k, v in r["state"].items() if v}
            if theirs or r["xfers"] or r["fault_handles"] or r["pinned"]:
                left[p.cfg["engine_id"]] = (theirs, r["xfers"], r["pinned"])
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def test_soak(peers: tuple[StandalonePeer, list[PeerProc]]) -> None:
    consumer, procs = peers
    fc, fd = install(
        consumer.runtime,
        ControlFaults(**CONTROL, **CONTROL_DELAY),
        DataFaults(**DATA),
        seed=7,
    )
    consumer.manager.settings.reconnect_backoff_s = 0.2
    s = Soak(consumer, [p.address for p in procs], seed=11)
    t0 = time.monotonic()
    warm = min(REQUESTS // 10, 500)
    rss_start = 0
    restarted = False
    next_cut = REQUESTS // 10
    next_sample = REQUESTS // 4
    samples: list[float] = []
    reborn: list[PeerProc] = []
    restart: threading.Thread | None = None
    while s.jobs < REQUESTS or any(lane.req for lane in s.lanes):
        s.step()
        if not rss_start and s.jobs >= warm:
            rss_start = rss()
        if s.jobs >= next_sample:
            next_sample += REQUESTS // 4
            samples.append(round(rss() / 2**20, 1))
        if s.jobs >= next_cut:
            # a connection dies under load (the runtime redials it)
            next_cut += REQUESTS // 5
            conns = fc.connections()
            if conns:
                fc.cut(s.rng.choice(conns))
        if not restarted and s.jobs >= REQUESTS // 2:
            # SIGKILL one producer mid-traffic; a new one takes its port
            # while the consumer goes on stepping (as an engine would)
            victim = procs[0]
            victim.kill()
            port = int(victim.address.rpartition(":")[2])
            restart = threading.Thread(
                target=lambda p=port: reborn.append(producer("soak-p0b", p, seed=5))
            )
            restart.start()
            restarted = True
        if reborn and restart is not None:
            restart.join()
            victim.stop()
            procs[0] = reborn[0]
            restart = None
        assert time.monotonic() - t0 < REQUESTS, "soak stalled"
    elapsed = time.monotonic() - t0
    for lane in s.lanes:
        if lane.req:
            s.finish(lane)
    left = settle(s, procs)
    rss_end = rss()
    reports = [p.call("report") for p in procs]
    injected = Counter(fc.counts.as_dict()) + Counter(fd.counts.as_dict())
    for r in reports:
        injected.update(r["faults"]["control"])
        injected.update(r["faults"]["data"])
    print(
        f"\nsoak: {s.started} requests ({s.jobs} load jobs) in {elapsed:.1f} s "
        f"({s.started / elapsed:.0f}/s): {dict(s.tally)}; "
        f"fallbacks {dict(consumer.manager.fallbacks)}; consumer RSS "
        f"{rss_start / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB (quarters "
        f"{samples}); producer RSS "
        f"{[round(r['rss'] / 2**20, 1) for r in reports]} MiB; injected "
        f"{ {k: v for k, v in injected.items() if v} }"
    )
    # Each variant's loads took its own path (staged: through NIXL only).
    inner = consumer.runtime.data.inner
    assert (inner.local_reads > 0) != (inner.staging_blocks()[0] > 0)
    assert not s.bad, s.bad[:10]
    assert not left, left
    assert not s.pending, f"jobs without a result: {sorted(s.pending)[:10]}"
    assert s.results == s.jobs
    assert consumer.manager.double_results == 0
    assert consumer.manager.requests.failed_ids() == frozenset()
    assert s.tally["ok"] > 0.5 * s.jobs
    assert injected["dropped"] and injected["failed_posts"] + injected["stalled_posts"]
    assert fc.counts.cuts >= 3
    assert rss_end - rss_start < 16 * 2**20
